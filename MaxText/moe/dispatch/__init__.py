"""Dispatch/combine: move each token's K copies to its experts' rows and back.

    x_MD, meta = dispatcher.dispatch(x_TD, ids_TK)   # rows sorted by expert
    y_MD = experts(x_MD, meta.group_sizes_G, group_offset=meta.group_offset)
    y_TD = dispatcher.combine(y_MD, weights_TK, meta) # weighted top-k sum

T tokens (this shard's), K experts per token, D hidden, M rows after dispatch
(>= the rows the local experts own; extra rows are padding the grouped GEMM
zeroes). `meta` is a frozen dataclass specific to the backend; every backend's
meta has `group_sizes_G`, `group_offset` and `num_local_experts`, which is all
the grouped GEMM needs.

Expert-parallel backends run inside `jax.shard_map` with the expert axis
named by `axis_name`; `local` needs no collective. Except a dispatcher with
`global_view = True` (te_ncclep: Transformer Engine's EP ops are partitioned
by TE itself): the block calls it outside shard_map, as
`dispatch(x_TD, ids_TK, weights_TK) -> ([P, R, D] rows, meta)` (the weights
travel with the tokens; combine ignores its weights), and runs only the
grouped GEMMs per shard. Backends, one file each:
"""

from __future__ import annotations

import importlib
from typing import Any, Literal, Protocol, get_args

import jax

Backend = Literal[
    "local",  # one device (or one EP rank holding every expert): fused gather / gather-sum
    "ring",  # ring-of-experts EP: all-gather tokens, local experts, reduce-scatter (runs on CPU)
    "ragged_a2a",  # EP via XLA ragged_all_to_all (GPU only; slow on H200, see a2a_padded)
    "a2a_padded",  # EP via counts all_to_all, then fixed-size all_to_all buffers (overflow checked)
    "hierarchical",  # EP over nodes: one copy per (token, node) over the node axis, then a2a_padded inside the node
    "te_ncclep",  # EP via Transformer Engine's ep_dispatch/ep_combine (needs TE)
]
BACKENDS: tuple[str, ...] = get_args(Backend)
EP_BACKENDS = tuple(b for b in BACKENDS if b != "local")


class Dispatcher(Protocol):
  """What the MoE block needs from a dispatch backend."""

  name: str

  def dispatch(self, x_TD: jax.Array, ids_TK: jax.Array) -> tuple[jax.Array, Any]:
    """Tokens -> rows sorted by (local) expert, and the metadata combine needs."""

  def combine(self, y_MD: jax.Array, weights_TK: jax.Array, meta: Any) -> jax.Array:
    """Expert rows -> per-token sum over its K experts weighted by weights_TK."""


def _module(name: str):
  if name not in BACKENDS:
    raise ValueError(f"unknown MoE dispatch backend {name!r}; valid: {', '.join(BACKENDS)}")
  return importlib.import_module(f"MaxText.moe.dispatch.{name}")


def unavailable_reason(name: str) -> str | None:
  """None if backend `name` can run here; else why, and what to install."""
  return _module(name).unavailable_reason()


def resolve(name: str, *, ep_size: int, platform: str | None = None) -> str:
  """'auto' -> a concrete backend; checks a concrete one can run with ep_size.

  auto: `local` without EP; with EP, `ring` on CPU (the only collective set
  XLA:CPU has) and `a2a_padded` on GPU (ragged_all_to_all measured 88 ms vs
  3 ms for all_to_all of the same 0.47 GB on 2xH200; the EP benchmark should
  confirm this default).
  """
  platform = platform or jax.default_backend()
  if name == "auto":
    name = "local" if ep_size == 1 else ("ring" if platform == "cpu" else "a2a_padded")
  _module(name)
  if ep_size > 1 and name == "local":
    raise ValueError(f"MoE dispatch backend 'local' cannot run with expert parallelism {ep_size}; "
                     f"pick one of {', '.join(EP_BACKENDS)}")
  reason = unavailable_reason(name)
  if reason:
    raise RuntimeError(f"MoE dispatch backend {name!r} is unavailable here: {reason}")
  return name


def make(name: str, *, num_experts: int, axis_name: str | None = None, ep_size: int = 1, **options) -> Dispatcher:
  """Builds backend `name` (already resolved) with its own options.

  options are backend-only settings, e.g. a2a_padded's capacity_factor.
  """
  return _module(name).make(num_experts=num_experts, axis_name=axis_name, ep_size=ep_size, **options)


__all__ = ["BACKENDS", "EP_BACKENDS", "Backend", "Dispatcher", "make", "resolve", "unavailable_reason"]
