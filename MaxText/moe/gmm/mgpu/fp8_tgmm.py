"""Blockwise-FP8 dW for Hopper: drhs[g]_KN = lhs[rows of g]^T @ dout[rows of g], both in e4m3.

Both operands are quantized in 128x1 tiles along the rows (DeepSeek-V3's Wgrad tiles), on the
group-aligned layout of `fp8_quant.group_blocks` (no 128-row block holds two groups' rows), and
transposed: the contraction runs over rows, and e4m3 wgmma wants both operands
contraction-major. So

  drhs[g][k, n] = sum over g's row blocks b of
      (lhs_q[b, k, :] . dout_q[b, n, :]) * lhs_scale[b, k] * dout_scale[b, n]

and each step's partial is promoted with an outer product of two scale vectors: one value per
output row (k), one per output column (n). The structure is `fp8.grouped_matmul_fp8`'s: a
TMA warpgroup and three wgmma warpgroups per SM, an output tile of 192 x 128 whose rows the three
warpgroups split (64 each), a fresh f32 partial per 128-row step, the scales pipelined beside
the operands. A tile's step count is its group's block count (none for an empty group: zeros).
K is rarely a multiple of 192 (7,168 and 2,048 are not), so the last row tile is shifted back to end
at K: it computes again the rows the tile before it has (1.8% more MMAs at K = 7,168, 3% at 2,048) and
stores only the others, whole warpgroups' rows since K and 192 are multiples of 64.
Against two warpgroups on 128 x 128 tiles, measured on the H200 (tools/bench_fp8.py, ab3ae0d): 8-9% faster on
every case (up balanced 2.445 -> 2.240 ms), the same change as the forward's three warpgroups. Issuing the
warpgroups' wgmmas in turn around a ring of barriers was 3-6% slower, on two warpgroups or three, and was removed.
2-SM clusters sharing the lhs blocks by multicast were 0-2.5% faster (c5910b3), about the spread
between runs: not kept, for the six warpgroups a cluster must co-schedule (and its tests' own processes).
Both are in docs/kernels.md, "Tried, and why it did not help".

One pipeline runs through all of an SM's tiles: the memory warpgroup loads the SM's next tile
while the compute warpgroups finish this one and store it. The ring's barriers are the ping-pong kernel's
(`pingpong.py`): `full[s]` counts slot s's four loads, `empty[s]` the three compute warpgroups' releases, and
each compute warpgroup releases a slot as soon as it has read it (before its promotion). JAX's
`emit_pipeline_warp_specialized` ran one pipeline per tile, which drains at the tile's end and fills again at
the next (its `pipeline_state` chaining needs a static step count). The compute warpgroups also start in
turn, each once the one before has finished its first MMA. Measured on the H200 against the per-tile
pipelines, bit for bit the same output: 1.01-1.05x (an A/B in one process, 227d6f6, 2026-12-04).

What limits it (BENCHMARKS.md "FP8 kernels"; docs/kernels.md, "FP8 dW"): a step takes about the three warpgroups' MMAs (768 cycles at the FP8 peak) plus
every compute warp's other instructions, issued one after another (190 a warp a step in the SASS: 64 FMUL and
64 FFMA for the promotion, 18 scale loads, the rest addressing, barriers and the branch). Without the column
scale (64 FFMA, as the forward) the kernel ran 1.25x faster, and with no promotion at all 1.34x; that model
gives 1.22x and 1.24x.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.moe.gmm import fp8_quant
from MaxText.moe.gmm.mgpu import fp8_quant_kernels as mgpu_fp8_quant, kernels as mgpu_kernels
from MaxText.moe.gmm.mgpu.tiling import FP8_WG_ROWS as WG_ROWS, SMEM_LIMIT_BYTES

BLOCK = fp8_quant.BLOCK  # contraction step = quantization block

STAGES = 4
GRID_BLOCK_N = 4
# Registers per thread, as the forward's: the memory warpgroup keeps 24, the compute ones (512 - 24) / 3 -> 160.
MEMORY_REGISTERS = 24
COMPUTE_REGISTERS = 160


# Output rows per tile: three compute warpgroups of WG_ROWS, as the forward's (mgpu_fp8.Fp8Tiling).
COMPUTE_WGS = 3
TILE_M = COMPUTE_WGS * WG_ROWS


def smem_bytes(out_itemsize: int, stages: int = STAGES) -> int:
  stage = (TILE_M + BLOCK) * BLOCK + (TILE_M + BLOCK) * 4  # lhs and dout blocks (e4m3), their scale rows
  return stages * stage + TILE_M * BLOCK * out_itemsize + mgpu_kernels.SMEM_OVERHEAD_BYTES


def transposed_grouped_matmul_fp8(lhs_q_PbKB, lhs_scale_PbK, dout_q_PbNB, dout_scale_PbN, block0_L, blocks_L, *,
                                  out_dtype=jnp.bfloat16, profile_dir: str | None = None):
  """[G_local, K, N] from `fp8_quant.quantize_group_row_blocks`'s operands (128-row blocks, each
  [columns, 128] contraction-major) and `group_blocks`'s block0_L / blocks_L; K >= 192. profile_dir: a trace
  of the `dw_tile` scopes from Mosaic GPU's on-device profiler (tools/bench_fp8.py --profile-dir)."""
  pb, k, b = lhs_q_PbKB.shape
  pb2, n, b2 = dout_q_PbNB.shape
  if (pb, b) != (pb2, b2) or b != BLOCK or lhs_scale_PbK.shape != (pb, k) or dout_scale_PbN.shape != (pb, n):
    raise ValueError(f"blockwise-FP8 dW operands disagree: lhs {lhs_q_PbKB.shape}, lhs_scale {lhs_scale_PbK.shape}, "
                     f"dout {dout_q_PbNB.shape}, dout_scale {dout_scale_PbN.shape}")
  for name, size in (("K", k), ("N", n)):
    if size % BLOCK:
      raise ValueError(f"blockwise-FP8 dW: {name} = {size} must be a multiple of {BLOCK}")
  if k < TILE_M:
    raise ValueError(f"blockwise-FP8 dW: K = {k} is less than a tile's {TILE_M} rows")
  out_itemsize = jnp.dtype(out_dtype).itemsize
  stages = STAGES
  while stages > 2 and smem_bytes(out_itemsize, stages) > SMEM_LIMIT_BYTES:
    stages -= 1
  num_groups = block0_L.shape[0]
  grid_m, grid_n = -(-k // TILE_M), n // BLOCK
  num_tiles = num_groups * grid_m * grid_n
  transforms = mgpu_kernels.swizzled(BLOCK, fp8_quant.E4M3)

  def tile_of(flat):
    """(group, row tile, column tile, first output row) of the SM's tile `flat`."""
    gi = flat // (grid_m * grid_n)
    mi, ni = plgpu.planar_snake(flat % (grid_m * grid_n), (grid_m, grid_n), 1, GRID_BLOCK_N)
    return gi, mi, ni, pl.multiple_of(jnp.minimum(mi * TILE_M, k - TILE_M), WG_ROWS)  # the last tile ends at K

  def body(block0_g, blocks_g, lhs_gmem, lhs_scale_gmem, dout_gmem, dout_scale_gmem, o_gmem):
    wg = lax.axis_index("wg")

    @functools.partial(
        pl.run_scoped,
        lhs_smem=plgpu.SMEM((stages, TILE_M, BLOCK), fp8_quant.E4M3, transforms=transforms),
        dout_smem=plgpu.SMEM((stages, BLOCK, BLOCK), fp8_quant.E4M3, transforms=transforms),
        lhs_scale_smem=plgpu.SMEM((stages, 1, TILE_M), jnp.float32),
        dout_scale_smem=plgpu.SMEM((stages, 1, BLOCK), jnp.float32),
        out_smem=plgpu.SMEM((COMPUTE_WGS, WG_ROWS, BLOCK), out_dtype),
        full=plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # a slot's four loads landed
        empty=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # every compute warpgroup released it
        go=plgpu.Barrier(num_barriers=COMPUTE_WGS),  # go[w]: compute warpgroup w may start
        collective_axes="wg",
    )
    def _scope(lhs_smem, dout_smem, lhs_scale_smem, dout_scale_smem, out_smem, full, empty, go):

      @pl.when(wg == COMPUTE_WGS)
      def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        @plgpu.nd_loop((num_tiles,), collective_axes="sm", init_carry=jnp.int32(0))
        def _tiles(loop_info, carry):  # carry: steps loaded so far (slot = that count mod stages)
          loaded = carry
          gi, _, ni, row0 = tile_of(loop_info.index[0])
          first, steps = block0_g[gi], blocks_g[gi]
          cols = pl.ds(ni * BLOCK, BLOCK)

          @pl.loop(0, steps)
          def _step(si):
            slot = lax.rem(loaded + si, stages)
            plgpu.barrier_wait(empty.at[slot])
            b = first + si
            plgpu.copy_gmem_to_smem(lhs_gmem.at[b, pl.ds(row0, TILE_M)], lhs_smem.at[slot], full.at[slot])
            plgpu.copy_gmem_to_smem(dout_gmem.at[b, cols], dout_smem.at[slot], full.at[slot])
            plgpu.copy_gmem_to_smem(lhs_scale_gmem.at[pl.ds(b, 1), pl.ds(row0, TILE_M)], lhs_scale_smem.at[slot],
                                    full.at[slot])
            plgpu.copy_gmem_to_smem(dout_scale_gmem.at[pl.ds(b, 1), cols], dout_scale_smem.at[slot], full.at[slot])

          return loaded + steps

        # Each slot gets one release more than it had loads (the initial one): observe it, so that no
        # barrier is freed with a phase its waiter has not seen.
        for s in range(stages):
          plgpu.barrier_wait(empty.at[s])

      @pl.when(wg < COMPUTE_WGS)
      def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        for s in range(stages):  # every slot starts free: the memory warpgroup's first waits pass
          plgpu.barrier_arrive(empty.at[s])
        # The warpgroups start in turn, w once w - 1 has finished its first MMA: they are then out of step, and
        # one promotes while the tensor cores run the others' MMAs (+0-3% measured on the H200, 2026-12-04).
        @pl.when(wg > 0)
        def _():
          plgpu.barrier_wait(go.at[wg])

        @plgpu.nd_loop((num_tiles,), collective_axes="sm", init_carry=jnp.int32(0))
        @jax.named_scope("dw_tile")
        def _tiles(loop_info, carry):  # carry: steps this warpgroup consumed so far
          consumed = carry
          gi, mi, ni, row0 = tile_of(loop_info.index[0])
          wg_row0 = row0 + wg * WG_ROWS

          def step(si, acc):
            slot = lax.rem(consumed + si, stages)
            plgpu.barrier_wait(full.at[slot])

            def mma(partial_ref):
              plgpu.wgmma(partial_ref, lhs_smem.at[slot, pl.ds(wg * WG_ROWS, WG_ROWS)],
                          dout_smem.at[slot].transpose((1, 0)))
              return partial_ref[...]

            partial = pl.run_scoped(mma, plgpu.ACC((WG_ROWS, BLOCK), jnp.float32))
            @pl.when((consumed + si == 0) & (wg + 1 < COMPUTE_WGS))  # this warpgroup's first MMA is done
            def _():
              plgpu.barrier_arrive(go.at[wg + 1])

            row_scale = plgpu.load(lhs_scale_smem.at[slot, 0, pl.ds(wg * WG_ROWS, WG_ROWS)],
                                   layout=plgpu.Layout.WGMMA.reduce(1))
            col_scale = plgpu.load(dout_scale_smem.at[slot, 0], layout=plgpu.Layout.WGMMA.reduce(0))
            plgpu.barrier_arrive(empty.at[slot])  # the slot is read: the memory warpgroup may refill it
            scale = (lax.broadcast_in_dim(row_scale, (WG_ROWS, BLOCK), [0])
                     * lax.broadcast_in_dim(col_scale, (WG_ROWS, BLOCK), [1]))
            return acc + partial * scale

          zeros = plgpu.layout_cast(jnp.zeros((WG_ROWS, BLOCK), jnp.float32), plgpu.Layout.WGMMA)
          steps = blocks_g[gi]
          acc = lax.fori_loop(0, steps, step, zeros)  # an empty group's tile stores zeros

          @pl.when(wg_row0 >= mi * TILE_M)  # rows the previous row tile did not store
          def _store():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out_smem[wg] = acc.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], o_gmem.at[gi, pl.ds(wg_row0, WG_ROWS), pl.ds(ni * BLOCK, BLOCK)])

          return consumed + steps

        steps_consumed = _tiles  # nd_loop returns its final carry
        @pl.when((steps_consumed == 0) & (wg + 1 < COMPUTE_WGS))  # an SM without steps still lets the next one go
        def _():
          plgpu.barrier_arrive(go.at[wg + 1])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      grid=(mgpu_kernels.num_sms(),),
      grid_names=("sm",),
      num_threads=COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=mgpu_kernels.compiler_params(profile_dir, smem_bytes(out_itemsize, stages), COMPUTE_WGS + 1),
  )
  return kernel(block0_L, blocks_L, lhs_q_PbKB, lhs_scale_PbK, dout_q_PbNB, dout_scale_PbN)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset=0, num_local_groups, out_dtype=None,
         gathered=(False, False), lhs_tiles: fp8_quant.RowTiles | None = None,
         dout_tiles: fp8_quant.RowTiles | None = None):
  """The grouped-GEMM protocol's dW with both operands quantized here (K and N are padded to 128:
  zero columns give output columns the slice drops).

  gathered (lhs, dout): an operand that is a gather of token rows is quantized by XLA, which fuses the
  gather (and the FP8 dispatch's dequantization) into its two passes and so reads the compact token
  rows: the proxy's compiled step reads x and the combine's cotangent from [16384, 7392]-byte e4m3
  buffers, never materializing the [131072, 7168] rows (the compiled H200 step's HLO). The kernel would need them
  materialized. Other operands (the SwiGLU's output and its gradients) are materialized rows, and the
  one-pass kernel reads them once where XLA reads them twice (0.15 against 0.32 ms at 65,536 x 2,048).

  lhs_tiles: lhs_MK's rows as the 1x128 tiles they are the values of (lhs_MK = dequantize_rows(tiles) in
  lhs_MK's dtype: the FP8 dispatch's rows, which the forward kernel read from memory). lhs is then
  requantized from those in one pass (`mgpu_fp8_quant.requantize_group_row_blocks`), same bytes, and
  `gathered[0]` is moot. dout_tiles: the same for dout_MN (the FP8 combine's cotangent, fp8_dispatch)."""
  from MaxText.moe.gmm import _pad  # pylint: disable=import-outside-toplevel

  def _quantize(gathered_operand: bool):
    return fp8_quant.quantize_group_row_blocks if gathered_operand else mgpu_fp8_quant.quantize_group_row_blocks

  out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
  m = lhs_MK.shape[0]
  # K under a tile's 192 rows (only toy widths) is padded to two blocks: the shifted tile needs K >= 192.
  k_align = BLOCK if lhs_MK.shape[1] >= TILE_M else 2 * BLOCK

  def operand(x_MX, tiles, gathered_operand: bool, align: int, layout):
    if tiles is None:
      return _quantize(gathered_operand)(x_MX, layout)
    # The tiles' columns zero-padded as x's: zero bytes stand for zeros whatever their scale.
    tiles = fp8_quant.RowTiles(_pad.pad_axes(tiles.q_MK, {1: align}),
                               _pad.pad_axes(tiles.scale_MKb, {1: align // BLOCK}))
    return mgpu_fp8_quant.requantize_group_row_blocks(tiles, layout, x_MX.dtype)

  def kernel(lhs_MK, dout_MN):
    layout = fp8_quant.group_blocks(group_sizes_G, group_offset, num_local_groups, m)
    lhs_q, lhs_scale = operand(lhs_MK, lhs_tiles, gathered[0], k_align, layout)
    dout_q, dout_scale = operand(dout_MN, dout_tiles, gathered[1], BLOCK, layout)
    return transposed_grouped_matmul_fp8(lhs_q, lhs_scale, dout_q, dout_scale, layout.block0_L, layout.blocks_L,
                                         out_dtype=out_dtype)

  return _pad.tgmm(kernel, lhs_MK, dout_MN, align=_pad.Align(m=1, k=k_align, n=BLOCK))
