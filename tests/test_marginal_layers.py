"""tools/marginal_layers.py: one decoder layer's step time per variant, from two bench_train.py runs at two layer
counts (the figures of BENCHMARKS.md "FP8 end to end": the proxy at 4 and 6 layers on the H200)."""

from __future__ import annotations

import json

import pytest

from conftest import load_script

ml = load_script("marginal_layers", "tools/marginal_layers.py")


def _run(tmp_path, name, steps: dict, failed=()):
  rows = [{"variant": v, "returncode": 0, "median_step_time_s": s} for v, s in steps.items()]
  rows += [{"variant": v, "returncode": 1, "error": "out of memory"} for v in failed]
  path = tmp_path / name / "bench_train.json"
  path.parent.mkdir()
  path.write_text(json.dumps({"peak_tflops": 650.0, "rows": rows}))
  return path


def test_the_per_layer_figure_is_the_difference_over_the_added_layers(tmp_path, capsys):
  """0.780 / 0.712 s at 4 layers, 1.117 / 1.010 s at 6: 0.1685 and 0.149 s a layer, FP8 1.131x per MoE layer
  where the whole step is 1.096x / 1.106x. The arguments' order does not matter."""
  four = _run(tmp_path, "bt4", {"ours": 0.780, "ours_fp8": 0.712})
  six = _run(tmp_path, "bt6", {"ours": 1.117, "ours_fp8": 1.010})
  assert ml.main([f"6:{six}", f"4:{four}"]) == 0
  out = capsys.readouterr().out
  rows = ml.marginal((4, ml.step_times(four)), (6, ml.step_times(six)))
  fp8 = rows[1]
  assert fp8["variant"] == "ours_fp8" and fp8["per_layer_s"] == pytest.approx(0.149)
  assert rows[0]["per_layer_s"] == pytest.approx(0.1685)
  assert fp8["speedup_per_layer"] == pytest.approx(1.1309, abs=1e-4)
  assert fp8["speedup_step"] == pytest.approx((1.0955, 1.1059), abs=1e-4)
  assert "1.131x" in out and "1.096x / 1.106x" in out and out.count("\n") == 4


def test_bad_input_gets_one_line_naming_it_and_exit_2(tmp_path, capsys):
  four = _run(tmp_path, "bt4", {"ours": 0.780, "ours_fp8": 0.712})
  other4 = _run(tmp_path, "other4", {"ours": 0.781, "ours_fp8": 0.713})
  oom = _run(tmp_path, "bt6", {"ours": 1.117}, failed=["ours_fp8"])
  six = _run(tmp_path, "six", {"ours": 1.117, "ours_fp8": 1.010})
  cases = {
      ("four", str(four)): "expected LAYERS:PATH",
      ("4:" + str(four), "6:" + str(tmp_path / "nowhere.json")): "nowhere.json: not a readable bench_train.json",
      ("4:" + str(four), "4:" + str(other4)): "both runs have 4 layers",
      ("4:" + str(four), "6:" + str(oom)): "ours_fp8 have a step time in only one run",
      ("6:" + str(four), "4:" + str(six)): "ours, ours_fp8 did not run slower with 6 layers than with 4",
  }
  for args, message in cases.items():
    assert ml.main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0, err
  assert ml.main([]) == 2 and "expected two runs" in capsys.readouterr().err
