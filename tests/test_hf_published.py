"""What transformers itself saves, imported (python -m MaxText.import_hf): random tiny models of transformers'
classes, their config.json as the class writes it (its defaults, its key names), every setting that changes the
function at a non-default value either carried (our logits from the import equal transformers' within 1e-4) or
refused in one line before anything is converted.

Slow: each case builds its model in the torch environment (scripts/hf_env.sh), imports it and runs both forwards.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import hf_helpers
from MaxText.hf.errors import BAD_INPUT

pytestmark = pytest.mark.slow
TOL = 1e-4

QWEN3 = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 32, "moe_intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_experts": 8, "num_experts_per_tok": 2}


def _logits_match(hf_python, hf_dir, tmp_path, architecture: str, length: int | None = None) -> float:
  proc = hf_helpers.import_(hf_dir, tmp_path / "params")
  assert proc.returncode == 0, proc.stderr[-3000:]
  ours = hf_helpers.imported(tmp_path / "params", tmp_path / "ours.npy", length)
  theirs = hf_helpers.theirs(hf_python, hf_dir, tmp_path / "hf.npy", architecture, length)
  diff = float(np.abs(ours - theirs).max())
  print(f"{architecture}: max |ours - transformers| = {diff:.2e} over logits of max |{np.abs(theirs).max():.2f}|")
  return diff


def _as_transformers_4(hf_dir) -> None:
  """config.json as transformers 4.x wrote it: Qwen3-MoE's expert count under `num_experts` (5.x:
  `num_local_experts`, the class reads both)."""
  path = hf_dir / "config.json"
  config = json.loads(path.read_text())
  config["num_experts"] = config.pop("num_local_experts")
  path.write_text(json.dumps(config))


@pytest.mark.parametrize("writer", ["transformers-5", "transformers-4"])
def test_qwen3_moe_norm_topk_prob_false_is_refused_before_converting(writer, hf_python, tmp_path):
  """Qwen3MoeConfig's default norm_topk_prob is false: each chosen expert weighs its softmax over all experts.
  Upstream's router (ours too) weighs the softmax over the chosen ones, which is norm_topk_prob true: no config of
  ours computes false, so it is refused in one line, nothing written (before this, it imported with exit 0 and
  logits 1.9 away from transformers')."""
  hf_dir = hf_helpers.make(hf_python, tmp_path / "hf", "Qwen3MoeForCausalLM", **QWEN3, norm_topk_prob=False)
  if writer == "transformers-4":
    _as_transformers_4(hf_dir)
  proc = hf_helpers.import_(hf_dir, tmp_path / "params")
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == BAD_INPUT and lines[-1].startswith("import_hf: config.json norm_topk_prob false"), lines
  assert not (tmp_path / "params").exists() and not (tmp_path / "params.tmp").exists()


def test_qwen3_moe_non_default_settings_give_transformers_logits_and_tied_embeddings_are_refused(hf_python,
                                                                                                   tmp_path):
  """norm_topk_prob true (the released models'), a norm epsilon and a RoPE base other than the tiny config's: the
  logits of transformers. Tied embeddings are refused in one line: upstream's tied head rounds the embedding to
  bfloat16 (measured: 5.8e-2 off logits of 36 in float32)."""
  hf_dir = hf_helpers.make(hf_python, tmp_path / "hf", "Qwen3MoeForCausalLM", **QWEN3, norm_topk_prob=True,
                           rms_norm_eps=1e-3, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
  assert _logits_match(hf_python, hf_dir, tmp_path, "Qwen3MoeForCausalLM") < TOL
  tied = hf_helpers.make(hf_python, tmp_path / "tied", "Qwen3MoeForCausalLM", **QWEN3, norm_topk_prob=True,
                         tie_word_embeddings=True)
  proc = hf_helpers.import_(tied, tmp_path / "tied_params")
  line = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode == BAD_INPUT and line.startswith("import_hf: config.json tie_word_embeddings true"), line
  assert not (tmp_path / "tied_params").exists()


DEEPSEEK = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 4,
            "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16}


def test_deepseek_v3_as_transformers_saves_it_imports_without_mtp_and_gives_its_logits(hf_python, tmp_path):
  """DeepseekV3Config's defaults name one MTP module that its class neither makes nor saves: imported without it,
  said in one line. Groups (4 of 2, the best 3) and a routing scale off the tiny config's. A norm epsilon other than
  1e-6 is refused (transformers normalizes MLA's latents at 1e-6 whatever it says; imported, 1e-4 gave 6.3e-4)."""
  hf_dir = hf_helpers.make(hf_python, tmp_path / "hf", "DeepseekV3ForCausalLM", **DEEPSEEK, n_group=4, topk_group=3,
                           routed_scaling_factor=1.7)
  assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
  proc = hf_helpers.import_(hf_dir, tmp_path / "params")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "names 1 MTP module(s) (num_nextn_predict_layers, DeepseekV3Config's default is 1) but the directory " \
         "holds 0: importing 0" in proc.stderr
  ours = hf_helpers.imported(tmp_path / "params", tmp_path / "ours.npy")
  theirs = hf_helpers.theirs(hf_python, hf_dir, tmp_path / "hf.npy", "DeepseekV3ForCausalLM")
  diff = float(np.abs(ours - theirs).max())
  print(f"DeepseekV3: max |ours - transformers| = {diff:.2e} over logits of max |{np.abs(theirs).max():.2f}|")
  assert diff < TOL
  # A config given on the command line that disagrees with config.json: one line, both values, nothing converted.
  proc = hf_helpers.import_(hf_dir, tmp_path / "other", "configs/deepseek3-tiny.yml", "base_num_decoder_layers=3",
                            "first_num_dense_layers=1", "vocab_size=256", "base_mlp_dim=96")
  line = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode == BAD_INPUT and line.startswith("import_hf: config key '") and " but " in line, line
  assert "config.json gives" in line and not (tmp_path / "other").exists()
  config = json.loads((hf_dir / "config.json").read_text())
  (hf_dir / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-4}))
  proc = hf_helpers.import_(hf_dir, tmp_path / "eps")
  line = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode == BAD_INPUT and line.startswith("import_hf: config.json rms_norm_eps 0.0001: "), line


def test_deepseek_v3_rope_interleave_false_is_carried(hf_python, tmp_path):
  """rope_interleave false: transformers turns the halves of the RoPE columns, as ours does, so nothing is moved
  (before, the import moved them as for DeepSeek's interleaved pairs: exit 0 and logits 5.3 off; with the released
  YaRN, 9.9 off, and 1.9e-5 after: the same columns, kept to this one case for CI's time)."""
  hf_dir = hf_helpers.make(hf_python, tmp_path / "hf", "DeepseekV3ForCausalLM", **DEEPSEEK,
                           n_group=4, topk_group=2, rope_interleave=False, num_nextn_predict_layers=0)
  assert json.loads((hf_dir / "config.json").read_text())["rope_interleave"] is False
  assert _logits_match(hf_python, hf_dir, tmp_path, "DeepseekV3ForCausalLM") < TOL


# The released configs' rope_scaling: DeepSeek-V3 (163,840 positions from 4,096) and Kimi-K2 (131,072; its base
# 50,000), both run by transformers' DeepseekV3 class. Kimi-K2's one group is no group limit.
YARN = {
    "deepseek-v3": {"max_position_embeddings": 163840, "n_group": 4, "topk_group": 2,
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40, "beta_fast": 32,
                                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "original_max_position_embeddings": 4096}},
    "kimi-k2": {"max_position_embeddings": 131072, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                                    "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                    "original_max_position_embeddings": 4096}},
}
LONG = 4096 + 64  # past the original context, where YaRN's interpolated frequencies matter
# Kimi-K2 measured 1.7e-4 at LONG (logits of 7.4; DeepSeek-V3's config 1.5e-5), growing with the position (2.2e-5
# in its first 520 tokens, 1.7e-4 in its last): transformers' float32 frequency 50,000^(-1/4) is one ulp above the
# correctly rounded one (1 / pow, where XLA's jit of upstream's same formula computes pow(base, -x) and rounds it
# right), so its angle at position p is p x 7.5e-9 rad off ours. Our forward given transformers' own float32
# frequencies: 2.1e-5. DeepSeek-V3's (base 10,000) turn the angles alike within 1e-8 rad at position 4,159. A
# wrong mapping (frequencies, mscale, column order) is off by more than 1e-2.
YARN_TOL = {"deepseek-v3": TOL, "kimi-k2": 2.5e-4}


@pytest.mark.parametrize("model", YARN)
def test_yarn_as_released_gives_transformers_logits_past_the_original_length(model, hf_python, tmp_path):
  hf_dir = hf_helpers.make(hf_python, tmp_path / "hf", "DeepseekV3ForCausalLM", **DEEPSEEK, **YARN[model],
                           num_nextn_predict_layers=0)
  assert _logits_match(hf_python, hf_dir, tmp_path, "DeepseekV3ForCausalLM", LONG) < YARN_TOL[model]


# The released DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3 on the Hugging Face hub), as docs/huggingface.md's
# 671B import reads it.
RELEASED_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "initializer_range": 0.02, "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}}


@pytest.mark.parametrize("change, says", [
    ({}, "has no model.embed_tokens.weight, which the config's model needs"),  # past every config check
    ({"rope_scaling": {**RELEASED_V3["rope_scaling"], "factor": 41}}, "rope_factor"),
    ({"routed_scaling_factor": 2.0}, "routed_scaling_factor"),
])
def test_the_documented_671b_import_agrees_with_the_released_config(change, says, tmp_path):
  """docs/huggingface.md's command for the released DeepSeek-V3 (configs/models/deepseek3-671b-yarn.yml) against
  its config.json: the config checks, which run before any tensor is read, pass; a released value changed is
  named. The weights here are one small tensor, so the import then stops at the first tensor it needs."""
  from MaxText.hf import safetensors  # pylint: disable=import-outside-toplevel

  hf_dir = tmp_path / "DeepSeek-V3"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(json.dumps({**RELEASED_V3, **change}))
  safetensors.write(hf_dir, [("model.norm.weight", (7168,))], lambda i: np.ones(7168, np.float32),
                    np.dtype(np.float32), 1 << 30)
  proc = hf_helpers.import_(hf_dir, tmp_path / "params", "configs/models/deepseek3-671b-yarn.yml")
  assert proc.returncode == BAD_INPUT and says in proc.stderr.splitlines()[-1], proc.stderr[-3000:]
  assert not (tmp_path / "params").exists()
