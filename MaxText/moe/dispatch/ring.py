"""Ring-of-experts EP: all-gather the tokens, run the local experts, reduce-scatter.

Inside `shard_map` over the expert axis (n shards, E/n experts each):

  dispatch: all-gather x and ids over the axis (every shard sees all n*T
    tokens), sort them by global expert like `local`. The grouped GEMM gets
    the global group sizes with group_offset = shard * E/n, so it computes
    only this shard's experts; rows of other experts come out as zeros.
  combine: all-gather the weights, weighted top-k sum over the n*T tokens
    (each shard holds the partial sum of its experts), then reduce-scatter so
    each shard gets its own T tokens summed over all shards' experts.

Only all-gather and reduce-scatter: the collectives XLA:CPU has, so this is
the backend that tests EP in CI. Its dispatch buffer holds all n*T*K rows,
more memory than a2a_padded's, and the reduce-scatter moves n*T*D.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from MaxText.moe.dispatch import local

NAME = "ring"


def unavailable_reason() -> str | None:
  return None


@dataclasses.dataclass(frozen=True)
class RingDispatcher:
  """Ring-of-experts over `axis_name` (ep_size shards)."""

  num_experts: int
  axis_name: str
  ep_size: int
  name: str = NAME

  def dispatch(self, x_TD, ids_TK):
    """Returns rows of all shards' tokens sorted by expert, and a LocalMeta over them.

    The meta's group_sizes_G are global (E entries); group_offset is this
    shard's first expert; num_local_experts = E / ep_size.
    """
    gather = lambda a: jax.lax.all_gather(a, self.axis_name, tiled=True)  # noqa: E731
    x_gTD, ids_gTK = gather(x_TD), gather(ids_TK)
    num_local = self.num_experts // self.ep_size
    meta = local.sort_by_expert(ids_gTK, self.num_experts, group_offset=jax.lax.axis_index(self.axis_name) * num_local,
                                num_local_experts=num_local)
    return local.permute_rows(x_gTD, meta.order_M, meta.slot_row_TK), meta

  def combine(self, y_MD, weights_TK, meta: local.LocalMeta):
    weights_gTK = jax.lax.all_gather(weights_TK, self.axis_name, tiled=True)
    # Partial sums stay float32 through the reduce-scatter, as one device's sum would.
    partial_gTD = local.combine_rows(y_MD, weights_gTK, meta.order_M, meta.slot_row_TK, jnp.float32)
    out_TD = jax.lax.psum_scatter(partial_gTD, self.axis_name, scatter_dimension=0, tiled=True)
    return out_TD.astype(y_MD.dtype)


def make(*, num_experts: int, axis_name: str | None, ep_size: int, **options) -> RingDispatcher:
  if options:
    raise ValueError(f"ring dispatch takes no options, got {sorted(options)}")
  if axis_name is None or num_experts % ep_size:
    raise ValueError(f"ring dispatch needs an expert mesh axis and num_experts ({num_experts}) divisible by "
                     f"its size ({ep_size})")
  return RingDispatcher(num_experts=num_experts, axis_name=axis_name, ep_size=ep_size)
