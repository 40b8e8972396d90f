"""tools/bench_families.py: the family table's arithmetic, its budget rule, and that every family it times has a
run config, a planner estimate to hold to the step and a grouped-GEMM shape in tools/bench_gmm.py. The whole
script ran on CPU through the tiny configs (its docstring's --configs); the GPU run's table is in BENCHMARKS."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO, load_script

sys.path.insert(0, str(REPO / "tools"))  # bench_families imports bench_train as a sibling script
families = load_script("bench_families", "tools/bench_families.py")
bench_gmm = load_script("bench_gmm", "tools/bench_gmm.py")
bench_train = load_script("bench_train", "tools/bench_train.py")


@pytest.mark.parametrize("family", sorted(families.FAMILY_CONFIGS))
def test_every_family_has_a_run_config_an_estimate_and_gemm_shapes(family):
  config = REPO / families.FAMILY_CONFIGS[family]
  assert config.is_file()
  assert families.planner_estimate_ms(config) > 0  # the header the measured step is held to
  assert family in bench_gmm.FAMILIES


def test_ratios_take_upstreams_fastest_variant():
  rows = [{"variant": "upstream_ragged", "median_step_time_s": 2.0},
          {"variant": "upstream_tokamax", "median_step_time_s": 1.5},
          {"variant": "ours", "median_step_time_s": 1.0},
          {"variant": "dense_equivalent", "median_step_time_s": 0.9},
          {"variant": "ours_fp8", "returncode": "timeout"}]
  s = families.family_row("mixtral", rows, estimate_ms=1100.0)
  assert s["best_upstream"] == "upstream_tokamax"
  assert s["ours_over_upstream"] == pytest.approx(1.5)
  assert s["ours_over_dense"] == pytest.approx(0.9)
  assert s["estimate_over_measured"] == pytest.approx(1.1)


def test_a_family_without_ours_has_no_ratios():
  s = families.family_row("llama4", [{"variant": "upstream_tokamax", "median_step_time_s": 1.0}], None)
  assert set(s) == {"family", "estimate_ms"}
  assert "-" in families.format_tables([{"family": "llama4", "rows": [], "summary": s}], None)


def test_a_row_faster_than_the_runs_own_gemm_is_flagged():
  """The Llama 4 dense equivalent that ran one layer of four (0.228 s, 1,024 TFLOP/s/device against a 524 TF/s
  GEMM in the same call): its row says so instead of passing as a reference."""
  rows = [{"variant": "dense_equivalent", "returncode": 0, "median_step_time_s": 0.228,
           "median_tflops_per_device": 1024.2},
          {"variant": "ours", "returncode": 0, "median_step_time_s": 0.513, "median_tflops_per_device": 455.2}]
  table = families.format_tables([{"family": "llama4", "rows": rows, "summary": families.family_row(
      "llama4", rows, 522.0)}], 524.0)
  flagged = [line for line in table.splitlines() if "its count is not what ran" in line]
  assert len(flagged) == 1 and "dense_equivalent" in flagged[0] and "(524)" in flagged[0]


def test_budget_starts_a_run_only_when_the_longest_so_far_fits():
  assert families.fits_budget(0, None, [])  # no budget: everything runs
  assert families.fits_budget(0, 300, [])  # the first run is bounded by a third of the budget
  assert not families.fits_budget(250, 300, [])
  assert families.fits_budget(200, 300, [60, 90, 40])
  assert not families.fits_budget(220, 300, [60, 90, 40])


def test_drift_split_variants_differ_only_in_remat():
  """The offload drift split (docs/cluster.md "Host offload, measured"): ours twice, custom remat with the offload preset's
  saved names kept on the device, then offloaded; only remat keys differ from ours."""
  bench_train = sys.modules["bench_train"]
  ours = set(bench_train.VARIANTS["ours"][0])
  assert set(bench_train.VARIANTS["ours_repeat"][0]) == ours
  custom = set(bench_train.VARIANTS["ours_custom"][0]) - ours
  assert {kv.split("=")[0] for kv in custom} == {"remat_policy", "decoder_layer_input", "moe_mlpwi_0", "moe_mlpwi_1"}
  assert all(kv.endswith(("=device", "=custom")) for kv in custom)


scaling = load_script("bench_scaling", "tools/bench_scaling.py")


def test_scaling_meshes_lay_the_proxy_over_the_hosts_gpus_along_one_axis():
  assert scaling.mesh_overrides("fsdp", 1) == []
  assert scaling.mesh_overrides("ep", 8) == ["recipe_num_gpus=8", "ici_expert_parallelism=8"]


def test_scaling_efficiency_is_the_one_gpu_step_over_the_meshs_and_ours_is_held_to_upstream_at_each_mesh():
  rows = [{"mesh": "1", "variant": "ours", "median_step_time_s": 1.0, "planned_s": 0.9},
          {"mesh": "1", "variant": "upstream_tokamax", "median_step_time_s": 1.5},
          {"mesh": "ep8", "variant": "ours", "median_step_time_s": 1.25, "planned_s": 1.0},
          {"mesh": "ep8", "variant": "upstream_tokamax", "median_step_time_s": 2.5},
          {"mesh": "fsdp8", "variant": "ours", "returncode": "not run", "error": "not run (budget)"}]
  scaling.annotate(rows)
  assert rows[2]["efficiency"] == pytest.approx(0.8) and rows[3]["efficiency"] == pytest.approx(0.6)
  assert rows[2]["ours_over_upstream"] == pytest.approx(2.0) and rows[0]["ours_over_upstream"] == pytest.approx(1.5)
  assert rows[2]["estimate_over_measured"] == pytest.approx(0.8)
  assert rows[4]["efficiency"] is None and "not run (budget)" in scaling.format_table(rows)


def test_a_variant_past_its_time_limit_names_the_limit_and_how_far_it_got():
  """A fresh machine's first compile autotunes for minutes: the table says the limit beside the variant it cut."""
  assert bench_train.timeout_note(110, ["compiling the train step..."]) == "ran past --timeout 110 s (still compiling)"
  tail = ["[progress] step 3/10 (30%): loss 9.1, 0.78 s", "[progress] step 4/10 (40%): loss 9.0, 0.78 s"]
  assert bench_train.timeout_note(300, tail) == "ran past --timeout 300 s (reached step 4/10 (40%))"
