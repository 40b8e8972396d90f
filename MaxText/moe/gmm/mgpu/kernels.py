"""Pallas Mosaic-GPU grouped-GEMM kernels for Hopper (sm_90a), used by `bf16.py`, and what
they share (profiling parameters, shared-memory transforms, the epilogue's stores).

Two kernels (the second in `tgmm.py`), written after JAX's `pallas/ops/gpu/
{ragged_dot_mgpu,transposed_ragged_dot_mgpu,hopper_matmul_mgpu}.py` (jax 0.11.2), with what
the MoE layer needs and they lack:

* `grouped_matmul`: out_MN = lhs_MK @ rhs[g] per row group. Warp-specialized like
  hopper_matmul_mgpu (one TMA-issuing memory warpgroup, two wgmma warpgroups sharing the lhs
  tile, block_m x 2*block_n per block), on a persistent grid whose tiles come from a work
  table built outside the kernel (`mgpu_schedule.work_table`), so that
    - only local groups (group_offset .. group_offset+G_local) are computed,
    - rows of non-local groups and rows past sum(group_sizes) are written as zeros,
    - empty groups and tile-aligned boundaries cost no tile (JAX's kernel spends a full
      tile on each),
  and rhs may be used transposed ([G, N, K], the dlhs product).
* `tgmm.transposed_grouped_matmul`: drhs[g]_KN = lhs[rows of g]^T @ dout[rows of g],
  for the local groups only (start/end per group passed in, so ring EP computes no foreign
  rows).

Shapes: lhs_MK [M, K] rows sorted by group; rhs_GKN [G_local, K, N] (or [G_local, N, K]).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.moe.gmm.mgpu import schedule as mgpu_schedule
from MaxText.moe.gmm.mgpu.schedule import COMPUTE, ZERO
from MaxText.moe.gmm.mgpu.tiling import EPI_SWIZZLE_BYTES, SMEM_LIMIT_BYTES, FwdTiling

# Warpgroups per block of the warp-specialized kernels: one TMA (memory) + two wgmma. A
# profile has one trace per warpgroup, so tools/tune_gmm.py reads it in threes.
NUM_WARPGROUPS = 3

# Profiler ranges (named scopes entered) recorded per warpgroup at most. Each costs 16 B of
# the block's shared memory per warpgroup, so the kernels get what their tiling leaves free.
_PROFILE_RANGES_MAX = 4096
# Fewer than this many tiles per SM tell little: such a tiling should be profiled with fewer
# stages (tools/tune_gmm.py does).
PROFILE_RANGES_MIN = 64
# Shared memory Mosaic GPU adds past our buffers (barriers, alignment of the trace buffer).
SMEM_OVERHEAD_BYTES = 1024


def num_sms() -> int:
  """Blocks of the persistent kernels: one per SM (132 on an H100/H200 SXM; the interpreter
  on CPU simulates as many). The forward's chain schedule is built for the same count."""
  device = jax.devices()[0]
  # Compile-only devices (MaxText/plan/gpu_target.py) carry no core_count; the shipped targets are H100/H200 SXM.
  return getattr(device, "core_count", 132) if device.platform == "gpu" else 132


def profile_ranges(kernel_smem_bytes: int, num_warpgroups: int) -> int:
  """Profiler ranges per warpgroup that fit beside a kernel's own shared memory."""
  free = SMEM_LIMIT_BYTES - kernel_smem_bytes - SMEM_OVERHEAD_BYTES
  return max(0, min(_PROFILE_RANGES_MAX, free // (16 * num_warpgroups)))


def compiler_params(profile_dir: str | None, kernel_smem_bytes: int = 0, num_warpgroups: int = 1):
  """Mosaic GPU parameters; with profile_dir, its on-device profiler writes a Chrome-trace
  JSON there per kernel run: one begin/end pair per `jax.named_scope` entered, per SM and
  warpgroup (tools/kernel_timeline.py summarizes it), as many as fit in the shared memory
  the tiling leaves (`profile_ranges`; later ones are dropped). For diagnostics: it slows
  the kernel."""
  profile = {}
  if profile_dir:
    ranges = profile_ranges(kernel_smem_bytes, num_warpgroups)
    if ranges < PROFILE_RANGES_MIN:
      raise ValueError(f"profile_dir: the tiling leaves {SMEM_LIMIT_BYTES - kernel_smem_bytes} B "
                       f"of shared memory, too little for a trace; profile it with fewer stages")
    profile = dict(profile_space=ranges, profile_dir=profile_dir, profile_bounds_check=True)
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **profile)


def swizzled(row_elems: int, dtype):
  """SMEM transforms for TMA/wgmma tiles whose rows are row_elems of dtype: (8, swizzle)
  tiles under the widest swizzle that fits the row."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(row_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def epilogue_buffer(t: FwdTiling, out_dtype):
  """Both compute warpgroups' epilogue buffers, [wg, block_m, epi_n]. No (8, x) tiling,
  swizzled or not: a tile's rows are stored from any row (store_rows). Swizzled rows are
  exactly 128 B (validate)."""
  transforms = (plgpu.SwizzleTransform(EPI_SWIZZLE_BYTES),) if t.epi_swizzle else ()
  return plgpu.SMEM((2, t.block_m, t.epi_n), out_dtype, transforms=transforms)


def store_rows(src_smem, dst_gmem, row0, size, max_rows: int):
  """TMA-stores rows [row0, row0+size) of src_smem to the same rows of dst_gmem.

  TMA boxes are static, so `size` is decomposed in powers of two (one conditional store per
  bit), the same ladder as JAX's ragged_dot_mgpu epilogue."""
  start = row0
  bit = 1 << int(math.log2(max_rows))
  while bit >= 1:
    @pl.when((size & bit) != 0)
    def _():
      plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(start, bit)], dst_gmem.at[pl.ds(start, bit)])
    start = start + (size & bit)
    bit //= 2


def store_tile(chunk, out_smem, out_gmem, rows, col0, row0, size, *, epi_n: int, width: int,
               tile_rows: int):
  """Stores rows [row0, row0+size) of window `rows`, columns col0.., width/epi_n chunks of
  chunk(c) ([tile_rows, epi_n] in registers) through this warpgroup's buffer out_smem.

  Per 128x64 chunk of a down-proj tile (tools/tune_gmm.py --profile-dir on the H200, with a named scope around
  each step at commit 5e9e2df): the wait 0.06 kc, the write to SMEM 0.23 (its bandwidth),
  the TMA store issue 0.50."""
  for c in range(width // epi_n):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    out_smem.at[pl.ds(0, tile_rows)][...] = chunk(c)
    plgpu.commit_smem()
    store_rows(out_smem, out_gmem.at[rows, pl.ds(col0 + c * epi_n, epi_n)], row0, size, tile_rows)


def grouped_matmul(lhs_MK, rhs, table, *, tiling: FwdTiling, transpose_rhs: bool, out_dtype,
                   profile_dir: str | None = None):
  """out_MN[rows of group g] = lhs_MK[rows] @ rhs[g]; ZERO rows are written as zeros.

  rhs: [G_local, K, N], or [G_local, N, K] with transpose_rhs.
  table: `mgpu_schedule.work_table(...)`.
  """
  m, k = lhs_MK.shape
  if transpose_rhs:
    _, n, k2 = rhs.shape
  else:
    _, k2, n = rhs.shape
  if k != k2:
    raise ValueError(f"contraction mismatch: lhs {lhs_MK.shape} rhs {rhs.shape} ({transpose_rhs=})")
  t = tiling
  t.validate(k, n, jnp.dtype(out_dtype).itemsize)
  num_items = table[0].shape[0]
  grid_n = n // t.cta_n
  out_itemsize = jnp.dtype(out_dtype).itemsize
  # With t.chain: how each compute tile's pipeline joins its SM's chain, for this kernel's
  # loop order (planar_snake over the table's items x grid_n) on its num_sms() blocks.
  chain = []
  if t.chain:
    chain = [mgpu_schedule.chain_states(table[0], grid_n, t.grid_block_n, num_sms())]
  k_steps = k // t.block_k
  dtype = lhs_MK.dtype
  transforms = swizzled(t.block_k, dtype)
  rhs_block = (t.cta_n, t.block_k) if transpose_rhs else (t.block_k, t.cta_n)
  rhs_index = (lambda ki: (0, ki)) if transpose_rhs else (lambda ki: (ki, 0))

  def pipeline(body, compute_context, state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((t.block_m, t.block_k), lambda ki: (0, ki), transforms=transforms),
            plgpu.BlockSpec(rhs_block, rhs_index, transforms=transforms),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=t.stages,
        compute_context=compute_context,
        pipeline_state=state,
    )

  def body(kind_g, group_g, start_g, row0_g, size_g, *refs):
    state_f = refs[0] if t.chain else None
    lhs_gmem, rhs_gmem, out_gmem = refs[-3:]
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_gmem.at[0]),
        out_smem=epilogue_buffer(t, out_dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((num_items * grid_n,), collective_axes="sm")
      def _tiles(loop_info):
        mi, ni = plgpu.planar_snake(loop_info.index[0], (num_items, grid_n), 1, t.grid_block_n)
        kind = kind_g[mi]
        row0 = row0_g[mi]
        size = size_g[mi]
        rows = pl.ds(pl.multiple_of(start_g[mi], t.window_align), t.block_m)

        def epilogue(chunk, tile_rows: int):  # chunk(c): [tile_rows, epi_n] values of this wg
          store_tile(chunk, out_smem.at[wg], out_gmem, rows, ni * t.cta_n + wg * t.block_n,
                     row0, size, epi_n=t.epi_n, width=t.block_n, tile_rows=tile_rows)

        def compute(tile_rows: int, state=None):
          """The MMA over the window's first tile_rows rows (block_m, or half of it); state:
          this tile's place in the SM's pipeline chain (None: a pipeline of its own)."""
          def compute_context(run_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_rows, t.block_n), jnp.float32))
            def _acc(acc_ref):
              run_pipeline(acc_ref)
              acc = acc_ref[...].astype(out_dtype)
              # Its own scope: ~1.9 kc of the ~3 kc per tile outside the K loop (tools/tune_gmm.py --profile-dir).
              with jax.named_scope("epilogue"):
                epilogue(lambda c: acc[:, c * t.epi_n:(c + 1) * t.epi_n], tile_rows)

          def mma(_, lhs_smem, rhs_smem, acc_ref):
            if transpose_rhs:
              rhs_wg = rhs_smem.at[pl.ds(wg * t.block_n, t.block_n)].transpose((1, 0))
            else:
              rhs_wg = rhs_smem.at[:, pl.ds(wg * t.block_n, t.block_n)]
            lhs_rows = lhs_smem if tile_rows == t.block_m else lhs_smem.at[pl.ds(0, tile_rows)]
            plgpu.wgmma(acc_ref, lhs_rows, rhs_wg)
            plgpu.wgmma_wait(0)
            return acc_ref

          cols = pl.ds(ni * t.cta_n, t.cta_n)
          rhs_g = rhs_gmem.at[group_g[mi]]
          rhs_tile = rhs_g.at[cols, :] if transpose_rhs else rhs_g.at[:, cols]
          pipeline(mma, compute_context, state)(lhs_gmem.at[rows, :], rhs_tile, allocations=allocs)

        # A piece inside the window's first half (a group's short tail) issues half the MMAs:
        # 64 rows is one wgmma's native height. The loads stay block_m rows (one pipeline).
        half = t.block_m // 2
        small = (row0 + size <= half) if t.half_tiles else False

        # Named scopes: the tile kinds in a profile (see compiler_params).
        if t.chain:
          # A chained tile's memory warpgroup starts loading the SM's next tile as soon as
          # this one's last stages are consumed, overlapping the epilogue (FwdTiling.chain).
          # An SM's only compute tile both fills and drains: an unchained pipeline.
          state = state_f[loop_info.index[0]]
          alone = state == mgpu_schedule.ALONE

          @pl.when((kind == COMPUTE) & jnp.logical_not(alone))
          def _chained():
            with jax.named_scope("full_tile"):
              compute(t.block_m, state)

          @pl.when((kind == COMPUTE) & alone)
          def _alone():
            with jax.named_scope("full_tile"):
              compute(t.block_m)
        else:
          @pl.when((kind == COMPUTE) & jnp.logical_not(small))
          def _full():
            with jax.named_scope("full_tile"):
              compute(t.block_m)

        if t.half_tiles:
          @pl.when((kind == COMPUTE) & small)
          def _half():
            with jax.named_scope("half_tile"):
              compute(half)

        @pl.when((kind == ZERO) & (wg < 2))
        def _zero():
          with jax.named_scope("zero_tile"):
            # Built per chunk: a whole zero tile would hold 128 registers per thread.
            epilogue(lambda c: plgpu.layout_cast(
                jnp.zeros((t.block_m, t.epi_n), out_dtype), plgpu.Layout.WGMMA), t.block_m)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(num_sms(),),
      grid_names=("sm",),
      num_threads=NUM_WARPGROUPS,
      thread_name="wg",
      compiler_params=compiler_params(profile_dir, t.smem_bytes(out_itemsize), NUM_WARPGROUPS),
  )
  return kernel(*table, *chain, lhs_MK, rhs)
