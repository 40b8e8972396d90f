"""TensorBoard histograms and heatmap of tokens per expert (host side; one call per kept step), and the
heatmap's numbers on stdout where they fit a terminal."""

from __future__ import annotations

import numpy as np


def heatmap_HWC(counts_LE) -> np.ndarray:
  """uint8 RGB image, one row per MoE layer, one column per expert, colour = load / layer mean.

  Blue below the mean, white at it, red above (saturating at 0 and 2x). Each cell is scaled up so small
  configs stay visible in TensorBoard."""
  c = np.asarray(counts_LE, np.float64)
  ratio = c / np.maximum(c.mean(axis=1, keepdims=True), 1e-20)
  t = np.clip(ratio - 1.0, -1.0, 1.0)  # -1 idle, 0 at the mean, +1 at twice the mean or more
  r = np.where(t < 0, 1.0 + t, 1.0)
  g = 1.0 - np.abs(t)
  b = np.where(t > 0, 1.0 - t, 1.0)
  img = (np.stack([r, g, b], axis=-1) * 255).round().astype(np.uint8)
  scale = max(1, 256 // max(c.shape))
  return np.repeat(np.repeat(img, scale, axis=0), scale, axis=1)


def write(writer, counts_LE, step: int, heatmap: bool) -> None:
  """moe/tokens_per_expert/layer_NNN histograms (the values: one per expert), and the heatmap image."""
  c = np.asarray(counts_LE, np.float64)
  for layer in range(c.shape[0]):
    writer.add_histogram(f"moe/tokens_per_expert/layer_{layer:03d}", c[layer], step)
  if heatmap:
    writer.add_image("moe/load_over_mean", heatmap_HWC(c), step, dataformats="HWC")
  writer.flush()


# The heatmap's numbers fit a terminal up to this many experts (4 characters each) and MoE layers.
TEXT_MAX_EXPERTS, TEXT_MAX_LAYERS = 32, 16


def heatmap_lines(counts_LE, step: int) -> list[str]:
  """The heatmap as text: load / layer mean per MoE layer and expert; one line past the size that fits."""
  c = np.asarray(counts_LE, np.float64)
  ratio = c / np.maximum(c.mean(axis=1, keepdims=True), 1e-20)
  layers, experts = ratio.shape
  hottest = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
  head = (f"MoE load at step {step + 1}, tokens per expert / the layer's mean ({layers} MoE layers x {experts} "
          f"experts; TensorBoard image moe/load_over_mean)")
  if experts > TEXT_MAX_EXPERTS or layers > TEXT_MAX_LAYERS:
    return [f"{head}: hottest expert {hottest[1]} of layer {hottest[0]} at {ratio[hottest]:.2f}"]
  return [f"{head}:"] + [f"  layer {layer:3d} " + " ".join(f"{v:4.2f}" for v in row) for layer, row in
                         enumerate(ratio)]
