"""Two-level EP for experts spread over nodes, as DeepSeek-V3 dispatches (arXiv 2412.19437, section 3.2.2).

The expert axis (n = N nodes x L GPUs per node, E_l = E/n experts each) is upstream's DCN x ICI axis,
DCN-major: coordinate c is node c // L, local rank c % L (patches/cpu_slices.py says why). A token
crosses InfiniBand once per destination node, to the GPU of its own local rank there, which forwards
it over NVLink to its experts; the combine sums each token's experts on their node before the one
crossing back. Flat EP (a2a_padded) sends every (token, expert) copy straight to the expert's GPU:
K copies at top-K, (N-1)/N of them over InfiniBand; here a token crosses to at most min(K, N, M)
nodes (M: node-limited routing's bound, `moe_node_limited_routing`).

Inside `shard_map` over the expert axis (this shard: node v, local rank l):

  stage 1 (node exchange; groups {(u, l) for every node u}): the (token, node) pairs of this shard's
    T tokens, one per node holding any of the token's experts, sorted by node; each node's rows go
    into a [N, C1, D] buffer and one all_to_all; the token's K expert ids travel too (node-local,
    a sentinel for experts elsewhere), and in the combine its K weights.
  stage 2 (local exchange; groups {(v, m) for every local rank m}): the received rows' slots on this
    node, sorted by expert, into a [L, C2, D] buffer for a2a_padded's exchange and expert-major regroup.
  combine: stage 2 backwards; then each received row's weighted sum over its slots on this node (one
    partial per (token, node), float32 sums cast to the rows' dtype: what crosses InfiniBand back is a
    row per node, as DeepEP's combine); stage 1 backwards; each token's partials summed.

The moves of rows in and out of the two exchange buffers are gathers by a map whose inverse is known,
each a custom VJP whose backward is the gather by the inverse (`spread` and `collect` are each other's
transpose): no sort or [T, E] one-hot in the backward, as in MaxText/moe/dispatch/local.py. Two moves
are plain gathers, as in a2a_padded: the expert-major regroup after stage 2 (`src_R`) and its undoing
at the start of the combine (`dest_R`); JAX transposes each into a scatter-add of the R2 rows.

Why axis_index_groups: the two exchanges are all_to_alls over subgroups of the one `expert` mesh axis.
jax 0.11.2 lowers `all_to_all(..., axis_index_groups=...)` inside shard_map on XLA:CPU and XLA:GPU (an
all-to-all whose replica groups are the subgroups; async on the GPU, checked compile-only for H200s),
with its transpose, so the block keeps upstream's mesh. Running the shard_map on a view of the mesh with
`expert` split into two named axes does not work under upstream's train step: it sets the mesh with
`jax.set_mesh`, and shard_map refuses a mesh other than the context's (and set_mesh cannot be entered
under jit).

Capacities: C1 = min(T, ceil(f T P / N)) rows per node, P = min(K, N, M) (T: a token goes to a node
once, so T never overflows); C2 = min(R1 min(K, E_l), ceil(f T K / L)) slots per local peer, R1 = N C1
(T K slots reach a shard when balanced). f = capacity_factor; f = the EP size never overflows. A buffer
sent more than it holds is an overflow, with a2a_padded's contract: the rows past its capacity are not
sent, and the shard flags it (meta.overflow) for the train step to reduce once (MaxText/moe/overflow.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from MaxText.moe import vma
from MaxText.moe.dispatch import a2a_padded, local
from MaxText.moe.dispatch.a2a_padded import exclusive_cumsum

NAME = "hierarchical"


def unavailable_reason() -> str | None:
  return None


# --- row moves with their transposes -------------------------------------------------------------------


def _take(x_SD, slot_R, copies: int):
  """Row r = x_SD[slot_R[r] // copies]; zero where slot_R[r] is the padding sentinel (S * copies)."""
  return x_SD.at[slot_R // copies].get(mode="fill", fill_value=0)


def _take_sum(h_RD, dst_SJ, w_SJ=None, out_dtype=None):
  """Row s = sum_j w[s, j] * h_RD[dst_SJ[s, j]] in float32 (dst = R: nothing), cast to out_dtype."""
  g_SJD = h_RD.at[dst_SJ].get(mode="fill", fill_value=0).astype(jnp.float32)
  s_SD = jnp.sum(g_SJD, axis=1) if w_SJ is None else jnp.einsum("sjd,sj->sd", g_SJD, w_SJ.astype(jnp.float32))
  return s_SD.astype(out_dtype or h_RD.dtype)


@jax.custom_vjp
def spread(x_SD, slot_R, dst_SJ):
  """Each row s of x to the J positions dst_SJ[s] names (the inverse of slot_R); padding rows zero."""
  return _take(x_SD, slot_R, dst_SJ.shape[1])


def _spread_fwd(x_SD, slot_R, dst_SJ):
  return spread(x_SD, slot_R, dst_SJ), (slot_R, dst_SJ, vma.stamp(x_SD))


def _spread_bwd(res, g_RD):
  _, dst_SJ, x_type = res
  return vma.like_primal(_take_sum(g_RD, dst_SJ, out_dtype=x_type.dtype), x_type), None, None


spread.defvjp(_spread_fwd, _spread_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def collect(h_RD, dst_SJ, slot_R, out_dtype):
  """`spread`'s transpose: row s = the sum of the rows dst_SJ[s] names, float32 sums cast to out_dtype."""
  return _take_sum(h_RD, dst_SJ, out_dtype=out_dtype)


def _collect_fwd(h_RD, dst_SJ, slot_R, out_dtype):
  return collect(h_RD, dst_SJ, slot_R, out_dtype), (slot_R, dst_SJ, vma.stamp(h_RD))


def _collect_bwd(out_dtype, res, g_SD):
  del out_dtype
  slot_R, dst_SJ, h_type = res
  g_RD = _take(g_SD, slot_R, dst_SJ.shape[1]).astype(h_type.dtype)
  return vma.like_primal(g_RD, h_type), None, None


collect.defvjp(_collect_fwd, _collect_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def weighted_collect(y_RD, w_SJ, dst_SJ, slot_R, out_dtype):
  """Row s = sum_j w_SJ[s, j] * y_RD[dst_SJ[s, j]] (float32 sums, cast): a combine on the node."""
  return _take_sum(y_RD, dst_SJ, w_SJ, out_dtype)


def _weighted_fwd(y_RD, w_SJ, dst_SJ, slot_R, out_dtype):
  return weighted_collect(y_RD, w_SJ, dst_SJ, slot_R, out_dtype), (y_RD, w_SJ, dst_SJ, slot_R)


def _weighted_bwd(out_dtype, res, g_SD):
  del out_dtype
  y_RD, w_SJ, dst_SJ, slot_R = res
  w_R = w_SJ.reshape(-1).at[slot_R].get(mode="fill", fill_value=0).astype(jnp.float32)
  g_RD = (_take(g_SD, slot_R, dst_SJ.shape[1]).astype(jnp.float32) * w_R[:, None]).astype(y_RD.dtype)
  y_SJD = y_RD.at[dst_SJ].get(mode="fill", fill_value=0).astype(jnp.float32)
  g_SJ = jnp.einsum("sjd,sd->sj", y_SJD, g_SD.astype(jnp.float32)).astype(w_SJ.dtype)
  return vma.like_primal(g_RD, y_RD), vma.like_primal(g_SJ, w_SJ), None, None


weighted_collect.defvjp(_weighted_fwd, _weighted_bwd)


def buffer_maps(order_M, slot_row_SJ, dest_SJ, send_P, capacity: int):
  """Where the sorted slots go in a [P, capacity] send buffer, both ways.

  order_M / slot_row_SJ: a sort of the S*J slots by destination (local.sort_by_expert), so each
  destination's slots are contiguous, in send_P[p] rows from exclusive_cumsum(send_P)[p].
  dest_SJ: each slot's destination, P for none. Returns slot_R (the slot each buffer row holds;
  S*J = padding) and dst_SJ (each slot's buffer row; P*capacity = not sent: no destination, or past
  the capacity on overflow).
  """
  num_dest, size = send_P.shape[0], order_M.shape[0]
  start_P = exclusive_cumsum(send_P)
  c = jnp.arange(capacity, dtype=jnp.int32)[None, :]
  take_PC = jnp.where(c < jnp.minimum(send_P, capacity)[:, None], start_P[:, None] + c, size)
  slot_R = order_M.at[take_PC.reshape(-1)].get(mode="fill", fill_value=size)
  p_SJ = jnp.minimum(dest_SJ, num_dest - 1)
  c_SJ = slot_row_SJ - start_P[p_SJ]
  dst_SJ = jnp.where((dest_SJ < num_dest) & (c_SJ < capacity), p_SJ * capacity + c_SJ, num_dest * capacity)
  return slot_R.astype(jnp.int32), dst_SJ.astype(jnp.int32)


# --- the dispatcher ------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["dst1_TN", "slot1_R", "send1_N", "dst2_RK", "slot2_R", "send2_L", "src_R", "dest_R",
                                "group_sizes_G", "group_offset", "overflow"],
                   meta_fields=["num_local_experts", "capacity1", "capacity2"])
@dataclasses.dataclass(frozen=True)
class HierarchicalMeta:
  """What combine needs. N nodes, L local ranks, C1/C2 the capacities, R1 = N*C1, R2 = L*C2.

  Attributes:
    dst1_TN: int32[T, N]: stage-1 buffer row of each (token, node) pair; R1 = not sent.
    slot1_R: int32[R1]: the pair (token * N + node) each stage-1 row holds; T*N = padding.
    send1_N: int32[N]: pairs bound for each node (may exceed C1 on overflow).
    dst2_RK: int32[R1, K]: stage-2 buffer row of each received row's slot; R2 = not on this node.
    slot2_R: int32[R2]: the slot (row * K + k) each stage-2 row holds; R1*K = padding.
    send2_L: int32[L]: slots bound for each local rank (may exceed C2 on overflow).
    src_R, dest_R: int32[R2]: a2a_padded's expert-major maps of the rows received in stage 2.
    group_sizes_G: int32[E_l]: rows per local expert; group_offset: int32[] = 0.
    overflow: bool[]: this shard sent a buffer more than it holds (the rest was not sent).
    num_local_experts: E_l.  capacity1, capacity2: C1, C2.
  """

  dst1_TN: jax.Array
  slot1_R: jax.Array
  send1_N: jax.Array
  dst2_RK: jax.Array
  slot2_R: jax.Array
  send2_L: jax.Array
  src_R: jax.Array
  dest_R: jax.Array
  group_sizes_G: jax.Array
  group_offset: jax.Array
  overflow: jax.Array
  num_local_experts: int
  capacity1: int
  capacity2: int

  def buffer_12(self):
    """f32[1, 2]: [the fullest buffer's fill (fraction of its capacity), rows and slots past capacity]."""
    fill = jnp.maximum(jnp.max(self.send1_N) / self.capacity1, jnp.max(self.send2_L) / self.capacity2)
    over = jnp.sum(jnp.maximum(self.send1_N - self.capacity1, 0)) + jnp.sum(jnp.maximum(self.send2_L - self.capacity2, 0))
    return jnp.stack([fill.astype(jnp.float32), over.astype(jnp.float32)])[None]


@dataclasses.dataclass(frozen=True)
class HierarchicalDispatcher:
  """Two-level EP over `axis_name` (ep_size = nodes x local ranks, node-major)."""

  num_experts: int
  axis_name: str
  ep_size: int
  nodes: int
  capacity_factor: float = 2.0
  max_nodes_per_token: int | None = None
  name: str = NAME

  @property
  def local_size(self) -> int:
    return self.ep_size // self.nodes

  def node_groups(self) -> list[list[int]]:
    """One group per local rank l: the shards (u, l) of every node u, in node order."""
    return [[u * self.local_size + l for u in range(self.nodes)] for l in range(self.local_size)]

  def local_groups(self) -> list[list[int]]:
    """One group per node v: its shards (v, m), in local-rank order."""
    return [[v * self.local_size + m for m in range(self.local_size)] for v in range(self.nodes)]

  def capacities(self, tokens: int, top_k: int) -> tuple[int, int]:
    n, l = self.nodes, self.local_size
    nodes_per_token = min(top_k, n, self.max_nodes_per_token or n)
    c1 = max(1, min(tokens, math.ceil(self.capacity_factor * tokens * nodes_per_token / n)))
    bound2 = n * c1 * min(top_k, self.num_experts // self.ep_size)
    return c1, max(1, min(bound2, math.ceil(self.capacity_factor * tokens * top_k / l)))

  def _a2a(self, x, groups):
    """Block p of x's leading axis to the p-th shard of this shard's group."""
    if len(groups[0]) == 1:
      return x
    return jax.lax.all_to_all(x, self.axis_name, 0, 0, tiled=True, axis_index_groups=groups)

  def dispatch(self, x_TD, ids_TK):
    n, l = self.nodes, self.local_size
    (t, k), d = ids_TK.shape, x_TD.shape[1]
    per_node, per_shard = self.num_experts // n, self.num_experts // self.ep_size
    c1, c2 = self.capacities(t, k)

    # Stage 1: one row per (token, node holding any of its experts), to the same local rank there.
    node_TK = ids_TK // per_node
    present_TN = jnp.any(node_TK[:, :, None] == jnp.arange(n, dtype=ids_TK.dtype), axis=1)
    node_TN = jnp.where(present_TN, jnp.arange(n, dtype=jnp.int32), n)
    pairs = local.sort_by_expert(node_TN, n)
    send1_N = pairs.group_sizes_G
    slot1_R, dst1_TN = buffer_maps(pairs.order_M, pairs.slot_row_TK, node_TN, send1_N, c1)
    recv_x = self._a2a(spread(x_TD, slot1_R, dst1_TN).reshape(n, c1, d), self.node_groups()).reshape(n * c1, d)
    # Each row's K experts as ids on its destination node; per_node (a sentinel) for experts elsewhere.
    ids_RK = ids_TK.at[slot1_R // n].get(mode="fill", fill_value=self.num_experts)
    to_R = jnp.arange(n * c1, dtype=ids_TK.dtype) // c1
    local_ids_RK = jnp.where(ids_RK // per_node == to_R[:, None], ids_RK % per_node, per_node)
    recv_ids_RK = self._a2a(local_ids_RK.reshape(n, c1, k), self.node_groups()).reshape(n * c1, k)

    # Stage 2: the received rows' slots on this node, to their experts' local ranks (a2a_padded's exchange).
    slots = local.sort_by_expert(recv_ids_RK, per_node)
    send2_LE = slots.group_sizes_G.reshape(l, per_shard)
    send2_L = send2_LE.sum(1)
    slot2_R, dst2_RK = buffer_maps(slots.order_M, slots.slot_row_TK, recv_ids_RK // per_shard, send2_L, c2)
    recv2 = self._a2a(spread(recv_x, slot2_R, dst2_RK).reshape(l, c2, d), self.local_groups()).reshape(l * c2, d)
    # Counts as sent: on overflow only the first C2 slots per rank travel (flagged below).
    sent2_LE = jnp.clip(c2 - exclusive_cumsum(send2_LE, axis=1), 0, send2_LE)
    recv2_LE = self._a2a(sent2_LE, self.local_groups())  # row m: what local rank m sent me, per local expert
    src_R, dest_R, group_sizes = a2a_padded.expert_major(recv2_LE, jnp.arange(l, dtype=jnp.int32) * c2, l * c2)

    overflow = jnp.any(send1_N > c1) | jnp.any(send2_L > c2)
    meta = HierarchicalMeta(dst1_TN=dst1_TN, slot1_R=slot1_R, send1_N=send1_N, dst2_RK=dst2_RK, slot2_R=slot2_R,
                            send2_L=send2_L, src_R=src_R, dest_R=dest_R, group_sizes_G=group_sizes,
                            group_offset=jnp.zeros((), jnp.int32), overflow=overflow, num_local_experts=per_shard,
                            capacity1=c1, capacity2=c2)
    return recv2.at[src_R].get(mode="fill", fill_value=0), meta

  def combine(self, y_RD, weights_TK, meta: HierarchicalMeta):
    n, l, d = self.nodes, self.local_size, y_RD.shape[1]
    c1, c2, k = meta.capacity1, meta.capacity2, weights_TK.shape[1]
    back = y_RD.at[meta.dest_R].get(mode="fill", fill_value=0).reshape(l, c2, d)
    home2 = self._a2a(back, self.local_groups()).reshape(l * c2, d)  # block m: my forwarded slots rank m computed
    # The weights follow stage 1's rows (K per row, a few bytes next to a row of D).
    w_RK = spread(weights_TK, meta.slot1_R, meta.dst1_TN).reshape(n, c1, k)
    w_RK = self._a2a(w_RK, self.node_groups()).reshape(n * c1, k)
    part_RD = weighted_collect(home2, w_RK, meta.dst2_RK, meta.slot2_R, y_RD.dtype)  # one partial per (token, node)
    home1 = self._a2a(part_RD.reshape(n, c1, d), self.node_groups()).reshape(n * c1, d)
    return collect(home1, meta.dst1_TN, meta.slot1_R, y_RD.dtype)


def make(*, num_experts: int, axis_name: str | None, ep_size: int, nodes: int = 1, capacity_factor: float = 2.0,
         max_nodes_per_token: int | None = None) -> HierarchicalDispatcher:
  if axis_name is None or num_experts % ep_size or nodes < 1 or ep_size % nodes:
    raise ValueError(f"hierarchical dispatch needs an expert mesh axis, num_experts ({num_experts}) divisible by its "
                     f"size ({ep_size}), and that size divisible by the nodes ({nodes})")
  if not 0 < capacity_factor < math.inf:
    raise ValueError(f"hierarchical: capacity_factor must be finite and > 0 (got {capacity_factor})")
  return HierarchicalDispatcher(num_experts=num_experts, axis_name=axis_name, ep_size=ep_size, nodes=nodes,
                                capacity_factor=capacity_factor, max_nodes_per_token=max_nodes_per_token)
