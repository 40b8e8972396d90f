"""Backend "xla_mxfp8": MXFP8 emulated by quantize-dequantize, the CPU path and the reference of `te_mxfp8`.

Each product's operands are rounded to MXFP8 (`fp8_quant.quantize_mx`: e4m3 values, one E8M0 power-of-two scale
per 32 values along the product's contraction) as Transformer Engine's MXFP8_1D_SCALING quantizes them for
Blackwell's block-scaled MMA, dequantized (behind `fp8_quant.kept`) and multiplied by the xla backend in float32:

    forward   lhs [M, K] in 1x32 blocks along K; the weight in 32x1 blocks along K
    dlhs      dout [M, N] along N; the same weight, quantized again along N (TE keeps both layouts)
    dW        lhs and dout in 32x1 blocks along the rows, each local expert's rows from a multiple of 128
              (`fp8_quant.group_blocks`, as te_mxfp8 lays them out), so that no block mixes two experts

The MMA accumulates the exact products of the dequantized values in f32, as this does, so the two differ in
summation order only. A dequantized value (4 significant bits times a power of two) is exact in bf16 too.
"""

from __future__ import annotations

import jax.numpy as jnp

from MaxText.moe.gmm import _pad, fp8_quant, xla

NAME = "xla_mxfp8"
_ALIGN = _pad.Align(m=1, k=fp8_quant.MX_BLOCK, n=1)


def unavailable_reason() -> str | None:
  return None  # plain JAX


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset, transpose_rhs, out_dtype):
  out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)

  def emulated(lhs_PK, rhs):  # K is zero-padded to 32 by _pad: zeros change no block's amax
    lhs_PK = fp8_quant.mx_values(lhs_PK, axis=1)
    rhs = fp8_quant.mx_values(rhs, axis=2 if transpose_rhs else 1)
    return xla.gmm(lhs_PK, rhs, group_sizes_G, group_offset=group_offset, transpose_rhs=transpose_rhs,
                   out_dtype=out_dtype)

  return _pad.gmm(emulated, lhs_MK, rhs_GKN, transpose_rhs=transpose_rhs, align=_ALIGN)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset, num_local_groups, out_dtype):
  out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
  layout = fp8_quant.group_blocks(group_sizes_G, group_offset, num_local_groups, lhs_MK.shape[0])

  def values_PX(a_MX):  # the local groups' rows, 128-aligned (zero rows between), in 32-row blocks
    rows_PX = jnp.take(a_MX, layout.src_P, axis=0, mode="fill", fill_value=0)
    return fp8_quant.mx_values(rows_PX, axis=0)

  return xla.tgmm(values_PX(lhs_MK), values_PX(dout_MN), layout.sizes_L, group_offset=0,
                  num_local_groups=num_local_groups, out_dtype=out_dtype)
