"""dW's FP8 operands in one pass over HBM: a Pallas Mosaic-GPU kernel for Hopper.

`fp8_quant.quantize_group_row_blocks` gives dW's operands: the local groups' rows laid out from
multiples of 128 (`fp8_quant.group_blocks`), quantized in 128x1 tiles along the rows, each
128-row block stored transposed, [P/128, K, 128]. XLA compiles it to two fusions, each reading
every row: a column reduction (the tiles' amax) and the transposing quantize. Measured on the
H200 at M = 65,536, K = 7,168: 1.10 ms, where a plain bf16 copy of x takes 0.57 ms; this kernel
0.456 ms (3.1 TB/s of reads and writes), and 0.150 against 0.325 ms at K = 2,048 (tools/bench_fp8.py;
BENCHMARKS.md "FP8 kernels"). Which operands it takes in a step is `fp8_tgmm.tgmm`'s `gathered`.

This kernel reads each [128 rows, 128 columns] tile once: TMA brings it into shared memory, one
warpgroup takes its columns' amax over the block's valid rows, scales, converts to e4m3 and
stores it transposed into shared memory, and TMA writes the [128 columns, 128 rows] tile and its
128 scales. A block's rows are contiguous in x (a group's rows are, and no block spans two
groups), so a block is one TMA box from its first source row; rows past the block's valid count
(the next group's, or past M, which TMA fills with zeros) are masked to zero before the amax,
so a NaN there leaks nowhere. Blocks with no valid row are zeros with scale 1, as in fp8_quant.

Bit for bit `fp8_quant.quantize_group_row_blocks`: the same f32 amax, the same reciprocal of each
scale and product, the same round-to-nearest-even conversion (tests/test_fp8.py runs it in the Mosaic-GPU interpreter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.moe.gmm import _pad, fp8_quant
from MaxText.moe.gmm.mgpu import kernels as mgpu_kernels

BLOCK = fp8_quant.BLOCK
# Column tiles per block of the grid: each block pipelines this many tiles of one 128-row block.
# Measured on the H200 (a scratch A/B, 2026-12-02; docs/kernels.md, "Tried, and why it did not help"): 4, 8 and 16
# within 2% at K = 7,168; 16 was 12% slower at 2,048.
CHUNK = 8
STAGES = 2


def block_rows(layout: fp8_quant.GroupBlocks, num_rows: int) -> tuple[jax.Array, jax.Array]:
  """(row0_Pb, valid_Pb) int32 [P/128]: each padded block's first source row, and how many of its
  128 rows are the group's (the rest are the layout's zero gap). A block's valid rows are the
  contiguous source rows row0 .. row0 + valid."""
  src_PbB = layout.src_P.reshape(-1, BLOCK)
  valid_Pb = jnp.sum(src_PbB < num_rows, axis=1, dtype=jnp.int32)
  return src_PbB[:, 0], valid_Pb


def quantize_group_row_blocks(x_MK: jax.Array, layout: fp8_quant.GroupBlocks) -> tuple[jax.Array, jax.Array]:
  """The kernel form of `fp8_quant.quantize_group_row_blocks`: (q_PbKB e4m3, scale_PbK f32)."""
  return _group_row_blocks(x_MK, None, layout, x_MK.dtype)


# A jit of its own: wi_0's and wi_1's dW requantize the same tiles, and only one traced kernel (one Mosaic module)
# lets XLA merge the two calls. Each call site's own trace gave two modules that differ in their source locations,
# and the compiled proxy step ran the kernel twice per layer (the compile-only H200 HLO of the 1-GPU proxy).
@functools.partial(jax.jit, static_argnums=2)
def requantize_group_row_blocks(tiles: fp8_quant.RowTiles, layout: fp8_quant.GroupBlocks,
                                dtype) -> tuple[jax.Array, jax.Array]:
  """dW's 128x1 operand from rows that are already 1x128 tiles (the FP8 dispatch's, which the forward
  multiplied): bit for bit `quantize_group_row_blocks(dequantize_rows(tiles, K', dtype), layout)`.

  The dispatch moved x as e4m3 tiles, and the forward kernel reads them from memory, so they are
  materialized rows: this reads their e4m3 bytes (1 B a value, half of x in bf16) and each row's scale,
  and rounds each dequantized value to dtype (the values gmm's VJP holds for them) before the 128x1
  quantization. XLA would fuse the dequantization into its two passes over the gathered token rows."""
  # Row-major scales, the columns padded to a multiple of SCALE_COLS (the padding is never selected).
  return _group_row_blocks(tiles.q_MK, _pad.pad_axes(tiles.scale_MKb, {1: SCALE_COLS}), layout, dtype)


# The tile scales' box: a block's 128 rows x 8 columns of the row-major [M, K'/128] scales (32 B a row). A box of
# the transposed [K'/128, M] scales would start at the block's first row in its minor dimension, any row, and a
# TMA box whose start there is not 16-byte aligned stopped the H200 with CUDA_ERROR_ILLEGAL_INSTRUCTION (a group
# from row 501, 2026-12-03). Rows are the major dimension here: any start is fine, as for x's own box.
SCALE_COLS = 8


def _group_row_blocks(x_MK, scale_MKb, layout: fp8_quant.GroupBlocks, value_dtype):
  """x's values are x_MK itself, or with scale_MKb (x_MK then e4m3 1x128 tiles, scale_MKb f32 [M, K'/128]
  padded to a multiple of SCALE_COLS columns) value_dtype(x_MK * scale), f32 products rounded as
  `fp8_quant.dequantize_rows` rounds them."""
  m, k = x_MK.shape
  if k % BLOCK:
    raise ValueError(f"dW quantization: K = {k} must be a multiple of {BLOCK}")
  row0_Pb, valid_Pb = block_rows(layout, m)
  pb = row0_Pb.shape[0]
  kb = k // BLOCK
  tiled = scale_MKb is not None
  # With scales, a grid block's column tiles lie in one aligned box of SCALE_COLS scale columns: chunk divides it.
  chunk = max(c for c in range(1, CHUNK + 1) if kb % c == 0 and (not tiled or SCALE_COLS % c == 0))
  # The e4m3 tile is swizzled in shared memory (its TMA store reads it so); x's tile cannot be: a
  # tiled TMA box must start at a multiple of 8 rows, and a block starts at its group's first row.
  out_transforms = mgpu_kernels.swizzled(BLOCK, fp8_quant.E4M3)

  def body(row0_gmem, valid_gmem, x_gmem, *refs):
    (s_in_gmem, q_gmem, s_gmem) = refs if tiled else (None, *refs)
    b, c = lax.axis_index("b"), lax.axis_index("c")
    row0, valid = row0_gmem[b], valid_gmem[b]
    cols = pl.ds(c * chunk * BLOCK, chunk * BLOCK)

    @functools.partial(pl.run_scoped, q_smem=plgpu.SMEM((2, BLOCK, BLOCK), fp8_quant.E4M3, transforms=out_transforms),
                       s_smem=plgpu.SMEM((2, 1, BLOCK), jnp.float32))
    def _scope(q_smem, s_smem):
      # Stores are issued here from two slots, not through emit_pipeline's out_specs: its predicated TMA
      # stores are not supported by the Mosaic-GPU interpreter that the CPU tests run the kernel in.
      def tile(idx, x_smem, s_in_smem=None):
        (j,) = idx
        slot = j % 2
        plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # this slot's stores of two tiles ago have read it
        x_RC = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        if tiled:  # each row's scale of this column tile: its column of the box, as a sum of one term per row
          s_RS = plgpu.load(s_in_smem, layout=plgpu.Layout.WGMMA)
          col_S = lax.broadcasted_iota(jnp.int32, (BLOCK, SCALE_COLS), 1)
          s_R = jnp.sum(jnp.where(col_S == (c * chunk + j) % SCALE_COLS, s_RS, 0.0), axis=1)
          x_RC = (x_RC * lax.broadcast_in_dim(s_R, (BLOCK, BLOCK), [0])).astype(value_dtype).astype(jnp.float32)
        rows = lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
        x_RC = jnp.where(rows < valid, x_RC, 0.0)
        amax_C = jnp.max(jnp.abs(x_RC), axis=0)
        scale_C = jnp.where(amax_C > 0, amax_C / fp8_quant.E4M3_MAX, 1.0)
        q_RC = x_RC * lax.broadcast_in_dim(1.0 / scale_C, (BLOCK, BLOCK), [1])
        # The transposed register layout holds a column's rows as vectors: stored contiguously below.
        q_RC = plgpu.layout_cast(q_RC, plgpu.Layout.WGMMA_TRANSPOSED)
        q_smem.at[slot].transpose((1, 0))[...] = q_RC.astype(fp8_quant.E4M3)
        s_smem.at[slot, 0][...] = scale_C
        plgpu.commit_smem()
        col = (c * chunk + j) * BLOCK
        plgpu.copy_smem_to_gmem(q_smem.at[slot], q_gmem.at[b, pl.ds(col, BLOCK)])
        plgpu.copy_smem_to_gmem(s_smem.at[slot], s_gmem.at[pl.ds(b, 1), pl.ds(col, BLOCK)])

      in_specs = [plgpu.BlockSpec((BLOCK, BLOCK), lambda j: (0, j))]
      inputs = [x_gmem.at[pl.ds(row0, BLOCK), cols]]
      if tiled:  # the block's rows of the aligned SCALE_COLS scale columns that hold this grid block's column tiles
        in_specs.append(plgpu.BlockSpec((BLOCK, SCALE_COLS), lambda j: (0, 0)))
        inputs.append(s_in_gmem.at[pl.ds(row0, BLOCK), pl.ds(c * chunk // SCALE_COLS * SCALE_COLS, SCALE_COLS)])
      plgpu.emit_pipeline(tile, grid=(chunk,), in_specs=in_specs, max_concurrent_steps=STAGES)(*inputs)
      plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((pb, k, BLOCK), fp8_quant.E4M3), jax.ShapeDtypeStruct((pb, k), jnp.float32)),
      grid=(pb, kb // chunk),
      grid_names=("b", "c"),
  )
  return kernel(row0_Pb, valid_Pb, x_MK, *([scale_MKb] if tiled else []))


# --- 1x128 row tiles (the forward's and dlhs's lhs) ---
#
# `fp8_quant.quantize_row_tiles` in one pass: XLA reads x twice (the tiles' amax, then the quantize), 0.81 ms at
# M = 65,536, K = 7,168 and 0.24 ms at K = 2,048 on the H200 (tools/bench_fp8.py; BENCHMARKS.md "FP8 kernels"),
# where the column kernel above moves the same bytes in 0.46 and 0.15. Each [128 rows, 128 columns] tile is
# loaded once by TMA; one warpgroup takes each
# row's amax (a row of the WGMMA register layout lives in four threads of a quad: a cross-lane max), scales,
# converts to e4m3 and writes the tile back unchanged in shape, with its 128 row scales as one row of scale_KbM.
# Row blocks start at multiples of 128; the last one's box runs past M, where TMA reads zeros (scale 1) and
# writes nothing.


def quantize_row_tiles(x_MK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The kernel form of `fp8_quant.quantize_row_tiles`: (q_MK e4m3, scale_KbM f32 [K/128, M]), bit for bit."""
  m, k = x_MK.shape
  if k % BLOCK:
    raise ValueError(f"row-tile quantization: K = {k} must be a multiple of {BLOCK}")
  mb, kb = -(-m // BLOCK), k // BLOCK
  chunk = max(c for c in range(1, CHUNK + 1) if kb % c == 0)

  def body(x_gmem, q_gmem, s_gmem):
    b, c = lax.axis_index("b"), lax.axis_index("c")
    rows = pl.ds(b * BLOCK, BLOCK)
    cols = pl.ds(c * chunk * BLOCK, chunk * BLOCK)

    @functools.partial(pl.run_scoped, q_smem=plgpu.SMEM((2, BLOCK, BLOCK), fp8_quant.E4M3),
                       s_smem=plgpu.SMEM((2, 1, BLOCK), jnp.float32))
    def _scope(q_smem, s_smem):
      def tile(idx, x_smem):  # stores from two slots, as quantize_group_row_blocks (the interpreter's reason)
        (j,) = idx
        slot = j % 2
        plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # this slot's stores of two tiles ago have read it
        x_RC = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        amax_R = jnp.max(jnp.abs(x_RC), axis=1)
        scale_R = jnp.where(amax_R > 0, amax_R / fp8_quant.E4M3_MAX, 1.0)
        q_RC = x_RC * lax.broadcast_in_dim(1.0 / scale_R, (BLOCK, BLOCK), [0])
        q_smem.at[slot][...] = q_RC.astype(fp8_quant.E4M3)
        s_smem.at[slot, 0][...] = scale_R
        plgpu.commit_smem()
        col_block = c * chunk + j
        plgpu.copy_smem_to_gmem(q_smem.at[slot], q_gmem.at[rows, pl.ds(col_block * BLOCK, BLOCK)])
        plgpu.copy_smem_to_gmem(s_smem.at[slot], s_gmem.at[pl.ds(col_block, 1), rows])

      plgpu.emit_pipeline(
          tile,
          grid=(chunk,),
          in_specs=[plgpu.BlockSpec((BLOCK, BLOCK), lambda j: (0, j))],
          max_concurrent_steps=STAGES,
      )(x_gmem.at[rows, cols])
      plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((m, k), fp8_quant.E4M3), jax.ShapeDtypeStruct((kb, m), jnp.float32)),
      grid=(mb, kb // chunk),
      grid_names=("b", "c"),
  )
  return kernel(x_MK)


# --- 128x128 weight blocks, in both layouts (the forward's and dlhs's) ---
#
# `fp8_quant.quantize_weight_blocks` and the forward's transposed copy, in one pass. XLA compiles the pair to an
# amax pass over the bf16 weight, a quantizing pass that reads it again, and a transpose of the e4m3 blocks (the
# FFN's compiled HLO, tools/hlo_ffn_fp8.py at 2b6d1c1): per weight 2 + 3 + 2 bytes a value, where this reads 2 and writes 2. Each
# [128, 128] block is loaded once by TMA; one warpgroup takes its amax (each row's, then the rows' across warps),
# scales, converts, and stores the block as is and transposed. `fp8.quantize_weight` calls it for the forward.
#
# One shared-memory buffer per output layout: a tile's stores wait for the previous tile's to have read it. Two
# (129 KB a grid block, one block per SM) ran at 3.0 TB/s; one (97 KB, two blocks per SM) at 3.8 TB/s, 1.85x XLA's
# passes, on the H200 at DeepSeek-V3's shapes (tools/bench_quant.py; BENCHMARKS.md "FP8 kernels"). Four column blocks
# per grid block measured 3-5% faster than eight.
WEIGHT_CHUNK = 4


def quantize_weight_blocks_both(w_GKN: jax.Array, *,
                                chunk: int = WEIGHT_CHUNK) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(q_GKN, q_GNK e4m3, scale_GKbNb f32): `fp8_quant.quantize_weight_blocks(w)` and its blocks transposed
  (q_GKN.swapaxes(1, 2)), bit for bit. K and N must be multiples of 128 (quantize_weight_blocks pads them).
  chunk: the most column blocks one grid block pipelines (tools/bench_quant.py sweeps it)."""
  g, k, n = w_GKN.shape
  if k % BLOCK or n % BLOCK:
    raise ValueError(f"weight-block quantization: K = {k} and N = {n} must be multiples of {BLOCK}")
  kb, nb = k // BLOCK, n // BLOCK
  chunk = max(c for c in range(1, chunk + 1) if nb % c == 0)
  out_transforms = mgpu_kernels.swizzled(BLOCK, fp8_quant.E4M3)

  def body(w_gmem, q_gmem, qT_gmem, s_gmem):
    gi, bi, c = lax.axis_index("g"), lax.axis_index("b"), lax.axis_index("c")
    rows = pl.ds(bi * BLOCK, BLOCK)

    @functools.partial(pl.run_scoped, q_smem=plgpu.SMEM((BLOCK, BLOCK), fp8_quant.E4M3),
                       qT_smem=plgpu.SMEM((BLOCK, BLOCK), fp8_quant.E4M3, transforms=out_transforms),
                       s_smem=plgpu.SMEM((1, BLOCK), jnp.float32))
    def _scope(q_smem, qT_smem, s_smem):
      def tile(idx, w_smem):  # stores issued here, as quantize_group_row_blocks's (the interpreter's reason)
        (j,) = idx
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's three stores have read the buffers
        w_RC = plgpu.load(w_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        amax_R = jnp.max(jnp.abs(w_RC), axis=1)
        # Every column of the block gets the block's amax: the rows' maxima broadcast back, then their max.
        amax_C = jnp.max(lax.broadcast_in_dim(amax_R, (BLOCK, BLOCK), [0]), axis=0)
        scale_C = jnp.where(amax_C > 0, amax_C / fp8_quant.E4M3_MAX, 1.0)
        q_RC = w_RC * lax.broadcast_in_dim(1.0 / scale_C, (BLOCK, BLOCK), [1])
        q_smem[...] = q_RC.astype(fp8_quant.E4M3)
        qT_smem.transpose((1, 0))[...] = plgpu.layout_cast(q_RC, plgpu.Layout.WGMMA_TRANSPOSED).astype(
            fp8_quant.E4M3)
        s_smem.at[0][...] = scale_C  # 128 copies of the block's scale: the caller keeps the first
        plgpu.commit_smem()
        nblk = c * chunk + j
        cols = pl.ds(nblk * BLOCK, BLOCK)
        plgpu.copy_smem_to_gmem(q_smem, q_gmem.at[gi, rows, cols])
        plgpu.copy_smem_to_gmem(qT_smem, qT_gmem.at[gi, cols, rows])
        plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[gi, bi, pl.ds(nblk, 1)])

      plgpu.emit_pipeline(
          tile,
          grid=(chunk,),
          in_specs=[plgpu.BlockSpec((BLOCK, BLOCK), lambda j: (0, j))],
          max_concurrent_steps=STAGES,
      )(w_gmem.at[gi, rows, pl.ds(c * chunk * BLOCK, chunk * BLOCK)])
      plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((g, k, n), fp8_quant.E4M3), jax.ShapeDtypeStruct((g, n, k), fp8_quant.E4M3),
                jax.ShapeDtypeStruct((g, kb, nb, BLOCK), jnp.float32)),
      grid=(g, kb, nb // chunk),
      grid_names=("g", "b", "c"),
  )
  q_GKN, q_GNK, s_GKbNbB = kernel(w_GKN)
  return q_GKN, q_GNK, s_GKbNbB[..., 0]
