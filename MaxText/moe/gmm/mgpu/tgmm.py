"""The dW grouped GEMM for Hopper: drhs[g]_KN = lhs[rows of g]^T @ dout[rows of g].

Written after JAX's `pallas/ops/gpu/transposed_ragged_dot_mgpu.py` (jax 0.11.2), for the
local groups only (start/end per group passed in, so ring EP computes no foreign rows), on a
persistent grid, in one warpgroup per block or warp-specialized (`TgmmTiling`). The forward
kernel and the helpers both use are in `kernels.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.moe.gmm.mgpu import schedule as mgpu_schedule
from MaxText.moe.gmm.mgpu.kernels import NUM_WARPGROUPS, compiler_params, num_sms, swizzled
from MaxText.moe.gmm.mgpu.tiling import TgmmTiling


def _dw_tile(flat, order_g, t: TgmmTiling, grid_mn: tuple[int, int]):
  """(group, mi, ni) of the persistent loop's flat index `flat` (over G x grid_m x grid_n
  output tiles).

  nd_loop hands SM s the flat indices s, s+S, s+2S...: tile costs follow group sizes, so
  with a few large groups some SMs get one more large tile than others. With
  t.largest_first the groups come largest first and every other round of S indices is
  reversed (boustrophedon), so an SM that drew a large tile in one round draws a small one
  in the next; the SMs' totals then differ by about one small tile, not one large one."""
  num_tiles = grid_mn[0] * grid_mn[1]
  if t.largest_first:
    flat = mgpu_schedule.boustrophedon(flat, lax.axis_size("sm"), order_g.shape[0] * num_tiles)
  gi = order_g[flat // num_tiles]
  mi, ni = plgpu.planar_snake(flat % num_tiles, grid_mn, 1, t.grid_block_n)
  return gi, mi, ni


def _each_dw_tile(t: TgmmTiling, rows: int, grid_gmn, order_g, first_g, steps_g):
  """Decorator: runs tile(gi, mi, ni, first, steps, window) on each of this SM's output tiles
  of the persistent loop (in `_dw_tile`'s order), each in the profile's "dw_tile" scope.
  window: the group's rows from `first` on; it may run past the arrays' end, where the
  pipelines never read."""
  g, grid_m, grid_n = grid_gmn

  def run(tile):
    @plgpu.nd_loop((g * grid_m * grid_n,), collective_axes="sm")
    @jax.named_scope("dw_tile")  # a profile's unit (see compiler_params)
    def _tiles(loop_info):
      gi, mi, ni = _dw_tile(loop_info.index[0], order_g, t, (grid_m, grid_n))
      first = pl.multiple_of(first_g[gi], t.window_align)
      tile(gi, mi, ni, first, steps_g[gi], pl.ds(first, rows))

  return run


def _zero_neighbour_rows(block_smem, cols: int, si, steps, starts_g, ends_g, gi, first,
                         t: TgmmTiling):
  """dW kernels, per pipeline step si of group gi's row window (which starts at row `first`,
  see `mgpu_schedule.dw_windows`): zero the rows of this (block_k, cols) SMEM block that
  belong to a neighbouring group, those before the group's start at its first step and
  those from its end at its last; a step with no such rows (an aligned boundary) costs no
  pass. A select, not a multiply by the mask: rows outside the group may hold NaN or inf
  (other shards' rows, padding), and NaN * 0 would still reach dW."""
  block_k = t.block_k

  def zero_rows(keep):
    idx = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (block_k, cols), 0), plgpu.Layout.WGMMA)
    tile = block_smem[...]
    block_smem[...] = jnp.where(keep(idx), tile, jnp.zeros_like(tile))
    plgpu.commit_smem()

  lo = starts_g[gi] - first
  hi = ends_g[gi] - first - si * block_k

  @pl.when((si == 0) & (lo > 0))
  def _():
    zero_rows(lambda r: r >= lo)

  @pl.when((si == steps - 1) & (hi < block_k))
  def _():
    zero_rows(lambda r: r < hi)


def transposed_grouped_matmul(lhs_MK, dout_MN, starts_G, ends_G, *, tiling: TgmmTiling, out_dtype,
                              profile_dir: str | None = None):
  """drhs[g] = lhs_MK[starts[g]:ends[g]]^T @ dout_MN[same rows] -> [G, K, N]; empty -> 0.

  The contraction runs over rows in steps of block_k; the first and last step of a group
  mask the rows that belong to its neighbours (as JAX's transposed_ragged_dot_mgpu does),
  but the groups are given by explicit bounds, so only local groups are visited.
  """
  rows, k = lhs_MK.shape
  rows2, n = dout_MN.shape
  if rows != rows2:
    raise ValueError(f"row mismatch: lhs {lhs_MK.shape} dout {dout_MN.shape}")
  t = tiling
  out_itemsize = jnp.dtype(out_dtype).itemsize
  t.validate(k, n, out_itemsize)
  # (group, row block, column block) of the output tiles; a warp-specialized block's tile is
  # both compute warpgroups' columns.
  grid_gmn = (starts_G.shape[0], k // t.block_m, n // t.cta_n)
  make_body = _ws_body if t.warp_specialized else _single_wg_body
  body = make_body(t, rows, grid_gmn, swizzled(t.block_k, lhs_MK.dtype),
                   swizzled(t.block_n, out_dtype), out_dtype)
  wgs = NUM_WARPGROUPS if t.warp_specialized else 1
  threads = dict(num_threads=wgs, thread_name="wg") if t.warp_specialized else {}
  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((grid_gmn[0], k, n), out_dtype),
      grid=(num_sms(),),
      grid_names=("sm",),
      compiler_params=compiler_params(profile_dir, t.smem_bytes(out_itemsize), wgs),
      **threads,
  )
  windows = mgpu_schedule.dw_windows(starts_G, ends_G, t)  # starts, ends, steps, first, order
  return kernel(*windows, lhs_MK, dout_MN)


def _single_wg_body(t: TgmmTiling, rows: int, grid_gmn, transforms, out_transforms, out_dtype):
  """The kernel body with one warpgroup per block (JAX's structure): it masks the boundary
  rows of its lhs block itself."""
  delay = 1 if t.stages > 1 else 0

  def body(starts_g, ends_g, steps_g, first_g, order_g, lhs_gmem, dout_gmem, o_gmem):
    @_each_dw_tile(t, rows, grid_gmn, order_g, first_g, steps_g)
    def _tile(gi, mi, ni, first, steps, window):
      def acc_scope(acc_ref):
        def step(idx, lhs_smem, dout_smem):
          (si,) = idx
          _zero_neighbour_rows(lhs_smem, t.block_m, si, steps, starts_g, ends_g, gi, first, t)
          plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), dout_smem)
          if delay == 0:
            plgpu.wgmma_wait(0)

        @pl.when(steps > 0)
        def _():
          plgpu.emit_pipeline(
              step,
              grid=(steps,),
              in_specs=[
                  plgpu.BlockSpec((t.block_k, t.block_m), lambda si: (si, mi),
                                  delay_release=delay, transforms=transforms),
                  plgpu.BlockSpec((t.block_k, t.block_n), lambda si: (si, ni),
                                  delay_release=delay, transforms=transforms),
              ],
              max_concurrent_steps=t.stages,
          )(lhs_gmem.at[window, :], dout_gmem.at[window, :])

        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((t.block_m, t.block_n)))

      @functools.partial(
          pl.run_scoped,
          o_smem=plgpu.SMEM((t.block_m, t.block_n), out_dtype, transforms=out_transforms))
      def _store(o_smem):
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem,
            o_gmem.at[gi, pl.ds(mi * t.block_m, t.block_m), pl.ds(ni * t.block_n, t.block_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return body


def _ws_body(t: TgmmTiling, rows: int, grid_gmn, transforms, out_transforms, out_dtype):
  """The warp-specialized kernel body: a memory warpgroup streams (block_k x block_m) lhs and
  (block_k x 2*block_n) dout blocks of one group's rows; two compute warpgroups each own
  block_n output columns. Boundary steps zero the rows of neighbouring groups in each
  warpgroup's own dout slice (lhs is shared by both, so masking it would race); rows outside
  the group then contribute lhs * 0 (inputs are finite activations)."""

  def pipeline(body, compute_context, steps):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((t.block_k, t.block_m), lambda si: (si, 0), transforms=transforms),
            plgpu.BlockSpec((t.block_k, t.cta_n), lambda si: (si, 0), transforms=transforms),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=t.stages,
        compute_context=compute_context,
    )

  def body(starts_g, ends_g, steps_g, first_g, order_g, lhs_gmem, dout_gmem, o_gmem):
    ignore = lambda *_, **__: None
    lhs_shape = lhs_gmem.at[:, pl.ds(0, t.block_m)]
    dout_shape = dout_gmem.at[:, pl.ds(0, t.cta_n)]

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore, t.stages).get_allocations(lhs_shape, dout_shape),
        out_smem=plgpu.SMEM((2, t.block_m, t.block_n), out_dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")

      @_each_dw_tile(t, rows, grid_gmn, order_g, first_g, steps_g)
      def _tile(gi, mi, ni, first, steps, window):
        wg_cols = pl.ds(wg * t.block_n, t.block_n)

        def store(tile):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          out_smem[wg] = tile
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              out_smem.at[wg],
              o_gmem.at[gi, pl.ds(mi * t.block_m, t.block_m),
                        pl.ds(ni * t.cta_n + wg * t.block_n, t.block_n)])

        def mma(idx, lhs_smem, dout_smem, acc_ref):
          (si,) = idx
          dout_wg = dout_smem.at[:, wg_cols]
          # Each compute warpgroup masks only its own dout columns (lhs is shared: masking it would race).
          _zero_neighbour_rows(dout_wg, t.block_n, si, steps, starts_g, ends_g, gi, first, t)
          plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), dout_wg)
          plgpu.wgmma_wait(0)
          return acc_ref

        def compute_context(run_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.block_m, t.block_n), jnp.float32))
          def _acc(acc_ref):
            run_pipeline(acc_ref)
            store(acc_ref[...].astype(out_dtype))

        @pl.when(steps > 0)
        def _compute():
          pipeline(mma, compute_context, steps)(
              lhs_gmem.at[window, pl.ds(mi * t.block_m, t.block_m)],
              dout_gmem.at[window, pl.ds(ni * t.cta_n, t.cta_n)],
              allocations=allocs)

        @pl.when((steps == 0) & (wg < 2))
        def _empty():
          store(plgpu.layout_cast(jnp.zeros((t.block_m, t.block_n), out_dtype),
                                  plgpu.Layout.WGMMA))

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return body
