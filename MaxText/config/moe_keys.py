"""Our MoE keys checked against each other and against upstream's: the grouped-GEMM seam's upstream keys, the
router keys that must take effect, and node-limited routing's groups."""

from __future__ import annotations

import json
from typing import Any

from MaxText.config.keys import ConfigError, ForkConfig, upstream_fields


# Upstream keys under which upstream's sparse_matmul sends its grouped GEMMs to
# `maxtext.kernels.megablox.gmm`, the seam patches/megablox_gmm.py replaces
# (layers/moe.py ~2296-2319 in maxtext 0.2.5); upstream's defaults all qualify.
MOE_GMM_UPSTREAM_KEYS: dict[str, Any] = {
    "sparse_matmul": True,  # else the dense capacity path runs: no grouped GEMM
    "megablox": True,  # else jax.lax.ragged_dot is called directly, not the seam
    "use_tokamax_gmm": False,  # else tokamax.ragged_dot is called directly
    "te_moe_block": False,  # else TE's whole MoE block runs instead of sparse_matmul
    "quantization": "",  # our backends do not quantize
}


def check_moe_keys(fork: ForkConfig, origins: dict[str, str]) -> None:
  """Our MoE keys that contradict each other: a ConfigError naming both."""
  def where(key: str) -> str:
    return origins.get(key, "default")

  def clash(a: str, b: str, why: str) -> ConfigError:
    return ConfigError(f"config keys '{a}' = {getattr(fork, a)!r} ({where(a)}) and '{b}' = {getattr(fork, b)!r} "
                       f"({where(b)}) contradict each other: {why}")

  if fork.moe_block == "ours" and fork.moe_gmm_backend == "upstream":
    raise clash("moe_block", "moe_gmm_backend", "our block runs our grouped GEMM; leave moe_gmm_backend unset "
                "(auto) or pick one of auto, xla, tokamax, mgpu, te")
  if fork.moe_block == "te" and fork.moe_gmm_backend != "upstream":
    raise clash("moe_block", "moe_gmm_backend", "TE's MoE block runs TE's own grouped GEMM")
  if fork.moe_fp8 != "none" and fork.moe_block != "ours":
    raise clash("moe_fp8", "moe_block", "FP8 experts are our block's (moe_block=ours)")
  if fork.moe_fp8 != "none" and fork.moe_gmm_backend not in ("auto", *(("te",) if fork.moe_fp8 == "mxfp8" else ())):
    raise clash("moe_fp8", "moe_gmm_backend", "moe_fp8 picks its own grouped GEMM (blockwise: mgpu_fp8 on Hopper; "
                "mxfp8: TE's te_mxfp8 on Blackwell; xla_fp8 or xla_mxfp8 on CPU); leave moe_gmm_backend unset")
  if fork.moe_block != "ours" and "moe_dispatch_backend" in origins:
    raise clash("moe_block", "moe_dispatch_backend", "only our block (moe_block=ours) dispatches with it")


def moe_gmm_upstream_keys(fork: ForkConfig, upstream: dict[str, Any], origins: dict[str, str]) -> dict[str, Any]:
  """Upstream keys with what moe_gmm_backend needs under moe_block=upstream; ConfigError on a conflict.

  megablox=false set in a config file (as the CPU configs do, to keep upstream's
  Pallas kernel out of interpret mode) becomes true: our patch replaces that
  call, so no Pallas kernel runs. Any conflicting value given on the command
  line, or any other conflicting key, is an error naming the key. Our block
  never reaches upstream's sparse_matmul, so these keys do not matter to it.
  """
  if fork.moe_gmm_backend == "upstream" or fork.moe_block != "upstream":
    return upstream
  out = dict(upstream)
  for key, need in MOE_GMM_UPSTREAM_KEYS.items():
    have = upstream.get(key, need)
    if have == need or (need == "" and not have):  # quantization: "" and None both mean off
      continue
    if key == "megablox" and origins.get(key) != "command line":
      out[key] = True
      continue
    raise ConfigError(
        f"config key '{key}' = {have!r} ({origins.get(key, 'default')}) conflicts with "
        f"moe_gmm_backend={fork.moe_gmm_backend}: it needs {key}={json.dumps(need)} "
        "(or moe_gmm_backend=upstream)"
    )
  return out


# Upstream 0.2.5 gives a model DeepSeek-V3's router only when model_name starts with one of these
# (layers/moe.py ~640 GateLogit's bias variable, ~1321 get_topk); patches/deepseek_v3_router.py
# gives it to moe_router=deepseek_v3 runs whatever the name.
UPSTREAM_V3_ROUTER_MODEL_PREFIXES = ("deepseek3", "deepseek4", "kimi-k2")


def router_checks(fork: ForkConfig, upstream: dict[str, Any], origins: dict[str, str]) -> None:
  """ConfigError for a router key that cannot take effect (never silently ignored)."""
  fields = upstream_fields()
  get = lambda key: upstream.get(key, fields[key].default)  # noqa: E731

  def error(key: str, why: str) -> ConfigError:
    value = getattr(fork, key) if key in ForkConfig.model_fields else get(key)
    return ConfigError(f"config key '{key}' = {value!r} ({origins.get(key, 'default')}): {why}")

  if fork.moe_node_limited_routing:
    _node_limit_checks(fork, get, error, origins)
  upstream_v3 = str(get("model_name")).startswith(UPSTREAM_V3_ROUTER_MODEL_PREFIXES)
  if fork.moe_router == "upstream" and not upstream_v3:
    for key, off in (("n_routing_groups", -1), ("topk_routing_group", -1), ("routed_bias_update_rate", 0.0)):
      if get(key) != off:  # ignored (groups) or a compile-time crash (rate) at upstream's other model names
        raise error(key, "upstream applies it only to model_name deepseek3*; set moe_router=deepseek_v3")
  if fork.moe_router == "deepseek_v3":
    if get("model_name") != "default" and not str(get("model_name")).startswith("deepseek3"):
      raise error("model_name", "moe_router=deepseek_v3 needs model_name default or deepseek3*")
    for key, need in (("decoder_block", "deepseek"), ("routed_score_func", "sigmoid"), ("routed_bias", True)):
      if get(key) != need:
        raise error(key, f"moe_router=deepseek_v3 needs {key}={json.dumps(need)}")
    groups, top_groups, experts = get("n_routing_groups"), get("topk_routing_group"), get("num_experts")
    if (groups > 0) != (top_groups > 0):
      raise error("topk_routing_group", "set both n_routing_groups and topk_routing_group, or neither")
    if groups > 0 and (experts % groups or experts // groups < 2):
      raise error("n_routing_groups", f"must split num_experts={experts} into groups of 2 or more experts")
    fits = get("num_experts_per_tok") <= top_groups * (experts // groups) and top_groups <= groups
    # More experts per token than exist: config_checks names num_experts_per_tok itself.
    if groups > 0 and get("num_experts_per_tok") <= experts and not fits:
      raise error("topk_routing_group", f"its groups must hold num_experts_per_tok={get('num_experts_per_tok')} "
                  f"experts, at most n_routing_groups={groups}")
  bias_moves = fork.moe_router == "deepseek_v3" or upstream_v3
  if fork.moe_bias_update_stop_tokens is not None and not (bias_moves and get("routed_bias_update_rate") > 0):
    raise error("moe_bias_update_stop_tokens", "needs routed_bias_update_rate > 0 and moe_router=deepseek_v3")
  if (fork.mtp_loss_switch_tokens is None) != (fork.mtp_loss_scaling_factor_late is None):
    raise error("mtp_loss_switch_tokens", "set it together with mtp_loss_scaling_factor_late, or neither")
  if fork.mtp_loss_switch_tokens is not None and get("mtp_num_layers") < 1:
    raise error("mtp_loss_switch_tokens", "needs mtp_num_layers >= 1")


def node_limited_groups(fork: ForkConfig, upstream: dict[str, Any]) -> dict[str, Any]:
  """moe_node_limited_routing with n_routing_groups unset: one routing group per EP node (dcn_expert_parallelism)."""
  if not fork.moe_node_limited_routing or fork.moe_router != "deepseek_v3" or int(upstream.get("n_routing_groups", -1)) > 0:
    return upstream
  return {**upstream, "n_routing_groups": int(upstream.get("dcn_expert_parallelism", 1))}


def _node_limit_checks(fork: ForkConfig, get, error, origins: dict[str, str]) -> None:
  """DeepSeek-V3's node-limited routing (arXiv 2412.19437, §2.1.2): each token's experts on at most M nodes, the
  nodes chosen by the sum of the highest K/M biased scores of the experts on each. Our router does it with one
  routing group per EP node (experts are laid out node-major over the expert axis, dcn_expert_parallelism x
  ici_expert_parallelism, so group g is node g's experts), M = topk_routing_group groups kept, each scored by its
  top K/M (MaxText/moe/routing.py node_limited). More groups than nodes would limit groups, not nodes."""
  if fork.moe_router != "deepseek_v3":
    raise error("moe_node_limited_routing", "needs moe_router=deepseek_v3 (its group-limited routing limits the nodes)")
  nodes, groups = get("dcn_expert_parallelism"), get("n_routing_groups")
  if nodes < 1:
    raise error("dcn_expert_parallelism", "moe_node_limited_routing needs the EP nodes written out (>= 1)")
  if groups != nodes:
    raise ConfigError(f"config keys 'n_routing_groups' = {groups} ({origins.get('n_routing_groups', 'default')}) and "
                      f"'dcn_expert_parallelism' = {nodes} ({origins.get('dcn_expert_parallelism', 'default')}) "
                      "contradict moe_node_limited_routing=true: the routing groups are the EP nodes, so "
                      "n_routing_groups must equal dcn_expert_parallelism (or be unset: set to it)")
  top_k, limit = get("num_experts_per_tok"), get("topk_routing_group")
  if limit < 1:
    raise error("topk_routing_group", "moe_node_limited_routing needs it: the nodes a token's experts may sit on (V3: 4)")
  if top_k % limit:
    raise ConfigError(f"config keys 'num_experts_per_tok' = {top_k} ({origins.get('num_experts_per_tok', 'default')}) "
                      f"and 'topk_routing_group' = {limit} ({origins.get('topk_routing_group', 'default')}) contradict "
                      "moe_node_limited_routing=true: a node is scored by its top K/M experts, so M must divide K")
  if fork.moe_block != "ours" and top_k != 2 * limit:
    raise ConfigError(f"config keys 'moe_block' = {fork.moe_block!r} ({origins.get('moe_block', 'default')}) and "
                      f"'moe_node_limited_routing' = True ({origins.get('moe_node_limited_routing', 'default')}): "
                      f"upstream's router scores a group by its top 2, node-limited routing by its top K/M = "
                      f"{top_k}/{limit}; set moe_block=ours (or num_experts_per_tok = 2 x topk_routing_group)")


