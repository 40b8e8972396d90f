"""FP8 dispatch: rows quantized to 1x128 e4m3 tiles before they move towards the experts, as DeepSeek-V3
trained (arXiv 2412.19437, section 3.3.3: the activations before the MoE up-projections are quantized,
then dispatched; "a similar strategy is applied to the activation gradient before MoE down-projections";
the forward and backward combine stay bf16).

    xhat_MD, tiles_M, meta = fp8_dispatch.dispatch(dispatcher, x_TD, ids_TK)
    y_TD = fp8_dispatch.combine(dispatcher, y_MD, weights_TK, meta, ids_TK)

`combine` is the dispatcher's bf16 combine; its backward sends the output's cotangent to the expert
rows as e4m3 tiles, by the dispatcher's own dispatch (the combine's transpose moves each token's
cotangent to its K rows, which is what a dispatch does), and scales each row by its routing weight
there. So every exchange towards the experts is FP8, and every exchange back is bf16. The cotangent's
tiles are what wo's dlhs quantizes again: scaling a row by its weight scales its tiles' scales, so the
requantized e4m3 values are the ones that crossed. The weights' gradient is taken from the cotangent
unquantized, on the tokens' side, as the bf16 combine's is.

A 1x128 tile is one row's 128 columns, so quantizing commutes with moving rows. The grouped GEMM gets
the same e4m3 values and scales, bit for bit, that it would compute from the dispatched bf16 rows.
What changes is the cost:
  * the quantization reads T token rows, not the T x K dispatched ones;
  * every dispatcher moves 1 + 4/128 bytes per value instead of 2: the e4m3 row and its f32 scales,
    packed side by side as uint8 so that one exchange carries both.

Gradients flow through xhat_MD, the tiles' values in x's dtype. Its cotangent goes back to the tokens
along the dispatcher's own backward (a bf16 exchange, like the combine's forward). dW quantizes xhat: the cached
FP8 activations converted to dW's 128x1 tiles, as in the paper, so dW differs from quantizing x itself
by FP8's rounding (tests/test_fp8_dispatch.py bounds it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from MaxText.moe import vma
from MaxText.moe.gmm import fp8_quant
from MaxText.moe.gmm.fp8_quant import BLOCK, RowTiles


def pack(tiles: RowTiles) -> jax.Array:
  """RowTiles -> uint8 [M, K' + 4 K'/128]: each row's e4m3 bytes, then its f32 scales' bytes."""
  m = tiles.q_MK.shape[0]
  q_bytes = jax.lax.bitcast_convert_type(tiles.q_MK, jnp.uint8)
  scale_bytes = jax.lax.bitcast_convert_type(tiles.scale_MKb, jnp.uint8).reshape(m, -1)
  return jnp.concatenate([q_bytes, scale_bytes], axis=1)


def unpack(packed_MB: jax.Array, k_padded: int) -> RowTiles:
  m = packed_MB.shape[0]
  q_MK = jax.lax.bitcast_convert_type(packed_MB[:, :k_padded], fp8_quant.E4M3)
  scale_MKb = jax.lax.bitcast_convert_type(packed_MB[:, k_padded:].reshape(m, k_padded // BLOCK, 4), jnp.float32)
  return RowTiles(q_MK, scale_MKb)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dispatch(dispatcher, x_TD, ids_TK):
  """(xhat_MD, tiles_M, meta): the dispatched rows' tiles, their values, and the dispatcher's meta."""
  return _dispatch_fwd(dispatcher, x_TD, ids_TK)[0]


def _moved_tiles(dispatcher, x_TD, ids_TK):
  """x's rows quantized to tiles here, then dispatched: (tiles of the M rows, meta)."""
  tiles_T = fp8_quant.quantize_rows(x_TD)
  packed_MB, meta = dispatcher.dispatch(pack(tiles_T), ids_TK)
  return unpack(packed_MB, tiles_T.q_MK.shape[1]), meta


def _checked_once(dispatcher):
  """The dispatcher for a backward's re-trace: the forward already checked its buffers, and a host
  callback there would survive XLA's dead-code pass (a2a_padded's on_overflow=error)."""
  if getattr(dispatcher, "on_overflow", "flag") != "flag":
    return dataclasses.replace(dispatcher, on_overflow="flag")
  return dispatcher


def _dispatch_fwd(dispatcher, x_TD, ids_TK):
  tiles_M, meta = _moved_tiles(dispatcher, x_TD, ids_TK)
  xhat_MD = fp8_quant.dequantize_rows(tiles_M, x_TD.shape[1], x_TD.dtype)
  return (xhat_MD, tiles_M, meta), (ids_TK, vma.stamp(x_TD))


def _dispatch_bwd(dispatcher, residuals, cotangents):
  """The dispatcher's own backward on the bf16 cotangent of xhat. Its forward runs on zeros only to
  build that backward, and XLA drops it: nothing uses its output."""
  ids_TK, x_stamp = residuals
  ct_MD = cotangents[0]
  zeros_TD = vma.like_operands(jnp.zeros((ids_TK.shape[0], ct_MD.shape[1]), x_stamp.dtype), x_stamp)
  dispatcher = _checked_once(dispatcher)
  _, pullback = jax.vjp(lambda x: dispatcher.dispatch(x, ids_TK)[0], zeros_TD)
  (dx_TD,) = pullback(ct_MD.astype(x_stamp.dtype))
  return vma.like_primal(dx_TD, x_stamp), None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine(dispatcher, y_MD, weights_TK, meta, ids_TK):
  """dispatcher.combine(y_MD, weights_TK, meta), bf16 as it is; the cotangent of y_MD crosses in FP8.
  meta and ids_TK: what `dispatch` returned and was given."""
  return dispatcher.combine(y_MD, weights_TK, meta)


def _combine_fwd(dispatcher, y_MD, weights_TK, meta, ids_TK):
  # The weights' pullback keeps what autodiff of the combine would (the rows it gathered for each token),
  # so their gradient is the bf16 combine's own, from the unquantized cotangent.
  y_TD, pull_weights = jax.vjp(lambda w: dispatcher.combine(y_MD, w, meta), weights_TK)
  rows_stamp = vma.like_operands(jnp.zeros((y_MD.shape[0], 0), y_MD.dtype), y_MD)  # M, dtype and type of y_MD
  return y_TD, (pull_weights, weights_TK, meta, ids_TK, rows_stamp)


def _combine_bwd(dispatcher, residuals, ct_TD):
  pull_weights, weights_TK, meta, ids_TK, rows_stamp = residuals
  (ct_weights_TK,) = pull_weights(ct_TD)
  dispatcher = _checked_once(dispatcher)
  # Each row's routing weight, where the row is: the combine's transpose of ones (one scalar per slot
  # crosses, not a row). Its forward on the zero probe is dropped by XLA.
  probe_M1 = vma.like_operands(jnp.zeros((rows_stamp.shape[0], 1), jnp.float32), rows_stamp)
  _, pull_rows = jax.vjp(lambda y: dispatcher.combine(y, weights_TK, meta), probe_M1)
  (weight_M1,) = pull_rows(vma.like_operands(jnp.ones((ct_TD.shape[0], 1), jnp.float32), ct_TD))
  tiles_M, _ = _moved_tiles(dispatcher, ct_TD, ids_TK)
  # Rows no slot points at (a bounded buffer's unfilled rows) have weight 0 and may hold any bytes.
  ct_MD = jnp.where(weight_M1 != 0, fp8_quant.dequantize_rows(tiles_M, ct_TD.shape[1], jnp.float32) * weight_M1, 0)
  return vma.like_primal(ct_MD.astype(rows_stamp.dtype), rows_stamp), ct_weights_TK, None, None


combine.defvjp(_combine_fwd, _combine_bwd)
