"""Schedules of the Mosaic-GPU grouped GEMMs (`kernels.py`, `tgmm.py`, `fp8.py`): which rows each tile of the
persistent loops covers and in what order, as small int32 arrays computed by XLA before the
kernel runs. Pure jnp, so that they are tested exactly on CPU.

* `work_table`: the forward kernel's row pieces (local groups, zero rows, cuts).
* `dw_windows`: the dW kernels' per-group row windows and group order.
* `boustrophedon`: the dW loop's alternating-round order over the SMs.
* `chain_states`: where each SM's chain of forward tile pipelines starts and stops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.moe.gmm.mgpu.tiling import TgmmTiling


def _cdiv(a, b):
  return -(-a // b)


# Work-table item kinds (see `work_table`).
SKIP, ZERO, COMPUTE = -1, 0, 1


def local_group_bounds(group_sizes_G, group_offset, num_local_groups, num_rows):
  """[start, end) rows of each local group (clipped to num_rows), int32 [G_local] each."""
  sizes = group_sizes_G.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  offset = jnp.asarray(group_offset, jnp.int32)
  starts = lax.dynamic_slice_in_dim(starts, offset, num_local_groups)
  ends = lax.dynamic_slice_in_dim(ends, offset, num_local_groups)
  return jnp.clip(starts, 0, num_rows), jnp.clip(ends, 0, num_rows)


def num_work_items(num_rows: int, num_local_groups: int, block_m: int,
                   window_align: int | None = None) -> int:
  """Static bound on work items of `work_table`, over its S = G_local + 2 row segments.

  Cuts at multiples of block_m: the segments' pieces are the row blocks plus at most one per
  segment boundary inside a block, <= cdiv(M, block_m) + S. Cuts from each segment's first
  row aligned down by r < block_m rows: a segment of L rows has cdiv(L + r, block_m) <=
  cdiv(L, block_m) + 1 pieces, and sum cdiv(L, block_m) <= cdiv(M, block_m) + S - 1. (For
  block_m 128 and 8-row alignment the first bound also holds, by a search over residues; the
  second needs no search, and the unused SKIP items cost a few scalar loads each.)"""
  segments = num_local_groups + 2
  if (window_align or block_m) == block_m:
    return _cdiv(num_rows, block_m) + segments
  return _cdiv(num_rows, block_m) + 2 * segments - 1


def work_table(group_sizes_G, group_offset, num_local_groups, num_rows, block_m, *,
               window_align: int | None = None):
  """Row-tile schedule of the forward kernel, as int32 arrays of length `num_work_items`.

  Rows [0, M) are cut into segments: [0, local_start) zero, one per local group, and
  [local_end, M) zero. Each segment is cut into pieces of at most block_m rows; a piece is
  one work item:
    kind:  COMPUTE (rows of a local group), ZERO (rows to be written as zeros), SKIP (unused
           tail of the table),
    group: local group id (COMPUTE only),
    start: first row of the block_m-row window the kernel loads and multiplies (a multiple
           of window_align),
    row0:  first row of the piece within the window, size: number of rows of the piece.
  A segment's cuts start at its first row aligned down to window_align and follow every
  block_m rows. window_align = block_m (the default) is JAX's scheme: a group boundary inside
  a block costs that block once per side, up to G-1 extra blocks. A small window_align (8,
  the least Mosaic GPU's swizzled TMA loads accept) leaves only a segment's last piece
  partial: about half the wasted rows for random group sizes.
  """
  align = window_align or block_m
  starts, ends = local_group_bounds(group_sizes_G, group_offset, num_local_groups, num_rows)
  zero = jnp.zeros((1,), jnp.int32)
  seg_lo = jnp.concatenate([zero, starts, ends[-1:]])
  seg_hi = jnp.concatenate([starts[:1], ends, zero + num_rows])
  num_segments = num_local_groups + 2
  nonempty = seg_hi > seg_lo
  origin = seg_lo // align * align  # first cut of a segment
  count = jnp.where(nonempty, _cdiv(seg_hi - origin, block_m), 0)
  cum_end = jnp.cumsum(count)
  cum_start = cum_end - count

  w = jnp.arange(num_work_items(num_rows, num_local_groups, block_m, align), dtype=jnp.int32)
  seg = jnp.clip(jnp.searchsorted(cum_end, w, side="right"), 0, num_segments - 1)
  seg = seg.astype(jnp.int32)
  start = origin[seg] + (w - cum_start[seg]) * block_m
  lo = jnp.maximum(seg_lo[seg], start)
  hi = jnp.minimum(seg_hi[seg], start + block_m)
  valid = w < cum_end[-1]
  is_group = (seg > 0) & (seg < num_segments - 1)
  kind = jnp.where(valid, jnp.where(is_group, COMPUTE, ZERO), SKIP).astype(jnp.int32)
  group = jnp.clip(seg - 1, 0, num_local_groups - 1)
  start = jnp.where(valid, start, 0)
  row0 = jnp.where(valid, lo - start, 0)
  size = jnp.where(valid, hi - lo, 0)
  return kind, group, start, row0, size


def dw_windows(starts_G, ends_G, t: TgmmTiling):
  """Per-group row windows of the dW kernels, int32 [G] each: (starts, ends, steps, first,
  order). A group's contraction runs over rows first .. first + steps*block_k, first being
  its start aligned down to block_k (JAX's scheme) or, with t.exact_start, only to the 8
  rows TMA needs, so that the first step holds < 8 rows of the previous group, not < 64.
  `order` lists the groups to visit: largest first with t.largest_first (see
  `tgmm._dw_tile`)."""
  starts = starts_G.astype(jnp.int32)
  ends = ends_G.astype(jnp.int32)
  first = starts // t.window_align * t.window_align
  steps = jnp.where(ends > starts, -((first - ends) // t.block_k), 0)
  if t.largest_first:
    order = jnp.argsort(-(ends - starts), stable=True).astype(jnp.int32)
  else:
    order = jnp.arange(starts.shape[0], dtype=jnp.int32)
  return starts, ends, steps, first, order


def boustrophedon(flat, num_sms, total: int):
  """Index permutation of [0, total): rounds of num_sms consecutive indices, every odd
  round reversed (the last, possibly short, round within its own length)."""
  rnd = flat // num_sms
  lane = flat - rnd * num_sms
  round_len = jnp.minimum(num_sms, total - rnd * num_sms)
  return rnd * num_sms + jnp.where(rnd % 2 == 1, round_len - 1 - lane, lane)


# Chain states of the forward kernel's compute tiles (FwdTiling.chain). The first three are
# plgpu.PipelinePipeline's START / STEADY / STOP; ALONE (an SM's only compute tile) runs an
# unchained pipeline, which both fills and drains.
START, STEADY, STOP = (int(s) for s in (plgpu.PipelinePipeline.START,
                                         plgpu.PipelinePipeline.STEADY,
                                         plgpu.PipelinePipeline.STOP))
ALONE = 3


def tile_items(flat, num_items: int, grid_n: int, grid_block_n: int):
  """Work item (row piece) of each flat loop index of the forward kernel."""
  snake = lambda f: plgpu.planar_snake(f, (num_items, grid_n), 1, grid_block_n)[0]
  return jax.vmap(snake)(flat)


def chain_states(kind, grid_n: int, grid_block_n: int, num_sms: int):
  """int32 [len(kind) * grid_n]: per flat loop index of the forward kernel (whose tile is
  `plgpu.planar_snake(flat, (len(kind), grid_n), 1, grid_block_n)`), the pipeline state of
  its tile if it is COMPUTE (else STEADY, unused). SM s runs flat indices s, s+S, s+2S...
  (`plgpu.nd_loop`); its first compute tile STARTs the chain, its last STOPs it."""
  num_items = kind.shape[0]
  total = num_items * grid_n
  rounds = _cdiv(total, num_sms)
  flat = jnp.arange(rounds * num_sms, dtype=jnp.int32)
  mi = tile_items(jnp.minimum(flat, total - 1), num_items, grid_n, grid_block_n)
  compute_RS = ((kind[mi] == COMPUTE) & (flat < total)).reshape(rounds, num_sms).astype(jnp.int32)
  upto_RS = jnp.cumsum(compute_RS, axis=0)  # compute tiles of this SM up to and incl. this one
  first = upto_RS == 1
  last = upto_RS == upto_RS[-1:]
  state = jnp.where(first & last, ALONE, jnp.where(first, START, jnp.where(last, STOP, STEADY)))
  state = jnp.where(compute_RS == 1, state, STEADY)
  return state.reshape(-1)[:total].astype(jnp.int32)
