"""EP via Transformer Engine's NCCL-EP kernels (`transformer_engine.jax.ep`): NOT WIRED YET.

What TE offers (read from TE's JAX EP API; TE is not installed where this was
written, so none of it could be run):

  ep_bootstrap(world_size, rank, num_experts, max_tokens_per_rank,
               recv_capacity_per_rank, hidden_dim)     once per process
  ep_dispatch(cfg, topk_idx, tokens, topk_weights, recv_capacity_per_rank)
      -> recv_tokens, recv_topk_weights, handle_mem, token_counts
  ep_combine(cfg, handle_mem, token_counts, expert_out, num_local_tokens)
      -> unweighted scatter-sum home (pre-multiply by recv_topk_weights)

Why it is not behind our Dispatcher yet: TE's ops run in the global view
(custom partitioning over MeshResource.ep_resource, one device per process),
not inside our shard_map, and its dispatch carries the routing weights with
the tokens while our `dispatch(x, ids)` / `combine(y, weights, meta)` sends
them at combine time. Wiring it means a global-view variant of the block and
a GPU with TE to verify it. Until then this backend reports itself
unavailable with the reason; TE's whole fused MoE block is reachable today
through `moe_block: te` (upstream's `te_moe_block` path).
"""

from __future__ import annotations

import importlib.util

NAME = "te_ncclep"
INSTALL = ("install Transformer Engine with JAX support on a CUDA machine: "
           "pip install 'transformer_engine[jax]' (a build with transformer_engine.jax.ep, NCCL EP)")


def te_ep_importable() -> bool:
  """True if `transformer_engine.jax.ep` can be found (it is not imported here)."""
  try:
    return importlib.util.find_spec("transformer_engine.jax.ep") is not None
  except ModuleNotFoundError:
    return False


def unavailable_reason() -> str | None:
  if not te_ep_importable():
    return f"transformer_engine.jax.ep does not import; {INSTALL}"
  return ("the TE NCCL-EP adapter is not wired yet (TE's ep_dispatch runs in the global view and carries the "
          "routing weights; see MaxText/moe/dispatch/te_ncclep.py); use moe_block=te for TE's fused MoE block")


def make(**_):
  raise RuntimeError(f"MoE dispatch backend 'te_ncclep' is unavailable: {unavailable_reason()}")
