"""Seam: maxtext.utils.max_utils.maybe_bootstrap_te_moe (maxtext 0.2.5) -> also bootstraps te_ncclep.

TE's NCCL EP must be bootstrapped eagerly, once per process, with the mesh and
TE's MeshResource in place, before anything using ep_dispatch/ep_combine is
traced. Upstream already has that moment for its own TE MoE block:
`setup_train_loop` (utils/train_utils.py ~387) calls
`max_utils.maybe_bootstrap_te_moe(config, mesh, shaped_batch)` right after the
mesh exists and before the train state (and any step) is traced or compiled,
looking the name up at call time. Our replacement bootstraps te_ncclep there
(moe_block=ours, moe_dispatch_backend=te_ncclep), then calls upstream's (a
no-op unless te_moe_block=true).

TE's MeshResource: upstream's `run()` (trainers/pre_train/train.py ~1507)
already holds TE's global_shard_guard around the whole train loop when
hardware is gpu/gpu_multiprocess (max_utils.transformer_engine_context:
dp_resource="data", ep_resource="expert", ...), so tracing and compiling
happen under it; we check it is there rather than enter a second one.

`plan(...)` is the one place the bootstrap numbers come from; the MoE block
(patches/routed_moe.py) recomputes it from the same config and mesh at trace
time, so ep_bootstrap and every ep_dispatch get the same capacity.
"""

from __future__ import annotations

import dataclasses
import math

from patches._seam import Seam

SEAM = Seam(
    name="te_ncclep_bootstrap",
    module="maxtext.utils.max_utils",
    attr="maybe_bootstrap_te_moe",
    sha256="b4a81f5c3baed06e",
)

# The mesh axes TE's MeshResource names in upstream's transformer_engine_context
# (max_utils.py ~1259) and RoutedMoE's expert axis (layers/moe.py ~952).
EP_AXIS = "expert"
DP_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class Plan:
  """te_ncclep's bootstrap numbers for one run.

  Attributes:
    ep_size: size of the expert axis (ranks per EP group).
    num_ranks: P = data x expert, every device (one per process on GPU).
    max_tokens_per_rank: tokens one rank holds in one MoE call (TE's max_tokens_per_rank).
    recv_capacity_per_rank: R, rows a rank receives (the key, or the dropless bound).
    alignment: rows each local expert's zone is padded to.
  """

  ep_size: int
  num_ranks: int
  max_tokens_per_rank: int
  recv_capacity_per_rank: int
  alignment: int

  def dispatch_options(self) -> dict:
    return {"recv_capacity_per_rank": self.recv_capacity_per_rank, "alignment": self.alignment}


def _tokens_per_call(config) -> int:
  """Global tokens of one model call; upstream's own rule (maybe_bootstrap_te_moe ~1305):
  the loaded batch per gradient-accumulation step, the train microbatch, and the
  eval microbatch when eval runs."""
  batch = max(config.global_batch_size_to_load // config.gradient_accumulation_steps,
              config.micro_batch_size_to_train_on)
  if config.eval_interval > 0:
    batch = max(batch, config.micro_batch_size_to_eval_on)
  return batch * config.max_target_length


def plan(config, mesh_shape: dict[str, int], *, recv_capacity_per_rank: int | None, alignment: int) -> Plan:
  """From upstream's config and the mesh shape; ValueError naming what does not fit."""
  from MaxText.moe.dispatch import te_ncclep  # pylint: disable=import-outside-toplevel

  split = {axis: n for axis, n in mesh_shape.items() if n > 1}
  other = sorted(set(split) - {DP_AXIS, EP_AXIS})
  ep_size = mesh_shape.get(EP_AXIS, 1)
  if other or ep_size < 2:
    raise ValueError(f"moe_dispatch_backend=te_ncclep needs a mesh split over '{DP_AXIS}' and '{EP_AXIS}' only, "
                     f"'{EP_AXIS}' >= 2 (TE's EP splits tokens over MeshResource dp_resource x ep_resource); got "
                     f"{split or mesh_shape}")
  if config.num_experts % ep_size:
    raise ValueError(f"moe_dispatch_backend=te_ncclep: num_experts={config.num_experts} is not divisible by the "
                     f"expert axis size {ep_size}")
  num_ranks = math.prod(mesh_shape.values())
  tokens = _tokens_per_call(config)
  if tokens % num_ranks:
    raise ValueError(f"moe_dispatch_backend=te_ncclep: {tokens} tokens per model call do not split over "
                     f"{num_ranks} ranks; make the batch divisible by data x expert")
  max_tokens = tokens // num_ranks
  if recv_capacity_per_rank is None:
    recv_capacity_per_rank = te_ncclep.dropless_recv_capacity(
        tokens_per_rank=max_tokens, top_k=config.num_experts_per_tok, ep_size=ep_size,
        num_local_experts=config.num_experts // ep_size, alignment=alignment)
  return Plan(ep_size=ep_size, num_ranks=num_ranks, max_tokens_per_rank=max_tokens,
              recv_capacity_per_rank=recv_capacity_per_rank, alignment=alignment)


def options_from(fork) -> dict:
  """Our te_ncclep config keys as `plan`'s keyword arguments: the one mapping, used here for
  the bootstrap and by patches/routed_moe.py for every dispatch, so the two cannot drift."""
  return {"recv_capacity_per_rank": fork.moe_te_ncclep_recv_capacity_per_rank,
          "alignment": fork.moe_te_ncclep_alignment}


def plan_for(fork, config, mesh_shape: dict[str, int]) -> Plan:
  return plan(config, mesh_shape, **options_from(fork))


def _check_mesh_resource() -> None:
  from transformer_engine.jax.sharding import global_mesh_resource  # pylint: disable=import-outside-toplevel

  resource = global_mesh_resource()
  if getattr(resource, "ep_resource", None) != EP_AXIS:
    raise ValueError(f"moe_dispatch_backend=te_ncclep: TE's MeshResource.ep_resource is "
                     f"{getattr(resource, 'ep_resource', None)!r}, not {EP_AXIS!r}; upstream enters TE's "
                     "global_shard_guard only with hardware=gpu or gpu_multiprocess")


def bootstrap(fork, config, mesh) -> Plan:
  """te_ncclep.bootstrap for this run, eagerly, with the mesh set."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.moe.dispatch import te_ncclep  # pylint: disable=import-outside-toplevel

  p = plan_for(fork, config, dict(mesh.shape))
  _check_mesh_resource()
  with jax.set_mesh(mesh):
    te_ncclep.bootstrap(num_experts=config.num_experts, max_tokens_per_rank=p.max_tokens_per_rank,
                        recv_capacity_per_rank=p.recv_capacity_per_rank, hidden_dim=config.emb_dim,
                        max_token_dtype=jax.numpy.bfloat16)  # the adapter moves bf16 tokens (te_ncclep.py)
  print(f"[maxtext-moe] te_ncclep bootstrapped: EP {p.ep_size} of {p.num_ranks} ranks, max_tokens_per_rank "
        f"{p.max_tokens_per_rank}, recv_capacity_per_rank {p.recv_capacity_per_rank}, alignment {p.alignment}",
        flush=True)
  return p


def wanted(fork) -> bool:
  return fork.moe_block == "ours" and fork.moe_dispatch_backend == "te_ncclep"


def apply(fork, hooks=None) -> None:  # pylint: disable=unused-argument
  def replace(upstream_bootstrap):
    def maybe_bootstrap_te_moe(config, mesh, shaped_batch):
      if getattr(config, "te_moe_block", False):
        raise ValueError("moe_dispatch_backend=te_ncclep with te_moe_block=true would bootstrap NCCL EP twice; "
                         "set te_moe_block=false (moe_block=ours runs our block)")
      bootstrap(fork, config, mesh)
      return upstream_bootstrap(config, mesh, shaped_batch)

    maybe_bootstrap_te_moe.__wrapped__ = upstream_bootstrap
    return maybe_bootstrap_te_moe

  SEAM.apply(replace)
