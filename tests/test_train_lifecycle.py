"""What clusters do to a run, on the tiny config: divergence, preemption (and a
plain exit) resumed exactly, a twin job, a full disk, resumes that change the
model or the schedule."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, BackgroundRun, TrainResult, run_train

TINY = "configs/deepseek3-tiny.yml"


def _one_line(result: TrainResult, code: int, expected: str) -> str:
  """Exactly one `maxtext-moe:` line on stderr, no Python traceback, the documented code."""
  lines = [line for line in result.stderr.splitlines() if line.startswith("maxtext-moe:")]
  assert result.returncode == code, (result.returncode, result.stderr[-3000:])
  assert len(lines) == 1 and expected in lines[0], result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  return lines[0]


def _checkpoints(result: TrainResult) -> list[int]:
  root = result.run_dir / "checkpoints"
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


@pytest.mark.slow
def test_a_diverging_run_never_saves_a_non_finite_state_and_resumes_from_the_last_finite(tmp_path):
  args = (TINY, "learning_rate=1e6", "checkpoint_period=1", "steps=6", "learning_rate_schedule_steps=6")
  first = run_train(tmp_path, *args)
  line = _one_line(first, 4, "non-finite state: step ")
  assert "loss" in line and "gradient norm" in line and "is finite" in line
  saved = _checkpoints(first)
  assert saved and max(saved) < 5, saved
  # Every checkpoint on disk restores to a finite state: rerun resumes from the last and stops at the same step.
  again = run_train(tmp_path, *args)
  assert f"resuming from checkpoint step {max(saved)}" in again.stdout
  assert _one_line(again, 4, "non-finite state: step ") == line
  assert _checkpoints(again) == saved
  # The stop is recorded for nonfinite_skip_batches; on synthetic data (one fixed batch) there is nothing to skip.
  step = int(line.split("non-finite state: step ")[1].split(":")[0])
  record = json.loads((first.run_dir / "maxtext-moe" / "nonfinite.json").read_text())
  assert record == {"step": step, "checkpoint": max(saved), "batches_past_checkpoint": step - max(saved)}
  assert "nonfinite_skip_batches=K skips them" in again.stdout
  skip = run_train(tmp_path, *args, "nonfinite_skip_batches=1")
  assert "no batches skipped: synthetic data is one fixed batch, so skipping changes nothing" in skip.stdout
  assert _one_line(skip, 4, "non-finite state: step ") == line


def _train_and_signal(tmp_path, sig, times: int, *args: str, at_step: int = 3, run_name: str = "run"):
  """Starts a run, sends `sig` `times` when `[progress] step at_step/` appears."""
  with BackgroundRun(tmp_path, *args, run_name=run_name) as run:
    run.wait_for(f"[progress] step {at_step}/")
    for _ in range(times):
      run.send_signal(sig)
      time.sleep(0.2)
    return run.finish(timeout=300)


@pytest.mark.slow
def test_preemption_saves_at_the_next_step_and_every_resume_is_exact(tmp_path):
  """SIGTERM and SIGUSR1 each save the step in flight (exit 75), and the resume trains on from the next; a run that
  ended at `steps` resumes from its last checkpoint. Each stop + resume gives one unbroken run's losses, bit for bit
  (one unbroken run for all three: each parametrized signal and tests/test_train.py trained their own)."""
  common = (TINY, "checkpoint_period=100", "learning_rate_schedule_steps=12")
  reference = run_train(tmp_path, *common, "steps=12", run_name="unbroken")
  assert reference.returncode == 0, reference.stderr[-3000:]
  unbroken = reference.losses()
  assert sorted(unbroken) == list(range(12))
  for sig in (signal.SIGTERM, signal.SIGUSR1):
    stopped = _train_and_signal(tmp_path, sig, 1, *common, "steps=12", run_name=sig.name)
    line = _one_line(stopped, 75, f"stopped by {sig.name} after step ")
    step = stopped.summary["stopped"]["saved"]
    assert f"checkpoint of step {step} saved" in line and step < 11
    assert max(_checkpoints(stopped)) == step  # the step the signal arrived in, not the last periodic one (0)
    stopped_losses = stopped.losses()  # summary.json describes the latest invocation
    assert max(stopped_losses) == step  # the summary holds every step trained
    resumed = run_train(tmp_path, *common, "steps=12", run_name=sig.name)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert min(resumed.losses()) == step + 1  # no step lost, none repeated
    assert {**stopped_losses, **resumed.losses()} == unbroken, sig.name  # bit-identical on CPU
  # A run that ended at steps=5 (its last checkpoint, step 4) resumed to steps=12: steps 5-11, the unbroken losses.
  first = run_train(tmp_path, *common, "steps=5", run_name="exited")
  assert first.returncode == 0, first.stderr[-3000:]
  first_losses = first.losses()  # read before the resume writes the run's summary.json anew
  assert sorted(first_losses) == [0, 1, 2, 3, 4]
  second = run_train(tmp_path, *common, "steps=12", run_name="exited")
  assert second.returncode == 0, second.stderr[-3000:]
  assert sorted(second.losses()) == list(range(5, 12)), "the second run must continue from the checkpoint, not restart"
  assert {**first_losses, **second.losses()} == unbroken  # exact on CPU


@pytest.mark.slow
def test_first_sigint_stops_cleanly_and_a_second_aborts(tmp_path):
  once = _train_and_signal(tmp_path, signal.SIGINT, 1, TINY, "steps=30", "checkpoint_period=100", run_name="once")
  _one_line(once, 75, "stopped by SIGINT")
  twice = _train_and_signal(tmp_path, signal.SIGINT, 2, TINY, "steps=30", "checkpoint_period=100", run_name="twice")
  _one_line(twice, 130, "aborted by a second SIGINT")
  assert not (twice.run_dir / "maxtext-moe" / "lock.json").exists()


@pytest.mark.slow
def test_a_twin_job_is_refused_while_the_first_runs(tmp_path):
  with BackgroundRun(tmp_path, TINY, "steps=100000", "checkpoint_period=100000", run_name="twin") as first:
    first.wait_for("[progress] step 2/")
    second = run_train(tmp_path, TINY, "steps=200", run_name="twin")
    _one_line(second, 5, f"in use by host {os.uname().nodename} pid {first.proc.pid} since")
    first.send_signal(signal.SIGTERM)
    assert first.finish(timeout=300).returncode == 75  # the first job was never disturbed


@pytest.mark.slow
def test_a_full_disk_keeps_the_last_checkpoint_and_says_how_much_was_needed(tmp_path):
  """A 6 MiB tmpfs holds one checkpoint (3.3 MB) of the tiny model, not two."""
  if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], check=False).returncode:
    pytest.skip("needs `unshare -m` (a private mount namespace) to mount a small tmpfs")
  disk = tmp_path / "disk"
  disk.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  train = (f"mount -t tmpfs -o size=6m tmpfs {disk} && exec {sys.executable} -m MaxText.train {TINY} steps=6 "
           f"checkpoint_period=2 base_output_directory={disk} run_name=full jax_cache_dir={tmp_path}/jax_cache "
           f"&& true; ls {disk}/full/checkpoints")
  proc = subprocess.run(["unshare", "-m", "sh", "-c", train], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  result = TrainResult(proc.returncode, proc.stdout, proc.stderr, disk / "full")
  line = _one_line(result, 6, f"checkpoint of step 2 not written to {disk}/full/checkpoints: it needs about ")
  assert "MiB are free; the last complete checkpoint (step 0) is kept" in line


# Bad input on the command line (per_device_batch_size=0.5, hardware=tpu, moe_block=te, checkpoint_period=0): one
# line in its words, exit 2, nothing written: the reliability harness's config cases
# (tests/test_reliability_cases.py, test_every_case_that_stops_before_training_is_clean); the command end to end:
# tests/test_train.py's test_bad_input_fails_fast_with_one_clear_line.


@pytest.mark.slow
def test_resumes_that_change_the_model_or_the_schedule_are_refused(tmp_path):
  first = run_train(tmp_path, TINY, "steps=3", "checkpoint_period=2")
  assert first.returncode == 0, first.stderr[-3000:]
  _one_line(run_train(tmp_path, TINY, "steps=3"), 0, "already finished: its last checkpoint is step 2 and steps=3")
  line = _one_line(run_train(tmp_path, TINY, "steps=6"), 2, "would change its learning-rate schedule")
  assert "learning_rate_schedule_steps 3 -> 6" in line and "pin learning_rate_schedule_steps=3" in line
  line = _one_line(run_train(tmp_path, TINY, "steps=6", "learning_rate_schedule_steps=3", "base_emb_dim=32"), 2,
                   "the model's shape changed: '")
  assert "(64,) float32 in the checkpoint but (32,) float32" in line and "base_emb_dim 64 -> 32" in line
  resumed = run_train(tmp_path, TINY, "steps=5", "learning_rate_schedule_steps=3")  # pinned: continues
  assert resumed.returncode == 0 and sorted(resumed.losses()) == [3, 4], resumed.stderr[-3000:]
  assert all(math.isfinite(v) for v in resumed.losses().values())


@pytest.mark.slow
def test_async_saves_resume_from_the_last_checkpoint_after_an_exit_and_after_a_sigkill(tmp_path):
  """async_checkpointing=true (upstream's default, the 671B recipes'): orbax commits each save in the background,
  and every record of ours must outlive that (they were dropped as stale while orbax still wrote
  <step>.orbax-checkpoint-tmp, so each resume set every checkpoint aside and retrained from step 0)."""
  from MaxText.checkpoints import resume  # pylint: disable=import-outside-toplevel

  common = (TINY, "async_checkpointing=true", "checkpoint_period=4", "learning_rate_schedule_steps=40")
  first = run_train(tmp_path, *common, "steps=9")
  assert first.returncode == 0 and resume.checkpoint_steps(first.run_dir) == [0, 4, 8], first.stderr[-3000:]
  with BackgroundRun(tmp_path, *common, "steps=40") as run:
    run.wait_for("[maxtext-moe] checkpoint 12 saved")  # committed; the next saves may be in flight at the kill
    run.send_signal(signal.SIGKILL)
    killed = run.finish(timeout=300)
  assert "resuming from checkpoint step 8" in killed.stdout and "is not a checkpoint" not in killed.stdout
  last = max(resume.checkpoint_steps(killed.run_dir))
  assert last >= 12, resume.unusable_steps(killed.run_dir)
  resumed = run_train(tmp_path, *common, f"steps={last + 3}")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resuming from checkpoint step {last}" in resumed.stdout and "is not a checkpoint" not in resumed.stdout
  assert sorted(resumed.losses()) == [last + 1, last + 2]
