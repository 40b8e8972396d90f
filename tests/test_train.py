"""The fork trains: the tiny DeepSeek-V3 on CPU through `python -m MaxText.train`."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

from tensorboard.backend.event_processing import event_accumulator

import pytest

from conftest import config_error_line, run_rejected, run_train
from MaxText.console import progress

TINY = "configs/deepseek3-tiny.yml"


def _tensorboard_scalars(run_dir: Path, tag: str) -> dict[int, float]:
  event_files = list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
  assert event_files, f"no TensorBoard event file under {run_dir / 'tensorboard'}"
  acc = event_accumulator.EventAccumulator(str(event_files[0].parent), size_guidance={"scalars": 0})
  acc.Reload()
  assert tag in acc.Tags()["scalars"], f"{tag} not in {acc.Tags()['scalars']}"
  return {e.step: e.value for e in acc.Scalars(tag)}


@pytest.mark.slow
def test_tiny_run_trains_logs_and_checkpoints(tmp_path):
  result = run_train(tmp_path, TINY, "steps=5", "checkpoint_period=2")
  assert result.returncode == 0, result.stderr[-3000:]

  losses = result.losses()
  assert sorted(losses) == [0, 1, 2, 3, 4]
  assert all(math.isfinite(v) for v in losses.values())
  assert losses[4] < losses[0] - 0.1, losses  # a fixed synthetic batch: loss must fall

  tb_loss = _tensorboard_scalars(result.run_dir, "learning/loss")
  assert sorted(tb_loss) == [0, 1, 2, 3, 4]
  assert abs(tb_loss[4] - losses[4]) < 1e-4

  saved = sorted(int(p.name) for p in (result.run_dir / "checkpoints").iterdir() if p.name.isdigit())
  assert saved == [0, 2, 4], saved  # every checkpoint_period steps, plus the last step

  assert "[progress] step 5/5 (100%)" in result.stdout
  assert "ETA" in result.stdout
  assert "[maxtext-moe] run summary: 5 steps (0-4) in " in result.stdout
  summary = result.summary  # MaxText's own per-step metrics, medians after warm-up
  assert summary["steps_completed"] == 5 and summary["median_step_time_s"] > 0
  assert summary["median_tokens_per_s_per_device"] > 0 and summary["median_tflops_per_device"] > 0
  assert f"  run directory {result.run_dir}" in result.stdout
  effective = (result.run_dir / "maxtext-moe" / "effective_config.json").read_text()
  assert '"steps": 5' in effective

  # Long phases say what they are doing: the compile before the first step, and each save's size and time.
  lines = result.stdout.splitlines()
  compiling = lines.index("[maxtext-moe] compiling the train step...")
  (compiled,) = [i for i, line in enumerate(lines) if line.startswith("[maxtext-moe] compiled the train step in ")]
  first_step = next(i for i, line in enumerate(lines) if line.startswith("[progress] step 1/"))
  assert compiling < compiled < first_step
  seconds = float(lines[compiled].split(" in ")[1].removesuffix(" s"))
  assert seconds > 0 and abs(summary["compile_s"] - seconds) < 0.06
  assert f"(the train step compiled in {seconds:.1f} s)" in result.stdout
  saves = summary["checkpoint_saves"]
  assert [s["step"] for s in saves] == saved
  for s in saves:  # the size is the finished step directory's
    assert s["bytes"] == progress.dir_bytes(result.run_dir / "checkpoints" / str(s["step"])) > 0
    assert f"[maxtext-moe] checkpoint {s['step']} saved: {progress.fmt_bytes(s['bytes'])} in {s['seconds']:.1f} s" in lines
  assert f"  checkpoints   3 saved in {result.run_dir / 'checkpoints'}; the last, step 4: " in result.stdout


@pytest.mark.slow
def test_the_quick_start_prints_one_line_a_step_and_at_most_40_in_all(tmp_path):
  """scripts/train.sh's run (the tiny config, 20 steps): our [progress] line once a step, none of upstream's absl
  or C++ log lines (upstream's own step line among them), the MFU's reason once, and at most 40 lines in all;
  the summary and the heatmap still there."""
  result = run_train(tmp_path, TINY)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines() + result.stderr.splitlines()
  assert len(lines) <= 40, "\n".join(lines)
  progress_lines = [line for line in lines if line.startswith("[progress] step ")]
  assert [line.split()[2] for line in progress_lines] == [f"{k}/20" for k in range(1, 21)]
  assert sum("no dense bf16 peak" in line for line in lines) == 1 and "no dense bf16 peak" in progress_lines[0]
  assert not [line for line in lines if re.match(r"[IWE]\d{4} ", line)]  # absl's and XLA's log format
  assert not [line for line in lines if "completed step" in line or "Memstats" in line or "TFLOPs" in line]
  assert lines[-6].startswith("[maxtext-moe] run summary: 20 steps (0-19) in ")
  assert any(line.startswith("[maxtext-moe] MoE load at step 20,") for line in lines)


def _files_under(root: Path) -> set[Path]:
  return {p for p in root.rglob("*")} if root.exists() else set()


@pytest.mark.slow
def test_run_writes_only_under_its_run_directory(tmp_path):
  """Upstream's defaults dump HLO to /tmp/xla_dump and cache compiles in ~/jax_cache."""
  home, cwd = tmp_path / "home", tmp_path / "cwd"
  home.mkdir()
  cwd.mkdir()
  started = time.time()
  result = run_train(tmp_path, str(Path(__file__).parent.parent / TINY), "steps=2", "enable_checkpointing=false",
                     env={"HOME": str(home)}, cwd=cwd, shared_cache=False)
  assert result.returncode == 0, result.stderr[-3000:]

  assert _files_under(home) == set(), f"written to $HOME: {sorted(_files_under(home))}"
  assert list(cwd.iterdir()) == [], f"written to the working directory: {list(cwd.iterdir())}"
  fresh_dumps = [p for p in _files_under(Path("/tmp/xla_dump")) if p.stat().st_mtime >= started]
  assert fresh_dumps == [], f"HLO dumped outside the run directory: {fresh_dumps[:3]}"
  written = {p.relative_to(tmp_path).parts[0] for p in _files_under(tmp_path) if p.is_file()}
  assert written == {"outputs"}, written
  assert (result.run_dir / "jax_cache").is_dir()  # the compile cache lives with the run


@pytest.mark.slow
def test_hlo_dump_lands_in_the_run_directory(tmp_path):
  started = time.time()
  result = run_train(tmp_path, TINY, "steps=2", "enable_checkpointing=false", "dump_hlo=true")
  assert result.returncode == 0, result.stderr[-3000:]
  dumped = [p.name for p in (result.run_dir / "xla_dump").glob("*jit_train_step*after_optimizations.txt")]
  assert dumped, f"no optimized HLO of jit_train_step under {result.run_dir / 'xla_dump'}"
  fresh_dumps = [p for p in _files_under(Path("/tmp/xla_dump")) if p.stat().st_mtime >= started]
  assert fresh_dumps == [], f"HLO dumped outside the run directory: {fresh_dumps[:3]}"


# A run that ended at `steps`, resumed with more, gives an unbroken run's losses bit for bit:
# tests/test_train_lifecycle.py's test_preemption_saves_at_the_next_step_and_every_resume_is_exact, beside the
# resumes after SIGTERM and SIGUSR1 (one unbroken run for the three).


def test_bad_input_fails_fast_with_one_clear_line(tmp_path):
  """The command end to end for one bad key: exit 2, its one line, no run directory, in seconds. Every config error
  takes this path (MaxText/run/main.py), so the other bad values are held to their line by the loader alone."""
  started = time.monotonic()
  result = run_rejected(tmp_path, "stepz=3", run_name="bad")
  assert result.returncode == 2, result.stderr[-2000:]
  error_lines = [line for line in result.stderr.splitlines() if line.startswith("maxtext-moe:")]
  assert error_lines == ["maxtext-moe: config error: unknown config key 'stepz' (command line); did you mean "
                         "'steps'?"], result.stderr[-2000:]
  assert "Traceback" not in result.stderr and not result.run_dir.exists(), "a rejected config must not start a run"
  assert time.monotonic() - started < 60
  cases = {
      ("steps=abc",): "config key 'steps' = 'abc' (command line)",
      ("configs/no-such-file.yml",): "config file not found: configs/no-such-file.yml",
      ("moe_gmm_backend=cutlass",): "config key 'moe_gmm_backend' = 'cutlass'",
  }
  for args, expected in cases.items():
    assert expected in config_error_line(*args), args


def test_unknown_key_in_yaml_names_the_file(tmp_path):
  cfg = tmp_path / "broken.yml"
  cfg.write_text("base_config: deepseek3-tiny.yml\nnum_expertz: 4\n")
  assert f"unknown config key 'num_expertz' ({cfg}); did you mean 'num_experts'?" in config_error_line(str(cfg))


def test_the_wheel_carries_the_shipped_configs(tmp_path):
  """An installed package (wheelhouse, container) runs the default config with no checkout."""
  import subprocess
  import sys
  import zipfile

  from MaxText import config

  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                  str(Path(__file__).parent.parent)], check=True, capture_output=True)
  (wheel,) = tmp_path.glob("maxtext_moe-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  assert "MaxText/configs/deepseek3-tiny.yml" in names
  assert "MaxText/configs/models/deepseek3-tiny.yml" in names  # its base_config
  assert "MaxText/configs/bench/proxy-1xh200.yml" in names
  assert config.DEFAULT_CONFIG == Path(config.__file__).resolve().parent.parent / "configs" / "deepseek3-tiny.yml"
