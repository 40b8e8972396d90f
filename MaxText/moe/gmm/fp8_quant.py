"""Blockwise FP8 (e4m3) quantization in DeepSeek-V3's layout (arXiv 2412.19437, section 3.3.2).

  activations: one scale per (row, 128 contraction columns): a 1x128 tile
  weights:     one scale per 128x128 block

A value is stored as q = x * (1 / s) in float8_e4m3fn with s = amax(tile) / 448 (448: e4m3's largest
finite value), so each tile uses the format's whole range and an outlier spoils only its own
128 values. One f32 reciprocal per tile, then a product per value, which the one-pass kernels
(mgpu/fp8_quant_kernels.py) compute exactly: an f32 division per value is a multi-instruction sequence on a
GPU. Measured on the H200 at the proxy's shapes, the kernels ran 1.00-1.05x faster than dividing, with
the same e4m3 bytes there (tools/bench_quant.py; BENCHMARKS.md "FP8 kernels"): the division was not what
limits them. The GEMM multiplies e4m3 products exactly into an f32 partial sum per 128 of the
contraction and applies s_row * s_block to it before adding it to the f32 accumulator:
DeepSeek's promotion interval (N_C = 128), one scale pair per partial.

Scales are float32. Row-tile scales are stored transposed, [K/128, M]: the kernel loads one
contiguous row of block_m scales per 128-column step (`mgpu/fp8.py`). An all-zero tile gets
scale 1 (its q is zero either way), never 0 or NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.moe.gmm import _pad

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128  # the tile/block edge, and the promotion interval along the contraction


def _scale(amax):
  return jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)


def _reciprocal(scale):
  """1 / scale in f32: q = x * _reciprocal(s) for every value of s's tile."""
  return (1.0 / scale).astype(jnp.float32)


def _check_multiple(name: str, size: int) -> None:
  if size % BLOCK:
    raise ValueError(f"blockwise FP8: {name} = {size} must be a multiple of {BLOCK}")


def quantize_row_tiles(x_MK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [M, K] -> (q_MK e4m3, scale_KbM f32 [K/128, M]): one scale per row and 128 columns."""
  m, k = x_MK.shape
  _check_multiple("K (the contraction)", k)
  tiles_MKbB = x_MK.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
  scale_MKb = _scale(jnp.max(jnp.abs(tiles_MKbB), axis=-1))
  q_MK = (tiles_MKbB * _reciprocal(scale_MKb)[..., None]).reshape(m, k).astype(E4M3)
  return q_MK, scale_MKb.T


def kept(quantized):
  """A quantize's outputs (a pytree), to be dequantized right away without losing the rounding.

  Under jit, XLA's GPU pipeline drops an f32 -> e4m3 -> f32 convert pair as "excess precision"
  (SimplifyFPConversions, on by default through xla_allow_excess_precision): quantize-then-dequantize
  lost its e4m3 rounding, and xla_fp8 on a GPU multiplied the unquantized values (the self-test's FP8
  reference, 3.7e-2 from mgpu_fp8: tools/gpu_selftest.py on the H200, 2026-12-02). The barrier keeps the
  rounding. Only the emulation needs it: the kernels take the e4m3 arrays themselves, and the FP8 dispatch's tiles come from
  memory. There it would cost a copy: the moved tiles' e4m3 bytes sliced out of the exchanged
  buffer, 0.9 GiB more on the 1-GPU proxy's compiled step."""
  return jax.lax.optimization_barrier(quantized)


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
  q_GKN = (blocks * _reciprocal(scale_GKbNb)[:, :, None, :, None]).reshape(g, k, n).astype(E4M3)
  return q_GKN, scale_GKbNb


class WeightBlocks(NamedTuple):
  """A weight's 128x128 blocks, the FP8 backends' rhs_blocks: q_GKN e4m3 and scale_GKbNb f32 (`quantize_blocks`
  of the weight padded to whole blocks), and q_GNK, the same bytes transposed, where the pass that quantized them
  wrote that layout too (mgpu_fp8's forward reads it; XLA would transpose q_GKN in a pass of its own)."""

  q_GKN: jax.Array
  scale_GKbNb: jax.Array
  q_GNK: jax.Array | None = None


def quantize_weight_blocks(w_GKN: jax.Array) -> tuple[jax.Array, jax.Array]:
  """quantize_blocks of w zero-padded to whole blocks along axes 1 and 2 (zeros change no block's amax): the
  blocks a weight's forward and its dlhs both multiply, whichever of its axes each contracts (the FP8 backends'
  gmm takes them as rhs_blocks, the custom VJP keeps them from the forward for dlhs: MaxText/moe/gmm/__init__.py)."""
  return quantize_blocks(pad_weight(w_GKN))


def pad_weight(w_GKN: jax.Array) -> jax.Array:
  return _pad.pad_axes(w_GKN, {1: BLOCK, 2: BLOCK})


def dequantize_blocks(q_GKN: jax.Array, scale_GKbNb: jax.Array) -> jax.Array:
  g, k, n = q_GKN.shape
  blocks = q_GKN.astype(jnp.float32).reshape(g, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
  return (blocks * scale_GKbNb[:, :, None, :, None]).reshape(g, k, n)


# --- rows quantized before they move (the FP8 dispatch, MaxText/moe/fp8_dispatch.py) ---


class RowTiles(NamedTuple):
  """Rows already in 1x128 tiles: q_MK e4m3 [M, K'] and scale_MKb f32 [M, K'/128], K' = K rounded up to 128
  (zero columns: they change no tile's amax). Row-major scales: a row's scales travel with the row."""

  q_MK: jax.Array
  scale_MKb: jax.Array


def quantize_rows(x_MK: jax.Array) -> RowTiles:
  """x [M, K] -> RowTiles, K zero-padded to a multiple of 128. Bit for bit what `quantize_row_tiles` gives
  the same rows later, wherever they moved in between: a tile is one row's 128 columns."""
  q_MK, scale_KbM = quantize_row_tiles(_pad.pad_axes(x_MK, {1: BLOCK}))
  return RowTiles(q_MK, scale_KbM.T)


def rows_for_kernel(tiles: RowTiles, num_rows: int) -> tuple[jax.Array, jax.Array]:
  """(q [num_rows, K'], scale [K'/128, num_rows]) as the kernels take them: zero rows (scale 1, as
  `quantize_row_tiles` gives an all-zero tile) past the tiles' rows."""
  extra = num_rows - tiles.q_MK.shape[0]
  q_MK, scale_MKb = tiles
  if extra:
    q_MK = jnp.pad(q_MK, ((0, extra), (0, 0)))
    scale_MKb = jnp.pad(scale_MKb, ((0, extra), (0, 0)), constant_values=1.0)
  return q_MK, scale_MKb.T


def dequantize_rows(tiles: RowTiles, k: int, dtype) -> jax.Array:
  """The values the tiles stand for, the first k columns, in dtype."""
  return dequantize_row_tiles(tiles.q_MK, tiles.scale_MKb.T)[:, :k].astype(dtype)


# --- dW: the contraction runs over rows, so both operands are quantized in 128-row blocks ---


class GroupBlocks(NamedTuple):
  """The local groups' rows laid out 128-aligned, so that no 128-row block spans two groups.

  src_P:       int32 [P]: the source row of each padded row, or num_rows (a zero row) in the
               gaps after each group; P = num_work_rows(...) (static).
  block0_L:    int32 [G_local]: each group's first 128-row block in the padded layout.
  blocks_L:    int32 [G_local]: its number of blocks (0 for an empty group).
  sizes_L:     int32 [G_local]: its padded row count (blocks * 128), for the emulation.
  """

  src_P: jax.Array
  block0_L: jax.Array
  blocks_L: jax.Array
  sizes_L: jax.Array


def num_padded_rows(num_rows: int, num_local_groups: int) -> int:
  """Static bound: every group gains < 128 rows, and the total is a whole number of blocks."""
  return -(-num_rows // BLOCK) * BLOCK + num_local_groups * BLOCK


def group_blocks(group_sizes_G, group_offset, num_local_groups: int, num_rows: int) -> GroupBlocks:
  """DeepSeek-V3 quantizes dW's operands in 128x1 tiles along the rows; a tile that held rows of two
  experts would scale one expert's values by the other's largest. Each local group's rows are
  therefore laid out from a multiple of 128 (zero rows fill the gap), as DeepGEMM's grouped
  layout requires of its inputs. Rows of other shards' groups and padding rows are left out."""
  sizes = group_sizes_G.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  offset = jnp.asarray(group_offset, jnp.int32)
  starts_L = jnp.clip(jax.lax.dynamic_slice_in_dim(starts, offset, num_local_groups), 0, num_rows)
  ends_L = jnp.clip(jax.lax.dynamic_slice_in_dim(ends, offset, num_local_groups), 0, num_rows)
  rows_L = ends_L - starts_L
  blocks_L = -(-rows_L // BLOCK)
  block0_L = jnp.cumsum(blocks_L) - blocks_L
  p = jnp.arange(num_padded_rows(num_rows, num_local_groups), dtype=jnp.int32)
  g = jnp.clip(jnp.searchsorted(block0_L + blocks_L, p // BLOCK, side="right"), 0, num_local_groups - 1)
  within = p - block0_L[g] * BLOCK
  inside = (p // BLOCK < block0_L[g] + blocks_L[g]) & (within < rows_L[g])
  src_P = jnp.where(inside, starts_L[g] + within, num_rows).astype(jnp.int32)
  return GroupBlocks(src_P, block0_L.astype(jnp.int32), blocks_L.astype(jnp.int32), (blocks_L * BLOCK).astype(jnp.int32))


def quantize_group_row_blocks(x_MK: jax.Array, layout: GroupBlocks) -> tuple[jax.Array, jax.Array]:
  """x [M, K] -> (q_PbKB e4m3 [P/128, K, 128], scale_PbK f32 [P/128, K]): the group-aligned rows in
  128-row blocks, each block transposed (dW's wgmma contracts over rows, and e4m3 operands must be
  contraction-major: a column's 128 values of one block are contiguous), one scale per column and
  block. Gap rows are zeros (scale 1 where a whole block is empty).

  Blocks, not one [K, P] transpose: XLA writes this layout in the quantizing pass itself, and made
  [K, P] from it with a second pass over the e4m3 bytes (the compiled HLO of the H200 step; one read and
  one write of every byte, dW's operands being 20,480 columns per MoE layer). The dW kernel reads a
  block's [128, 128] tile as one contiguous 16 KiB TMA box."""
  rows_PK = jnp.take(x_MK, layout.src_P, axis=0, mode="fill", fill_value=0)
  p, k = rows_PK.shape
  qT_KP, scale_PbK = quantize_row_tiles(rows_PK.T)
  return qT_KP.reshape(k, p // BLOCK, BLOCK).transpose(1, 0, 2), scale_PbK


def group_row_blocks_KP(q_PbKB: jax.Array) -> jax.Array:
  """quantize_group_row_blocks's blocks as one [K, P] matrix (the emulation and tests)."""
  pb, k, _ = q_PbKB.shape
  return q_PbKB.transpose(1, 0, 2).reshape(k, pb * BLOCK)


# --- MXFP8 (OCP Microscaling, as Blackwell's tensor cores and Transformer Engine's MXFP8_1D_SCALING take it) ---
#
# Blocks of 32 consecutive values along a product's contraction dim share one E8M0 scale: a bare power of two,
# stored as its biased exponent in a byte (2^(e - 127), e in [0, 254]). Values are e4m3. The scale is the
# smallest power of two s with amax / s <= 448, i.e. 2^ceil(log2(amax / 448)): Transformer Engine rounds the
# exponent up (its float_to_e8m0), so no value saturates except by the f32 rounding of amax / 448, which the
# clip to +-448 absorbs (e4m3fn has no infinity: past 464 a cast gives NaN). An all-zero block gets scale 1.
# Each tensor is quantized along the dim its product contracts: a weight twice (along K for the forward, N for
# dlhs), an activation along its row for the forward and along its rows (32 of them, within one expert) for dW.

MX_BLOCK = 32
E8M0_BIAS = 127
# E8M0 reaches 2^-127, a subnormal float32, which XLA flushes to zero (CPU and GPU): the emulation's smallest
# scale is 2^-126. Only blocks whose amax is under 448 x 2^-126 (5.3e-36) see it.
MX_MIN_EXPONENT = -126


def mx_exponent(amax: jax.Array) -> jax.Array:
  """int32 ceil(log2(amax / 448)) clamped to [MX_MIN_EXPONENT, 127]; 0 where amax is 0. Exact, from amax's own
  frexp (amax / 448 can be subnormal where amax is not): amax = m 2^e with m in [0.5, 1) and 448 = 0.875 2^9, so
  amax / 448 = (m / 0.875) 2^(e - 9), whose first factor lies in (0.5, 1] for m <= 0.875, else in (1, 2)."""
  mantissa, exponent = jnp.frexp(amax.astype(jnp.float32))
  up = exponent - 9 + (mantissa > 0.875).astype(exponent.dtype)
  return jnp.where(amax > 0, jnp.clip(up, MX_MIN_EXPONENT, E8M0_BIAS), 0).astype(jnp.int32)


def quantize_mx(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """x -> (q e4m3, like x; scale_e8m0 uint8, x's shape with `axis` divided by 32): blocks of 32 along `axis`."""
  axis = axis % x.ndim
  size = x.shape[axis]
  if size % MX_BLOCK:
    raise ValueError(f"MXFP8: the blocked dim = {size} must be a multiple of {MX_BLOCK}")
  moved = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
  blocks = moved.reshape(*moved.shape[:-1], size // MX_BLOCK, MX_BLOCK)
  exponent = mx_exponent(jnp.max(jnp.abs(blocks), axis=-1))
  scaled = blocks * jnp.ldexp(jnp.float32(1.0), -exponent)[..., None]  # exact: a power of two
  q = jnp.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(E4M3).reshape(moved.shape)
  return jnp.moveaxis(q, -1, axis), jnp.moveaxis((exponent + E8M0_BIAS).astype(jnp.uint8), -1, axis)


def dequantize_mx(q: jax.Array, scale_e8m0: jax.Array, axis: int) -> jax.Array:
  """The float32 values `quantize_mx`'s output stands for."""
  axis = axis % q.ndim
  scale = jnp.ldexp(jnp.float32(1.0), scale_e8m0.astype(jnp.int32) - E8M0_BIAS)
  return q.astype(jnp.float32) * jnp.repeat(scale, MX_BLOCK, axis=axis)


def mx_values(x: jax.Array, axis: int) -> jax.Array:
  """x rounded to MXFP8 along `axis` (zero-padded there to a multiple of 32, then cut back), in float32.
  Exact in bf16 as well: an e4m3 value times a power of two has 4 significant bits."""
  size = x.shape[axis % x.ndim]
  padded = _pad.pad_axes(x, {axis % x.ndim: MX_BLOCK})
  values = dequantize_mx(*kept(quantize_mx(padded, axis)), axis)
  return jax.lax.slice_in_dim(values, 0, size, axis=axis % x.ndim)
