"""Backend "xla_fp8": blockwise FP8 emulated in float32, the CPU path and the reference of `mgpu_fp8`.

Both operands go through `fp8_quant` exactly as the Hopper kernel's do (1x128 row tiles for the
activations, 128x128 blocks for the weights, e4m3), are dequantized (behind `fp8_quant.kept`, so
that XLA's GPU pipeline keeps the rounding), and multiplied by the xla backend in float32. The
kernel computes the same sum with the FP8 MMA and a promotion every 128 of the contraction, so the
two differ only in summation order (and the MMA's own accumulation on a GPU: tools/bench_fp8.py). dW quantizes both operands in 128x1 tiles along the rows, as the kernel
does.
"""

from __future__ import annotations

import jax.numpy as jnp

from MaxText.moe.gmm import _pad, fp8_quant, xla

NAME = "xla_fp8"


def unavailable_reason() -> str | None:
  return None  # plain JAX


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset, transpose_rhs, out_dtype, lhs_tiles=None, lhs_gathered=False,
        rhs_blocks=None):
  """lhs_gathered (which pass quantizes lhs on a GPU) changes no value, as tgmm's `gathered`. rhs_blocks: rhs
  already quantized (`fp8_quant.quantize_weight_blocks`), as mgpu_fp8.gmm's."""
  del lhs_gathered
  out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)

  def emulated(lhs_PK, rhs):
    if lhs_tiles is None:
      lhs_PK = fp8_quant.dequantize_row_tiles(*fp8_quant.kept(fp8_quant.quantize_row_tiles(lhs_PK)))
    else:  # quantized before the dispatch (the same tiles, bit for bit)
      lhs_PK = fp8_quant.dequantize_row_tiles(*fp8_quant.rows_for_kernel(lhs_tiles, lhs_PK.shape[0]))
    rhs = fp8_quant.dequantize_blocks(*fp8_quant.kept(fp8_quant.quantize_blocks(rhs) if rhs_blocks is None
                                                      else rhs_blocks[:2]))
    return xla.gmm(lhs_PK, rhs, group_sizes_G, group_offset=group_offset, transpose_rhs=transpose_rhs,
                   out_dtype=out_dtype)

  # Zero padding to the quantization blocks changes no tile's amax: the same quantization as the kernel's.
  return _pad.gmm(emulated, lhs_MK, rhs_GKN, transpose_rhs=transpose_rhs,
                  align=_pad.Align(m=1, k=fp8_quant.BLOCK, n=fp8_quant.BLOCK))


def quantize_weight(rhs_GKN) -> fp8_quant.WeightBlocks:
  """The weight's blocks, once for the forward and dlhs (gmm's custom VJP)."""
  return fp8_quant.WeightBlocks(*fp8_quant.quantize_weight_blocks(rhs_GKN))


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset, num_local_groups, out_dtype, gathered=(False, False),
         lhs_tiles=None, dout_tiles=None):
  """dW from both operands quantized in 128x1 tiles along the rows, each group's rows 128-aligned
  (`fp8_quant.group_blocks`, as `mgpu_fp8_tgmm`), dequantized, multiplied in float32. gathered (which
  pass quantizes each operand on a GPU) changes no value: mgpu_fp8_quant is fp8_quant bit for bit. Nor do
  lhs_tiles and dout_tiles: the operands are their values (mgpu_fp8_tgmm.tgmm's contract), so quantizing them
  gives their requantization."""
  del gathered, lhs_tiles, dout_tiles
  out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)

  def emulated(lhs_MK, dout_MN):
    layout = fp8_quant.group_blocks(group_sizes_G, group_offset, num_local_groups, lhs_MK.shape[0])
    def values_PK(a):
      q_PbKB, scale_PbK = fp8_quant.kept(fp8_quant.quantize_group_row_blocks(a, layout))
      return fp8_quant.dequantize_row_tiles(fp8_quant.group_row_blocks_KP(q_PbKB), scale_PbK).T

    lhs_PK, dout_PN = values_PK(lhs_MK), values_PK(dout_MN)
    return xla.tgmm(lhs_PK, dout_PN, layout.sizes_L, group_offset=0, num_local_groups=num_local_groups,
                    out_dtype=out_dtype)

  return _pad.tgmm(emulated, lhs_MK, dout_MN, align=_pad.Align(m=1, k=fp8_quant.BLOCK, n=fp8_quant.BLOCK))
