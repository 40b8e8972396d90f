"""A run's life on a cluster: exit codes, stop signals, the run-directory lock,
and what a resume may change.

Exit codes of `python -m MaxText.train` (README "Exit codes"):
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from MaxText.config import ConfigError

EXIT_OK = 0  # trained to `steps` (or the run had already finished: nothing to do)
EXIT_ERROR = 1  # anything unexpected: upstream's traceback
EXIT_CONFIG = 2  # bad input: one line naming the key or path; nothing written for a new run
EXIT_UPSTREAM = 3  # the installed maxtext is not the one our patches were written for
EXIT_NONFINITE = 4  # the state went non-finite; it was not saved (the last checkpoint is finite)
EXIT_LOCKED = 5  # another live job holds the run directory
EXIT_SAVE_FAILED = 6  # a checkpoint could not be written (disk full, unwritable); the last good one is kept
EXIT_PREEMPTED = 75  # SIGTERM/SIGUSR1/SIGINT: checkpoint saved at the next step boundary (EX_TEMPFAIL: rerun)
EXIT_ABORTED = 130  # a second SIGINT: stopped at once, nothing saved since the last checkpoint

__doc__ += "\n".join(f"  {value:>3}  {name}" for name, value in sorted(
    ((k, v) for k, v in globals().items() if k.startswith("EXIT_")), key=lambda kv: kv[1]))

RUN_FILES = "maxtext-moe"  # our files inside the run directory


class RunLocked(RuntimeError):
  """Another live job holds the run directory."""


# --- stop signals -------------------------------------------------------------


@dataclass
class StopRequest:
  """Set by SIGTERM / SIGUSR1 / the first SIGINT; read at each step boundary.

  The training loop is never interrupted mid-step: the handler only records the
  signal, and patches/checkpoint_guard.py saves and stops at the next boundary.
  A second SIGINT aborts now: it runs the cleanups registered with `on_abort` (the
  run-directory lock) and then `abort`, which ends the process (MaxText/train.py:
  exit 130), there in the handler; without `abort` it raises KeyboardInterrupt.
  Raised at whatever bytecode the main thread was at, the exception can be caught
  on its way: in CI it became a SystemError inside numpy's dtype code, and the run
  exited 1 (CI's slow tier). In a multi-process job
  the processes must stop at the same step, so there the signal is turned into
  a SIGTERM for JAX's preemption service (jax.distributed's notifier agrees on a
  step across processes; upstream asks it at every step).
  """

  signal_name: str | None = None
  received_at: float | None = None
  multi_process: bool = False
  abort: Callable[[], None] | None = None  # the second SIGINT's exit; it must not return
  _sigints: int = field(default=0, repr=False)
  _cleanups: list[Callable[[], None]] = field(default_factory=list, repr=False)

  def on_abort(self, cleanup: Callable[[], None]) -> None:
    """Run `cleanup` before an abort (last registered, first run); its exceptions are ignored."""
    self._cleanups.append(cleanup)

  def __call__(self, signum: int, frame: Any) -> None:  # pylint: disable=unused-argument
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      self._sigints += 1
      if self._sigints > 1:
        if self.abort is None:
          raise KeyboardInterrupt
        for cleanup in reversed(self._cleanups):
          try:
            cleanup()
          except Exception:  # pylint: disable=broad-except
            pass  # the abort goes on: nothing is saved either way
        self.abort()
    if self.signal_name is None:
      self.signal_name, self.received_at = name, time.time()
      # Straight to fd 1: print could re-enter sys.stdout's buffer if the signal came mid-write (RuntimeError).
      os.write(1, (f"[maxtext-moe] {name} received: saving a checkpoint at the next step boundary, then stopping "
                   f"(exit {EXIT_PREEMPTED}){'; SIGINT again aborts at once' if signum == signal.SIGINT else ''}\n"
                   ).encode())
    if self.multi_process and signum != signal.SIGTERM:
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier, which owns SIGTERM here

  @property
  def requested(self) -> bool:
    return self.signal_name is not None

  def install(self, multi_process: bool) -> None:
    """Before jax.distributed starts: its notifier then takes SIGTERM over (multi-process)."""
    self.multi_process = multi_process
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
      signal.signal(sig, self)


# --- the run-directory lock ---------------------------------------------------

HEARTBEAT_S = 15.0
STALE_AFTER_S = 90.0  # a lock not refreshed for this long belongs to a dead job


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


@dataclass
class RunLock:
  """`<run_dir>/maxtext-moe/lock.json`: host, pid and start time of the job
  writing the run directory, refreshed every HEARTBEAT_S by a daemon thread.

  A lock is stale (and taken over, with a log line) when its process is gone on
  this host, or when it has not been refreshed for STALE_AFTER_S (a job killed
  on another node). Otherwise a second job stops with RunLocked.
  """

  path: Path
  _stop: threading.Event = field(default_factory=threading.Event, repr=False)

  @classmethod
  def for_run(cls, run_dir: Path) -> "RunLock":
    return cls(run_dir / RUN_FILES / "lock.json")

  def holder(self) -> dict[str, Any] | None:
    try:
      return json.loads(self.path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
      return None

  def stale_reason(self, held: dict[str, Any]) -> str | None:
    age = time.time() - self.path.stat().st_mtime
    if held.get("host") == socket.gethostname() and not _pid_alive(int(held.get("pid", -1))):
      return f"its process {held.get('pid')} on this host is gone"
    if age > STALE_AFTER_S:
      return f"not refreshed for {age:.0f} s"
    return None

  def acquire(self) -> None:
    self.path.parent.mkdir(parents=True, exist_ok=True)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
          "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    for _ in range(2):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        held = self.holder()
        if held is None:  # being written right now, or torn: look again shortly
          time.sleep(0.5)
          held = self.holder() or {}
        reason = self.stale_reason(held)
        if reason is None:
          age = time.time() - self.path.stat().st_mtime
          raise RunLocked(
              f"run directory {self.path.parent.parent} is in use by host {held.get('host')} pid {held.get('pid')} "
              f"since {held.get('started')} (lock refreshed {age:.0f} s ago); pick another run_name, or if that job "
              f"is dead wait {STALE_AFTER_S:.0f} s for the lock to go stale (or delete {self.path})") from None
        print(f"[maxtext-moe] taking over a stale lock ({reason}): host {held.get('host')} pid {held.get('pid')} "
              f"since {held.get('started')}", flush=True)
        self.path.unlink(missing_ok=True)
        continue
      with os.fdopen(fd, "w") as f:
        json.dump(me, f)
      threading.Thread(target=self._heartbeat, name="maxtext-moe-lock", daemon=True).start()
      return
    raise RunLocked(f"could not take the lock {self.path} (another job took it at the same moment)")

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        os.utime(self.path)
      except OSError:
        return

  def release(self) -> None:
    self._stop.set()
    held = self.holder()
    if held and held.get("pid") == os.getpid() and held.get("host") == socket.gethostname():
      self.path.unlink(missing_ok=True)


# --- what a resume may change -------------------------------------------------


def checkpoint_steps(run_dir: Path) -> list[int]:
  """Completed checkpoints (orbax renames a step's directory to its number when it is final)."""
  root = run_dir / "checkpoints"
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


# The keys that define the learning-rate schedule of upstream's optimizer
# (maxtext_utils.create_learning_rate_schedule). steps enters through
# learning_rate_schedule_steps, which upstream sets to steps when it is -1.
SCHEDULE_KEYS = ("learning_rate", "learning_rate_schedule_steps", "warmup_steps_fraction",
                 "learning_rate_final_fraction", "lr_schedule_type",
                 "wsd_decay_steps_fraction", "wsd_decay_style")


def schedule_of(config: Any) -> dict[str, Any]:
  return {k: getattr(config, k) for k in SCHEDULE_KEYS if hasattr(config, k)}


def check_resume(run_dir: Path, config: Any, allow_schedule_change: bool) -> tuple[int | None, list[str]]:
  """Before anything is written: what this invocation does to an existing run.

  Returns (the checkpoint step it resumes from or None, warnings). Raises
  ConfigError when the run has already finished or when the resume would
  silently change the learning-rate schedule of the steps already taken.
  """
  steps = checkpoint_steps(run_dir)
  if not steps:
    return None, []
  last = steps[-1]
  if last + 1 >= int(config.steps):
    raise FinishedRun(f"run {run_dir} already finished: its last checkpoint is step {last} and steps={config.steps}; "
                      f"nothing to train (raise steps to continue, or pick another run_name)")
  warnings = []
  recorded = _read_json(run_dir / RUN_FILES / "schedule.json")
  if recorded:
    now = schedule_of(config)
    changed = [k for k in SCHEDULE_KEYS if k in recorded and k in now and recorded[k] != now[k]]
    if changed:
      what = ", ".join(f"{k} {recorded[k]} -> {now[k]}" for k in changed)
      if not allow_schedule_change:
        raise ConfigError(
            f"resuming {run_dir} at step {last + 1} would change its learning-rate schedule ({what}), so the steps "
            f"already taken followed another schedule; pin learning_rate_schedule_steps="
            f"{recorded.get('learning_rate_schedule_steps')} (and the other keys) to continue it, or set "
            "allow_schedule_change=true")
      warnings.append(f"WARNING: the learning-rate schedule changes on resume ({what}); allow_schedule_change=true")
  return last, warnings


def record_schedule(run_dir: Path, config: Any) -> None:
  path = run_dir / RUN_FILES / "schedule.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(schedule_of(config), indent=2, sort_keys=True, default=str))


class FinishedRun(Exception):
  """Re-running a run that has already trained to `steps`: nothing to do."""


def _read_json(path: Path) -> dict[str, Any] | None:
  try:
    return json.loads(path.read_text())
  except (FileNotFoundError, json.JSONDecodeError):
    return None


# --- skipping the batches of a non-finite stop --------------------------------
#
# `<run_dir>/maxtext-moe/nonfinite.json`, written when a run stops at a
# non-finite step (exit 4): {"step": N, "checkpoint": C, "batches_past_checkpoint": B}.
# C is the last (finite) checkpoint at the stop, B how many batches the data
# iterator had read past C's position when step N's batch was the latest: N - C,
# plus any batches an earlier skip from the same C had already passed over.
# On the next resume from C with nonfinite_skip_batches=K > 0,
# patches/checkpoint_restore.py advances the restored iterator by max(K, B)
# batches, so the batch that went non-finite is never trained on again. Keyed on
# C: once the resumed run saves a later checkpoint (whose iterator position
# already includes the skip), the record no longer applies.

NONFINITE_RECORD = "nonfinite.json"


def record_nonfinite(run_dir: Path, step: int, skipped_since: tuple[int, int] | None) -> dict[str, Any]:
  """Writes the record atomically. `skipped_since`: (checkpoint, batches) of a skip this run applied."""
  steps = checkpoint_steps(run_dir)
  last = steps[-1] if steps else None
  past = None
  if last is not None:
    past = step - last + (skipped_since[1] if skipped_since and skipped_since[0] == last else 0)
  record = {"step": int(step), "checkpoint": last, "batches_past_checkpoint": past}
  path = run_dir / RUN_FILES / NONFINITE_RECORD
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  tmp.write_text(json.dumps(record))
  os.replace(tmp, path)
  return record


def batches_to_skip(run_dir: Path, restored: int, skip_at_least: int) -> tuple[int, dict[str, Any]] | None:
  """(batches, record) to skip after restoring checkpoint `restored`; None when no record applies."""
  record = _read_json(run_dir / RUN_FILES / NONFINITE_RECORD)
  if skip_at_least <= 0 or not record or record.get("checkpoint") != restored:
    return None
  return max(skip_at_least, int(record["batches_past_checkpoint"])), record
