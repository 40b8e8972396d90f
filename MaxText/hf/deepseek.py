"""DeepSeek-V3 in Hugging Face's layout: the tensor names of the released checkpoint and transformers'
DeepseekV3ForCausalLM, and its config.json, from a MaxText model (upstream's parameter tree, shared by
`moe_block: ours` and `upstream`).

What upstream's converter leaves out is here: the routing bias (a MoEBiasVar, in the checkpoint's `nnx_aux`, stacked
[layers, experts]) goes to `mlp.gate.e_score_correction_bias`; the MTP module goes where DeepSeek publishes it, as
layer index num_hidden_layers (`model.layers.<N>.enorm/hnorm/eh_proj/shared_head` and a whole decoder layer, with
its own copies of the embedding and the output head; transformers' class does not load it and says so); the RoPE
columns are moved to the interleaved order (MaxText/hf/layout.py). Shapes: D emb_dim, H heads, E experts.
"""

from __future__ import annotations

from typing import Any, Mapping

from MaxText.hf import layout
from MaxText.hf.errors import BadInput

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"


def refusal(c: Any, fork: Any) -> str | None:
  """Why DeepseekV3's layout cannot hold this model (one line naming the key), or None."""
  checks = [
      ("decoder_block", str(getattr(c.decoder_block, "value", c.decoder_block)), "deepseek"),
      ("attention_type", str(getattr(c.attention_type, "value", c.attention_type)), "mla"),
      ("routed_score_func", c.routed_score_func, "sigmoid"),
      ("mlp_activations", list(c.mlp_activations), ["silu", "linear"]),
      ("rope_type", str(getattr(c.rope_type, "value", c.rope_type)), "default"),
      ("final_logits_soft_cap", c.final_logits_soft_cap, None),
      ("num_kv_heads", c.num_kv_heads, c.num_query_heads),
  ]
  for key, value, wanted in checks:
    if value != wanted:
      why = {"rope_type": "only plain RoPE is exported and checked against transformers (YaRN is not yet)"}.get(
          key, f"DeepseekV3's layout needs {wanted!r}")
      return f"config key '{key}' = {value!r}: {why}"
  if not (c.model_name.startswith("deepseek3") or fork.moe_router == "deepseek_v3"):
    return (f"config key 'moe_router' = {fork.moe_router!r} at model_name {c.model_name!r}: not DeepSeek-V3's "
            "router (the routing bias would be a trained weight); set moe_router: deepseek_v3")
  if c.num_experts <= 1 or c.first_num_dense_layers >= c.num_decoder_layers:
    return f"config key 'num_experts' = {c.num_experts}: DeepseekV3's layout needs MoE layers"
  return None


def hf_config(c: Any, dtype: str) -> dict[str, Any]:
  """config.json for transformers' DeepseekV3Config (and DeepSeek's own inference code's names)."""
  return {
      "architectures": [ARCHITECTURE],
      "model_type": MODEL_TYPE,
      "vocab_size": c.vocab_size,
      "hidden_size": c.emb_dim,
      "intermediate_size": c.mlp_dim,
      "moe_intermediate_size": c.moe_mlp_dim,
      "num_hidden_layers": c.num_decoder_layers,
      "num_attention_heads": c.num_query_heads,
      "num_key_value_heads": c.num_kv_heads,
      "n_shared_experts": c.shared_experts,
      "n_routed_experts": c.num_experts,
      "num_experts_per_tok": c.num_experts_per_tok,
      "routed_scaling_factor": c.routed_scaling_factor,
      "n_group": max(c.n_routing_groups, 1),
      "topk_group": max(c.topk_routing_group, 1),
      "topk_method": "noaux_tc",
      "scoring_func": "sigmoid",
      "norm_topk_prob": bool(c.norm_topk_prob),
      "first_k_dense_replace": c.first_num_dense_layers,
      "moe_layer_freq": 1,
      "kv_lora_rank": c.kv_lora_rank,
      "q_lora_rank": c.q_lora_rank or None,
      "qk_nope_head_dim": c.qk_nope_head_dim,
      "qk_rope_head_dim": c.qk_rope_head_dim,
      "v_head_dim": c.v_head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": c.normalization_layer_epsilon,
      "max_position_embeddings": c.max_position_embeddings,
      "rope_theta": c.rope_max_timescale,
      "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_max_timescale},
      "rope_interleave": True,  # the RoPE columns are exported interleaved
      "attention_bias": False,
      "tie_word_embeddings": bool(c.logits_via_embedding),
      "num_nextn_predict_layers": c.mtp_num_layers,
      "dtype": dtype,
      "torch_dtype": dtype,
  }


def _attention(c: Any) -> list[tuple[tuple[str, ...], str, layout.Transform]]:
  r = c.qk_rope_head_dim
  query = ([(("self_attention", "wq_a", "kernel"), "self_attn.q_a_proj.weight", layout.LINEAR),
            (("self_attention", "q_norm", "scale"), "self_attn.q_a_layernorm.weight", layout.SAME),
            (("self_attention", "wq_b", "kernel"), "self_attn.q_b_proj.weight", layout.heads_in(rope=r))]
           if c.q_lora_rank else
           [(("self_attention", "query", "kernel"), "self_attn.q_proj.weight", layout.heads_in(rope=r))])
  return query + [
      (("pre_self_attention_layer_norm", "scale"), "input_layernorm.weight", layout.SAME),
      (("post_self_attention_layer_norm", "scale"), "post_attention_layernorm.weight", layout.SAME),
      (("self_attention", "wkv_a", "kernel"), "self_attn.kv_a_proj_with_mqa.weight", layout.linear_rope_tail(r)),
      (("self_attention", "kv_norm", "scale"), "self_attn.kv_a_layernorm.weight", layout.SAME),
      (("self_attention", "wkv_b", "kernel"), "self_attn.kv_b_proj.weight", layout.heads_in()),
      (("self_attention", "out", "kernel"), "self_attn.o_proj.weight", layout.HEADS_OUT),
  ]


DENSE_MLP = [((("mlp", w, "kernel")), f"mlp.{hf}.weight", layout.LINEAR)
             for w, hf in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))]
MOE = ("DeepSeekMoeBlock_0", "MoeBlock_0")
SHARED = ("DeepSeekMoeBlock_0", "shared_experts")
MOE_MLP = [((*SHARED, w, "kernel"), f"mlp.shared_experts.{hf}.weight", layout.LINEAR)
           for w, hf in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))] + [
               ((*MOE, "gate", "kernel"), "mlp.gate.weight", layout.LINEAR)]
EXPERTS = [((*MOE, w), f"{hf}.weight") for w, hf in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))]
BIAS = (*MOE, "gate", "bias")  # under nnx_aux: a MoEBiasVar


def _layer(src: layout.Source, root, layer, hf_prefix: str, rules, c, moe: bool, out: list, need_bias: bool) -> None:
  def add(sub, name, transform, picks=None, required=True):
    found = src.find(root, sub, picks or {}, layer)
    if found is None:
      if required:
        raise BadInput(f"the checkpoint has no {'/'.join(root + sub)}: not a DeepSeek-V3 parameter tree")
      return
    key, index, sliced = found
    out.append(layout.Piece(f"{hf_prefix}.{name}", key, index, transform, sliced))

  for sub, name, transform in rules:
    add(sub, name, transform)
  if not moe:
    return
  add(BIAS, "mlp.gate.e_score_correction_bias", layout.SAME, required=need_bias)
  for sub, hf in EXPERTS:
    for e in range(c.num_experts):
      add(sub, f"mlp.experts.{e}.{hf}", layout.LINEAR, picks={0: e})


def pieces(shapes: Mapping[tuple[str, ...], tuple[int, ...]], c: Any, fork: Any) -> list[layout.Piece]:
  """Every HF tensor of the model, in the order they are written: the embedding, each layer, the MTP modules, the
  final norm and head. Expert arrays are walked expert-major within a layer group so that each stored chunk is
  decoded once (MaxText/hf/checkpoint.py)."""
  why = refusal(c, fork)
  if why:
    raise BadInput(why)
  src = layout.Source(shapes, c.param_scan_axis)
  need_bias = bool(c.routed_bias)
  out: list[layout.Piece] = []
  top = [(("token_embedder", "embedding"), "model.embed_tokens.weight", layout.SAME),
         (("decoder", "decoder_norm", "scale"), "model.norm.weight", layout.SAME)]
  if not c.logits_via_embedding:
    top.append((("decoder", "logits_dense", "kernel"), "lm_head.weight", layout.LINEAR))
  for sub, name, transform in top:
    found = src.find((), sub, {}, None)
    if found is None:
      raise BadInput(f"the checkpoint has no {'/'.join(sub)}: not a DeepSeek-V3 parameter tree")
    out.append(layout.Piece(name, found[0], found[1], transform, found[2]))
  dense, n = c.first_num_dense_layers, c.num_decoder_layers
  groups = [("dense_layers", dense, 0, _attention(c) + DENSE_MLP, False),
            ("moe_layers", n - dense, dense, _attention(c) + MOE_MLP, True)]
  for group, count, first, rules, moe in groups:
    for i, (root, layer) in enumerate(src.layer_roots(group, count)):
      _layer(src, root, layer, f"model.layers.{first + i}", rules, c, moe, out, need_bias)
  for k in range(1, c.mtp_num_layers + 1):
    out.extend(_mtp(src, c, k, f"model.layers.{n + k - 1}", out, need_bias))
  return out


def _mtp(src: layout.Source, c: Any, k: int, prefix: str, exported: list[layout.Piece], need_bias: bool) -> list[layout.Piece]:
  """MTP module k as DeepSeek publishes it: its own norms and projection, a MoE decoder layer, and copies of the
  shared embedding and head (MaxText shares them with the main model)."""
  root = ("mtp_block", f"mtp_layer_{k}")
  out: list[layout.Piece] = []
  for sub, name, transform in [((f"mtp_{k}_embedding_norm", "scale"), "enorm.weight", layout.SAME),
                               ((f"mtp_{k}_hidden_state_norm", "scale"), "hnorm.weight", layout.SAME),
                               ((f"mtp_{k}_projection", "kernel"), "eh_proj.weight", layout.LINEAR),
                               ((f"mtp_{k}_final_norm", "scale"), "shared_head.norm.weight", layout.SAME)]:
    found = src.find(root, sub, {}, None)
    if found is None:
      raise BadInput(f"the checkpoint has no {'/'.join(root + sub)} though mtp_num_layers = {c.mtp_num_layers}")
    out.append(layout.Piece(f"{prefix}.{name}", found[0], found[1], transform, found[2]))
  _layer(src, root + (f"mtp_{k}_transformer_layer",), None, prefix, _attention(c) + MOE_MLP, c, True, out, need_bias)
  by_name = {p.name: p for p in exported}
  head = by_name.get("lm_head.weight") or by_name["model.embed_tokens.weight"]
  embed = by_name["model.embed_tokens.weight"]
  out.append(layout.Piece(f"{prefix}.embed_tokens.weight", embed.key, embed.index, embed.transform,
                          embed.maxtext_shape, copy=True))
  out.append(layout.Piece(f"{prefix}.shared_head.head.weight", head.key, head.index, head.transform,
                          head.maxtext_shape, copy=True))
  return out


# --- import: config.json -> our config keys ---

DEFAULT_CONFIG = "configs/deepseek3-tiny.yml"  # run settings for an import given no config: CPU, our block


def maxtext_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Our config keys for a DeepseekV3 config.json (the inverse of hf_config); BadInput for what we cannot run."""
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind != "default":
    raise BadInput(f"config.json rope type {kind!r}: only plain RoPE is imported and checked (YaRN is not yet)")
  if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
    raise BadInput(f"config.json scoring_func {hf.get('scoring_func')!r} / topk_method {hf.get('topk_method')!r}: "
                   "DeepSeek-V3's router is sigmoid with noaux_tc")
  if hf.get("moe_layer_freq", 1) != 1 or hf.get("hidden_act", "silu") != "silu":
    raise BadInput(f"config.json moe_layer_freq {hf.get('moe_layer_freq')} / hidden_act {hf.get('hidden_act')!r}: "
                   "our DeepSeek layers need 1 and silu")
  theta = rope.get("rope_theta", hf.get("rope_theta", 10_000))
  return {
      "base_emb_dim": hf["hidden_size"], "base_mlp_dim": hf["intermediate_size"],
      "base_moe_mlp_dim": hf["moe_intermediate_size"], "base_num_decoder_layers": hf["num_hidden_layers"],
      "base_num_query_heads": hf["num_attention_heads"],
      "base_num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
      "first_num_dense_layers": hf["first_k_dense_replace"], "vocab_size": hf["vocab_size"],
      "num_experts": hf["n_routed_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
      "shared_experts": hf["n_shared_experts"], "routed_scaling_factor": hf["routed_scaling_factor"],
      "n_routing_groups": hf["n_group"], "topk_routing_group": hf["topk_group"],
      "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "q_lora_rank": hf.get("q_lora_rank") or 0,
      "kv_lora_rank": hf["kv_lora_rank"], "qk_nope_head_dim": hf["qk_nope_head_dim"],
      "qk_rope_head_dim": hf["qk_rope_head_dim"], "v_head_dim": hf["v_head_dim"],
      "normalization_layer_epsilon": hf["rms_norm_eps"], "rope_type": "default", "rope_max_timescale": theta,
      "max_position_embeddings": hf["max_position_embeddings"],
      "original_max_position_embeddings": hf["max_position_embeddings"],
      "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
      "mtp_num_layers": hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0,
  }
