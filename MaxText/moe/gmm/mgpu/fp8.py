"""Blockwise-FP8 grouped GEMM for Hopper: a Pallas Mosaic-GPU kernel (sm_90a e4m3 wgmma).

  out_MN[rows of local group g] = sum over 128-wide contraction blocks kb of
      (lhs_q[rows, kb] @ rhs_q[g][:, kb]^T)  *  lhs_scale[kb, rows]  *  rhs_scale[g, nb, kb]

with `fp8_quant`'s scales (1x128 row tiles for lhs, 128x128 blocks for rhs). It follows
`mgpu_kernels.grouped_matmul` (one TMA warpgroup and wgmma warpgroups on a persistent grid,
the same work table, ZERO rows written as zeros) with what e4m3 needs:

* Both operands K-major: e4m3 wgmma has no transposed-operand mode, so rhs is stored
  [G, N_out, K] (the forward takes the weights' transposed quantized copy; dlhs takes the
  weights as stored, [G, K, N], contracting over N).
* Promotion every 128 of the contraction (DeepSeek-V3's N_C): each pipeline step multiplies
  one 128-column block into a fresh f32 accumulator, waits for it, and adds it to the running
  sum times lhs_scale (one value per row, loaded from the stage's shared memory in the
  accumulator's row layout) times rhs_scale (one scalar: a tile's 128 columns are one weight
  block). While one warpgroup scales, the others' wgmmas run.
* A tile is 192 rows x 128 columns and each of three compute warpgroups takes 64 of its rows
  (WG_ROWS): the running sum and the step's partial are 64 registers per thread each.
* The scales travel with the stage: lhs_scale is stored [K/128, M] so that a step's 128 row
  scales are one contiguous row for TMA; rhs_scale is read as a scalar, a step ahead of its use.

Shapes: K and N multiples of 128, M of 8 (TMA rows). DeepSeek-V3's expert shapes need no
padding. Measured on the H200 by tools/bench_fp8.py (BENCHMARKS.md "FP8 kernels"); the designs
tried and dropped: docs/kernels.md, "Tried, and why it did not help".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.moe.gmm import _pad, fp8_quant
from MaxText.moe.gmm.mgpu import bf16 as mgpu, fp8_quant_kernels as mgpu_fp8_quant, fp8_tgmm as mgpu_fp8_tgmm
from MaxText.moe.gmm.mgpu import kernels as mgpu_kernels, schedule as mgpu_schedule, tiling as mgpu_tiling
from MaxText.moe.gmm.mgpu.schedule import COMPUTE, ZERO
from MaxText.moe.gmm.mgpu.tiling import FP8_WG_ROWS as WG_ROWS, SMEM_LIMIT_BYTES, TMA_ROW_ALIGN

BLOCK = fp8_quant.BLOCK  # contraction step = quantization block = one wgmma warpgroup's columns


@dataclasses.dataclass(frozen=True)
class Fp8Tiling:
  """A tile is 192 rows x 128 columns (one weight block column): compute warpgroup w takes rows
  [64w, 64w + 64) of it. A stage is 128 of the contraction (128 B of e4m3, one swizzle row)."""

  # 5 stages of 192-row tiles and a bf16 epilogue need 233,216 B of shared memory, over the limit.
  stages: int = 4
  # A multiple of 128 B per row (mgpu_tiling.check_epilogue_rows).
  epi_n: int = 64
  # Measured on the H200 (tools/bench_fp8.py --tilings; docs/kernels.md, "Tried, and why it did not help"): a
  # band of 16 column tiles was +3% on the balanced cases and -1 to -4% on Zipf-1.2, so 4 stays. Promoting the
  # previous step's partial while this step's wgmma ran (a third 64x128 f32 array in registers) was 7-11% slower
  # on every case and was removed.
  # A 128x256 tile (each warpgroup multiplying two 128-column weight blocks one after the other into the
  # same partial, 4 stages) was 4-12% slower on every case and was removed.
  grid_block_n: int = 4
  # Loading each weight scale two steps ahead instead of one was 1-6% slower on every case, and was removed.
  # A diagnostic, never a product setting (bench_fp8.py --tilings promote=0): False drops DeepSeek-V3's promotion.
  # The wgmmas accumulate the whole contraction in one f32 accumulator, unscaled, as a per-tensor FP8 GEMM does, on
  # the same tiles, stages and loads. Its values are wrong by design. Its time is the kernel's data path (TMA,
  # shared memory, MMAs) without the per-128 wait and promotion, so the gap to the default splits the loss to
  # dense FP8 between the two.
  promote: bool = True
  # Issuing the compute warpgroups' wgmmas in turn (a ring of barriers: wait for the turn, issue, hand it on before
  # the wgmma's wait), so that their MMAs finish apart and each promotion runs under the others' MMAs, was 5-12%
  # slower on every case (ab3ae0d) and was removed: three barrier hand-offs per step cost more than the
  # promotions they would hide.

  # Three compute warpgroups of 64 rows. A warpgroup's tensor-core work stops from its wgmma wait to its
  # next MMA (the promotion, the stage barrier): with two, the other's one MMA must cover that; with three,
  # two others' do. Against two (128-row tiles, 5 stages), measured on the H200 (tools/bench_fp8.py): -10% on the
  # up-projection (0.71 -> 0.79 of dense FP8), -6% on the down-projection balanced, equal on its Zipf-1.2
  # case; the two-warpgroup option was removed. Four would leave (512 - 24) / 4 -> 120 registers per
  # thread, less than the running sum and the partial (128).
  compute_wgs = 3
  num_warpgroups = compute_wgs + 1  # and the memory warpgroup
  block_m = compute_wgs * WG_ROWS
  cta_n = BLOCK
  # The memory warpgroup's registers: setmaxnreg's least, so that each compute thread gets
  # (512 - 24) / 3 -> 160 (kernel_sass: no spills at 4 stages).
  memory_registers = 24
  # Clusters of two SMs on neighbouring column tiles, each loading half of every lhs slot (and its row scales)
  # and multicasting it to both (12 + 16 KiB per SM per step instead of 24 + 16), were 2-4% slower on every case
  # (c5910b3) and were removed: the L2 fill rate is not what limits a tile.

  def smem_bytes(self, out_itemsize: int) -> int:
    """Our buffers plus what Mosaic GPU adds (barriers, alignment)."""
    stage = self.block_m * BLOCK + self.cta_n * BLOCK + self.block_m * 4  # lhs, rhs (e4m3), row scales
    return self.stages * stage + self.block_m * self.epi_n * out_itemsize + mgpu_kernels.SMEM_OVERHEAD_BYTES

  def fit_output(self, out_itemsize: int) -> "Fp8Tiling":
    """Fewer stages where an f32 epilogue buffer needs the room."""
    tiling = self
    while tiling.stages > 2 and tiling.smem_bytes(out_itemsize) > SMEM_LIMIT_BYTES:
      tiling = dataclasses.replace(tiling, stages=tiling.stages - 1)
    return tiling

  def validate(self, m: int, k: int, n: int, out_itemsize: int) -> None:
    mgpu_tiling.check_epilogue_rows(self, self.epi_n, out_itemsize)
    for name, size, multiple in (("M", m, TMA_ROW_ALIGN), ("K", k, BLOCK), ("N", n, self.cta_n)):
      if size % multiple:
        raise ValueError(f"blockwise-FP8 grouped GEMM: {name} = {size} must be a multiple of {multiple}")
    if self.smem_bytes(out_itemsize) > SMEM_LIMIT_BYTES:
      raise ValueError(f"{self} needs {self.smem_bytes(out_itemsize)} B of shared memory > {SMEM_LIMIT_BYTES}")


def grouped_matmul_fp8(lhs_q_MK, lhs_scale_KbM, rhs_q_GNK, rhs_scale_GNbKb, table, *,
                       tiling: Fp8Tiling = Fp8Tiling(), out_dtype=jnp.bfloat16, profile_dir: str | None = None):
  """The scaled product above. table: `mgpu_schedule.work_table(..., tiling.block_m, window_align=8)`.
  profile_dir: Mosaic GPU's on-device profiler writes a trace of the named scopes there (diagnostics:
  tools/bench_fp8.py --profile-dir)."""
  m, k = lhs_q_MK.shape
  _, n, k2 = rhs_q_GNK.shape
  if k != k2 or lhs_scale_KbM.shape != (k // BLOCK, m) or rhs_scale_GNbKb.shape[1:] != (n // BLOCK, k // BLOCK):
    raise ValueError(f"blockwise-FP8 operands disagree: lhs {lhs_q_MK.shape}, lhs_scale {lhs_scale_KbM.shape}, "
                     f"rhs {rhs_q_GNK.shape}, rhs_scale {rhs_scale_GNbKb.shape}")
  if lhs_q_MK.dtype != fp8_quant.E4M3 or rhs_q_GNK.dtype != fp8_quant.E4M3:
    raise ValueError(f"expected float8_e4m3fn operands, got {lhs_q_MK.dtype}/{rhs_q_GNK.dtype}")
  t = tiling
  out_itemsize = jnp.dtype(out_dtype).itemsize
  t.validate(m, k, n, out_itemsize)
  num_items = table[0].shape[0]
  grid_n = n // t.cta_n
  k_steps = k // BLOCK
  transforms = mgpu_kernels.swizzled(BLOCK, fp8_quant.E4M3)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=t.memory_registers,
        in_specs=[
            plgpu.BlockSpec((t.block_m, BLOCK), lambda ki: (0, ki), transforms=transforms),
            plgpu.BlockSpec((t.cta_n, BLOCK), lambda ki: (0, ki), transforms=transforms),
            plgpu.BlockSpec((1, t.block_m), lambda ki: (ki, 0)),
        ],
        wg_axis="wg",
        num_compute_wgs=t.compute_wgs,
        max_concurrent_steps=t.stages,
        compute_context=compute_context,
    )

  def body(kind_g, group_g, start_g, row0_g, size_g, lhs_gmem, lhs_scale_gmem, rhs_gmem, rhs_scale_gmem,
           out_gmem):
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_gmem.at[0], lhs_scale_gmem),
        out_smem=plgpu.SMEM((t.compute_wgs, WG_ROWS, t.epi_n), out_dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((num_items * grid_n,), collective_axes="sm")
      def _tiles(loop_info):
        mi, ni = plgpu.planar_snake(loop_info.index[0], (num_items, grid_n), 1, t.grid_block_n)
        kind, group = kind_g[mi], group_g[mi]
        start = pl.multiple_of(start_g[mi], TMA_ROW_ALIGN)
        # This warpgroup's rows of the window, and of the piece [row0, row0 + size) within them.
        wg_lo = wg * WG_ROWS
        lo = jnp.clip(row0_g[mi] - wg_lo, 0, WG_ROWS)
        hi = jnp.clip(row0_g[mi] + size_g[mi] - wg_lo, 0, WG_ROWS)
        wg_rows = pl.ds(pl.multiple_of(start + wg_lo, TMA_ROW_ALIGN), WG_ROWS)

        def epilogue(chunk):  # chunk(c): [64, epi_n] values of this warpgroup's rows
          mgpu_kernels.store_tile(chunk, out_smem.at[wg], out_gmem, wg_rows, ni * t.cta_n, lo, hi - lo,
                                  epi_n=t.epi_n, width=t.cta_n, tile_rows=WG_ROWS)

        @pl.when(kind == COMPUTE)
        def _compute():
          rhs_scale_Kb = rhs_scale_gmem.at[group, ni]  # the tile's weight block column

          def promote(acc, partial, scale_rows):  # acc + partial * (row scale x weight scale), per row
            return acc + partial * lax.broadcast_in_dim(scale_rows, (WG_ROWS, BLOCK), [0])

          def compute_context(run_pipeline):
            zeros = plgpu.layout_cast(jnp.zeros((WG_ROWS, BLOCK), jnp.float32), plgpu.Layout.WGMMA)
            acc, _ = run_pipeline((zeros, rhs_scale_Kb[0]))  # (running sum, this step's weight scale)
            with jax.named_scope("epilogue"):
              out = acc.astype(out_dtype)
              epilogue(lambda c: out[:, c * t.epi_n:(c + 1) * t.epi_n])

          def step(idx, lhs_smem, rhs_smem, lhs_scale_smem, carry):
            (ki,) = idx
            lhs_wg = lhs_smem.at[pl.ds(wg_lo, WG_ROWS)]
            rhs_KN = rhs_smem.transpose((1, 0))  # [128 K, 128 N], K-major as e4m3 wgmma needs

            def mma(partial_ref):
              plgpu.wgmma(partial_ref, lhs_wg, rhs_KN)
              return partial_ref[...]  # reading the partial waits for it

            # This step's weight scale came with the carry; the next step's is loaded from global memory
            # now, a whole step before its use. Loaded in the step that uses it, the SASS consumed it
            # right after the wgmma's wait, and the tile was 4% slower (tools/bench_fp8.py on the H200, 2026-12-02).
            # The row scales are read from the stage before the MMA, not after its wait, for the same reason.
            acc, w_scale = carry
            w_scale_next = rhs_scale_Kb[jnp.minimum(ki + 1, k_steps - 1)]
            row_scale = plgpu.load(lhs_scale_smem.at[0, pl.ds(wg_lo, WG_ROWS)], layout=plgpu.Layout.WGMMA.reduce(1))
            partial = pl.run_scoped(mma, plgpu.ACC((WG_ROWS, BLOCK), jnp.float32))
            return promote(acc, partial, row_scale * w_scale), w_scale_next

          def unpromoted_context(run_pipeline):  # Fp8Tiling.promote=False: the diagnostic
            def scope(acc_ref):
              run_pipeline(acc_ref)
              out = acc_ref[...].astype(out_dtype)
              with jax.named_scope("epilogue"):
                epilogue(lambda c: out[:, c * t.epi_n:(c + 1) * t.epi_n])
            pl.run_scoped(scope, plgpu.ACC((WG_ROWS, BLOCK), jnp.float32))

          def unpromoted_step(_, lhs_smem, rhs_smem, lhs_scale_smem, acc_ref):
            del lhs_scale_smem
            plgpu.wgmma(acc_ref, lhs_smem.at[pl.ds(wg_lo, WG_ROWS)], rhs_smem.transpose((1, 0)))
            plgpu.wgmma_wait(0)  # as our bf16 kernel's step (0.95-1.0 of dense bf16)
            return acc_ref

          window = pl.ds(start, t.block_m)
          body_fns = (step, compute_context) if t.promote else (unpromoted_step, unpromoted_context)
          with jax.named_scope("full_tile"):
            pipeline(*body_fns)(lhs_gmem.at[window, :], rhs_gmem.at[group].at[pl.ds(ni * t.cta_n, t.cta_n), :],
                                lhs_scale_gmem.at[:, window], allocations=allocs)

        @pl.when((kind == ZERO) & (wg < t.compute_wgs))
        def _zero():
          with jax.named_scope("zero_tile"):
            epilogue(lambda c: plgpu.layout_cast(jnp.zeros((WG_ROWS, t.epi_n), out_dtype), plgpu.Layout.WGMMA))

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(mgpu_kernels.num_sms(),),
      grid_names=("sm",),
      num_threads=t.num_warpgroups,
      thread_name="wg",
      compiler_params=mgpu_kernels.compiler_params(profile_dir, t.smem_bytes(out_itemsize), t.num_warpgroups),
  )
  return kernel(*table, lhs_q_MK, lhs_scale_KbM, rhs_q_GNK, rhs_scale_GNbKb)


# --- the grouped-GEMM backend protocol (MaxText/moe/gmm/__init__.py) ---

NAME = "mgpu_fp8"


def unavailable_reason() -> str | None:
  """The same Hopper requirement as mgpu (sm_90a wgmma, e4m3 included)."""
  return mgpu.unavailable_reason()


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset=0, transpose_rhs=False, out_dtype=None,
        tiling: Fp8Tiling = Fp8Tiling(), lhs_tiles: fp8_quant.RowTiles | None = None, lhs_gathered: bool = False,
        rhs_blocks: fp8_quant.WeightBlocks | None = None):
  """The grouped GEMM's contract with both operands quantized to blockwise e4m3 here:
  out[rows of local group g] = lhs[rows] @ rhs[g] (rhs[g].T with transpose_rhs), zeros elsewhere.
  rhs is [G_local, K, N] (or [G_local, N, K]). Other shapes are zero-padded to the kernel's
  multiples (`_pad`; zeros change no tile's amax, so the quantization is the same). With lhs_tiles
  (the FP8 dispatch moved lhs already quantized) the kernel reads those and lhs_MK only gives the shape.
  lhs_gathered: lhs is a gather of token rows (tgmm's `gathered`), quantized by XLA through the gather;
  otherwise it is materialized rows, quantized in one pass (`mgpu_fp8_quant.quantize_row_tiles`, the same
  bytes: 0.36 against XLA's 0.82 ms at 65,536 x 7,168 on the H200; BENCHMARKS.md "FP8 kernels"). rhs_blocks: rhs already
  quantized (`quantize_weight(rhs)`: the forward's, which dlhs reuses), else quantized here."""
  out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
  tiling = tiling.fit_output(out_dtype.itemsize)
  quantize_rows = fp8_quant.quantize_row_tiles if lhs_gathered else mgpu_fp8_quant.quantize_row_tiles

  def kernel(lhs_PK, rhs):
    if lhs_tiles is None:
      lhs_q_PK, lhs_scale_KbP = quantize_rows(lhs_PK)
    else:
      lhs_q_PK, lhs_scale_KbP = fp8_quant.rows_for_kernel(lhs_tiles, lhs_PK.shape[0])
    # rhs padded to whole blocks (cta_n is BLOCK): quantize_weight_blocks's shapes.
    w = fp8_quant.WeightBlocks(*fp8_quant.quantize_blocks(rhs)) if rhs_blocks is None else rhs_blocks
    # The kernel wants rhs as [G, out, contraction]: the forward's [G, K, N] weights transposed (the copy
    # `quantize_weight` wrote, else an XLA transpose), dlhs's ([G, N, K] with transpose_rhs: contraction N) as stored.
    if transpose_rhs:
      rhs_q, rhs_scale = w.q_GKN, w.scale_GKbNb
    else:
      rhs_q = w.q_GKN.swapaxes(1, 2) if w.q_GNK is None else w.q_GNK
      rhs_scale = w.scale_GKbNb.swapaxes(1, 2)
    table = mgpu_schedule.work_table(group_sizes_G, group_offset, rhs.shape[0], lhs_PK.shape[0], tiling.block_m,
                                     window_align=TMA_ROW_ALIGN)
    return grouped_matmul_fp8(lhs_q_PK, lhs_scale_KbP, rhs_q, rhs_scale, table, tiling=tiling, out_dtype=out_dtype)

  return _pad.gmm(kernel, lhs_MK, rhs_GKN, transpose_rhs=transpose_rhs,
                  align=_pad.Align(m=TMA_ROW_ALIGN, k=BLOCK, n=tiling.cta_n))


def quantize_weight(rhs_GKN) -> fp8_quant.WeightBlocks:
  """The weight's blocks, once for the forward and dlhs (gmm's custom VJP), in both layouts from one pass over the
  bf16 weight (`mgpu_fp8_quant.quantize_weight_blocks_both`), where XLA's amax, quantize and transpose read it
  twice and the e4m3 blocks once more (the expert FFN's compiled HLO, tools/hlo_ffn_fp8.py at 2b6d1c1)."""
  q_GKN, q_GNK, scale_GKbNb = mgpu_fp8_quant.quantize_weight_blocks_both(fp8_quant.pad_weight(rhs_GKN))
  return fp8_quant.WeightBlocks(q_GKN, scale_GKbNb, q_GNK)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset=0, num_local_groups, out_dtype=None, gathered=(False, False),
         lhs_tiles: fp8_quant.RowTiles | None = None, dout_tiles: fp8_quant.RowTiles | None = None):
  """dW in FP8 too: both operands in 128x1 tiles along the rows, groups 128-aligned (`mgpu_fp8_tgmm`;
  gathered: which operands XLA quantizes; lhs_tiles, dout_tiles: operands' rows as tiles, see there)."""
  return mgpu_fp8_tgmm.tgmm(lhs_MK, dout_MN, group_sizes_G, group_offset=group_offset,
                            num_local_groups=num_local_groups, out_dtype=out_dtype, gathered=gathered,
                            lhs_tiles=lhs_tiles, dout_tiles=dout_tiles)
