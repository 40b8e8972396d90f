"""Ping-pong variant of the forward grouped GEMM (`FwdTiling.pingpong`), for Hopper.

`kernels.grouped_matmul` runs both compute warpgroups on one block_m x 2*block_n tile:
they finish its K loop together and both run the epilogue while the tensor cores idle. The
on-device profile measured that loss (BENCHMARKS.md "Grouped GEMM (bf16)"): the K loop is at
the tensor cores' peak and ~3k cycles per tile sit outside it, 8% of a 32-step (K=2048) tile.

Here each compute warpgroup owns its own block_m x block_n tiles, and the two take an SM's
tiles in turn (local tile j goes to warpgroup j % 2), so one's epilogue runs while the other
issues MMAs (CUTLASS's "ping-pong" Hopper kernel). One memory warpgroup loads, in tile order,
into two rings of `stages` slots, one ring per compute warpgroup:

  full_lhs/full_rhs[c*S + s]: the TMA loads of ring c's slot s landed (one arrival each);
  empty[c*S + s]:             compute warpgroup c released the slot (one arrival).

Separate rings, because a Mosaic barrier's phase is tracked by each waiting thread, flipped
on each of its waits: a warpgroup that skipped the other's slots would lose count. The
release lags one step (wgmma_wait(1)): the tensor cores always have the next MMA queued.

The cost, and why this is a tiling option and not the default: each step loads 32 KiB for a
128x128x64 MMA, against 48 KiB for 128x256x64 in the shared-tile kernel (1.33x the operand
bytes per FLOP): 13-29% slower on the H200 (docs/kernels.md, "Tried, and why it did not help"). Not for the L2's bandwidth
(multicast, below, halves the reads and is no faster): a warpgroup alone on the tensor cores
consumes a slot every ~0.5 kc, so a ring of 3 slots runs ~1.5 kc ahead of the loads' latency,
where the shared-tile kernel's 4 slots run ~4 kc ahead; twice the slots do not fit in 227 KiB.
With `multicast`, SMs run in clusters of two that take neighbouring column tiles of the same
row window in lockstep (the same work-item order); each loads half of every lhs slot and
multicasts it into both SMs' slot, so an SM reads 8 + 16 KiB per step. A slot is refilled
only after both SMs' warpgroups released it (`empty` is then a cluster barrier).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.moe.gmm.mgpu import kernels as mgpu_kernels
from MaxText.moe.gmm.mgpu.schedule import COMPUTE, ZERO
from MaxText.moe.gmm.mgpu.tiling import FwdTiling

_MEMORY_WG = 2
# Per-thread registers: the memory warpgroup gives back all but 40; the two compute
# warpgroups share the rest of the SM's 64K (512 per warpgroup lane: (512 - 40) / 2, rounded
# down to the multiple of 8 setmaxnreg takes), as JAX's warp-specialized pipeline does.
_MEMORY_REGISTERS = 40
_COMPUTE_REGISTERS = 232


def grouped_matmul_pingpong(lhs_MK, rhs, table, *, tiling: FwdTiling, transpose_rhs: bool,
                            out_dtype, profile_dir: str | None = None):
  """out_MN[rows of group g] = lhs_MK @ rhs[g], as `mgpu_kernels.grouped_matmul` (same work
  table, same zero rows), with block_m x block_n tiles alternating between compute
  warpgroups."""
  m, k = lhs_MK.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  t = tiling
  t.validate(k, n, jnp.dtype(out_dtype).itemsize)
  num_items = table[0].shape[0]
  grid_n = n // t.block_n
  pair = 2 if t.multicast else 1  # SMs per cluster, each on its own column tile
  cluster_axes = ("cluster",) if t.multicast else None
  k_steps = k // t.block_k
  ring = t.stages
  dtype = lhs_MK.dtype
  transforms = mgpu_kernels.swizzled(t.block_k, dtype)
  rhs_block = (t.block_n, t.block_k) if transpose_rhs else (t.block_k, t.block_n)

  def body(kind_g, group_g, start_g, row0_g, size_g, lhs_gmem, rhs_gmem, out_gmem):
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cluster") if t.multicast else 0

    def tile_of(loop_info):
      """(work item, column tile, row window) of this loop step."""
      mi, nj = plgpu.planar_snake(loop_info.index[0], (num_items, grid_n // pair), 1,
                                  max(1, t.grid_block_n // pair))
      ni = nj * pair + cta
      rows = pl.ds(pl.multiple_of(start_g[mi], t.window_align), t.block_m)
      return mi, ni, rows

    @functools.partial(
        pl.run_scoped,
        lhs_smem=plgpu.SMEM((2, ring, t.block_m, t.block_k), dtype, transforms=transforms),
        rhs_smem=plgpu.SMEM((2, ring, *rhs_block), dtype, transforms=transforms),
        out_smem=mgpu_kernels.epilogue_buffer(t, out_dtype),
        full_lhs=plgpu.Barrier(num_barriers=2 * ring),
        full_rhs=plgpu.Barrier(num_barriers=2 * ring),
        empty=(plgpu.ClusterBarrier(collective_axes=cluster_axes, num_barriers=2 * ring)
               if t.multicast else plgpu.Barrier(num_barriers=2 * ring)),
        collective_axes="wg",
    )
    def _scope(lhs_smem, rhs_smem, out_smem, full_lhs, full_rhs, empty):

      @pl.when(wg == _MEMORY_WG)
      def _memory():
        plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

        # carry: steps loaded so far into each ring (slot = that count mod ring).
        @plgpu.nd_loop((num_items * grid_n // pair,), collective_axes="sm",
                       init_carry=(jnp.int32(0), jnp.int32(0)))
        def _tiles(loop_info, carry):
          mi, ni, rows = tile_of(loop_info)
          c = lax.rem(loop_info.local_index, 2)
          loaded = jnp.where(c == 0, carry[0], carry[1])
          compute = kind_g[mi] == COMPUTE
          rhs_g = rhs_gmem.at[group_g[mi]]
          cols = pl.ds(ni * t.block_n, t.block_n)

          @pl.when(compute)
          def _load():
            @pl.loop(0, k_steps)
            def _step(ki):
              slot = lax.rem(loaded + ki, ring)
              b = c * ring + slot
              plgpu.barrier_wait(empty.at[b])  # compute warpgroups pre-release each slot once
              ks = pl.ds(ki * t.block_k, t.block_k)
              plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, ks], lhs_smem.at[c, slot], full_lhs.at[b],
                                      collective_axes=cluster_axes)
              rhs_tile = rhs_g.at[cols, ks] if transpose_rhs else rhs_g.at[ks, cols]
              plgpu.copy_gmem_to_smem(rhs_tile, rhs_smem.at[c, slot], full_rhs.at[b])

          steps = jnp.where(compute, k_steps, 0)
          return (carry[0] + jnp.where(c == 0, steps, 0), carry[1] + jnp.where(c == 1, steps, 0))

        # Each slot gets one release more than it had loads (the initial one): observe it, so
        # that no barrier is freed with a phase its waiter has not seen.
        for b in range(2 * ring):
          plgpu.barrier_wait(empty.at[b])

      @pl.when(wg != _MEMORY_WG)
      def _compute():
        plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
        for s in range(ring):  # every slot starts free: the memory warpgroup's first wait passes
          plgpu.barrier_arrive(empty.at[wg * ring + s])

        def epilogue(chunk, rows, ni, row0, size):  # chunk(c): [block_m, epi_n] of this tile
          mgpu_kernels.store_tile(chunk, out_smem.at[wg], out_gmem, rows, ni * t.block_n, row0,
                                  size, epi_n=t.epi_n, width=t.block_n, tile_rows=t.block_m)

        # carry: steps consumed so far from this warpgroup's ring.
        @plgpu.nd_loop((num_items * grid_n // pair,), collective_axes="sm",
                       init_carry=jnp.int32(0))
        def _tiles(loop_info, carry):
          consumed = carry
          mi, ni, rows = tile_of(loop_info)
          mine = lax.rem(loop_info.local_index, 2) == wg
          kind = kind_g[mi]
          row0, size = row0_g[mi], size_g[mi]

          @pl.when(mine & (kind == COMPUTE))
          def _tile():
            def slot_of(ki):
              return lax.rem(consumed + ki, ring)

            def acc_scope(acc_ref):
              @pl.loop(0, k_steps)
              def _step(ki):
                slot = slot_of(ki)
                plgpu.barrier_wait(full_lhs.at[wg * ring + slot])
                plgpu.barrier_wait(full_rhs.at[wg * ring + slot])
                rhs_s = rhs_smem.at[wg, slot]
                plgpu.wgmma(acc_ref, lhs_smem.at[wg, slot],
                            rhs_s.transpose((1, 0)) if transpose_rhs else rhs_s)
                plgpu.wgmma_wait(1)  # the previous step's MMA is done: release its slot

                @pl.when(ki > 0)
                def _():
                  plgpu.barrier_arrive(empty.at[wg * ring + slot_of(ki - 1)])

              plgpu.wgmma_wait(0)
              plgpu.barrier_arrive(empty.at[wg * ring + slot_of(k_steps - 1)])
              return acc_ref[...]

            with jax.named_scope("full_tile"):
              acc = pl.run_scoped(acc_scope, plgpu.ACC((t.block_m, t.block_n), jnp.float32))
              acc = acc.astype(out_dtype)
              with jax.named_scope("epilogue"):
                epilogue(lambda ci: acc[:, ci * t.epi_n:(ci + 1) * t.epi_n], rows, ni, row0, size)

          @pl.when(mine & (kind == ZERO))
          def _zero():
            with jax.named_scope("zero_tile"):
              epilogue(lambda ci: plgpu.layout_cast(jnp.zeros((t.block_m, t.epi_n), out_dtype),
                                                    plgpu.Layout.WGMMA), rows, ni, row0, size)

          return consumed + jnp.where(mine & (kind == COMPUTE), k_steps, 0)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(mgpu_kernels.num_sms() // pair,),
      grid_names=("sm",),
      **(dict(cluster=(pair,), cluster_names=("cluster",)) if t.multicast else {}),
      num_threads=mgpu_kernels.NUM_WARPGROUPS,
      thread_name="wg",
      compiler_params=mgpu_kernels.compiler_params(
          profile_dir, t.smem_bytes(jnp.dtype(out_dtype).itemsize), mgpu_kernels.NUM_WARPGROUPS),
  )
  return kernel(*table, lhs_MK, rhs)
