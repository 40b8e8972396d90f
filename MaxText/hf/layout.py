"""How one stored MaxText array (a layer's slice, or one expert of it) becomes one Hugging Face tensor, and back.

A `Piece` names both ends: the HF tensor's name and shape, the checkpoint array (its key) and the slice of it
(layer, expert), and the transform between them. Every transform is a pure permutation or reshape of the same
numbers, so export then import gives the same bits. Shapes: D model width, H heads, d a head's width, E experts,
F an expert's MLP width, r the RoPE columns of a head.

RoPE. MaxText's plain RoPE (rope_type: default) rotates column i with column i + r/2 (the two halves of the r
columns, concatenated); DeepSeek's released weights and transformers' DeepseekV3 (rope_interleave=True, its default)
rotate columns 2i and 2i+1. Both pair column i's two partners with the same frequency i, so moving MaxText's
columns (i, i + r/2) to (2i, 2i + 1) in the query's and the key's RoPE part gives the same attention scores.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from MaxText.hf.checkpoint import AUX, PARAMS


def rope_to_interleaved(r: int) -> np.ndarray:
  """perm with hf[..., j] = maxtext[..., perm[j]] over r RoPE columns: [0, r/2, 1, r/2 + 1, ...]."""
  half = np.arange(r // 2)
  return np.stack([half, half + r // 2], axis=1).reshape(-1)


def _permute_tail(x: np.ndarray, r: int, axis: int, inverse: bool) -> np.ndarray:
  """Reorders the last r entries of `axis` to the interleaved order (or back)."""
  if not r:
    return x
  perm = rope_to_interleaved(r)
  perm = np.argsort(perm) if inverse else perm
  n = x.shape[axis]
  full = np.concatenate([np.arange(n - r), n - r + perm])
  return np.take(x, full, axis=axis)


@dataclasses.dataclass(frozen=True)
class Transform:
  """maxtext slice -> hf tensor (`to_hf`) and back (`to_maxtext`), with the shape it gives."""

  name: str
  to_hf: Callable[[np.ndarray], np.ndarray]
  to_maxtext: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]  # (hf tensor, maxtext slice shape)
  hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]


SAME = Transform("same", lambda x: x, lambda y, shape: y.reshape(shape), lambda s: s)

# [in, out] -> [out, in]: a dense kernel as torch's Linear holds it
LINEAR = Transform("linear", lambda x_IO: x_IO.T, lambda y_OI, shape: y_OI.T.reshape(shape), lambda s: (s[1], s[0]))


def heads_in(rope: int = 0, scale: float = 1.0) -> Transform:
  """[in, H, d] -> [H*d, in] (a projection into heads: q_b_proj, kv_b_proj, q/k/v_proj), the RoPE tail of each head
  interleaved, times `scale` (a query whose weights hold MaxText's 1/sqrt(d) gets sqrt(d): exact, and so back,
  when d is a power of 4)."""

  def to_hf(x_IHd):
    y_Ni = _permute_tail(x_IHd, rope, 2, inverse=False).reshape(x_IHd.shape[0], -1).T
    return y_Ni if scale == 1.0 else (y_Ni * np.float32(scale)).astype(x_IHd.dtype)

  def to_maxtext(y_Ni, shape):
    y_Ni = y_Ni if scale == 1.0 else (y_Ni / np.float32(scale)).astype(y_Ni.dtype)
    return _permute_tail(y_Ni.T.reshape(shape), rope, 2, inverse=True)

  return Transform(f"heads_in(rope={rope}, scale={scale:g})", to_hf, to_maxtext, lambda s: (s[1] * s[2], s[0]))


# [H, d, out] -> [out, H*d]: the attention output projection
HEADS_OUT = Transform("heads_out", lambda x_HdO: x_HdO.reshape(-1, x_HdO.shape[-1]).T,
                      lambda y_ON, shape: y_ON.T.reshape(shape), lambda s: (s[2], s[0] * s[1]))


def linear_rope_tail(rope: int) -> Transform:
  """[in, out] -> [out, in] with the last `rope` outputs interleaved (MLA's kv_a_proj_with_mqa: latent, then key RoPE)."""
  return Transform(f"linear_rope_tail({rope})", lambda x_IO: _permute_tail(x_IO, rope, 1, inverse=False).T,
                   lambda y_OI, shape: _permute_tail(y_OI.T, rope, 1, inverse=True).reshape(shape),
                   lambda s: (s[1], s[0]))


@dataclasses.dataclass(frozen=True)
class Piece:
  """One HF tensor: `name` (hf_shape) is `transform` of checkpoint array `key` at `index` (layer, expert ints)."""

  name: str
  key: tuple[str, ...]
  index: tuple[int | slice, ...]
  transform: Transform
  maxtext_shape: tuple[int, ...]  # the slice's shape
  copy: bool = False  # a second HF copy of an array exported elsewhere (MTP's shared embedding and head)

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return tuple(self.transform.hf_shape(self.maxtext_shape))


def slice_index(shape: tuple[int, ...], picks: dict[int, int]) -> tuple[tuple[int | slice, ...], tuple[int, ...]]:
  """(index, slice shape) picking `picks` {axis: i} of an array of `shape`; picked axes drop out."""
  index = tuple(picks[a] if a in picks else slice(None) for a in range(len(shape)))
  return index, tuple(n for a, n in enumerate(shape) if a not in picks)


class Source:
  """Where layer i of a group lives: stacked (one array, the layer on param_scan_axis; nnx_aux's at 0) or one
  array per layer (scan_layers: false, groups named `<group>_<i>`)."""

  def __init__(self, shapes: Mapping[tuple[str, ...], tuple[int, ...]], scan_axis: int):
    self.shapes, self.scan_axis = shapes, scan_axis

  def find(self, root: tuple[str, ...], sub: tuple[str, ...], picks: dict[int, int], layer: int | None):
    """(key, index, slice shape) of sub under root (layer None: not a stacked group), or None when absent."""
    for top in (PARAMS, AUX):
      key = top + root + sub
      if key in self.shapes:
        shape = self.shapes[key]
        picks = dict(picks)
        if layer is not None:
          axis = 0 if top == AUX else self.scan_axis
          if axis in picks:
            raise ValueError(f"{'/'.join(key)}: its layer axis {axis} is also its expert axis")
          picks[axis] = layer
        index, sliced = slice_index(shape, picks)
        return key, index, sliced
    return None

  def layer_roots(self, group: str, count: int) -> list[tuple[tuple[str, ...], int | None]]:
    stacked = any(k[len(PARAMS):len(PARAMS) + 2] == ("decoder", group) for k in self.shapes)
    return [(("decoder", group), i) if stacked else (("decoder", f"{group}_{i}"), None) for i in range(count)]

  def piece(self, root: tuple[str, ...], sub: tuple[str, ...], layer: int | None, name: str, transform: Transform,
            picks: dict[int, int] | None = None) -> Piece | None:
    found = self.find(root, sub, picks or {}, layer)
    return None if found is None else Piece(name, found[0], found[1], transform, found[2])
