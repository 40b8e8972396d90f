"""A run's lifecycle without training: config values upstream accepts, the
run-directory lock, what a resume may change, stop signals, storage errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import patches
from MaxText import config as fork_config
from MaxText.run import lifecycle
from MaxText.checkpoints import resume
from MaxText.config import command_line
from MaxText.config import environment
from MaxText.run import main as train
from patches import checkpoint_guard, checkpoint_restore

TINY = str(Path(__file__).resolve().parent.parent / "configs/deepseek3-tiny.yml")


@pytest.fixture(scope="module")
def upstream_patched():
  from patches import config_errors  # pylint: disable=import-outside-toplevel

  patches.apply_module(config_errors)  # upstream's config errors raise instead of exiting
  yield
  patches.undo_module(config_errors)


# Each: an override upstream 0.2.5 accepts (the run then fails with a
# traceback, at the earliest after compiling), and what our line must say.
BAD_VALUES = {
    "per_device_batch_size=0": "'per_device_batch_size' = 0",
    "per_device_batch_size=-2": "'per_device_batch_size' = -2",
    "num_experts_per_tok=16": "'num_experts_per_tok' = 16 is more than num_experts = 8",
    "attention=nosuch": "'attention' = 'nosuch'",
    "vocab_size=-1": "'vocab_size' = -1",
    "max_target_length=0": "'max_target_length' = 0",
    "checkpoint_period=0": "'checkpoint_period' = 0",
    "base_output_directory=/proc/maxtext-out": "'base_output_directory' = '/proc/maxtext-out'",
    "base_output_directory=/no/such/parent/out": "neither it nor its parent '/no/such/parent' exists",
}


@pytest.mark.parametrize("override", sorted(BAD_VALUES))
def test_values_upstream_accepts_are_refused_with_the_key(override, upstream_patched, tmp_path):  # pylint: disable=unused-argument,redefined-outer-name
  args = [TINY, f"base_output_directory={tmp_path}", override]
  run = fork_config.load(args)
  with pytest.raises(fork_config.ConfigError, match=BAD_VALUES[override].replace("(", r"\(").replace(")", r"\)")):
    environment.validate_with_upstream(run)


def test_the_tiny_config_itself_passes_the_value_checks(upstream_patched, tmp_path):  # pylint: disable=unused-argument,redefined-outer-name
  environment.validate_with_upstream(fork_config.load([TINY, f"base_output_directory={tmp_path}/new"]))
  assert not (tmp_path / "new").exists()  # checked, not created


def test_base_config_on_the_command_line_is_refused():
  with pytest.raises(fork_config.ConfigError, match="'base_config=models/deepseek3-tiny.yml' on the command line"):
    fork_config.load([TINY, "base_config=models/deepseek3-tiny.yml"])


def test_a_dispatch_backend_without_our_block_is_refused():
  with pytest.raises(fork_config.ConfigError, match="'moe_block' = 'upstream' .* and 'moe_dispatch_backend' = 'te_ncclep' .* contradict"):
    fork_config.load([TINY, "moe_block=upstream", "moe_dispatch_backend=te_ncclep"])
  fork_config.load([TINY, "moe_dispatch_backend=te_ncclep", "moe_block=ours"])  # the pair is fine


def test_te_moe_block_in_one_process_is_refused_before_anything_starts():
  """TE's MoE block bootstraps NCCL EP, which refuses a world of one process (measured on the H200: a
  ValueError masked by upstream's TE context); ours refuses first, in one line naming the key."""
  from MaxText.config import checks as config_checks  # pylint: disable=import-outside-toplevel

  run = fork_config.load([TINY, "moe_block=te", "hardware=cpu"])
  config = types.SimpleNamespace(hardware="cpu", per_device_batch_size=1)
  with pytest.raises(fork_config.ConfigError, match=r"'moe_block' = 'te' .* >= 2 processes .* this run has 1 process"):
    config_checks.check_devices(run, config)
  config_checks.check_devices(fork_config.load([TINY, "moe_block=ours", "hardware=cpu"]), config)


# --- the lock ---


def test_a_second_job_is_refused_with_the_holder_named(tmp_path):
  first = lifecycle.RunLock.for_run(tmp_path)
  first.acquire()
  try:
    held = json.loads(first.path.read_text())
    assert held["host"] == socket.gethostname() and held["pid"] == os.getpid() and held["started"]
    with pytest.raises(lifecycle.RunLocked, match=f"in use by host {socket.gethostname()} pid {os.getpid()} since"):
      lifecycle.RunLock.for_run(tmp_path).acquire()
  finally:
    first.release()
  assert not first.path.exists()
  second = lifecycle.RunLock.for_run(tmp_path)
  second.acquire()  # free again once released
  second.release()


def test_a_lock_of_a_dead_process_is_taken_over(tmp_path, capsys):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                        check=True)
  lock = lifecycle.RunLock.for_run(tmp_path)
  lock.path.parent.mkdir(parents=True)
  lock.path.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "started": "then"}))
  lock.acquire()
  lock.release()
  assert f"its process {int(dead.stdout)} on this host is gone" in capsys.readouterr().out


def test_a_lock_not_refreshed_from_another_host_goes_stale(tmp_path):
  lock = lifecycle.RunLock.for_run(tmp_path)
  lock.path.parent.mkdir(parents=True)
  lock.path.write_text(json.dumps({"host": "node-that-died", "pid": 1, "started": "then"}))
  with pytest.raises(lifecycle.RunLocked, match="node-that-died"):
    lifecycle.RunLock.for_run(tmp_path).acquire()  # fresh: refused
  old = time.time() - lifecycle.STALE_AFTER_S - 1
  os.utime(lock.path, (old, old))
  lock.acquire()
  lock.release()


@pytest.mark.parametrize("content", ["", '{"host": "h", "pi', '"pid 12"', '[1, 2]', '{"host": "h", "pid": "12"}',
                                     '{"host": "h", "pid": -1}', '{"pid": 12}'])
def test_an_empty_or_torn_lock_is_taken_over_at_once(tmp_path, capsys, content):
  """A lock appears whole (hard link of a written file), so a torn one was never a live job's: no 90 s wait,
  no 'host None pid None'."""
  lock = lifecycle.RunLock.for_run(tmp_path)
  lock.path.parent.mkdir(parents=True)
  lock.path.write_text(content)
  started = time.monotonic()
  lock.acquire()
  try:
    assert time.monotonic() - started < 5
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert "taking over a stale lock (lock.json is empty or torn, not a lock record" in capsys.readouterr().out
  finally:
    lock.release()
  assert not lock.path.exists()


def test_a_directory_in_place_of_the_lock_is_one_line_naming_it(tmp_path):
  lock = lifecycle.RunLock.for_run(tmp_path)
  lock.path.mkdir(parents=True)
  with pytest.raises(fork_config.ConfigError, match=f"{lock.path} is a directory, not a run lock; remove it"):
    lock.acquire()


def test_a_lock_stamped_in_the_future_says_the_real_wait(tmp_path):
  lock = lifecycle.RunLock.for_run(tmp_path)
  lock.path.parent.mkdir(parents=True)
  lock.path.write_text(json.dumps({"host": "node-ahead", "pid": 7, "started": "then"}))
  ahead = time.time() + 3600
  os.utime(lock.path, (ahead, ahead))
  with pytest.raises(lifecycle.RunLocked, match=r"its time stamp is 3\d\d\d s in the future \(clocks differ\?\).*"
                                                r"wait 3[67]\d\d s for the lock to go stale"):
    lock.acquire()


def test_a_lock_that_cannot_be_written_leaves_no_lock_behind(tmp_path, monkeypatch):
  """A full disk at start: the write seam raises ENOSPC (as the tmpfs of tests/test_train_lifecycle.py does)."""
  import errno  # pylint: disable=import-outside-toplevel

  real = Path.write_text

  def full(self, *args, **kwargs):
    if self.name.startswith("lock.json"):
      real(self, "")  # the file is created, then the write fails
      raise OSError(errno.ENOSPC, "No space left on device", str(self))
    return real(self, *args, **kwargs)

  monkeypatch.setattr(Path, "write_text", full)
  lock = lifecycle.RunLock.for_run(tmp_path)
  with pytest.raises(OSError) as e:
    lock.acquire()
  assert e.value.errno == errno.ENOSPC and checkpoint_guard.no_space_reason(e.value).startswith("No space")
  assert list(lock.path.parent.iterdir()) == []  # neither lock.json nor its temporary file


# --- resume ---


def _config(**kw):
  values = {"steps": 10, "learning_rate": 1e-3, "learning_rate_schedule_steps": 10, "warmup_steps_fraction": 0.1,
            "enable_checkpointing": True, "dataset_type": "synthetic", "vocab_size": 1024}
  return types.SimpleNamespace(**{**values, **kw})


def _with_checkpoints(run_dir: Path, *steps: int, config=None) -> None:
  """Step directories as a save leaves them (orbax's commit marker and tree metadata, our record), the run's
  schedule and data records (those of `config`), and an unfinished save, which is not a checkpoint."""
  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel

  for step in steps:
    (run_dir / "checkpoints" / str(step) / "items").mkdir(parents=True)
    (run_dir / "checkpoints" / str(step) / "items" / "_METADATA").write_text("{}")
    (run_dir / "checkpoints" / str(step) / checkpoint_records.COMMIT_MARKER).write_text("committed")
    checkpoint_records.write_record(run_dir, step, [], [])
  (run_dir / "checkpoints" / f"{max(steps) + 1}.orbax-checkpoint-tmp-123").mkdir()
  resume.record_schedule(run_dir, config or _config())
  resume.record_data(run_dir, config or _config())


def test_resume_refuses_a_changed_schedule_and_names_the_pin(tmp_path):
  _with_checkpoints(tmp_path, 0, 4)
  assert resume.check_resume(tmp_path, _config(), False) == (4, [])
  with pytest.raises(fork_config.ConfigError, match=r"learning_rate_schedule_steps 10 -> 20\).*pin "
                                                    r"learning_rate_schedule_steps=10 to continue"):
    resume.check_resume(tmp_path, _config(steps=20, learning_rate_schedule_steps=20), False)
  step, warnings = resume.check_resume(tmp_path, _config(steps=20, learning_rate_schedule_steps=20), True)
  assert step == 4 and "WARNING" in warnings[0]
  resume.check_resume(tmp_path, _config(steps=20), False)  # more steps on the pinned schedule: fine
  # The hint names the key that changed, with its recorded value.
  with pytest.raises(fork_config.ConfigError, match=r"\(learning_rate 0.001 -> 0.002\).*pin learning_rate=0.001 "):
    resume.check_resume(tmp_path, _config(learning_rate=2e-3), False)


def test_after_a_non_finite_stop_the_advised_lower_learning_rate_resumes_with_a_warning(tmp_path):
  _with_checkpoints(tmp_path, 0, 4)
  resume.record_nonfinite(tmp_path, 6, None)  # exit 4 at step 6, its advice: lower learning_rate
  step, warnings = resume.check_resume(tmp_path, _config(learning_rate=5e-4), False)
  assert step == 4 and warnings == ["WARNING: learning_rate 0.001 -> 0.0005 after the non-finite stop at step 6: "
                                    "steps up to 4 followed the old rate, steps from 5 the new one"]
  with pytest.raises(fork_config.ConfigError, match="pin learning_rate=0.001"):  # higher: not the remedy
    resume.check_resume(tmp_path, _config(learning_rate=2e-3), False)
  with pytest.raises(fork_config.ConfigError, match="pin learning_rate=0.001 warmup_steps_fraction=0.1"):
    resume.check_resume(tmp_path, _config(learning_rate=5e-4, warmup_steps_fraction=0.2), False)


@pytest.mark.parametrize("record", ["schedule.json", "data.json"])
@pytest.mark.parametrize("damage", ["missing", "garbled", "a list"])
def test_a_missing_or_garbled_resume_record_is_refused_unless_allowed(tmp_path, record, damage):
  _with_checkpoints(tmp_path, 0, 4)
  path = tmp_path / resume.RUN_FILES / record
  if damage == "missing":
    path.unlink()
  else:
    path.write_text('{"learning_rate": 0.0' if damage == "garbled" else "[1, 2]")
  key = "allow_schedule_change" if record == "schedule.json" else "allow_data_change"
  why = {"missing": "is missing", "garbled": "cannot be read", "a list": "is not a JSON object"}[damage]
  with pytest.raises(fork_config.ConfigError, match=f"record {path} {why}.*set {key}=true"):
    resume.check_resume(tmp_path, _config(), False, False)
  step, warnings = resume.check_resume(tmp_path, _config(), True, True)
  assert step == 4 and len(warnings) == 1 and f"{key}=true: this run's" in warnings[0]


def test_a_resume_on_other_data_is_refused_naming_what_changed(tmp_path):
  _with_checkpoints(tmp_path, 0, 4)  # a synthetic-data run
  grain = _config(dataset_type=types.SimpleNamespace(value="grain"), grain_train_files="/data/*.arrayrecord",
                  grain_file_type="arrayrecord", grain_train_mixture_config_path="", train_data_columns=["text"],
                  tokenizer_type="sentencepiece", tokenizer_path="/tok/llama2", vocab_size=32000)
  with pytest.raises(fork_config.ConfigError, match=r"would train on other data \(dataset_type 'synthetic' -> "
                                                    r"'grain', vocab_size 1024 -> 32000, grain_train_files"):
    resume.check_resume(tmp_path, grain, False, False)
  step, warnings = resume.check_resume(tmp_path, grain, False, True)
  assert step == 4 and warnings[0].startswith("WARNING: the data changes on resume (dataset_type 'synthetic'")
  resume.record_data(tmp_path, grain)
  assert resume.check_resume(tmp_path, _config(**{**vars(grain), "steps": 10}), False) == (4, [])


def test_checkpointing_off_on_a_run_with_checkpoints_is_refused(tmp_path):
  _with_checkpoints(tmp_path, 0, 4)
  with pytest.raises(fork_config.ConfigError, match=r"'enable_checkpointing' = False: run .* holds checkpoints up to "
                                                    r"step 4, which this run would neither resume nor extend"):
    resume.check_resume(tmp_path, _config(enable_checkpointing=False), False)
  assert resume.check_resume(tmp_path / "other", _config(enable_checkpointing=False), False) == (None, [])


def test_only_committed_and_recorded_step_directories_count_and_the_rest_are_set_aside(tmp_path):
  _with_checkpoints(tmp_path, 0, 4, 8)
  root = tmp_path / "checkpoints"
  (root / "99").mkdir()  # a stray directory
  (root / "8" / "commit_success.txt").unlink()  # a save that never committed
  (root / "4" / "items" / "_METADATA").unlink()
  (root / "12" / "items").mkdir(parents=True)
  (root / "12" / "items" / "_METADATA").write_text("{}")
  (root / "12" / "commit_success.txt").write_text("committed")  # no record of ours
  assert resume.checkpoint_steps(tmp_path) == [0]
  assert resume.check_resume(tmp_path, _config(steps=100), False) == (0, [])  # not "already finished" at 99
  dry = resume.set_aside_unusable(tmp_path, dry_run=True)
  assert [p.name for p in sorted(root.iterdir())] == ["0", "12", "4", "8", "9.orbax-checkpoint-tmp-123", "99"]
  incomplete, *lines = resume.set_aside_unusable(tmp_path)
  # The save cut short says so first (MaxText/checkpoints/resume.py incomplete_saves), then each set-aside folder.
  assert incomplete == ("WARNING: the newest save, of step 9, was incomplete (checkpoints/9.orbax-checkpoint-tmp-123: "
                        "the run ended while writing it) and is skipped; the run resumes from checkpoint 0")
  assert [line.split(" is not a checkpoint ")[0] for line in lines] == [
      f"WARNING: {root / str(s)}" for s in (4, 8, 12, 99)]
  assert "(its items/_METADATA is missing): set aside as 4.unusable" in lines[0]
  assert "(no orbax commit marker (commit_success.txt): the save never completed)" in lines[1]
  assert f"(no record of ours ({tmp_path}/maxtext-moe/checkpoints/12.json))" in lines[2]
  assert all("the run would set it aside" in line for line in dry[1:])
  assert sorted(p.name for p in root.iterdir()) == ["0", "12.unusable", "4.unusable", "8.unusable",
                                                    "9.orbax-checkpoint-tmp-123", "99.unusable"]
  assert (root / "4.unusable" / "items").is_dir()  # kept, only moved out of orbax's sight


def test_a_run_whose_checkpoints_predate_our_records_is_refused_with_nothing_moved(tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel

  _with_checkpoints(tmp_path, 0, 4)
  shutil.rmtree(tmp_path / resume.RUN_FILES / "checkpoints")
  with pytest.raises(fork_config.ConfigError, match=r"holds checkpoints \(0, 4\) but no records of them .*cannot be "
                                                    r"verified.*nothing was moved"):
    resume.set_aside_unusable(tmp_path)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["0", "4", "5.orbax-checkpoint-tmp-123"]


def test_rerunning_a_finished_run_says_so(tmp_path):
  _with_checkpoints(tmp_path, 0, 9)
  with pytest.raises(resume.FinishedRun, match="already finished: its last checkpoint is step 9 and steps=10"):
    resume.check_resume(tmp_path, _config(), False)
  assert resume.check_resume(tmp_path / "new", _config(), False) == (None, [])


def test_a_negative_skip_count_is_one_line_naming_the_key():
  with pytest.raises(fork_config.ConfigError, match=r"config key 'nonfinite_skip_batches' = -1 \(command line\)"):
    fork_config.load(["configs/deepseek3-tiny.yml", "nonfinite_skip_batches=-1"])


def test_the_skip_covers_the_non_finite_batch_and_follows_the_data_across_resumes(tmp_path):
  """Checkpoints 0 and 4, step 7 went non-finite: the batches of steps 5..7 must go."""
  _with_checkpoints(tmp_path, 0, 4)
  assert resume.record_nonfinite(tmp_path, 7, None) == {"step": 7, "checkpoint": 4, "batches_past_checkpoint": 3}
  assert resume.batches_to_skip(tmp_path, 4, 0) is None  # the option is off: replay
  assert resume.batches_to_skip(tmp_path, 4, 1)[0] == 3  # never fewer than through the non-finite batch
  assert resume.batches_to_skip(tmp_path, 4, 10)[0] == 10
  assert resume.batches_to_skip(tmp_path, 0, 10) is None  # the record is for checkpoint 4's position only
  # Resumed from 4 skipping 10 batches, it went non-finite again at step 6 before a new save: the data
  # iterator had read 6 - 4 + 10 = 12 batches past checkpoint 4's position.
  assert resume.record_nonfinite(tmp_path, 6, (4, 10))["batches_past_checkpoint"] == 12
  # After a save at 8 (its iterator position includes the skip), a stop at 9 is 1 batch past it.
  _with_checkpoints(tmp_path, 8)
  assert resume.record_nonfinite(tmp_path, 9, (4, 10)) == {"step": 9, "checkpoint": 8, "batches_past_checkpoint": 1}
  assert resume.batches_to_skip(tmp_path, 4, 10) is None
  assert not list((tmp_path / resume.RUN_FILES).glob("*.tmp*"))  # written atomically (temp file, then rename)


def test_a_garbled_non_finite_record_is_refused_when_a_skip_is_asked_for(tmp_path):
  _with_checkpoints(tmp_path, 0, 4)
  (tmp_path / resume.RUN_FILES / resume.NONFINITE_RECORD).write_text('{"step": 7, "checkp')
  assert resume.batches_to_skip(tmp_path, 4, 0) is None  # no skip asked for: nothing depends on it
  with pytest.raises(fork_config.ConfigError, match=r"'nonfinite_skip_batches' = 3: the record of the last non-finite "
                                                    r"stop, .*nonfinite.json, cannot be read"):
    resume.batches_to_skip(tmp_path, 4, 3)


def test_shape_difference_names_the_first_array():
  recorded = {"params/emb": [[1024, 64], "float32"], "params/out": [[64, 1024], "float32"]}
  assert checkpoint_restore.first_difference(recorded, recorded) is None
  assert checkpoint_restore.first_difference(recorded, {**recorded, "params/out": [[32, 1024], "float32"]}) == (
      "'params/out' is (64, 1024) float32 in the checkpoint but (32, 1024) float32 in the state this config builds")
  assert "'params/new' is in the state this config builds but not" in checkpoint_restore.first_difference(
      recorded, {**recorded, "params/new": [[1], "float32"]})


# --- the guard's pieces ---


def test_the_finite_check_names_params_and_optimizer_state_and_the_step_scalars(monkeypatch):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  state = {"params": {"a": jnp.ones(3), "b": jnp.array([1.0, jnp.nan])},
           "opt_state": {"mu": jnp.array([jnp.inf])}, "step": jnp.array(3)}
  monkeypatch.setattr(checkpoint_guard, "_step_scalars",
                      lambda: {"learning/loss": 7.5, "learning/raw_grad_norm": float("inf")})
  with pytest.raises(checkpoint_guard.NonFiniteState) as e:
    checkpoint_guard.check_finite(state, 12, last_saved=10)
  assert str(e.value).startswith("step 12: non-finite values after the update in 1 parameter arrays (first params/b)"
                                 " and 1 optimizer-state arrays (first opt_state/mu); this step's loss 7.5, gradient "
                                 "norm inf"), e.value
  assert "the last checkpoint, step 10, is finite" in str(e.value)
  checkpoint_guard.check_finite({"params": {"a": jnp.ones(3)}}, 12, 10)  # finite: no error


def test_storage_errors_are_recognised_through_tensorstore_wrappers():
  inner = ValueError('RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database')
  try:
    try:
      raise inner
    except ValueError as e:
      raise RuntimeError("Checkpointing failed.") from e
  except RuntimeError as outer:
    assert checkpoint_guard.no_space_reason(outer) == "no space left on the device"
  assert checkpoint_guard.no_space_reason(OSError(28, "No space left on device", "/ckpt")).startswith("No space")
  assert checkpoint_guard.no_space_reason(RuntimeError("shape mismatch")) is None


def test_first_sigint_requests_a_stop_and_the_second_aborts():
  stop = lifecycle.StopRequest()
  previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
  try:
    stop.install(multi_process=False)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)
    assert stop.signal_name == "SIGINT"
    time.sleep(lifecycle.DUPLICATE_S)  # a second one, not a copy
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.01)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def test_the_second_sigint_runs_the_cleanups_then_the_abort_in_the_handler():
  """With an abort (MaxText/run/main.py's exits 130) nothing is raised: a KeyboardInterrupt raised at an arbitrary
  bytecode can be caught on its way (CI: a SystemError inside numpy, exit 1). The lock's cleanup runs first;
  a failing cleanup does not stop the abort."""
  calls = []

  class Aborted(BaseException):
    pass

  def abort():
    calls.append("abort")
    raise Aborted  # stands in for os._exit: the handler must not go on

  stop = lifecycle.StopRequest(abort=abort)
  stop.on_abort(lambda: calls.append("release lock"))
  stop.on_abort(lambda: 1 / 0)
  stop(signal.SIGINT, None)
  assert calls == [] and stop.signal_name == "SIGINT"
  time.sleep(lifecycle.DUPLICATE_S)
  with pytest.raises(Aborted):
    stop(signal.SIGINT, None)
  assert calls == ["release lock", "abort"]


def test_a_job_signal_that_reaches_the_trainer_directly_and_through_its_keeper_is_one_delivery():
  """scancel and SLURM's time-limit USR1 signal every process of the step: the trainer, and its keeper, which
  forwards it (MaxText/run/keeper.py). The copy, milliseconds later, must not be the second SIGINT that aborts."""
  calls = []
  stop = lifecycle.StopRequest(abort=lambda: calls.append("abort"))
  stop(signal.SIGINT, None)
  stop(signal.SIGINT, None)  # the keeper's copy
  assert calls == [] and stop.signal_name == "SIGINT"
  stop(signal.SIGUSR1, None)  # another signal is never a copy
  time.sleep(lifecycle.DUPLICATE_S)
  stop(signal.SIGINT, None)  # a person's second Ctrl-C
  assert calls == ["abort"]


def test_exit_codes_are_documented():
  doc = command_line.__doc__
  for name in ("EXIT_CONFIG", "EXIT_NONFINITE", "EXIT_LOCKED", "EXIT_SAVE_FAILED", "EXIT_PREEMPTED"):
    assert f"{getattr(command_line, name):>3}  {name}" in doc
  readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
  for value in (2, 4, 5, 6, 75, 130):
    assert f"| {value} |" in readme, value


# A child under a 4 GiB address-space limit asks XLA's CPU client (the host's memory), then numpy, for 64 GB.
_HOST_OOM_CHILD = """
import json, resource
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import jax, jax.numpy as jnp, numpy as np
said = {}
try:
  jax.jit(lambda: jnp.ones((16_000_000_000,), jnp.float32))().block_until_ready()
except Exception as e:
  said["xla"] = [type(e).__name__, str(e)]
try:
  np.ones((16_000_000_000,), np.float32)
except MemoryError as e:
  said["numpy"] = [type(e).__name__, str(e)]
print(json.dumps(said))
"""


def test_out_of_host_memory_is_one_line_not_a_full_disk():
  """A real allocation past the host's limit: XLA's CPU wording and numpy's are out of memory (exit 7, one line
  naming the figure), and neither is taken for a full disk (tensorstore's storage errors share RESOURCE_EXHAUSTED;
  the loop's storage check ran first and said exit 6, 'no space left on the device')."""
  import jax  # pylint: disable=import-outside-toplevel
  from MaxText.run import disk_full  # pylint: disable=import-outside-toplevel

  proc = subprocess.run([sys.executable, "-c", _HOST_OOM_CHILD], env={**os.environ, "JAX_PLATFORMS": "cpu"},
                        capture_output=True, text=True, timeout=120, check=False)
  said = json.loads(proc.stdout.strip().splitlines()[-1])
  assert said["xla"][0] == "JaxRuntimeError" and said["numpy"][0] == "MemoryError", said
  errors = {"xla": jax.errors.JaxRuntimeError(said["xla"][1]), "numpy": MemoryError(said["numpy"][1])}
  try:  # as the loop meets it: upstream's or orbax's wrapper around XLA's error
    raise RuntimeError("train step failed") from errors["xla"]
  except RuntimeError as wrapped:
    errors["wrapped"] = wrapped
  for name, error in errors.items():
    line = train.out_of_memory_line(error, None)
    assert line is not None and line.startswith("out of host memory: ") and "\n" not in line, (name, line)
    assert "64000000000 bytes" in line or "59.6 GiB" in line, (name, line)
    assert not disk_full.is_storage_failure(error), name
  assert disk_full.is_storage_failure(ValueError('RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database'))


def test_out_of_device_memory_is_one_line_naming_xlas_figure():
  """An H200 that cannot hold the step (the shape of XLA's error there: RESOURCE_EXHAUSTED from the allocator):
  exit 7 with one line, not upstream's traceback; any other runtime error is left alone."""
  import jax  # pylint: disable=import-outside-toplevel

  error = jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8589934592 bytes.\nBufferAssignment OOM Debugging.")
  line = train.out_of_memory_line(error, None)
  assert line.startswith("out of device memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                         "8589934592 bytes.; scripts/plan.sh CONFIG")
  assert "\n" not in line and "per_device_batch_size" in line
  assert train.out_of_memory_line(jax.errors.JaxRuntimeError("INTERNAL: cuDNN failed"), None) is None
  assert command_line.EXIT_OUT_OF_MEMORY == 7
