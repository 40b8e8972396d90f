"""Recipe headers and BENCHMARKS.md's system-table rows against the plan summaries committed beside the recipes
(configs/recipes/plans/<recipe>.json, written by tools/replan_recipes.py from real plans; MaxText/plan/summary.py)."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, load_script
from MaxText.plan import summary

RECIPES = load_script("replan_recipes", "tools/replan_recipes.py").recipes([])  # every shipped recipe, as it plans them


def _summary() -> dict:
  """A summary as summary.of writes one (its figures invented: this checks the format, not a plan)."""
  axes = {a: {"ici": 1, "dcn": 1} for a in ("data", "fsdp", "expert")}
  axes["expert"]["ici"], axes["fsdp"]["dcn"] = 8, 16
  return {"recipe": "configs/recipes/x-128xh100.yml", "planned_at": {"commit": "abc1234", "date": "2026-12-05"},
          "compiled": {"platform": "gpu_target", "target_gpu": "H100 SXM 80 GB"}, "gpus": 128, "axes": axes,
          "precision": {"weights": "float32", "gradients": "float32", "adam_mu": "bfloat16", "adam_nu": "float32",
                        "compute": "bfloat16", "routed_experts": "blockwise"},
          "batch": {"per_device_batch_size": 1, "max_target_length": 4096, "gradient_accumulation_steps": 15},
          "dispatch": {"backend": "hierarchical", "a2a_padded_capacity_factor": 1.5, "hierarchical_capacity_factor": 1.5,
                       "node_limited_routing": True},
          "memory": {"device_gib": 57.85, "usable_gib": 72.0, "fits": True}, "step_s": 134.19, "tflops_per_gpu": 116.5,
          "terms_s": {"collectives_s": 119.0, "exposed_collectives_s": 96.7}}


def test_the_header_block_and_the_row_say_every_axis_the_precision_and_the_plan(tmp_path):
  lines = summary.header_lines(_summary(), "configs/recipes/plans/x-128xh100.json")
  assert lines[0].startswith(summary.HEADER_BEGIN) and lines[-1] == summary.HEADER_END
  assert "# Planned at abc1234 (2026-12-05): 128 x H100 SXM 80 GB, compile-only; not run" in lines
  assert "# Layout: data 1x1, fsdp 1x16, expert 8x1 (ICI x DCN)" in lines
  assert "# Precision: fp32 master weights, fp32 gradients, AdamW bf16/fp32; routed experts' GEMMs FP8 (blockwise e4m3)" in lines
  assert ("# Batch: 1 x 4096 tokens a GPU a microbatch, 15 microbatches; dispatch: hierarchical, capacity 1.5, "
          "node-limited routing") in lines
  assert "# Memory: 57.85 GiB a GPU of 72.00 usable: fits" in lines
  marginal = {**_summary(), "memory": {**_summary()["memory"], "device_gib": 67.47, "marginal": True}}
  assert ("# Memory: 67.47 GiB a GPU of 72.00 usable: fits, marginal (compile-only has read up to 9% low: confirm "
          "with --mock)") in summary.header_lines(marginal, "p.json")
  assert "# Estimate: step 134.2 s, 116.5 TFLOP/s/GPU (collectives 119 s, 96.7 s of them exposed)" in lines
  # 1 x 4096 tokens x 15 microbatches a GPU in 134.19 s: 458 tokens/s/GPU.
  assert summary.table_row(_summary(), "x") == (
      "| x | expert 8 in a node; fsdp 16 across nodes | fp32 master, FP8 experts; hierarchical, capacity 1.5, "
      "node-limited routing | 458 | 116.5 | 57.85 of 72.00 | 134.2 s | abc1234 · 2026-12-05 |")
  # tools/replan_recipes.py puts the block under a recipe's first line, and replaces it the next time.
  replan = load_script("replan_recipes", "tools/replan_recipes.py")
  recipe = tmp_path / "x-128xh100.yml"
  recipe.write_text("# Title line\n# prose\nbase_config: a.yml\n")
  replan.PLANS, replan.REPO = tmp_path / "plans", tmp_path
  replan.write_header(recipe, _summary())
  replan.write_header(recipe, {**_summary(), "step_s": 99.0})
  text = recipe.read_text().splitlines()
  assert text[0] == "# Title line" and text[-2:] == ["# prose", "base_config: a.yml"]
  assert sum(l.startswith(summary.HEADER_BEGIN) for l in text) == 1 and any("step 99 s" in l for l in text)


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_each_recipe_header_states_its_committed_plan(recipe):
  """A header cannot drift from its plan: its block is the summary's lines, the summary a real plan's whose one
  account held, and its row in BENCHMARKS.md's system tables is the same summary's."""
  path = REPO / "configs" / "recipes" / "plans" / f"{recipe.stem}.json"
  assert path.exists(), f"no plan summary for {recipe.name}: python3 tools/replan_recipes.py --only {recipe.stem}"
  s = json.loads(path.read_text())
  assert s["recipe"] == str(recipe.relative_to(REPO)) and s["account"]["ok"], s["account"]
  assert s["config_digest"] == summary.config_digest(recipe), f"{recipe.name} changed since its plan: re-plan it"
  block = summary.header_lines(s, str(path.relative_to(REPO)))
  text = recipe.read_text().splitlines()
  begin = text.index(block[0])
  assert text[begin:begin + len(block)] == block
  assert summary.table_row(s, recipe.stem) in (REPO / "BENCHMARKS.md").read_text()
