"""Seam: maxtext.layers.moe.RoutedMoE (maxtext 0.2.5) -> a subclass running our MoE block.

Upstream's `RoutedAndSharedMoE.__init__` (~4777; the DeepSeek, Kimi-K2, Llama 4
and Gemma 4 layers) and the Mixtral, GPT-OSS, Switch (envy), Qwen3-custom and
Qwen3-Next layers construct `moe.RoutedMoE(...)` by looking the name up in the
module at construction time, so rebinding it reaches every MoE layer built
afterwards. models/qwen3.py (~59) bound the class by name at import, for
Qwen3-MoE's layer (~2156): IMPORTED_BY rebinds it there too, so Qwen3-MoE runs
our block rather than silently keeping upstream's.

The subclass adds no parameters and changes no `__init__`: the parameter tree
(gate.kernel, gate.bias, wi_0, wi_1, wo, their names, shapes and logical
sharding) is upstream's, so checkpoints stay interchangeable. Only `__call__`
changes, by `moe_block`:

  ours      MaxText/moe/block.py: route -> dispatch -> gmm -> combine, with
            moe_dispatch_backend and moe_gmm_backend (unset: auto; the pick is logged).
            Returns what upstream's returns: (output, load-balance loss or
            None, routing-bias update or None), and sows `moe_has_overflow`
            (a bounded dispatch's per-shard flags, MaxText/moe/overflow.py). In
            upstream's dropless replay (`force_dropless`) its buffers hold
            the EP size.
  te        upstream's own `_te_moe_block` (TE's fused MoEBlock); needs TE and
            upstream's te_moe_block=true (+ prefuse_moe_weights=true,
            te_gmm_quantization); refused with what to set otherwise.
  upstream  (only with moe_metrics_every_n_steps > 0) upstream's block unchanged,
            after sowing the MoE statistics from its own gate and get_topk.

Each family's routing and expert GLU (Qwen3, Mixtral, GPT-OSS with its expert
biases and clamped GLU, Llama 4, DeepSeek-V2/V3, Kimi-K2) come from
MaxText/moe/families.py. What our block does not implement (quantization, hash
or random routing, Gemma 4's router, FP8-stored or prefused weights, forced
experts, weight sparsity) is refused with a message naming it, never silently
sent to upstream; MaxText/config/checks.py refuses the config-level ones before
anything compiles.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.console.progress import log as _log
from patches import pipeline_v3
from patches._seam import Seam

SEAM = Seam(
    name="routed_moe",
    module="maxtext.layers.moe",
    attr="RoutedMoE",
    sha256="43ef2fb72f8a621d",
)
# Upstream modules that bound the class by name at import (`from maxtext.layers.moe import RoutedMoE`), which
# the rebinding above cannot reach: the same class, so the same source hash. tests/test_moe_families.py scans
# upstream's package for every such import.
IMPORTED_BY = (
    Seam(name="routed_moe", module="maxtext.models.qwen3", attr="RoutedMoE", sha256=SEAM.sha256),  # Qwen3-MoE
)

# Traces through our block per dispatch backend (instrumentation read by tests).
_CALLS: collections.Counter[str] = collections.Counter()


def call_counts() -> dict[str, int]:
  return dict(_CALLS)


def _unsupported(layer, gate_inputs, forced_routed_experts) -> list[str]:
  """Upstream settings our block does not implement, as key=value strings: the config's (families.refusals)
  and this layer's own."""
  from MaxText.moe import families  # pylint: disable=import-outside-toplevel

  checks = {
      "quantization": layer.quant is not None,
      "hash routing": layer.is_hash_routing,
      "forced_routed_experts": forced_routed_experts is not None,
      "gate_inputs": gate_inputs is not None,
      "weight sparsity": layer.wi_0_sparsity_module is not None,
      "per-expert scales": layer.per_expert_scale is not None,
      "expert parallelism over several mesh axes": not isinstance(
          layer._expert_parallelism_name, str),  # pylint: disable=protected-access
  }
  return [f"{key}={value}" for key, value, _ in families.refusals(layer.config)] + [
      name for name, bad in checks.items() if bad]


def _router_config(layer, settings: dict | None = None):
  """The layer's routing as our RouterConfig (MaxText/moe/families.py reads upstream's keys); with
  moe_node_limited_routing its groups are the EP nodes (MaxText/config/moe_keys.py checks it), each scored by its top K/M."""
  from MaxText.moe import families, routing  # pylint: disable=import-outside-toplevel

  cfg = families.router_config(layer.config, layer.num_experts, layer.num_experts_per_tok)
  return routing.node_limited(cfg) if (settings or {}).get("node_limited_routing") else cfg


def _sharding(layer, num_tokens: int, ep_size: int):
  """Token axes (batch, then sequence, whose product divides T) and the EP axis."""
  from MaxText.moe import block  # pylint: disable=import-outside-toplevel

  mesh = layer.mesh
  if mesh is None or math.prod(mesh.shape.values()) == 1:
    return None
  # Inside a pipeline stage (patches/pipeline_v3.py marks its layers' config) the stage axis is the vmap's.
  vmapped = getattr(layer.config, pipeline_v3.STAGE_AXIS_KEY, None)
  # pylint: disable-next=protected-access
  spec = layer._logical_to_mesh_axes(("activation_batch", "activation_norm_length", None))
  axes, size = [], 1
  for dim in spec[:2]:
    for axis in (dim,) if isinstance(dim, str) else (dim or ()):
      if axis != vmapped and num_tokens % (size * mesh.shape[axis]) == 0:
        axes.append(axis)
        size *= mesh.shape[axis]
  expert_axis = layer._expert_parallelism_name  # pylint: disable=protected-access
  if ep_size > 1 and expert_axis not in axes:
    raise ValueError(f"moe_block=ours with expert parallelism {ep_size} needs the tokens ({num_tokens}) split over "
                     f"the '{expert_axis}' mesh axis; make the batch divisible by it")
  return block.Sharding(mesh=mesh, token_axes=tuple(axes), expert_axis=expert_axis if ep_size > 1 else None,
                        vmapped_axis=vmapped, wi_spec=_weight_spec(layer, layer.wi_kernel_axes, vmapped),
                        wo_spec=_weight_spec(layer, layer.wo_kernel_axes, vmapped))


def _weight_spec(layer, logical_axes, vmapped):
  """How an expert weight lies on the mesh: its logical axes under the rules (the block takes it so split and
  gathers it itself, so that its gradient is reduce-scattered). In a pipeline that gathers the weights over fsdp
  once before its loop (pipeline_fsdp_ag_once: upstream drops fsdp and fsdp_transpose from their specs), without
  those: taken split, they would be gathered again in every call."""
  spec = layer._logical_to_mesh_axes(logical_axes)  # pylint: disable=protected-access
  if not (vmapped and layer.config.pipeline_fsdp_ag_once):
    return spec
  axes_of = lambda d: () if d is None else (d,) if isinstance(d, str) else tuple(d)  # noqa: E731
  return jax.sharding.PartitionSpec(*(tuple(a for a in axes_of(d) if a not in ("fsdp", "fsdp_transpose")) or None
                                      for d in spec))


def _aux_outputs(layer, r, batch: int):
  """Upstream's (load-balance loss, bias update) from our routing, global view."""
  from MaxText.moe import routing  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe as upstream_moe  # pylint: disable=import-outside-toplevel

  cfg = layer.config
  lb_loss = bias_updates = None
  ids_BSK = r.ids_TK.reshape(batch, -1, r.ids_TK.shape[-1])
  if cfg.load_balance_loss_weight > 0.0:
    scores_BSE = r.scores_TE.reshape(batch, -1, r.scores_TE.shape[-1])
    if upstream_moe.uses_megatron_seq_aux_loss(cfg):  # ~437: sigmoid router, unbiased ungrouped top-k
      probs, aux_ids = routing.megatron_aux_inputs(scores_BSE, layer.num_experts_per_tok)
    else:
      probs = jax.nn.softmax(scores_BSE.astype(jnp.float32), axis=-1).astype(layer.dtype)
      aux_ids = ids_BSK
    lb_loss = routing.load_balance_loss(aux_ids, probs, cfg.load_balance_loss_weight)
  if layer.should_update_load_balance():
    counts = routing.expert_counts_E(r.ids_TK, cfg.num_experts)
    # ~2510: raw counts under gradient accumulation (summed over microbatches, then one sign).
    bias_updates = counts if cfg.gradient_accumulation_steps > 1 else routing.bias_update_E(
        counts, cfg.routed_bias_update_rate)
  return lb_loss, bias_updates


def _ours(layer, inputs, settings: dict):
  """Our block on upstream's parameters; returns upstream's (output, lb_loss, bias_updates)."""
  from MaxText.moe import block, dispatch, families, routing  # pylint: disable=import-outside-toplevel
  from MaxText.moe import gmm as moe_gmm  # pylint: disable=import-outside-toplevel

  cfg = layer.config
  batch, seq, hidden = inputs.shape
  ep_size = layer.get_expert_parallelism_size()
  backend = dispatch.resolve(settings["dispatch"], ep_size=ep_size)
  router_cfg = _router_config(layer, settings)
  disp = _dispatcher(layer, backend, settings, ep_size, batch * seq, router_cfg)
  block_cfg = block.BlockConfig(
      router=router_cfg,
      **families.glu(cfg),
      gmm_backend=moe_gmm.resolve_backend(settings["gmm"]).NAME,  # "auto" resolved (and logged) once
      dtype=jnp.dtype(cfg.dtype),
      gate_dtype=jnp.float32 if cfg.float32_gate_logits else jnp.dtype(cfg.dtype),
      overlap_chunks=settings["overlap_chunks"] if ep_size > 1 else 1,  # nothing to overlap without EP
  )
  # moe_fp8: tokens cross the dispatch in e4m3 tiles, as DeepSeek-V3's did (te_ncclep moves TE's own buffers).
  block_cfg = dataclasses.replace(block_cfg, fp8_dispatch=block_cfg.gmm_backend in moe_gmm.FP8_BACKENDS
                                  and not getattr(disp, "global_view", False))
  router = block.Router(kernel_DE=layer.gate.kernel[...],
                        bias_E=None if layer.gate.bias is None else layer.gate.bias[...])
  biases = {} if layer.wi_0_bias is None else {  # mlp_bias (GPT-OSS): upstream's own [experts, width] params
      "b0_EF": layer.wi_0_bias[...], "b1_EF": layer.wi_1_bias[...], "bo_ED": layer.wo_bias[...]}
  experts = block.Experts(w0_EDF=layer.wi_0[...], w1_EDF=layer.wi_1[...], wo_EFD=layer.wo[...], **biases)
  x_TD = inputs.reshape(batch * seq, hidden)
  sharding = _sharding(layer, batch * seq, ep_size)
  _CALLS[backend] += 1
  nodes = f" = {disp.nodes} nodes x {disp.local_size}" if backend == "hierarchical" else ""
  chunks = f", {block_cfg.overlap_chunks} chunks" if block_cfg.overlap_chunks > 1 else ""
  replay = ", dropless replay: buffers at the EP size" if _replaying(layer, backend) else ""
  _log(f"routed MoE layer -> our block (dispatch {backend}{' in fp8' if block_cfg.fp8_dispatch else ''}, "
       f"gmm {block_cfg.gmm_backend}, EP {ep_size}{nodes}{chunks}{replay})")
  y_TD, r, overflow_S, buffer_2 = block.moe_block_with_buffer(x_TD, router, experts, block_cfg, disp, sharding)
  if backend in BOUNDED:  # each shard's flag, unreduced: the train step reduces every layer's once (MaxText/moe/overflow.py)
    layer.sow(nnx.Intermediate, "moe_has_overflow", overflow_S)
  if settings.get("moe_metrics"):  # moe_metrics_every_n_steps > 0: small arrays, read in the step (moe_metrics.py)
    from MaxText.moe import stats  # pylint: disable=import-outside-toplevel

    bias_E = None if layer.gate.bias is None else layer.gate.bias[...]
    for name, value in stats.layer_stats(r.ids_TK, r.scores_TE, bias_E, layer.num_experts, jnp.any(overflow_S),
                                         buffer_2, score_func=router_cfg.score_func).items():
      layer.sow(nnx.Intermediate, name, jax.lax.stop_gradient(value))
  if settings["on_expert_counts"] is not None:  # moe_log_expert_load: global counts, outside the shard_map
    jax.debug.callback(settings["on_expert_counts"], routing.expert_counts_E(r.ids_TK, layer.num_experts))
  return (y_TD.reshape(batch, seq, hidden), *_aux_outputs(layer, r, batch))


# Dispatchers whose buffers have a capacity, so that rows can be dropped (and flagged); the others are dropless.
BOUNDED = ("a2a_padded", "hierarchical", "ragged_a2a", "te_ncclep")


def _replaying(layer, backend: str) -> bool:
  """In upstream's dropless replay program (moe_dropless_fallback=step: train.py build_dropless_graphdef sets
  `force_dropless` on every RoutedMoE), for a dispatcher whose capacity we size."""
  return bool(getattr(layer, "force_dropless", False)) and backend in BOUNDED and backend != "te_ncclep"


def _dispatcher(layer, backend: str, settings: dict, ep_size: int, num_tokens: int, router_cfg):
  """The layer's dispatcher with its backend's own options; in upstream's dropless replay, capacity factor =
  the EP size, with which no buffer of a2a_padded, hierarchical or ragged_a2a can overflow (each one's docstring
  says why), so the replayed step trains on every token."""
  from MaxText.moe import dispatch  # pylint: disable=import-outside-toplevel

  if backend == "te_ncclep":  # the capacity TE was bootstrapped with, not the raw keys
    options = _te_ncclep_options(layer, num_tokens, settings["te_ncclep_options"])
  else:
    options = {k: v for k, v in settings.get(f"{backend}_options", {}).items() if v is not None}
  if _replaying(layer, backend):
    options["capacity_factor"] = float(ep_size)
  if backend == "hierarchical":
    options.update(_node_layout(layer, ep_size, router_cfg))
  return dispatch.make(backend, num_experts=layer.num_experts, axis_name=layer._expert_parallelism_name,  # pylint: disable=protected-access
                       ep_size=ep_size, **options)


def _node_layout(layer, ep_size: int, router) -> dict:
  """hierarchical's nodes: the expert axis is dcn_expert_parallelism x ici_expert_parallelism, node-major
  (patches/cpu_slices.py); and how many nodes a token reaches at most when its routing groups sit on nodes."""
  nodes = int(layer.config.dcn_expert_parallelism)
  if nodes < 1 or ep_size % nodes:
    raise ValueError(f"moe_dispatch_backend=hierarchical: dcn_expert_parallelism={nodes} does not divide the "
                     f"expert parallelism {ep_size}")
  grouped = router.bias_selects_only and router.n_groups > 0 and router.n_groups % nodes == 0
  return {"nodes": nodes, "max_nodes_per_token": router.topk_groups if grouped else None}


def _te_ncclep_options(layer, num_tokens: int, te_options: dict) -> dict:
  """The capacity and alignment te_ncclep was bootstrapped with (the same plan, from the same config and mesh)."""
  from patches import te_ncclep_bootstrap  # pylint: disable=import-outside-toplevel

  p = te_ncclep_bootstrap.plan(layer.config, dict(layer.mesh.shape), **te_options)
  if num_tokens > p.max_tokens_per_rank * p.num_ranks:
    raise ValueError(f"te_ncclep: this MoE call has {num_tokens} tokens, more than the {p.max_tokens_per_rank} per "
                     f"rank x {p.num_ranks} ranks TE was bootstrapped for")
  return p.dispatch_options()


def _sow_upstream_stats(layer, inputs, input_ids, gate_inputs, forced_routed_experts) -> None:
  """MoE statistics for upstream's own block: its gate and get_topk again, in the global view.

  Upstream routes inside its sparse path's shard_map, where nothing can be sown. The copy costs a
  second gate matmul on the same inputs (XLA may merge the two; not measured) and a top-k over
  [T, E], both small next to the experts.
  Gradients do not flow through this copy. Random routing draws keys we would not reproduce: skipped.
  """
  from MaxText.moe import stats  # pylint: disable=import-outside-toplevel

  cfg = layer.config
  if cfg.use_random_routing:
    return
  gate_dtype = jnp.float32 if cfg.float32_gate_logits else cfg.dtype
  x = jax.lax.stop_gradient(inputs if gate_inputs is None else gate_inputs.astype(gate_dtype))
  logits, pre_bias_logits = layer.gate(x)
  _, ids_BSK = layer.get_topk(logits, pre_bias_logits, None, input_ids, forced_routed_experts)
  scores = pre_bias_logits if pre_bias_logits is not None else logits
  bias_E = None if layer.gate.bias is None else layer.gate.bias[...]
  num_experts = layer.num_experts
  for name, value in stats.layer_stats(ids_BSK.reshape(-1, ids_BSK.shape[-1]), scores.reshape(-1, num_experts),
                                       bias_E, num_experts, score_func=layer.gate.score_func or "").items():
    layer.sow(nnx.Intermediate, name, jax.lax.stop_gradient(value))


def _subclass(upstream_cls, settings: dict):
  class RoutedMoE(upstream_cls):  # pylint: disable=missing-class-docstring
    __doc__ = f"upstream RoutedMoE with moe_block={settings['block']} (patches/routed_moe.py)"

    def __call__(self, inputs, input_ids=None, gate_inputs=None, out_sharding=None, forced_routed_experts=None):
      if settings["block"] == "upstream":  # only for the statistics (wanted): upstream's block runs unchanged
        _sow_upstream_stats(self, inputs, input_ids, gate_inputs, forced_routed_experts)
        return super().__call__(inputs, input_ids, gate_inputs, out_sharding, forced_routed_experts)
      if settings["block"] == "te":
        if not self.config.te_moe_block:
          raise ValueError("moe_block=te runs upstream's TE MoE block: also set te_moe_block=true "
                           "prefuse_moe_weights=true te_gmm_quantization=te_no_quant")
        return super().__call__(inputs, input_ids, gate_inputs, out_sharding, forced_routed_experts)
      bad = _unsupported(self, gate_inputs, forced_routed_experts)
      if bad:
        raise ValueError(f"moe_block=ours does not implement {', '.join(bad)}; use moe_block=upstream for them")
      out, lb_loss, bias_updates = _ours(self, inputs.astype(self.config.dtype), settings)
      if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
      return out, lb_loss, bias_updates

  RoutedMoE.__qualname__ = f"patched.{upstream_cls.__qualname__}"
  return RoutedMoE


def gmm_backend(fork) -> str:
  """The grouped-GEMM backend our block calls: moe_fp8's on this platform (config_checks.check_devices
  has refused GPUs it cannot run on), else moe_gmm_backend."""
  if fork.moe_fp8 == "blockwise":
    return "mgpu_fp8" if jax.default_backend() == "gpu" else "xla_fp8"
  if fork.moe_fp8 == "mxfp8":
    return "te_mxfp8" if jax.default_backend() == "gpu" else "xla_mxfp8"
  return fork.moe_gmm_backend


def settings_from(fork, hooks=None) -> dict:
  """What the subclass needs from our config (captured, never global)."""
  from patches import te_ncclep_bootstrap  # pylint: disable=import-outside-toplevel

  return {
      "block": fork.moe_block,
      "dispatch": fork.moe_dispatch_backend,
      "gmm": gmm_backend(fork),
      "a2a_padded_options": {"capacity_factor": fork.moe_a2a_padded_capacity_factor},
      "ragged_a2a_options": {"capacity_factor": fork.moe_ragged_a2a_capacity_factor},
      "hierarchical_options": {"capacity_factor": fork.moe_hierarchical_capacity_factor},
      "overlap_chunks": fork.moe_ep_overlap_chunks,
      "node_limited_routing": fork.moe_node_limited_routing,
      # None capacity: the dropless bound (patches/te_ncclep_bootstrap.py plan), as bootstrapped.
      "te_ncclep_options": te_ncclep_bootstrap.options_from(fork),
      "moe_metrics": fork.moe_metrics_every_n_steps > 0,
      "on_expert_counts": hooks.on_expert_counts if hooks is not None and fork.moe_log_expert_load else None,
  }


def wanted(fork) -> bool:
  """Our block or TE's, or upstream's when its MoE statistics are on (moe_metrics_every_n_steps > 0)."""
  return fork.moe_block != "upstream" or fork.moe_metrics_every_n_steps > 0


def _check_te_ncclep_runs_here() -> None:
  """Before anything is written or compiled: a config error naming what to install or change."""
  from MaxText.config.keys import ConfigError  # pylint: disable=import-outside-toplevel
  from MaxText.moe import dispatch  # pylint: disable=import-outside-toplevel

  reason = dispatch.unavailable_reason("te_ncclep")
  if reason:
    raise ConfigError(f"moe_dispatch_backend=te_ncclep cannot run here: {reason}")


def apply(fork, hooks=None) -> None:
  # moe_block=te without TE is refused before this, by config_checks.check_fork (trainer and planner).
  if fork.moe_block == "ours" and fork.moe_dispatch_backend == "te_ncclep":
    _check_te_ncclep_runs_here()
  settings = settings_from(fork, hooks)
  for alias in IMPORTED_BY:  # all checked before anything is patched
    alias.check()
  SEAM.apply(lambda upstream_cls: _subclass(upstream_cls, settings))
  for alias in IMPORTED_BY:
    alias.apply(lambda _: SEAM.target())  # the subclass just bound in maxtext.layers.moe


def undo() -> None:
  for alias in IMPORTED_BY:
    alias.undo()
  SEAM.undo()
