"""Every shipped DeepSeek-V3 config against the published values (arXiv 2412.19437; HF config.json).

One table, one row per published value: the section that states it, the key, the value, and
which configs it binds (tiny and proxy configs scale expert counts; their YAML says how).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import REPO
from MaxText import config as fork_config

# The other families' configs (MaxText/moe/families.py; tests/test_moe_families.py holds them to their own models)
# and the files they share are not DeepSeek-V3's.
OTHER_FAMILIES = ("deepseek2", "gpt-oss", "kimi-k2", "llama4", "mixtral", "qwen3", "families-", "tiny-cpu-common",
                  "upstream-model")
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yml") if not p.name.startswith(OTHER_FAMILIES))


def _kind(path: Path) -> set[str]:
  name = path.name
  kinds = {"all"}
  if "recipes" in path.parts:
    kinds |= {"recipe", "full"}
    if path.stem != "deepseek3-671b-common":
      kinds.add("cluster")  # a recipe with its mesh (the common file has none: node-limited routing needs EP nodes)
  elif name in ("deepseek3-671b.yml", "deepseek3-671b-yarn.yml"):
    kinds.add("full")
  if "yarn" not in name:
    kinds.add("pretrain_rope")
  return kinds


def _effective(path: Path) -> dict:
  run = fork_config.load([str(path)])
  fields = fork_config.upstream_fields()
  out = {k: info.default for k, info in fields.items()}
  out.update(run.upstream)
  out.update(run.fork.model_dump())
  return out


# (section, key, published value, configs it binds)
PUBLISHED = [
    ("§2.1.2 sigmoid affinities", "routed_score_func", "sigmoid", "all"),
    ("§2.1.2 bias term for routing (aux-loss-free)", "routed_bias", True, "all"),
    ("§2.1.2 bias only selects; no gradient (ours: moe_router)", "moe_router", "deepseek_v3", "all"),
    ("§2.1.2 eq. 13 gates normalized over the selected", "norm_topk_prob", True, "all"),
    ("config.json routed_scaling_factor", "routed_scaling_factor", 2.5, "all"),
    ("§4.2 bias update speed gamma = 0.001", "routed_bias_update_rate", 0.001, "all"),
    ("§4.2 sequence-wise balance loss alpha = 0.0001", "load_balance_loss_weight", 1e-4, "all"),
    ("§2.1.2 eq. 17-20 sequence-wise loss on unbiased top-k", "moe_use_megatron_seq_aux_loss", True, "all"),
    ("§4.2 256 routed experts", "num_experts", 256, "full"),
    ("§4.2 8 experts per token", "num_experts_per_tok", 8, "full"),
    ("§4.2 / config.json n_group 8 (at most 4 nodes)", "n_routing_groups", 8, "full"),
    ("§4.2 / config.json topk_group 4", "topk_routing_group", 4, "full"),
    ("§4.2 MTP depth 1", "mtp_num_layers", 1, "full"),
    ("§4.2 MTP loss weight 0.3 for the first 10T tokens", "mtp_loss_scaling_factor", 0.3, "full"),
    ("§4.2 pretraining at 4K, plain RoPE", "rope_type", "default", "pretrain_rope"),
    ("§4.2 no YaRN attention scaling at 4K", "max_position_embeddings", 4096, "pretrain_rope"),
    ("§4.2 MTP loss weight 0.1 afterwards", "mtp_loss_scaling_factor_late", 0.1, "recipe"),
    ("§4.2 ... after 10T tokens", "mtp_loss_switch_tokens", 10_000_000_000_000, "recipe"),
    ("§4.2 gamma 0 for the last 500B of 14.8T tokens", "moe_bias_update_stop_tokens", 14_300_000_000_000, "recipe"),
    ("§4.2 AdamW beta1 0.9", "adam_b1", 0.9, "recipe"),
    ("§4.2 AdamW beta2 0.95", "adam_b2", 0.95, "recipe"),
    ("§4.2 weight decay 0.1", "adam_weight_decay", 0.1, "recipe"),
    ("§4.2 gradient clipping norm 1.0", "gradient_clipping_threshold", 1.0, "recipe"),
    ("§4.2 peak LR 2.2e-4", "learning_rate", 2.2e-4, "recipe"),
    ("§4.2 cosine decay to 2.2e-5 (0.1 of peak)", "learning_rate_final_fraction", 0.1, "recipe"),
    ("§4.2 constant, then cosine decay", "lr_schedule_type", "wsd", "recipe"),
    ("§4.2 constant, then cosine decay", "wsd_decay_style", "cosine", "recipe"),
    ("§4.2 max sequence length 4K", "max_target_length", 4096, "recipe"),
    ("our path in the recipes (not the paper)", "moe_block", "ours", "recipe"),
    ("our path in the recipes (not the paper)", "moe_gmm_backend", "auto", "recipe"),
    ("our path in the recipes (not the paper): EP across nodes in two exchanges", "moe_dispatch_backend", "hierarchical",
     "recipe"),
    ("§2.1.2 node-limited routing: a token's experts on at most M = 4 nodes", "moe_node_limited_routing", True, "cluster"),
]


def _id(path: Path) -> str:
  return str(path.relative_to(REPO / "configs"))


def _by_the_layout(key: str, c: dict) -> bool:
  """A published property the mesh itself keeps: a token's experts on at most M = 4 nodes, where the experts are on
  no more nodes than that (the 256 x B200 recipe's EP over 2 nodes) and node-limited routing has nothing to limit."""
  return key == "moe_node_limited_routing" and c["dcn_expert_parallelism"] <= c["topk_routing_group"]


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_config_has_deepseek_v3_published_values(path):
  c, kinds = _effective(path), _kind(path)
  wrong = [f"{key} = {c[key]!r}, published {want!r} ({where})" for where, key, want, binds in PUBLISHED
           if binds in kinds and c[key] != want and not _by_the_layout(key, c)]
  assert not wrong, "\n".join(wrong)
  # Group-limited routing at every size: groups of >= 2 experts, kept groups hold more than top-k
  # candidates (scaled configs say in a comment how they scale V3's 8 groups / 4 kept).
  groups, kept, experts, k = c["n_routing_groups"], c["topk_routing_group"], c["num_experts"], c["num_experts_per_tok"]
  assert groups > 0 and experts % groups == 0 and experts // groups >= 2
  assert k < kept * (experts // groups) and kept < groups


@pytest.mark.parametrize("path", [p for p in CONFIGS if "recipes" in p.parts and "x" in p.stem], ids=_id)
def test_recipe_lr_schedule_is_v3s_in_steps(path):
  """§4.2: warmup over the first 2K steps; cosine over 4.3T tokens at 15,360 x 4,096 tokens a step."""
  c = _effective(path)
  assert int(c["learning_rate_schedule_steps"] * c["warmup_steps_fraction"]) == 2000
  tokens_per_step = 15360 * 4096  # V3's batch from step 0 (the ramp is not expressed: the recipes say why)
  end = c["learning_rate_schedule_steps"]
  assert end == math.ceil(14.3e12 / tokens_per_step)
  assert int(end * c["wsd_decay_steps_fraction"]) == end - math.ceil(10e12 / tokens_per_step)
  assert c["steps"] == c["learning_rate_schedule_steps"]


def test_1024_gpu_recipes_take_v3s_batch_by_accumulation():
  """§4.2's final batch, 15,360 sequences, as micro-batch x accumulation x GPUs; the ramp is stated, not run."""
  for name in ("1024xh100", "1024xh200"):
    path = REPO / f"configs/recipes/deepseek3-671b-{name}.yml"
    c = _effective(path)
    assert c["per_device_batch_size"] * c["gradient_accumulation_steps"] * c["recipe_num_gpus"] == 15360
    assert not c.get("enable_rampup_batch_size")
    assert "ramp from 3,072 over the first 469B tokens is not expressed" in path.read_text()


def test_yarn_config_is_v3s_context_extension():
  """§4.3: YaRN s = 40, alpha = 1, beta = 32, on the pretraining model."""
  c = _effective(REPO / "configs/models/deepseek3-671b-yarn.yml")
  assert (c["rope_type"], c["rope_factor"], c["beta_fast"], c["beta_slow"]) == ("yarn", 40, 32, 1)
  assert (c["original_max_position_embeddings"], c["max_position_embeddings"]) == (4096, 163840)


def test_recipe_schedule_steps_are_v3s_token_counts():
  """The LR schedule's steps (computed by hand in the common recipe) are where the token-count
  switches land at V3's batch: 10T tokens at the cosine's start, 14.3T at its end."""
  import types  # pylint: disable=import-outside-toplevel

  from patches import train_schedule  # pylint: disable=import-outside-toplevel

  c = _effective(REPO / "configs/recipes/deepseek3-671b-1024xh200.yml")
  batch = c["per_device_batch_size"] * c["recipe_num_gpus"] * c["gradient_accumulation_steps"]  # upstream's own sum
  cfg = types.SimpleNamespace(**{**c, "num_target_devices": c["recipe_num_gpus"], "global_batch_size_to_train_on": batch})
  end = c["learning_rate_schedule_steps"]
  decay = int(end * c["wsd_decay_steps_fraction"])
  assert train_schedule.step_at_tokens(cfg, c["mtp_loss_switch_tokens"]) == end - decay  # 10T: constant -> cosine
  assert train_schedule.step_at_tokens(cfg, c["moe_bias_update_stop_tokens"]) == end  # 14.3T
