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

from MaxText.hf import layout
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

  def refusal(self, c: Any, fork: Any) -> str | None:  # pylint: disable=unused-argument
    checks = [("mlp_activations", list(c.mlp_activations), ["silu", "linear"]),
              ("rope_type", str(getattr(c.rope_type, "value", c.rope_type)), "default"),
              ("final_logits_soft_cap", c.final_logits_soft_cap, None),
              ("use_qk_norm", bool(c.use_qk_norm), self.qk_norm),
              ("shared_experts", c.shared_experts, 0)]
    for key, value, wanted in checks:
      if value != wanted:
        return f"config key '{key}' = {value!r}: {self.ARCHITECTURE}'s layout needs {wanted!r}"
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
    return {**common, "intermediate_size": c.mlp_dim, "moe_intermediate_size": c.moe_mlp_dim,
            "num_experts": c.num_experts, "norm_topk_prob": bool(c.norm_topk_prob), "decoder_sparse_step": 1,
            "mlp_only_layers": []}

  def maxtext_keys(self, hf: Mapping[str, Any]) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" or hf.get("hidden_act", "silu") != "silu":
      raise BadInput(f"config.json rope {rope} / hidden_act {hf.get('hidden_act')!r}: only plain RoPE and silu")
    if self.model_type == "qwen3_moe" and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
      raise BadInput("config.json mlp_only_layers / decoder_sparse_step: our Qwen3-MoE has a MoE in every layer")
    if hf.get("sliding_window"):
      raise BadInput(f"config.json sliding_window {hf['sliding_window']}: not imported (full attention only)")
    heads = hf["num_attention_heads"]
    keys = {"base_emb_dim": hf["hidden_size"], "base_num_decoder_layers": hf["num_hidden_layers"],
            "base_num_query_heads": heads, "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "vocab_size": hf["vocab_size"],
            "num_experts_per_tok": hf["num_experts_per_tok"], "normalization_layer_epsilon": hf["rms_norm_eps"],
            "rope_max_timescale": rope.get("rope_theta", hf.get("rope_theta", 10_000)),
            "max_position_embeddings": hf.get("max_position_embeddings", 4096),
            "logits_via_embedding": bool(hf.get("tie_word_embeddings", False))}
    if self.model_type == "mixtral":
      return {**keys, "base_mlp_dim": hf["intermediate_size"], "base_moe_mlp_dim": hf["intermediate_size"],
              "num_experts": hf["num_local_experts"]}
    return {**keys, "base_mlp_dim": hf["intermediate_size"], "base_moe_mlp_dim": hf["moe_intermediate_size"],
            "num_experts": hf["num_experts"], "norm_topk_prob": bool(hf.get("norm_topk_prob", True))}

  def pieces(self, shapes: Mapping[tuple[str, ...], tuple[int, ...]], c: Any, fork: Any) -> list[layout.Piece]:
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
