"""The MoE time split live (moe_profile_every_n_steps): the classifier on an op-stats
table shaped like xprof's GPU hlo_stats, the profiled-step rule, the config errors, and a tiny run."""

from __future__ import annotations

import glob
import json

import pytest

from tests.conftest import config_error_line

TINY = "configs/deepseek3-tiny.yml"
_COLS = ("rank", "program_id", "category", "hlo_op_name", "hlo_op_expression", "tf_op_name", "occurrences",
         "total_self_time", "source_info")


def _table(*rows: tuple) -> dict:
  """xprof's hlo_stats data table: rows are (program_id, hlo_op_name, expression, tf_op_name, self_us, source)."""
  out = []
  for i, (program, name, expression, op_name, self_us, source) in enumerate(rows):
    cells = (i + 1, program, "fusion", name, expression, op_name, 1, self_us, source)
    out.append({"c": [{"v": v} for v in cells]})
  return {"cols": [{"id": c, "label": c, "type": "string"} for c in _COLS], "rows": out}


STEP = "jit(train_step)/jvp()/while/body"
TABLE = _table(
    ("7", "fusion.1", "%fusion.1 = bf16[8] fusion(...)", f"{STEP}/route/top_k", 100.0, ""),
    ("7", "all-to-all.2", "%all-to-all.2 = bf16[8] all-to-all(...)", f"{STEP}/dispatch/all_to_all", 200.0, ""),
    ("7", "custom-call.3", '%custom-call.3 = bf16[8] custom-call(...), custom_call_target="mosaic_gpu"',
     f"{STEP}/gmm/pallas_call", 400.0, ""),
    ("7", "all-to-all.4", "%all-to-all.4 = bf16[8] all-to-all(...)", f"{STEP}/combine/all_to_all", 150.0, ""),
    ("7", "fusion.5", "%fusion.5 = bf16[8] fusion(...)", f"{STEP}/combine/mul", 50.0, ""),
    ("7", "custom-call.6", '%custom-call.6 = (bf16[8]) custom-call(...), custom_call_target="__cudnn$fmhaSoftmax"',
     f"{STEP}/checkpoint/dot_product_attention", 300.0, ""),
    # a nameless backward op, decided by the source frame xprof keeps with it
    ("7", "fusion.7", "%fusion.7 = bf16[8] fusion(...)", "jit(train_step)/transpose(jvp())/transpose", 100.0,
     '<div title="maxtext/layers/attention_op.py:AttentionOp.qk_product">attention_op.py:3122</div>'),
    ("7", "fusion.8", "%fusion.8 = f32[8] fusion(...)", "jit(train_step)/jit(tree_bias_correction)/div", 150.0, ""),
    # XLA's own copy, no metadata: still the step's program, so "rest"
    ("7", "copy.9", "%copy.9 = bf16[8] copy(...)", "", 50.0, ""),
    # another program in the window (eval): not the train step's
    ("9", "fusion.1", "%fusion.1 = bf16[8] fusion(...)", "jit(eval_step)/gmm/dot", 5000.0, ""),
)


def test_split_of_an_xprof_op_stats_table():
  from MaxText.moe import time_split as ts

  rows = ts.rows_from_hlo_stats(json.loads(json.dumps([TABLE])))  # as the converter returns it: JSON
  assert len(rows) == 10 and rows[2].target == "mosaic_gpu"
  assert rows[6].frames[0] == "maxtext/layers/attention_op.py:AttentionOp.qk_product"
  step = ts.step_rows(rows)
  assert {r.program_id for r in step} == {"7"}
  got = ts.split(step)
  assert got["ms"] == pytest.approx({"route": 0.1, "dispatch": 0.2, "gmm": 0.4, "combine": 0.2, "attention": 0.4,
                                     "rest": 0.2})
  assert got["total_ms"] == pytest.approx(1.5)
  assert sum(got["share"].values()) == pytest.approx(1.0)
  assert got["share"]["gmm"] == pytest.approx(0.4 / 1.5)
  scalars = ts.scalars(got)
  assert scalars["moe_time/gmm_ms"] == pytest.approx(0.4) and scalars["moe_time/total_ms"] == pytest.approx(1.5)
  assert set(scalars) == {f"moe_time/{c}_{u}" for c in ts.CATEGORIES for u in ("ms", "share")} | {"moe_time/total_ms"}
  assert "gmm 0.40 ms (27%)" in ts.format_line({**got, "source": "xprof hlo_stats"}, step=5)


def test_kernel_name_decides_only_without_metadata():
  """cuDNN's Hopper flash-attention kernels carry "wgmma": a kernel name never beats the op's own scope,
  and is used only for ops with no framework op name."""
  from MaxText.moe import time_split as ts

  row = lambda name, op_name="", target="": ts.OpRow("1", "", name, op_name, target, (), 1.0)  # noqa: E731
  assert ts.classify_row(row("sm90_flash_bprop_wgmma_f16_kernel0", f"{STEP}/gmm/dot")) == "gmm"
  assert ts.classify_row(row("sm90_flash_bprop_wgmma_f16_kernel0")) == "attention"
  assert ts.classify_row(row("nccl_AllToAll_kernel")) == "dispatch"
  assert ts.classify_row(row("fusion.3")) == "rest"


def test_profiled_steps_skip_the_compiling_first_step_and_pgles_own_runs():
  from patches import moe_profile

  moe_profile._state.update(every=2, first_step=0)
  try:
    assert [s for s in range(8) if moe_profile.profiled(s)] == [1, 3, 5, 7]
    moe_profile._state.update(every=1, first_step=4)  # a resumed run: its first step compiles
    assert [s for s in range(4, 8) if moe_profile.profiled(s)] == [5, 6, 7]
    # the pgle preset: jax profiles the first 3 runs (steps 4-6) itself and recompiles at step 7
    moe_profile._state.update(every=1, first_step=4, pgle_runs=3)
    assert [s for s in range(4, 10) if moe_profile.profiled(s)] == [8, 9]
  finally:
    moe_profile._state.update(every=0, first_step=None, pgle_runs=0)


def test_off_by_default_patches_no_profiler_hook():
  import patches
  from maxtext.common import profiler

  from MaxText.config import ForkConfig

  before = profiler.Profiler.maybe_activate_profiler
  try:
    applied = patches.apply_all(ForkConfig())
    assert "moe_profile" not in applied and profiler.Profiler.maybe_activate_profiler is before
    assert "moe_profile" in patches.apply_all(ForkConfig(moe_profile_every_n_steps=3))
    assert profiler.Profiler.maybe_activate_profiler is not before
  finally:
    patches.undo_all()
  assert profiler.Profiler.maybe_activate_profiler is before


@pytest.mark.parametrize("value", ["-1", "two"])
def test_bad_interval_is_one_config_error_line(value):
  assert "config key 'moe_profile_every_n_steps' = " in config_error_line(TINY, f"moe_profile_every_n_steps={value}")


def test_upstream_profiler_at_the_same_time_is_one_config_error_line():
  line = config_error_line(TINY, "moe_profile_every_n_steps=2", "profiler=xplane")
  assert "'moe_profile_every_n_steps' = 2 (command line) and 'profiler' = 'xplane'" in line


@pytest.mark.slow
def test_tiny_run_writes_the_time_split(train):
  """Steps 1 and 3 of 4 are profiled (every 2nd, never the compiling step 0): their traces stay in the run
  directory and their moe_time/ scalars reach TensorBoard. On CPU, xprof has no op statistics and events
  carry no named scope, so only the plumbing and the arithmetic are checked here, not the categories."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  result = train(TINY, "steps=4", "enable_checkpointing=false", "moe_block=ours", "moe_profile_every_n_steps=2")
  assert result.returncode == 0, result.stderr[-3000:]
  traces = sorted(glob.glob(str(result.run_dir / "**" / "*.xplane.pb"), recursive=True))
  assert len(traces) == 2 and all(f"/moe_profile/step_{s}/" in t for s, t in zip((1, 3), traces)), traces
  events = glob.glob(str(result.run_dir / "tensorboard" / "**" / "events.out.tfevents.*"), recursive=True)
  acc = EventAccumulator(events[0], size_guidance={"scalars": 0})
  acc.Reload()
  assert [e.step for e in acc.Scalars("moe_time/total_ms")] == [1, 3]
  for step_index in range(2):
    shares = [acc.Scalars(f"moe_time/{c}_share")[step_index].value
              for c in ("route", "dispatch", "gmm", "combine", "attention", "rest")]
    assert sum(shares) == pytest.approx(1.0, abs=1e-4)
    assert acc.Scalars("moe_time/total_ms")[step_index].value > 0
  lines = [line for line in result.stdout.splitlines() if "MoE time split, step" in line]
  assert len(lines) == 2 and "trace events" in lines[0], result.stdout[-3000:]


def test_an_unreadable_trace_costs_one_warning_not_the_run(tmp_path, capsys, monkeypatch):
  from patches import metric_logger, moe_profile

  monkeypatch.setattr(metric_logger, "_extra", {})  # another test in this worker may have queued step 3 (data/pass)

  trace = tmp_path / "step_3" / "plugins" / "profile" / "x" / "host.xplane.pb"
  trace.parent.mkdir(parents=True)
  trace.write_bytes(b"not an XSpace")
  assert moe_profile.report(3, tmp_path / "step_3") is None
  lines = [line for line in capsys.readouterr().out.splitlines() if "MoE time split" in line]
  assert len(lines) == 1 and "WARNING" in lines[0] and "not converted" in lines[0]
  assert 3 not in metric_logger._extra  # no scalars queued for the step
