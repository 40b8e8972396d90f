"""config.json read the way transformers' class reads it: the class's defaults for what the file leaves out, the key
names transformers has used across versions, and the RoPE settings wherever a version put them.

A file saved by transformers holds most keys, but not all (5.x drops some defaults, 4.x wrote others), and a
published one (DeepSeek's, Moonshot's) holds what its own code reads. The defaults below are transformers 5.24's
(the release requirements/hf.txt pins), for the keys that change the function or the shapes.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from MaxText.hf.errors import BadInput

TIED = ("upstream's tied head (logits_via_embedding) multiplies by the embedding rounded to bfloat16 whatever the "
        "dtype (embeddings.py attend_on_embedding), and by 1/sqrt(emb_dim) unless normalize_embedding_logits is "
        "false; transformers' by the embedding as stored")

# model_type -> the class's defaults for the keys we read (DeepseekV3Config, Qwen3MoeConfig, MixtralConfig).
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False,
        "num_nextn_predict_layers": 1,
        # not DeepseekV3Config fields: what DeepSeek's own code (and transformers' class, which ignores them) means
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    },
    "qwen3_moe": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
        "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": [],
    },
    "mixtral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "sliding_window": None, "num_experts_per_tok": 2, "num_experts": 8,
    },
}
# model_type -> the attention's bias tensors attention_bias true gives (transformers' DeepseekV3Attention,
# Qwen3MoeAttention; MixtralConfig has no such key and its attention no biases)
ATTENTION_BIASES = {"deepseek_v3": "q_a_proj, kv_a_proj_with_mqa and o_proj", "qwen3_moe": "q, k, v and o_proj"}
# model_type -> the keys that change only training (dropout, router noise), which the import does not carry: a
# run's own keys (dropout_rate) say what it trains with.
TRAINING_ONLY = {"deepseek_v3": ("attention_dropout",), "qwen3_moe": ("attention_dropout",),
                 "mixtral": ("attention_dropout", "router_jitter_noise")}
# The base wavelength when config.json names none (the class's default_theta).
DEFAULT_THETA = {"deepseek_v3": 10_000.0, "qwen3_moe": 10_000.0, "mixtral": 1_000_000.0}
# model_type -> {the name we read: the other names transformers has written it under}
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "deepseek_v3": {"n_routed_experts": ("num_local_experts",),
                    "num_nextn_predict_layers": ("num_mtp_layers",)},
    "qwen3_moe": {"num_experts": ("num_local_experts",)},  # 4.x wrote num_experts, 5.x num_local_experts
    "mixtral": {"num_experts": ("num_local_experts",)},
}


def read(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
  """config.json with the class's defaults filled in and every alias under the one name we read; `rope` holds the
  RoPE settings, resolved as transformers does (rope_parameters, else rope_scaling, else none; rope_theta inside,
  else at the top, else the class's default; `type` is the old name of `rope_type`)."""
  out = dict(DEFAULTS[model_type])
  out.update({k: v for k, v in hf.items()})
  for name, others in ALIASES[model_type].items():
    for other in others:
      if other in hf and name not in hf:
        out[name] = hf[other]
  if model_type == "deepseek_v3" or out.get("num_key_value_heads") is None:
    # MLA has no separate key/value heads (DeepseekV3Config's default of 128 is unused by its attention)
    out["num_key_value_heads"] = out["num_attention_heads"]
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  if any(isinstance(v, dict) for v in rope.values()):
    raise BadInput(f"config.json rope_parameters {sorted(rope)}: a RoPE per layer type is not imported")
  rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
  rope.pop("type", None)
  rope.setdefault("rope_theta", hf.get("rope_theta", DEFAULT_THETA[model_type]))
  if rope["rope_type"] == "yarn":
    rope.setdefault("original_max_position_embeddings",
                    hf.get("original_max_position_embeddings", out["max_position_embeddings"]))
  out["rope"] = rope
  if out["tie_word_embeddings"]:
    raise BadInput(f"config.json tie_word_embeddings true: not imported: {TIED}")
  if model_type in ATTENTION_BIASES and out["attention_bias"]:
    raise BadInput(f"config.json attention_bias true: the biases of {ATTENTION_BIASES[model_type]} have no place "
                   "here: upstream's attention (ours too) has no bias terms")
  return out


def training_only(hf: Mapping[str, Any], model_type: str) -> list[str]:
  """The keys config.json sets that change training but not the model's function, which the import leaves out."""
  return [f"{k} {hf[k]}" for k in TRAINING_ONLY[model_type] if hf.get(k)]


def get_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention scale (transformers' get_mscale, upstream's 0.1 * mscale * ln(factor) + 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_keys(rope: Mapping[str, Any], max_positions: int) -> dict[str, Any]:
  """Our YaRN keys (upstream's YarnRotaryEmbedding and MLA's softmax scale) for transformers' yarn rope_parameters;
  BadInput for a setting ours does not compute the same way.

  transformers: inv_freq mixes 1/theta^(2i/d) and it / factor by a ramp over the correction range of beta_fast,
  beta_slow at original_max_position_embeddings (floored and ceiled unless truncate: false); cos and sin times
  attention_factor (given, else get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set,
  else get_mscale(factor)); DeepseekV3's softmax scale times get_mscale(factor, mscale_all_dim)^2 when
  mscale_all_dim is set. Upstream: the same frequencies (rope_truncate); cos and sin times get_mscale(factor) with
  rope_attention_scaling, else 1; the softmax scale times get_mscale(factor, mscale)^2 whenever
  max_position_embeddings > original_max_position_embeddings."""
  part = rope.get("partial_rotary_factor", 1.0)
  if part is not None and float(part) != 1.0:  # transformers' YaRN then turns head_dim x part of the columns
    raise BadInput(f"config.json rope_parameters partial_rotary_factor {part}: our YaRN turns every RoPE column")
  factor = float(rope.get("factor") or 0)
  if factor <= 1:
    raise BadInput(f"config.json rope_parameters factor {rope.get('factor')!r}: YaRN needs a factor above 1")
  mscale, mscale_all = rope.get("mscale"), float(rope.get("mscale_all_dim") or 0.0)
  attention = rope.get("attention_factor")
  if attention is None:
    attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all else \
        get_mscale(factor)
  if abs(attention - 1.0) < 1e-12:
    scale_rope = False
  elif abs(attention - get_mscale(factor)) < 1e-12:
    scale_rope = True
  else:
    raise BadInput(f"config.json rope_parameters attention_factor {attention:.6g} (from {dict(rope)}): ours scales "
                   f"cos and sin by 1 or by 0.1 ln(factor) + 1 = {get_mscale(factor):.6g}")
  original = int(rope["original_max_position_embeddings"])
  if mscale_all and max_positions <= original:
    raise BadInput(f"config.json max_position_embeddings {max_positions} <= original_max_position_embeddings "
                   f"{original}: upstream's MLA applies mscale_all_dim only above the original length")
  return {"rope_type": "yarn", "rope_factor": factor, "beta_fast": float(rope.get("beta_fast") or 32),
          "beta_slow": float(rope.get("beta_slow") or 1), "mscale": mscale_all,
          "original_max_position_embeddings": original, "max_position_embeddings": max_positions,
          "rope_truncate": bool(rope.get("truncate", True)), "rope_attention_scaling": scale_rope,
          "rope_interleave": False}


def yarn_parameters(c: Any) -> dict[str, Any]:
  """transformers' yarn rope_parameters for upstream's YaRN keys (the inverse of yarn_keys): DeepSeek's released
  form (mscale = mscale_all_dim) where it says the same, an explicit attention_factor otherwise."""
  softmax = float(c.mscale) if c.max_position_embeddings > c.original_max_position_embeddings else 0.0
  out = {"rope_type": "yarn", "rope_theta": c.rope_max_timescale, "factor": c.rope_factor,
         "beta_fast": c.beta_fast, "beta_slow": c.beta_slow,
         "original_max_position_embeddings": c.original_max_position_embeddings, "truncate": bool(c.rope_truncate)}
  if softmax and not c.rope_attention_scaling:
    return {**out, "mscale": softmax, "mscale_all_dim": softmax}
  return {**out, "mscale_all_dim": softmax,
          "attention_factor": get_mscale(c.rope_factor) if c.rope_attention_scaling else 1.0}
