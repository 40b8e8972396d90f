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

from MaxText.hf import config_json, layout
from MaxText.hf.errors import BadInput

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"


# transformers' DeepseekV3 (as DeepSeek's own code) normalizes the MLA latents (q_a_layernorm, kv_a_layernorm) with
# epsilon 1e-6 whatever rms_norm_eps says; upstream's MLA uses normalization_layer_epsilon for them too.
MLA_NORM_EPS = 1e-6
MLA_NORM_WHY = ("transformers' DeepseekV3 normalizes the MLA latents with epsilon 1e-6 whatever rms_norm_eps says, "
                "upstream with normalization_layer_epsilon: only 1e-6 computes the same")


def _rope_type(c: Any) -> str:
  return str(getattr(c.rope_type, "value", c.rope_type))


def refusal(c: Any, fork: Any) -> str | None:
  """Why DeepseekV3's layout cannot hold this model, or transformers' class would compute another function (one
  line naming the key), or None."""
  checks = [
      ("decoder_block", str(getattr(c.decoder_block, "value", c.decoder_block)), "deepseek"),
      ("attention_type", str(getattr(c.attention_type, "value", c.attention_type)), "mla"),
      ("routed_score_func", c.routed_score_func, "sigmoid"),
      ("mlp_activations", list(c.mlp_activations), ["silu", "linear"]),
      ("final_logits_soft_cap", c.final_logits_soft_cap, None),
      ("num_kv_heads", c.num_kv_heads, c.num_query_heads),
  ]
  for key, value, wanted in checks:
    if value != wanted:
      why = {"routed_score_func": "DeepseekV3's router is sigmoid (DeepSeek-V2's softmax router has no layout "
                                  "here: DeepseekV2ForCausalLM is not mapped)"}.get(key,
                                                                                    f"DeepseekV3's layout needs {wanted!r}")
      return f"config key '{key}' = {value!r}: {why}"
  if c.normalization_layer_epsilon != MLA_NORM_EPS:
    return (f"config key 'normalization_layer_epsilon' = {c.normalization_layer_epsilon}: {MLA_NORM_WHY}")
  rope = _rope_type(c)
  if rope not in ("default", "yarn"):
    return f"config key 'rope_type' = {rope!r}: DeepseekV3 runs plain RoPE or YaRN"
  if rope == "default" and c.mscale and c.max_position_embeddings > c.original_max_position_embeddings:
    return (f"config key 'max_position_embeddings' = {c.max_position_embeddings} > original_max_position_embeddings"
            f" = {c.original_max_position_embeddings} with plain RoPE: upstream's MLA scales the softmax by YaRN's "
            "mscale there, which plain RoPE in transformers does not; set them equal")
  if c.logits_via_embedding:
    return f"config key 'logits_via_embedding' = True: {config_json.TIED}"
  if getattr(fork, "moe_node_limited_routing", False) and c.num_experts_per_tok // max(c.topk_routing_group, 1) != 2:
    return (f"config key 'moe_node_limited_routing' = True with num_experts_per_tok / topk_routing_group = "
            f"{c.num_experts_per_tok} / {c.topk_routing_group}: each group is scored by its top "
            f"{c.num_experts_per_tok // max(c.topk_routing_group, 1)}, transformers' DeepseekV3 by its top 2")
  if not (c.model_name.startswith("deepseek3") or c.model_name.startswith("kimi-k2")
          or fork.moe_router == "deepseek_v3"):
    return (f"config key 'moe_router' = {fork.moe_router!r} at model_name {c.model_name!r}: not DeepSeek-V3's "
            "router (the routing bias would be a trained weight); set moe_router: deepseek_v3")
  if c.num_experts <= 1 or c.first_num_dense_layers >= c.num_decoder_layers:
    return f"config key 'num_experts' = {c.num_experts}: DeepseekV3's layout needs MoE layers"
  return None


def _rope_interleaved(c: Any) -> bool:
  """Whether the checkpoint's RoPE columns are already DeepSeek's interleaved pairs: upstream's YaRN with
  rope_interleave: true turns columns 2i and 2i + 1; its plain RoPE always turns the halves."""
  return _rope_type(c) == "yarn" and bool(c.rope_interleave)


def _rope_columns_to_move(c: Any, hf_interleaved: bool) -> int:
  """How many RoPE columns of each head the layout moves between the halves and the interleaved order: all of
  them where the HF side turns pairs (rope_interleave true) and ours the halves, none where ours turns the same
  columns (an import always builds the halves: yarn_keys sets rope_interleave false, and a config saying
  otherwise is refused by import_cli.disagreement)."""
  return c.qk_rope_head_dim if hf_interleaved and not _rope_interleaved(c) else 0


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
      "norm_topk_prob": True,  # upstream's deepseek_scale_weights always normalizes sigmoid scores
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
      "rope_parameters": (config_json.yarn_parameters(c) if _rope_type(c) == "yarn" else
                          {"rope_type": "default", "rope_theta": c.rope_max_timescale}),
      "rope_interleave": True,  # the RoPE columns are exported interleaved
      "attention_bias": False,
      "tie_word_embeddings": bool(c.logits_via_embedding),
      "num_nextn_predict_layers": c.mtp_num_layers,
      "dtype": dtype,
      "torch_dtype": dtype,
  }


def _attention(c: Any, r: int) -> list[tuple[tuple[str, ...], str, layout.Transform]]:
  """The attention's tensors; `r` RoPE columns of each head moved to (or from) the interleaved order."""
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


def pieces(shapes: Mapping[tuple[str, ...], tuple[int, ...]], c: Any, fork: Any,
           hf: Mapping[str, Any] | None = None) -> list[layout.Piece]:
  """Every HF tensor of the model, in the order they are written: the embedding, each layer, the MTP modules, the
  final norm and head. Expert arrays are walked expert-major within a layer group so that each stored chunk is
  decoded once (MaxText/hf/checkpoint.py). `hf`: the config.json being imported, whose rope_interleave says the
  RoPE columns' order (transformers turns the halves where it is false, as ours does: nothing moves); None on
  export, which writes them interleaved (hf_config's rope_interleave true)."""
  why = refusal(c, fork)
  if why:
    raise BadInput(why)
  hf_interleaved = bool(config_json.read(hf, MODEL_TYPE)["rope_interleave"]) if hf is not None else True
  attention = _attention(c, _rope_columns_to_move(c, hf_interleaved))
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
  groups = [("dense_layers", dense, 0, attention + DENSE_MLP, False),
            ("moe_layers", n - dense, dense, attention + MOE_MLP, True)]
  for group, count, first, rules, moe in groups:
    for i, (root, layer) in enumerate(src.layer_roots(group, count)):
      _layer(src, root, layer, f"model.layers.{first + i}", rules, c, moe, out, need_bias)
  for k in range(1, c.mtp_num_layers + 1):
    out.extend(_mtp(src, c, k, f"model.layers.{n + k - 1}", out, need_bias, attention))
  return out


def _mtp(src: layout.Source, c: Any, k: int, prefix: str, exported: list[layout.Piece], need_bias: bool,
         attention: list) -> list[layout.Piece]:
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
  _layer(src, root + (f"mtp_{k}_transformer_layer",), None, prefix, attention + MOE_MLP, c, True, out, need_bias)
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
  """Our config keys for a DeepseekV3 config.json (the inverse of hf_config), read as DeepseekV3Config reads it;
  BadInput for what we cannot run the same way."""
  h = config_json.read(hf, MODEL_TYPE)
  rope = h["rope"]
  if h["scoring_func"] != "sigmoid" or h["topk_method"] != "noaux_tc":
    raise BadInput(f"config.json scoring_func {h['scoring_func']!r} / topk_method {h['topk_method']!r}: "
                   "DeepSeek-V3's router is sigmoid with noaux_tc")
  if h["moe_layer_freq"] != 1 or h["hidden_act"] != "silu":
    raise BadInput(f"config.json moe_layer_freq {h['moe_layer_freq']} / hidden_act {h['hidden_act']!r}: "
                   "our DeepSeek layers need 1 and silu")
  if h["rms_norm_eps"] != MLA_NORM_EPS:
    raise BadInput(f"config.json rms_norm_eps {h['rms_norm_eps']}: {MLA_NORM_WHY}")
  if not h["norm_topk_prob"]:
    raise BadInput("config.json norm_topk_prob false: upstream's DeepSeek router (ours too) always normalizes the "
                   "chosen sigmoid scores")
  if h["n_routed_experts"] % max(h["n_group"] or 1, 1):
    raise BadInput(f"config.json n_group {h['n_group']} does not divide n_routed_experts {h['n_routed_experts']}")
  if rope["rope_type"] == "yarn":
    positions = config_json.yarn_keys(rope, h["max_position_embeddings"])
  elif rope["rope_type"] == "default":
    # plain RoPE: no YaRN softmax scale (upstream's MLA applies it whenever max > original)
    positions = {"rope_type": "default", "max_position_embeddings": h["max_position_embeddings"],
                 "original_max_position_embeddings": h["max_position_embeddings"]}
  else:
    raise BadInput(f"config.json rope_type {rope['rope_type']!r}: DeepseekV3 is imported with plain RoPE or YaRN")
  groups = (h["n_group"], h["topk_group"]) if (h["n_group"] or 1) > 1 else (-1, -1)  # one group: no group limit
  tied = bool(h["tie_word_embeddings"])
  return {
      "base_emb_dim": h["hidden_size"], "base_mlp_dim": h["intermediate_size"],
      "base_moe_mlp_dim": h["moe_intermediate_size"], "base_num_decoder_layers": h["num_hidden_layers"],
      "base_num_query_heads": h["num_attention_heads"], "base_num_kv_heads": h["num_attention_heads"],
      "first_num_dense_layers": h["first_k_dense_replace"], "vocab_size": h["vocab_size"],
      "num_experts": h["n_routed_experts"], "num_experts_per_tok": h["num_experts_per_tok"],
      "shared_experts": h["n_shared_experts"], "routed_scaling_factor": h["routed_scaling_factor"],
      "n_routing_groups": groups[0], "topk_routing_group": groups[1],
      "q_lora_rank": h["q_lora_rank"] or 0, "kv_lora_rank": h["kv_lora_rank"],
      "qk_nope_head_dim": h["qk_nope_head_dim"], "qk_rope_head_dim": h["qk_rope_head_dim"],
      "v_head_dim": h["v_head_dim"], "normalization_layer_epsilon": h["rms_norm_eps"],
      "rope_max_timescale": rope["rope_theta"], **positions,
      "logits_via_embedding": tied,
      "mtp_num_layers": h["num_nextn_predict_layers"] or 0,
  }


def free_keys(keys: Mapping[str, Any]) -> set[str]:
  """Keys of maxtext_keys whose value a given config may change without changing the function: the MTP modules,
  of which it may take fewer (the rest are listed as not imported), and under plain RoPE the table of positions it
  precomputes (refusal() checks that no YaRN softmax scale comes with it)."""
  plain = keys.get("rope_type") == "default"
  return {"mtp_num_layers"} | ({"max_position_embeddings", "original_max_position_embeddings"} if plain else set())
