"""EP by fixed-size all_to_all: exchange counts, then padded row buffers.

Why not ragged_all_to_all: on 2xH200 (jax 0.11.2) it moved 0.47 GB per device
in 88 ms (5.3 GB/s) while all_to_all of the same bytes took 3 ms (~150 GB/s);
BENCHMARKS.md "Dispatch and expert parallelism". all_to_all also runs on XLA:CPU, so this is tested in CI.

Inside `shard_map` over the expert axis (n shards, E_l = E/n experts each):

  1. sort the T*K (token, choice) slots by global expert (`local`): the rows
     bound for peer p are then contiguous, sorted by p's local expert.
  2. all_to_all the per-(peer, local expert) counts [n, E_l] (tiny).
  3. copy each peer's rows into a [n, C, D] send buffer, C = the per-peer
     bound, and all_to_all it; received block p holds peer p's rows.
  4. regroup the received rows expert-major with one gather (positions come
     from the exchanged counts, no sort), for the grouped GEMM.
  combine runs 4 -> 3 -> 1 backwards: gather back to block layout,
  all_to_all home, gather to the sorted slots, weighted top-k sum.

C = ceil(capacity_factor * T*K / n): capacity_factor 1 fits a perfectly
balanced routing, n fits anything (then never overflows). A peer sent more
than C rows is an *overflow*: only its first C rows travel. Each shard flags
its own overflow from its counts (meta.overflow, no collective and no host
callback); the block returns the flags, the layer sows them unreduced as
`moe_has_overflow`, and the train step reduces them once
(MaxText/moe/overflow.py: the run stops, or upstream replays the step dropless).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import jax
import jax.numpy as jnp

from MaxText.moe.dispatch import local

NAME = "a2a_padded"


def unavailable_reason() -> str | None:
  return None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slots", "send_start_P", "send_P", "src_R", "dest_R", "group_sizes_G", "group_offset",
                                "overflow"],
                   meta_fields=["num_local_experts", "capacity"])
@dataclasses.dataclass(frozen=True)
class A2AMeta:
  """What combine needs to send expert rows home. n peers, C = capacity, R = n*C.

  Attributes:
    slots: LocalMeta of step 1 (this shard's T*K slots sorted by global expert).
    send_start_P: int32[n]: first sorted row bound for each peer.
    send_P: int32[n]: rows bound for each peer (may exceed C on overflow).
    src_R: int32[R]: expert-major row r came from received row src_R[r]
      (R = padding: a zero row).
    dest_R: int32[R]: received row i went to expert-major row dest_R[i]
      (R = padding).
    group_sizes_G: int32[E_l]: rows per local expert after the exchange.
    group_offset: int32[] = 0: the rows hold local experts only.
    overflow: bool[]: this shard had more than C rows for a peer (its rows past C were not sent).
    num_local_experts: E_l.
    capacity: C.
  """

  slots: local.LocalMeta
  send_start_P: jax.Array
  send_P: jax.Array
  src_R: jax.Array
  dest_R: jax.Array
  group_sizes_G: jax.Array
  group_offset: jax.Array
  overflow: jax.Array
  num_local_experts: int
  capacity: int


def exclusive_cumsum(a, axis=0):
  return jnp.cumsum(a, axis=axis) - a


def exchange_blocks(x, axis_name: str):
  """Block p of x's leading axis goes to peer p; block p of the result came from peer p."""
  return jax.lax.all_to_all(x, axis_name, split_axis=0, concat_axis=0, tiled=True)


def expert_major(recv_PE, block_start_P, rows: int):
  """Maps received rows to expert-major order for the grouped GEMM; no sort.

  Received rows come in per-peer blocks (block p starts at block_start_P[p]
  and holds recv_PE[p].sum() rows, sorted by local expert). Row (p, c), in
  local expert e's run of block p, goes to: start of e's rows + rows of e
  from peers before p + its place in the run.

  Returns:
    src_R, dest_R: int32[rows], inverse maps (rows = padding sentinel).
    group_sizes_E: int32[E_l] rows per local expert.
  """
  i = jnp.arange(rows, dtype=jnp.int32)
  p = jnp.clip(jnp.searchsorted(block_start_P, i, side="right") - 1, 0, recv_PE.shape[0] - 1)
  c = i - block_start_P[p]
  run_start_PE = exclusive_cumsum(recv_PE, axis=1)
  e = jnp.minimum(jnp.sum(c[:, None] >= (run_start_PE + recv_PE)[p], axis=-1), recv_PE.shape[1] - 1)
  group_sizes = recv_PE.sum(0)
  pos_PE = exclusive_cumsum(group_sizes)[None, :] + exclusive_cumsum(recv_PE, axis=0)
  dest_R = jnp.where(c < recv_PE.sum(1)[p], pos_PE[p, e] + c - run_start_PE[p, e], rows).astype(jnp.int32)
  src_R = jnp.full((rows,), rows, jnp.int32).at[dest_R].set(i, mode="drop")
  return src_R, dest_R, group_sizes.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class A2APaddedDispatcher:
  """Padded all_to_all EP over `axis_name`."""

  num_experts: int
  axis_name: str
  ep_size: int
  capacity_factor: float = 2.0
  name: str = NAME

  def capacity(self, slots: int) -> int:
    return max(1, min(slots, math.ceil(self.capacity_factor * slots / self.ep_size)))

  def _a2a(self, x):
    return exchange_blocks(x, self.axis_name)

  def dispatch(self, x_TD, ids_TK):
    n, num_local = self.ep_size, self.num_experts // self.ep_size
    slots = local.sort_by_expert(ids_TK, self.num_experts)
    x_MD = local.permute_rows(x_TD, slots.order_M, slots.slot_row_TK)
    cap = self.capacity(x_MD.shape[0])
    rows = n * cap

    send_PE = slots.group_sizes_G.reshape(n, num_local)
    send_P = send_PE.sum(1)
    send_start_P = exclusive_cumsum(send_P)
    overflow = jnp.any(send_P > cap)

    c = jnp.arange(cap)[None, :]
    take_PC = jnp.where(c < jnp.minimum(send_P, cap)[:, None], send_start_P[:, None] + c, x_MD.shape[0])
    send_PCD = x_MD.at[take_PC].get(mode="fill", fill_value=0)
    recv_RD = self._a2a(send_PCD).reshape(rows, -1)
    # Counts as sent: on overflow only the first C rows per peer travel (flagged above).
    sent_PE = jnp.clip(cap - exclusive_cumsum(send_PE, axis=1), 0, send_PE)
    recv_PE = self._a2a(sent_PE)  # row p: what peer p sent me, per local expert

    src_R, dest_R, group_sizes = expert_major(recv_PE, jnp.arange(n, dtype=jnp.int32) * cap, rows)
    x_RD = recv_RD.at[src_R].get(mode="fill", fill_value=0)
    meta = A2AMeta(slots=slots, send_start_P=send_start_P, send_P=send_P, src_R=src_R, dest_R=dest_R,
                   group_sizes_G=group_sizes, group_offset=jnp.zeros((), jnp.int32), overflow=overflow,
                   num_local_experts=num_local, capacity=cap)
    return x_RD, meta

  def combine(self, y_RD, weights_TK, meta: A2AMeta):
    n, cap = self.ep_size, meta.capacity
    back_PCD = y_RD.at[meta.dest_R].get(mode="fill", fill_value=0).reshape(n, cap, -1)
    home_RD = self._a2a(back_PCD).reshape(n * cap, -1)  # block p: my rows that peer p computed
    m = jnp.arange(meta.slots.order_M.shape[0])
    p_M = jnp.sum(m[:, None] >= (meta.send_start_P + meta.send_P)[None, :], axis=-1)
    p_safe = jnp.minimum(p_M, n - 1)
    c_M = m - meta.send_start_P[p_safe]
    y_MD = home_RD.at[jnp.where(c_M < cap, p_safe * cap + c_M, n * cap)].get(mode="fill", fill_value=0)
    return local.combine_rows(y_MD, weights_TK, meta.slots.order_M, meta.slots.slot_row_TK, y_RD.dtype)


def make(*, num_experts: int, axis_name: str | None, ep_size: int, capacity_factor: float = 2.0) -> A2APaddedDispatcher:
  if axis_name is None or num_experts % ep_size:
    raise ValueError(f"a2a_padded dispatch needs an expert mesh axis and num_experts ({num_experts}) divisible by "
                     f"its size ({ep_size})")
  if not 0 < capacity_factor < math.inf:
    raise ValueError(f"a2a_padded: capacity_factor must be finite and > 0 (got {capacity_factor})")
  return A2APaddedDispatcher(num_experts=num_experts, axis_name=axis_name, ep_size=ep_size,
                             capacity_factor=capacity_factor)
