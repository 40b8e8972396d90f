"""FP8 dispatch: tokens quantized to 1x128 e4m3 tiles before they move, as DeepSeek-V3 trained
(arXiv 2412.19437, section 3.3: the activations before the MoE up-projections are quantized, then
dispatched; the combine stays bf16).

    xhat_MD, tiles_M, meta = fp8_dispatch.dispatch(dispatcher, x_TD, ids_TK)

A 1x128 tile is one row's 128 columns, so quantizing commutes with moving rows. The grouped GEMM gets
the same e4m3 values and scales, bit for bit, that it would compute from the dispatched bf16 rows.
What changes is the cost:
  * the quantization reads T token rows, not the T x K dispatched ones;
  * every dispatcher moves 1 + 4/128 bytes per value instead of 2: the e4m3 row and its f32 scales,
    packed side by side as uint8 so that one exchange carries both.

Gradients flow through xhat_MD, the tiles' values in x's dtype. Its cotangent goes back to the tokens
along the dispatcher's own backward (a bf16 exchange, like the combine's). dW quantizes xhat: the cached
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


def _dispatch_fwd(dispatcher, x_TD, ids_TK):
  tiles_T = fp8_quant.quantize_rows(x_TD)
  packed_MB, meta = dispatcher.dispatch(pack(tiles_T), ids_TK)
  tiles_M = unpack(packed_MB, tiles_T.q_MK.shape[1])
  xhat_MD = fp8_quant.dequantize_rows(tiles_M, x_TD.shape[1], x_TD.dtype)
  return (xhat_MD, tiles_M, meta), (ids_TK, vma.stamp(x_TD))


def _dispatch_bwd(dispatcher, residuals, cotangents):
  """The dispatcher's own backward on the bf16 cotangent of xhat. Its forward runs on zeros only to
  build that backward, and XLA drops it: nothing uses its output."""
  ids_TK, x_stamp = residuals
  ct_MD = cotangents[0]
  zeros_TD = vma.like_operands(jnp.zeros((ids_TK.shape[0], ct_MD.shape[1]), x_stamp.dtype), x_stamp)
  if getattr(dispatcher, "on_overflow", "flag") != "flag":
    # The forward already checked its buffers; a host callback here would survive XLA's dead-code pass.
    dispatcher = dataclasses.replace(dispatcher, on_overflow="flag")
  _, pullback = jax.vjp(lambda x: dispatcher.dispatch(x, ids_TK)[0], zeros_TD)
  (dx_TD,) = pullback(ct_MD.astype(x_stamp.dtype))
  return vma.like_primal(dx_TD, x_stamp), None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)
