"""Upstream's MoE families on our block: each model's routing and expert GLU, read from upstream's own config
keys, and what our block cannot express, named by the key that asks for it.

Upstream MaxText 0.2.5 decides these inside RoutedMoE by decoder block and model name (layers/moe.py:
GateLogit ~675, get_topk ~1277, permute ~1545, apply_ffn_activation ~1441). This module is the one place our
side reads them, so that block.py and routing.py stay model-agnostic and patches/routed_moe.py (trace time)
and MaxText/config/checks.py (before anything is compiled) agree.

  decoder_block        upstream configs/models/        routing                                   expert GLU
  qwen3_moe, qwen3_next, Qwen3-MoE, Qwen3-Next,       softmax of the top-k logits,              silu(h0) * h1
  qwen3_5, qwen3_custom  Qwen3.5                        norm_topk_prob renormalizes
  mixtral, envy        Mixtral, Switch (envy)          softmax of the top-k logits               act(h0) * h1
  gpt_oss              GPT-OSS                         top-k of logits + bias (a trained          GPT-OSS's clamped GLU,
                                                       parameter: it weighs too), softmax        expert biases (mlp_bias)
  llama4               Llama 4 (top-1)                 top-1 logit; its sigmoid scales the token silu(h0) * h1
                                                       before the expert, combined with 1
  deepseek             DeepSeek-V2 (softmax scores)    top-k of the scores, x routed_scaling     silu(h0) * h1
                       DeepSeek-V3, Kimi-K2 (sigmoid;  the bias only selects (model_name
                       model_name deepseek3*, kimi-k2*) deepseek3*/kimi-k2*), weights normalized
  deepseek4            DeepSeek-V4                     as V3, sqrtsoftplus; refused while any    clamped GLU
                                                       layer hash-routes (first_num_hash_layers)

Shared experts (DeepSeek, Kimi-K2, Llama 4, Qwen3-Next) and the placement of MoE layers among dense ones
(first_num_dense_layers, Llama 4's interleave_moe_layer_step) belong to upstream's decoder layers around
RoutedMoE; swapping the block leaves them, and every parameter, as upstream builds them.
"""

from __future__ import annotations

from typing import Any, Mapping

from MaxText.moe import block
from MaxText.moe import routing

# Model names whose router upstream gives DeepSeek-V3's semantics: the bias (a non-trained variable) only
# selects, the weights are the pre-bias scores (GateLogit ~640/~708, get_topk ~1321).
V3_ROUTER_MODEL_PREFIXES = ("deepseek3", "deepseek4", "kimi-k2")
SCORE_FUNCS = ("", "sigmoid", "softmax", "sqrtsoftplus")  # routing._score's; upstream takes any jax.nn name


def _get(cfg: Any, key: str) -> Any:
  """A key of upstream's resolved config (attributes) or of a plain mapping (a YAML merged over base.yml)."""
  return cfg[key] if isinstance(cfg, Mapping) else getattr(cfg, key)


def _name(value: Any) -> str:
  return str(getattr(value, "value", value))  # upstream's enums (DecoderBlockType) and plain strings alike


def router_config(cfg: Any, num_experts: int, top_k: int) -> routing.RouterConfig:
  """The routing upstream's RoutedMoE gives a config, as our RouterConfig."""
  decoder = _name(_get(cfg, "decoder_block"))
  return routing.RouterConfig(
      num_experts=num_experts,
      top_k=top_k,
      score_func=_get(cfg, "routed_score_func") or "",
      bias_selects_only=str(_get(cfg, "model_name")).startswith(V3_ROUTER_MODEL_PREFIXES),
      deepseek_weights=decoder in ("deepseek", "deepseek4"),  # get_topk ~1331: deepseek_scale_weights
      routed_scaling_factor=_get(cfg, "routed_scaling_factor"),
      n_groups=_get(cfg, "n_routing_groups"),
      topk_groups=_get(cfg, "topk_routing_group"),
      norm_topk_prob=_get(cfg, "norm_topk_prob"),
      weigh_input=decoder == "llama4",  # permute ~1545, unpermute ~1748
  )


def glu(cfg: Any) -> dict[str, Any]:
  """BlockConfig's activation, glu and activation_limit for a config (apply_ffn_activation ~1441)."""
  decoder, limit = _name(_get(cfg, "decoder_block")), float(_get(cfg, "mlp_activations_limit"))
  if decoder == "gpt_oss":
    form = "gpt_oss"
  elif decoder in ("deepseek", "deepseek4") and limit > 0:
    form = "clamped_glu"
  else:
    form = "glu"  # upstream ignores mlp_activations_limit for every other decoder block
  return {"activation": _get(cfg, "mlp_activations")[0], "glu": form, "activation_limit": limit}


def refusals(cfg: Any) -> list[tuple[str, Any, str]]:
  """(key, value, why) for each setting of `cfg` our block cannot run as upstream's would; [] if none."""
  get = lambda key: _get(cfg, key)  # noqa: E731
  decoder = _name(get("decoder_block"))
  out = []

  def refuse(key: str, why: str) -> None:
    value = get(key)
    out.append((key, getattr(value, "value", value), why))

  if decoder == "gemma4":
    refuse("decoder_block", "Gemma 4's router (weights from a softmax over every expert) and per-expert output "
           "scales are not implemented")
  if get("first_num_hash_layers") > 0:
    refuse("first_num_hash_layers", "hash routing (a token-id -> expert table) is not implemented")
  if get("use_random_routing"):
    refuse("use_random_routing", "random routing is not implemented")
  if get("quantization") not in ("", None):
    refuse("quantization", "our grouped GEMMs do not run upstream's quantized (AQT/qwix) experts; moe_fp8=blockwise "
           "is ours")
  if "float8" in _name(get("weight_dtype")):
    refuse("weight_dtype", "FP8-stored expert weights carry per-block scales our block does not apply")
  if get("prefuse_moe_weights"):
    refuse("prefuse_moe_weights", "our block reads wi_0 and wi_1, not upstream's fused wi")
  if get("use_batch_split_schedule"):
    refuse("use_batch_split_schedule", "upstream's batch-split DeepSeek layers never call RoutedMoE: our block "
           "would not run")
  if _name(get("custom_mesh_and_rule")) == "cp-as-ep":
    refuse("custom_mesh_and_rule", "expert parallelism over two mesh axes (context and expert) is not implemented")
  if (get("routed_score_func") or "") not in SCORE_FUNCS:
    refuse("routed_score_func", f"our router scores with one of {', '.join(repr(s) for s in SCORE_FUNCS)}")
  if get("mlp_activations")[0] not in block.ACTIVATIONS:
    refuse("mlp_activations", f"the expert gate's activation must be one of {', '.join(block.ACTIVATIONS)}")
  if decoder == "llama4" and get("num_experts_per_tok") != 1:
    refuse("num_experts_per_tok", "Llama 4's router scales the token by its one expert's score: top-1 only "
           "(upstream's permute fails on more)")
  if decoder == "llama4" and get("norm_topk_prob"):
    refuse("norm_topk_prob", "upstream would divide Llama 4's one logit by itself (every score sigmoid(1))")
  return out
