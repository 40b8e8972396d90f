"""Blockwise FP8 (e4m3) quantization in DeepSeek-V3's layout (arXiv 2412.19437, section 3.3.2).

  activations: one scale per (row, 128 contraction columns): a 1x128 tile
  weights:     one scale per 128x128 block

A value is stored as q = x / s in float8_e4m3fn with s = amax(tile) / 448 (448: e4m3's largest
finite value), so each tile uses the format's whole range and an outlier spoils only its own
128 values. The GEMM multiplies e4m3 products exactly into an f32 partial sum per 128 of the
contraction and applies s_row * s_block to it before adding it to the f32 accumulator:
DeepSeek's promotion interval (N_C = 128), one scale pair per partial.

Scales are float32. Row-tile scales are stored transposed, [K/128, M]: the kernel loads one
contiguous row of block_m scales per 128-column step (`mgpu_fp8.py`). An all-zero tile gets
scale 1 (its q is zero either way), never 0 or NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128  # the tile/block edge, and the promotion interval along the contraction


def _scale(amax):
  return jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)


def _check_multiple(name: str, size: int) -> None:
  if size % BLOCK:
    raise ValueError(f"blockwise FP8: {name} = {size} must be a multiple of {BLOCK}")


def quantize_row_tiles(x_MK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [M, K] -> (q_MK e4m3, scale_KbM f32 [K/128, M]): one scale per row and 128 columns."""
  m, k = x_MK.shape
  _check_multiple("K (the contraction)", k)
  tiles_MKbB = x_MK.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
  scale_MKb = _scale(jnp.max(jnp.abs(tiles_MKbB), axis=-1))
  q_MK = (tiles_MKbB / scale_MKb[..., None]).reshape(m, k).astype(E4M3)
  return q_MK, scale_MKb.T


def dequantize_row_tiles(q_MK: jax.Array, scale_KbM: jax.Array) -> jax.Array:
  """The float32 values q_MK stands for (tests and the reference GEMM)."""
  m, k = q_MK.shape
  tiles = q_MK.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
  return (tiles * scale_KbM.T[..., None]).reshape(m, k)


def quantize_blocks(w_GKN: jax.Array) -> tuple[jax.Array, jax.Array]:
  """w [G, K, N] -> (q_GKN e4m3, scale_GKbNb f32 [G, K/128, N/128]): one scale per 128x128 block.

  The same scales serve the transposed copy q_GKN.swapaxes(1, 2) with scale.swapaxes(1, 2): a
  128x128 block is one block either way, which is why weights are blocked rather than tiled
  (the forward contracts over K, dlhs over N)."""
  g, k, n = w_GKN.shape
  _check_multiple("K", k)
  _check_multiple("N", n)
  blocks = w_GKN.astype(jnp.float32).reshape(g, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
  scale_GKbNb = _scale(jnp.max(jnp.abs(blocks), axis=(2, 4)))
  q_GKN = (blocks / scale_GKbNb[:, :, None, :, None]).reshape(g, k, n).astype(E4M3)
  return q_GKN, scale_GKbNb


def dequantize_blocks(q_GKN: jax.Array, scale_GKbNb: jax.Array) -> jax.Array:
  g, k, n = q_GKN.shape
  blocks = q_GKN.astype(jnp.float32).reshape(g, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
  return (blocks * scale_GKbNb[:, :, None, :, None]).reshape(g, k, n)
