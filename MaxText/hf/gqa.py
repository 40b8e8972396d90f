"""Qwen3-MoE (`Qwen3MoeForCausalLM`) and Mixtral (`MixtralForCausalLM`) in Hugging Face's layout: grouped-query
attention and one routed MoE (no shared expert, no bias) in every layer, upstream's parameter tree (either block).

Both use the RoPE of the halves, as MaxText's plain RoPE does: no column moves. Mixtral's query weights hold
MaxText's 1/sqrt(head_dim) (attentions.py init_query_w folds the depth scaling into the kernel where there is no
qk-norm), so its q_proj is exported times sqrt(head_dim) (exact, and exact back, when head_dim is a power of 4);
Qwen3's query and key are normalized per head (q_norm, k_norm) and its weights unscaled. Shapes: D emb_dim,
H query heads, K kv heads, d head_dim, E experts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from MaxText.hf import config_json, layout
from MaxText.hf.errors import BadInput


@dataclasses.dataclass(frozen=True)
class Family:
  """One family: its HF names, what it requires of our config, and its config.json."""

  ARCHITECTURE: str
  model_type: str
  decoder_block: str
  moe: tuple[str, ...]  # our MoE block's path in a layer
  gate: str  # HF: the router, under the layer
  experts: str  # HF: expert e's prefix, under the layer, with {e}
  expert_names: tuple[str, str, str]  # HF names of wi_0, wi_1, wo
  qk_norm: bool
  DEFAULT_CONFIG: str

  @property
  def MODEL_TYPE(self) -> str:  # pylint: disable=invalid-name  # as MaxText/hf/deepseek.py names it
    return self.model_type

  def refusal(self, c: Any, fork: Any) -> str | None:  # pylint: disable=unused-argument
    checks = [("mlp_activations", list(c.mlp_activations), ["silu", "linear"]),
              ("rope_type", str(getattr(c.rope_type, "value", c.rope_type)), "default"),
              ("final_logits_soft_cap", c.final_logits_soft_cap, None),
              ("use_qk_norm", bool(c.use_qk_norm), self.qk_norm),
              ("shared_experts", c.shared_experts, 0),
              ("routed_score_func", c.routed_score_func or "", ""),  # transformers' softmax of the logits
              ("routed_bias", bool(c.routed_bias), False)]
    for key, value, wanted in checks:
      if value != wanted:
        return f"config key '{key}' = {value!r}: {self.ARCHITECTURE}'s layout needs {wanted!r}"
    if c.logits_via_embedding:
      return f"config key 'logits_via_embedding' = True: {config_json.TIED}"
    return None

  def hf_config(self, c: Any, dtype: str) -> dict[str, Any]:
    common = {"architectures": [self.ARCHITECTURE], "model_type": self.model_type, "vocab_size": c.vocab_size,
              "hidden_size": c.emb_dim, "num_hidden_layers": c.num_decoder_layers,
              "num_attention_heads": c.num_query_heads, "num_key_value_heads": c.num_kv_heads,
              "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.normalization_layer_epsilon,
              "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_max_timescale,
              "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_max_timescale},
              "tie_word_embeddings": bool(c.logits_via_embedding), "num_experts_per_tok": c.num_experts_per_tok,
              "attention_bias": False, "dtype": dtype, "torch_dtype": dtype}
    if self.model_type == "mixtral":
      return {**common, "intermediate_size": c.moe_mlp_dim, "num_local_experts": c.num_experts,
              "sliding_window": None}
    # norm_topk_prob: upstream's weights are a softmax over the chosen logits, which sums to 1 with or without it
    return {**common, "intermediate_size": c.mlp_dim, "moe_intermediate_size": c.moe_mlp_dim,
            "num_experts": c.num_experts, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None}

  def maxtext_keys(self, hf: Mapping[str, Any]) -> dict[str, Any]:
    """Our config keys for this family's config.json, read as its transformers class reads it; BadInput for what
    we cannot run the same way."""
    h = config_json.read(hf, self.model_type)
    rope = h["rope"]
    if rope["rope_type"] != "default" or h["hidden_act"] != "silu":
      raise BadInput(f"config.json rope_type {rope['rope_type']!r} / hidden_act {h['hidden_act']!r}: "
                     f"{self.ARCHITECTURE} is imported with plain RoPE and silu")
    if self.model_type == "qwen3_moe":
      if h["mlp_only_layers"] or h["decoder_sparse_step"] != 1:
        raise BadInput("config.json mlp_only_layers / decoder_sparse_step: our Qwen3-MoE has a MoE in every layer")
      if not h["norm_topk_prob"]:
        raise BadInput("config.json norm_topk_prob false (Qwen3MoeConfig's default): transformers weighs each "
                       "chosen expert by its softmax over all experts; upstream's router (ours too) takes the "
                       "softmax over the chosen ones, which is norm_topk_prob true (the released Qwen3-MoE's)")
    window = h["sliding_window"] if h.get("use_sliding_window", True) else None
    if window:
      raise BadInput(f"config.json sliding_window {window}: not imported (full attention only)")
    heads = h["num_attention_heads"]
    tied = bool(h["tie_word_embeddings"])
    keys = {"base_emb_dim": h["hidden_size"], "base_num_decoder_layers": h["num_hidden_layers"],
            "base_num_query_heads": heads, "base_num_kv_heads": h["num_key_value_heads"],
            "head_dim": h.get("head_dim") or h["hidden_size"] // heads, "vocab_size": h["vocab_size"],
            "num_experts_per_tok": h["num_experts_per_tok"], "normalization_layer_epsilon": h["rms_norm_eps"],
            "rope_max_timescale": rope["rope_theta"], "max_position_embeddings": h["max_position_embeddings"],
            "logits_via_embedding": tied,
            "num_experts": h["num_experts"]}
    if self.model_type == "mixtral":
      return {**keys, "base_mlp_dim": h["intermediate_size"], "base_moe_mlp_dim": h["intermediate_size"]}
    # norm_topk_prob true is carried by the router's form (a softmax over the chosen logits sums to 1 with or
    # without upstream's norm_topk_prob): no key to set
    return {**keys, "base_mlp_dim": h["intermediate_size"], "base_moe_mlp_dim": h["moe_intermediate_size"]}

  @staticmethod
  def free_keys(keys: Mapping[str, Any]) -> set[str]:  # pylint: disable=unused-argument
    """Keys a given config may change without changing the function: plain RoPE's table of positions."""
    return {"max_position_embeddings"}

  def pieces(self, shapes: Mapping[tuple[str, ...], tuple[int, ...]], c: Any, fork: Any,
             hf: Mapping[str, Any] | None = None) -> list[layout.Piece]:  # pylint: disable=unused-argument
    """Every HF tensor of the model; `hf` (the config.json imported) changes nothing: both classes turn halves."""
    why = self.refusal(c, fork)
    if why:
      raise BadInput(why)
    src = layout.Source(shapes, c.param_scan_axis)
    out: list[layout.Piece] = []

    def add(root, sub, layer, name, transform, picks=None):
      p = src.piece(root, sub, layer, name, transform, picks)
      if p is None:
        raise BadInput(f"the checkpoint has no {'/'.join(root + sub)}: not a {self.ARCHITECTURE} parameter tree")
      out.append(p)

    add((), ("token_embedder", "embedding"), None, "model.embed_tokens.weight", layout.SAME)
    scale = 1.0 if self.qk_norm else math.sqrt(c.head_dim)
    attn = [(("self_attention", "query", "kernel"), "self_attn.q_proj.weight", layout.heads_in(scale=scale)),
            (("self_attention", "key", "kernel"), "self_attn.k_proj.weight", layout.heads_in()),
            (("self_attention", "value", "kernel"), "self_attn.v_proj.weight", layout.heads_in()),
            (("self_attention", "out", "kernel"), "self_attn.o_proj.weight", layout.HEADS_OUT),
            (("pre_self_attention_layer_norm", "scale"), "input_layernorm.weight", layout.SAME),
            (("post_self_attention_layer_norm", "scale"), "post_attention_layernorm.weight", layout.SAME),
            ((*self.moe, "gate", "kernel"), f"{self.gate}.weight", layout.LINEAR)]
    if self.qk_norm:
      attn += [(("self_attention", "query_norm", "scale"), "self_attn.q_norm.weight", layout.SAME),
               (("self_attention", "key_norm", "scale"), "self_attn.k_norm.weight", layout.SAME)]
    for i, (root, layer) in enumerate(src.layer_roots("layers", c.num_decoder_layers)):
      for sub, name, transform in attn:
        add(root, sub, layer, f"model.layers.{i}.{name}", transform)
      for w, hf in zip(("wi_0", "wi_1", "wo"), self.expert_names):
        for e in range(c.num_experts):
          add(root, (*self.moe, w), layer, f"model.layers.{i}.{self.experts.format(e=e)}.{hf}.weight",
              layout.LINEAR, {0: e})
    add((), ("decoder", "decoder_norm", "scale"), None, "model.norm.weight", layout.SAME)
    if not c.logits_via_embedding:
      add((), ("decoder", "logits_dense", "kernel"), None, "lm_head.weight", layout.LINEAR)
    return out


QWEN3_MOE = Family("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3_moe", ("moe_block",), "mlp.gate", "mlp.experts.{e}",
                   ("gate_proj", "up_proj", "down_proj"), qk_norm=True, DEFAULT_CONFIG="configs/qwen3-moe-tiny.yml")
MIXTRAL = Family("MixtralForCausalLM", "mixtral", "mixtral", ("MoeBlock_0",), "block_sparse_moe.gate",
                 "block_sparse_moe.experts.{e}", ("w1", "w3", "w2"), qk_norm=False,
                 DEFAULT_CONFIG="configs/mixtral-tiny.yml")
