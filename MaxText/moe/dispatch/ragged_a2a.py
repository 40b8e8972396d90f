"""EP by XLA's `jax.lax.ragged_all_to_all`: each peer's rows, exact sizes, one hop.

GPU only: XLA:CPU does not implement ragged-all-to-all, so this raises on CPU
(tests/ep_check.py checks the message). Measured on 2xH200 (jax 0.11.2):
0.47 GB per device in 88 ms, ~30x slower than all_to_all of the same bytes;
a2a_padded exists for that reason. Kept for comparison in the EP benchmark.

Inside `shard_map` over the expert axis (n shards, E_l = E/n experts each):

  dispatch: sort slots by global expert (`local`); all_to_all the per-(peer,
    local expert) counts and each shard's receive offsets; ragged_all_to_all
    the rows into a [R, D] buffer where peer p's rows start at the exclusive
    cumsum of the receive counts; regroup expert-major (a2a_padded's map,
    moved by local.take_rows: its backward gathers by the inverse map).
  combine: regroup back, ragged_all_to_all home into the sender's sorted-slot
    layout (offsets: the sender's send starts), weighted top-k sum.

Backward: the two exchanges are each other's reverse, so each one's VJP is
the other's stored plan applied to the cotangent (`ragged_exchange`, a
custom VJP) instead of JAX's transpose rule. Why the old code got wrong
gradients on GPU (tests/ep_check.py gpu, 2026-11-30: loss 5e-6 off, grads
off by 40.5 / 18.6 / 65.5): jax 0.11.2's transpose rule itself is right (it
all_to_alls the offsets and swaps sizes, i.e. exactly this reverse plan), but
`_ragged_all_to_all_effectful_abstract_eval` (jax/_src/lax/parallel.py)
types the result like `output` (`out_aval = output.update(...)`), where
all_to_all uses `collective_vma_rule`. A zeros buffer made inside the
shard_map is invariant over the expert axis, so the received rows were typed
invariant; autodiff then cast them to varying with `pvary`, whose transpose
is a psum: the grad jaxpr summed the cotangents of the combine output and of
the dispatch buffer over all devices. Lowering the primitive through the
test emulation on CPU reproduces the GPU errors to 3 digits. So the buffers
here are cast to varying like the rows sent (`_zeros_varying_like`; on the
same CPU reproduction that alone fixes the grads, the explicit VJP keeps the
backward's plans in view, lets the emulation test them, and skips the
transpose rule's two offset all_to_alls per exchange). tests/test_ep.py
checks that the block's grad jaxpr has no float psum over the expert axis.

R = ceil(capacity_factor * T*K), default capacity_factor = EP size (never
overflows). When a shard would receive more than R rows every shard learns it
from the counts (one all-reduce: every shard must agree, since nothing may be
sent then: ragged_all_to_all must not write past R), and the overflow is
flagged as in a2a_padded, for the train step to reduce (MaxText/moe/overflow.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from MaxText.moe import vma
from MaxText.moe.dispatch import a2a_padded, local

NAME = "ragged_a2a"


def unavailable_reason() -> str | None:
  if jax.default_backend() == "cpu":
    return "XLA:CPU does not implement ragged-all-to-all; use 'ring' or 'a2a_padded' on CPU"
  return None


class Plan(NamedTuple):
  """One ragged exchange, int32[n] each, in ragged_all_to_all's argument order.

  I send my rows [in_start_P[p], +send_P[p]) to peer p, where they land at
  out_offset_P[p] of its buffer; I receive recv_P[p] rows from peer p.
  """

  in_start_P: jax.Array
  send_P: jax.Array
  out_offset_P: jax.Array
  recv_P: jax.Array


# (x_MD, out_RD, in_start_P, send_P, out_offset_P, recv_P, *, axis_name) -> out_RD
# with rows received; tests swap in an all_to_all emulation (XLA:CPU has none).
ExchangeImpl = Callable[..., jax.Array]


def _zeros_varying_like(x, rows: int):
  """zeros[rows, ...] typed varying over x's manual axes (see the module note)."""
  return vma.like_operands(jnp.zeros((rows, *x.shape[1:]), x.dtype), x)


def _send(impl, axis_name, rows, x, plan: Plan):
  return impl(x, _zeros_varying_like(x, rows), *plan, axis_name=axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _exchange(impl, axis_name, in_rows, out_rows, x, plan_fwd, plan_bwd):
  del in_rows, plan_bwd
  return _send(impl, axis_name, out_rows, x, plan_fwd)


def _exchange_fwd(impl, axis_name, in_rows, out_rows, x, plan_fwd, plan_bwd):
  return _exchange(impl, axis_name, in_rows, out_rows, x, plan_fwd, plan_bwd), (plan_bwd, vma.stamp(x))


def _exchange_bwd(impl, axis_name, in_rows, out_rows, res, ct):
  del out_rows  # cotangent rows outside the received slices belong to the zeros buffer: dropped
  plan_bwd, x_type = res
  return vma.like_primal(_send(impl, axis_name, in_rows, ct, plan_bwd), x_type), None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def ragged_exchange(x_MD, out_rows: int, plan_fwd: Plan, plan_bwd: Plan, axis_name: str,
                    impl: ExchangeImpl = jax.lax.ragged_all_to_all):
  """Rows of x_MD to peers by plan_fwd, into zeros[out_rows, D]; VJP = plan_bwd.

  plan_bwd must be plan_fwd's reverse (send back what was received, to where
  it came from); the integer plans get no gradient.
  """
  return _exchange(impl, axis_name, x_MD.shape[0], out_rows, x_MD, plan_fwd, plan_bwd)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slots", "send_start_P", "send_P", "recv_start_P", "recv_P", "out_offset_P",
                                "home_offset_P", "src_R", "dest_R", "group_sizes_G", "group_offset", "overflow"],
                   meta_fields=["num_local_experts"])
@dataclasses.dataclass(frozen=True)
class RaggedMeta:
  """What combine needs to send rows home. n peers, R receive-buffer rows.

  Attributes:
    slots: LocalMeta of this shard's T*K slots sorted by global expert.
    send_start_P, send_P: int32[n]: where my rows for peer p start, how many.
    recv_start_P, recv_P: int32[n]: where peer p's rows sit in my buffer, how many.
    out_offset_P: int32[n]: where my rows start in peer p's buffer (combine's
      backward sends cotangents there again).
    home_offset_P: int32[n]: where my rows start in peer p's send order (the
      offset to write results back at p).
    src_R, dest_R: int32[R]: expert-major <-> received-row maps (R = padding).
    group_sizes_G: int32[E_l] rows per local expert.
    group_offset: int32[] = 0 (rows hold local experts only).
    overflow: bool[]: some shard would have received more than R rows.
    num_local_experts: E_l.
  """

  slots: local.LocalMeta
  send_start_P: jax.Array
  send_P: jax.Array
  recv_start_P: jax.Array
  recv_P: jax.Array
  out_offset_P: jax.Array
  home_offset_P: jax.Array
  src_R: jax.Array
  dest_R: jax.Array
  group_sizes_G: jax.Array
  group_offset: jax.Array
  overflow: jax.Array
  num_local_experts: int


@dataclasses.dataclass(frozen=True)
class RaggedA2ADispatcher:
  """ragged_all_to_all EP over `axis_name`."""

  num_experts: int
  axis_name: str
  ep_size: int
  capacity_factor: float | None = None
  name: str = NAME
  exchange_impl: ExchangeImpl = jax.lax.ragged_all_to_all  # tests: an all_to_all emulation on CPU

  def _a2a(self, x):
    return a2a_padded.exchange_blocks(x, self.axis_name)

  def dispatch(self, x_TD, ids_TK):
    n, num_local = self.ep_size, self.num_experts // self.ep_size
    slots = local.sort_by_expert(ids_TK, self.num_experts)
    x_MD = local.permute_rows(x_TD, slots.order_M, slots.slot_row_TK)
    rows = math.ceil((self.capacity_factor or n) * x_MD.shape[0])

    send_PE = slots.group_sizes_G.reshape(n, num_local)
    recv_PE = self._a2a(send_PE)
    overflow = jax.lax.pmax((recv_PE.sum() > rows).astype(jnp.int32), self.axis_name) > 0
    send_PE = jnp.where(overflow, 0, send_PE)  # never write past the receive buffer
    recv_PE = jnp.where(overflow, 0, recv_PE)
    send_P, recv_P = send_PE.sum(1), recv_PE.sum(1)
    send_start_P, recv_start_P = a2a_padded.exclusive_cumsum(send_P), a2a_padded.exclusive_cumsum(recv_P)
    out_offset_P = self._a2a(recv_start_P)  # where my rows land in each peer's buffer
    home_offset_P = self._a2a(send_start_P)  # where each peer's rows came from in its own order

    there = Plan(send_start_P, send_P, out_offset_P, recv_P)
    back = Plan(recv_start_P, recv_P, home_offset_P, send_P)  # combine's plan: dispatch's VJP
    recv_RD = ragged_exchange(x_MD, rows, there, back, self.axis_name, self.exchange_impl)
    src_R, dest_R, group_sizes = a2a_padded.expert_major(recv_PE, recv_start_P, rows)
    meta = RaggedMeta(slots=slots, send_start_P=send_start_P, send_P=send_P, recv_start_P=recv_start_P,
                      recv_P=recv_P, out_offset_P=out_offset_P, home_offset_P=home_offset_P, src_R=src_R,
                      dest_R=dest_R, group_sizes_G=group_sizes, group_offset=jnp.zeros((), jnp.int32),
                      overflow=overflow, num_local_experts=num_local)
    return local.take_rows(recv_RD, src_R, dest_R), meta

  def combine(self, y_RD, weights_TK, meta: RaggedMeta):
    back_RD = local.take_rows(y_RD, meta.dest_R, meta.src_R)
    back = Plan(meta.recv_start_P, meta.recv_P, meta.home_offset_P, meta.send_P)
    there = Plan(meta.send_start_P, meta.send_P, meta.out_offset_P, meta.recv_P)  # dispatch's plan: the VJP
    y_MD = ragged_exchange(back_RD, meta.slots.order_M.shape[0], back, there, self.axis_name, self.exchange_impl)
    return local.combine_rows(y_MD, weights_TK, meta.slots.order_M, meta.slots.slot_row_TK, y_RD.dtype)


def make(*, num_experts: int, axis_name: str | None, ep_size: int, capacity_factor: float | None = None,
         exchange_impl: ExchangeImpl = jax.lax.ragged_all_to_all) -> RaggedA2ADispatcher:
  if axis_name is None or num_experts % ep_size:
    raise ValueError(f"ragged_a2a dispatch needs an expert mesh axis and num_experts ({num_experts}) divisible "
                     f"by its size ({ep_size})")
  return RaggedA2ADispatcher(num_experts=num_experts, axis_name=axis_name, ep_size=ep_size,
                             capacity_factor=capacity_factor, exchange_impl=exchange_impl)
