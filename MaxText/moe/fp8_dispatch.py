"""FP8 dispatch: rows quantized to 1x128 e4m3 tiles before they move towards the experts, as DeepSeek-V3
trained (arXiv 2412.19437, section 3.3.3: the activations before the MoE up-projections are quantized,
then dispatched; "a similar strategy is applied to the activation gradient before MoE down-projections";
the forward and backward combine stay bf16).

    xhat_MD, tiles_M, meta = fp8_dispatch.dispatch(dispatcher, x_TD, ids_TK)
    ...                                                  # the up-projections and the SwiGLU: h_MF
    y_TD = fp8_dispatch.expert_output_combine(dispatcher, h_MF, wo_EFD, meta, weights_TK, ids_TK, ...)

`expert_output_combine` is wo's grouped GEMM and the dispatcher's bf16 combine; its backward sends the
output's cotangent to the expert rows as e4m3 tiles, by the dispatcher's own dispatch, and scales each
row's tiles by its routing weight there. So every exchange towards the experts is FP8, and every
exchange back is bf16. wo's dlhs multiplies those tiles and its dW requantizes them (gmm.backward's
dout_tiles): no second quantization of the cotangent. The weights' gradient is taken from the
cotangent unquantized, on the tokens' side, as the bf16 combine's is.

A 1x128 tile is one row's 128 columns, so quantizing commutes with moving rows. The grouped GEMM gets
the same e4m3 values and scales, bit for bit, that it would compute from the dispatched bf16 rows.
What changes is the cost:
  * the quantization reads T token rows, not the T x K dispatched ones;
  * every dispatcher moves 1 + 4/128 bytes per value instead of 2: the e4m3 row and its f32 scales,
    packed side by side in uint32 words (WORD) so that one exchange carries both.

Gradients flow through xhat_MD, the tiles' values in x's dtype. Its cotangent goes back to the tokens
along the dispatcher's own backward (a bf16 exchange, like the combine's forward). dW quantizes xhat: the cached
FP8 activations converted to dW's 128x1 tiles, as in the paper, so dW differs from quantizing x itself
by FP8's rounding (tests/test_fp8_dispatch.py bounds it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from MaxText.moe import gmm as gmm_lib
from MaxText.moe import vma
from MaxText.moe.dispatch import local
from MaxText.moe.gmm import fp8_quant
from MaxText.moe.gmm.fp8_quant import BLOCK, RowTiles


# The packed rows' word, for dispatchers that exchange rows between devices. XLA gathers a row of words as that many
# elements, 4 to a GPU thread: the packed rows' gather on the H200 ([131,072, 7,392] bytes) took 1.245 ms in uint8,
# 0.583 in uint32 (tools/bench_packed_gather.py at 2b6d1c1, BENCHMARKS.md's D3 at 1bc5e82). In the whole compiled
# step, uint32 words alone had XLA gather the forward's rows in a transposed layout: the kernel's transposed scales
# ([K'/128, M]) chose the layout of the one gather that carried them (an optimization barrier did not
# change it). `_moved_tiles` pins the moved rows row-major (a layout constraint), so the scales are transposed
# alone, a [K'/128, M] fusion (the compile-only H200 HLO of the EP=2 proxy; tests/test_gpu_target.py checks it). The
# local dispatcher has no exchange to share: it moves the e4m3 bytes as uint32 and the scales by a gather of their own
# (the proxy's step: tools/bench_train.py; BENCHMARKS.md "FP8 end to end").
WORD = jnp.uint32


def pack(tiles: RowTiles, word=WORD) -> jax.Array:
  """RowTiles -> [M, (K' + 4 K'/128) / word size] of `word`: each row's e4m3 bytes, then its f32 scales' bytes."""
  m, k = tiles.q_MK.shape
  size = jnp.dtype(word).itemsize
  q_MW = jax.lax.bitcast_convert_type(tiles.q_MK.reshape(m, k // size, size) if size > 1 else tiles.q_MK, word)
  scale_MW = jax.lax.bitcast_convert_type(tiles.scale_MKb, word).reshape(m, -1)
  return jnp.concatenate([q_MW, scale_MW], axis=1)


def unpack(packed_MW: jax.Array, k_padded: int) -> RowTiles:
  """`pack`'s inverse, whatever its word (uint8 or uint32)."""
  m, size = packed_MW.shape[0], packed_MW.dtype.itemsize
  q_MW, scale_MW = packed_MW[:, :k_padded // size], packed_MW[:, k_padded // size:]
  q_MK = jax.lax.bitcast_convert_type(q_MW, fp8_quant.E4M3).reshape(m, k_padded)
  # The scales through bytes, [M, K'/128, 4] -> f32, whatever the word (XLA folds the uint32 -> uint8 -> f32 pair).
  scale_bytes = jax.lax.bitcast_convert_type(scale_MW, jnp.uint8).reshape(m, k_padded // BLOCK, 4)
  return RowTiles(q_MK, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dispatch(dispatcher, x_TD, ids_TK):
  """(xhat_MD, tiles_M, meta): the dispatched rows' tiles, their values, and the dispatcher's meta."""
  return _dispatch_fwd(dispatcher, x_TD, ids_TK)[0]


def _moved_tiles(dispatcher, x_TD, ids_TK, keep_M1=None):
  """x's rows quantized to tiles here, then dispatched: (tiles of the M rows, meta). keep_M1: rows kept; the others
  come out all zero bytes (q zero, scale 0), selected on the moved words so that the select is part of the
  gather's pass at the words' width."""
  tiles_T = fp8_quant.quantize_rows(x_TD)
  k_padded = tiles_T.q_MK.shape[1]
  keep = (lambda a: a) if keep_M1 is None else (lambda a: jnp.where(keep_M1, a, jnp.zeros((), a.dtype)))
  if isinstance(dispatcher, local.LocalDispatcher):  # two gathers by one sort: no exchange to share (see WORD)
    q_TW = jax.lax.bitcast_convert_type(tiles_T.q_MK.reshape(x_TD.shape[0], k_padded // 4, 4), jnp.uint32)
    q_MW, meta = dispatcher.dispatch(q_TW, ids_TK)
    scale_MKb = local.permute_rows(tiles_T.scale_MKb, meta.order_M, meta.slot_row_TK)
    q_MK = jax.lax.bitcast_convert_type(keep(q_MW), fp8_quant.E4M3).reshape(q_MW.shape[0], k_padded)
    return RowTiles(q_MK, keep(scale_MKb)), meta
  packed_MW, meta = dispatcher.dispatch(pack(tiles_T), ids_TK)
  packed_MW = with_layout_constraint(packed_MW, Layout(major_to_minor=(0, 1)))  # row-major: see WORD
  return unpack(keep(packed_MW), k_padded), meta


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
  _, pullback = jax.vjp(lambda x: dispatcher.dispatch(x, ids_TK)[0], zeros_TD)
  (dx_TD,) = pullback(ct_MD.astype(x_stamp.dtype))
  return vma.like_primal(dx_TD, x_stamp), None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def expert_output_combine(dispatcher, h_MF, wo_EFD, meta, weights_TK, ids_TK, *, backend, dtype, tag):
  """dispatcher.combine(gmm(h_MF, wo_EFD), weights_TK, meta) in one VJP: the forward is the FFN's last grouped
  GEMM and the bf16 combine as they are; the backward moves the output's cotangent to the expert rows as e4m3
  tiles, scales each row's tile scales by its routing weight, and hands wo's dlhs those tiles to multiply and
  its dW the same tiles to requantize in one pass (gmm.backward's dout_tiles). A custom VJP of the combine alone
  could only hand the GEMM's VJP bf16 values, which it quantized again through XLA. tag: the checkpoint names
  of wo's output (block._tag), applied where remat policies see them (inside the forward rule too)."""
  operands, static = gmm_lib.prepare(h_MF, wo_EFD, meta.group_sizes_G, backend=backend,
                                     group_offset=meta.group_offset, preferred_element_type=dtype,
                                     gathered=(False, True))
  return _output_combine(dispatcher, static, tag, operands, weights_TK, meta, ids_TK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _output_combine(dispatcher, static, tag, operands, weights_TK, meta, ids_TK):
  return _output_combine_fwd(dispatcher, static, tag, operands, weights_TK, meta, ids_TK)[0]


def _output_combine_fwd(dispatcher, static, tag, operands, weights_TK, meta, ids_TK):
  y_MD, gmm_residuals = gmm_lib.forward(operands, static)
  y_MD = tag(y_MD)
  # The weights' pullback keeps what autodiff of the combine would (the rows it gathered for each token),
  # so their gradient is the bf16 combine's own, from the unquantized cotangent.
  with jax.named_scope("combine"):  # wo's product stays in the caller's "gmm" scope (MaxText/moe/time_split.py)
    y_TD, pull_weights = jax.vjp(lambda w: dispatcher.combine(y_MD, w, meta), weights_TK)
  rows_stamp = vma.like_operands(jnp.zeros((y_MD.shape[0], 0), y_MD.dtype), y_MD)  # M, dtype and type of y_MD
  return y_TD, (gmm_residuals, pull_weights, weights_TK, meta, ids_TK, rows_stamp)


def _output_combine_bwd(dispatcher, static, tag, residuals, ct_TD):
  del tag  # the forward's
  gmm_residuals, pull_weights, weights_TK, meta, ids_TK, rows_stamp = residuals
  with jax.named_scope("combine"):
    (ct_weights_TK,) = pull_weights(ct_TD)
    dy_tiles = _weighted_cotangent_tiles(dispatcher, ct_TD, weights_TK, meta, ids_TK, rows_stamp)
  # The tiles' values in h's dtype: gmm.backward's contract for dout_tiles.
  dy_MD = fp8_quant.dequantize_rows(dy_tiles, ct_TD.shape[1], gmm_residuals[0].dtype)
  d_operands = gmm_lib.backward(static, gmm_residuals, dy_MD, dout_tiles=dy_tiles)
  return d_operands, ct_weights_TK, None, None


_output_combine.defvjp(_output_combine_fwd, _output_combine_bwd)


def _weighted_cotangent_tiles(dispatcher, ct_TD, weights_TK, meta, ids_TK, rows_stamp) -> RowTiles:
  """The combine's transpose in FP8: ct_TD's rows quantized to 1x128 tiles where they are, moved to the M expert
  rows by the dispatcher's own dispatch (the transpose moves each token's cotangent to its K rows, which is what
  a dispatch does), each row's scales times its routing weight. Scaling a row scales its tiles' amax, so these
  are the tiles quantizing the weighted row would give, without a second rounding. Rows no slot points at (a
  bounded buffer's unfilled rows) have weight 0 and may hold any bytes: zeros of scale 1, as an all-zero tile."""
  # Each row's routing weight, where the row is: the combine's transpose of ones (one scalar per slot
  # crosses, not a row). Its forward on the zero probe is dropped by XLA.
  probe_M1 = vma.like_operands(jnp.zeros((rows_stamp.shape[0], 1), jnp.float32), rows_stamp)
  _, pull_rows = jax.vjp(lambda y: dispatcher.combine(y, weights_TK, meta), probe_M1)
  (weight_M1,) = pull_rows(vma.like_operands(jnp.ones((ct_TD.shape[0], 1), jnp.float32), ct_TD))
  routed_M1 = weight_M1 != 0
  tiles_M, _ = _moved_tiles(dispatcher, ct_TD, ids_TK, keep_M1=routed_M1)
  return RowTiles(tiles_M.q_MK, jnp.where(routed_M1, tiles_M.scale_MKb * weight_M1, 1.0))
