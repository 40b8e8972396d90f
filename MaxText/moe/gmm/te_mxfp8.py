"""Backend "te_mxfp8": Transformer Engine's grouped GEMM with MXFP8 block scaling (Blackwell), on our dispatch.

Transformer Engine 2.20's `cpp_extensions.grouped_gemm` quantizes its two `GroupedNoScaleTensor` operands itself
when handed a quantizer set (`QuantizerFactory.create_set(scaling_mode=MXFP8_1D_SCALING, n_groups=...)`), each
along the dim its contracting_dims contract (TE's `_quantize_inputs_if_needed`): rowwise (1x32) where that is the
last dim, else colwise (32x1). So the three products take the layouts `xla_mxfp8` emulates:

    ((1,), (1,))  x [P, K] rowwise, w [G, K, N] colwise: blocks along K      forward
    ((1,), (2,))  dy [P, N] rowwise, w [G, K, N] rowwise: blocks along N     dlhs
    ((0,), (0,))  x and dy colwise: blocks of 32 rows                        dW

TE wants sum(group sizes) == rows and, for MXFP8, every group 128-aligned (its V2 kernel; a 32-row block must
not span two experts in dW either), and has no group_offset. So the local experts' rows are gathered into the
128-aligned layout of `fp8_quant.group_blocks` (zero rows after each expert), the rows past them form one
trailing group multiplied by zero weights (as te.py's), and the output rows are gathered back. K and N are
zero-padded to 128. It never ran here: no Blackwell GPU; tests/test_mxfp8.py holds its plumbing to a stand-in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.moe.gmm import _pad, fp8_quant, te

NAME = "te_mxfp8"
_ALIGN = _pad.Align(m=1, k=128, n=128)


def _mxfp8_quantizers(num_groups: int):
  """A fresh MXFP8 quantizer set for one grouped_gemm call (the call sets its quantizers' layouts)."""
  from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode  # pylint: disable=import-outside-toplevel

  return QuantizerFactory.create_set(scaling_mode=ScalingMode.MXFP8_1D_SCALING, fwd_dtype=fp8_quant.E4M3,
                                     bwd_dtype=fp8_quant.E4M3, n_groups=num_groups)


def unavailable_reason() -> str | None:
  why = te.unavailable_reason()
  if why:
    return why
  cc = str(getattr(jax.devices()[0], "compute_capability", ""))
  if not cc.split(".")[0].isdigit() or int(cc.split(".")[0]) < 10:
    return (f"GPU compute capability {cc!r}: MXFP8 needs Blackwell's block-scaled tensor cores (10.x); "
            "moe_fp8=blockwise runs on Hopper")
  return None


def _layout(group_sizes_G, group_offset, num_local_groups: int, num_rows: int):
  """(src_P, sizes with the trailing group, dst_M): the 128-aligned rows, and where each row m landed (P: none)."""
  layout = fp8_quant.group_blocks(group_sizes_G, group_offset, num_local_groups, num_rows)
  p = layout.src_P.shape[0]
  dst_M = jnp.full((num_rows,), p, jnp.int32).at[layout.src_P].set(jnp.arange(p, dtype=jnp.int32), mode="drop")
  return layout.src_P, te._with_tail_group(layout.sizes_L, p), dst_M  # pylint: disable=protected-access


def _rows(a_MX, src_P):
  return jnp.take(a_MX, src_P, axis=0, mode="fill", fill_value=0)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset, transpose_rhs, out_dtype):
  grouped_gemm, tensor_cls = te._grouped_gemm()  # pylint: disable=protected-access
  ragged = te._ragged  # pylint: disable=protected-access
  num_local = rhs_GKN.shape[0]

  def kernel(lhs_MK, rhs):
    src_P, sizes, dst_M = _layout(group_sizes_G, group_offset, num_local, lhs_MK.shape[0])
    tail = jnp.zeros((1,) + rhs.shape[1:], rhs.dtype)  # the trailing group's weights
    out_PN = grouped_gemm(ragged(tensor_cls, _rows(lhs_MK, src_P), sizes),
                          ragged(tensor_cls, jnp.concatenate([rhs, tail])),
                          contracting_dims=te._TRANSPOSED_RHS_DIMS if transpose_rhs else te._FWD_DIMS,  # pylint: disable=protected-access
                          preferred_element_type=out_dtype, quantizer_set=_mxfp8_quantizers(num_local + 1))
    return jnp.take(out_PN, dst_M, axis=0, mode="fill", fill_value=0).astype(out_dtype)

  return _pad.gmm(kernel, lhs_MK, rhs_GKN, transpose_rhs=transpose_rhs, align=_ALIGN)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset, num_local_groups, out_dtype):
  grouped_gemm, tensor_cls = te._grouped_gemm()  # pylint: disable=protected-access
  ragged = te._ragged  # pylint: disable=protected-access

  def kernel(lhs_MK, dout_MN):
    src_P, sizes, _ = _layout(group_sizes_G, group_offset, num_local_groups, lhs_MK.shape[0])
    drhs_GKN = grouped_gemm(ragged(tensor_cls, _rows(lhs_MK, src_P), sizes),
                            ragged(tensor_cls, _rows(dout_MN, src_P), sizes),
                            contracting_dims=te._WGRAD_DIMS,  # pylint: disable=protected-access
                            preferred_element_type=out_dtype, quantizer_set=_mxfp8_quantizers(num_local_groups + 1))
    return drhs_GKN[:num_local_groups].astype(out_dtype)

  return _pad.tgmm(kernel, lhs_MK, dout_MN, align=_ALIGN)
