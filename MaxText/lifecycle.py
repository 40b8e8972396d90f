"""A run's life on a cluster: exit codes, stop signals, the run-directory lock,
and what a resume may change.

Exit codes of `python -m MaxText.train` (README "Exit codes"):
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from MaxText import checkpoint_records
from MaxText.config import ConfigError

EXIT_OK = 0  # trained to `steps` (or the run had already finished: nothing to do)
EXIT_ERROR = 1  # anything unexpected: upstream's traceback
EXIT_CONFIG = 2  # bad input: one line naming the key or path; nothing written for a new run
EXIT_UPSTREAM = 3  # the installed maxtext is not the one our patches were written for
EXIT_NONFINITE = 4  # the state went non-finite; it was not saved (the last checkpoint is finite)
EXIT_LOCKED = 5  # another live job holds the run directory
EXIT_SAVE_FAILED = 6  # a checkpoint could not be written (disk full, unwritable); the last good one is kept
EXIT_OUT_OF_MEMORY = 7  # the train step does not fit in device memory (XLA's RESOURCE_EXHAUSTED)
EXIT_MOE_OVERFLOW = 8  # a bounded MoE dispatch buffer dropped rows (on_overflow=error); that step was not saved
EXIT_PREEMPTED = 75  # SIGTERM/SIGUSR1/SIGINT: checkpoint saved at the next step boundary (EX_TEMPFAIL: rerun)
EXIT_ABORTED = 130  # a second SIGINT: stopped at once, nothing saved since the last checkpoint

# What each code means, one line each: `--help` prints these (exit_code_lines), the documents explain them.
EXIT_CODES = {
    EXIT_OK: "done: trained to `steps`, or the run had already finished; --print-config / --dry-run passed",
    EXIT_ERROR: "anything unexpected (a traceback on stderr)",
    EXIT_CONFIG: "bad config or launch environment: one line naming the key, value or path; also a resume that "
                 "would change the model's shape, its schedule or its data",
    EXIT_UPSTREAM: "the installed upstream MaxText is not the version a patch was written for",
    EXIT_NONFINITE: "the state went non-finite (step, arrays, loss named); not saved, the last checkpoint is finite",
    EXIT_LOCKED: "another live job holds the run directory (host, pid, start time named)",
    EXIT_SAVE_FAILED: "the run's storage refused a write (full, read-only); the last complete checkpoint is kept",
    EXIT_OUT_OF_MEMORY: "the train step does not fit in device memory (XLA's figure named)",
    EXIT_MOE_OVERFLOW: "a bounded MoE dispatch buffer dropped rows; that step was not saved",
    EXIT_PREEMPTED: "stopped by SIGTERM, SIGUSR1 or a first Ctrl-C after saving the step in flight: run again to resume",
    EXIT_ABORTED: "a second Ctrl-C: stopped at once, nothing saved since the last checkpoint",
}

__doc__ += "\n".join(f"  {value:>3}  {name}" for name, value in sorted(
    ((k, v) for k, v in globals().items() if k.startswith("EXIT_") and isinstance(v, int)), key=lambda kv: kv[1]))


def exit_code_lines(codes: dict[int, str] | None = None) -> list[str]:
  """`  code  meaning` lines, in code order (default: every code of `python -m MaxText.train`)."""
  return [f"  {code:>3}  {text}" for code, text in sorted((EXIT_CODES if codes is None else codes).items())]


class CommandLineError(ValueError):
  """A command line an entry point refuses (argparse's verdict, or an option it does not know): one line naming
  the argument, exit EXIT_CONFIG."""


class _OneLineParser(argparse.ArgumentParser):
  def error(self, message: str):  # argparse would print its usage and exit; the entry point says one line
    raise CommandLineError(message)


def command_line_parser(prog: str, usage: str, description: str,
                        codes: dict[int, str] | None = None) -> argparse.ArgumentParser:
  """An entry point's argparse (python -m MaxText.train, python -m MaxText.plan): its exit codes as the epilog,
  no abbreviated options, no help of argparse's own (each adds its -h/--help as a flag), and CommandLineError
  where argparse would print its usage and exit."""
  return _OneLineParser(prog=prog, usage=usage, description=description, add_help=False, allow_abbrev=False,
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n".join(["exit codes:", *exit_code_lines(codes)]))


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

  The lock appears whole or not at all: it is written to a file of its own and
  then hard-linked to lock.json, which fails if lock.json exists (O_EXCL's
  atomicity, with the content already there). So a lock.json that is empty, not
  JSON or not a lock record was never a live job's (a disk that filled while an
  older version wrote it, a hand edit): it is taken over at once, with a line.
  A lock is also stale when its process is gone on this host, or when it has not
  been refreshed for STALE_AFTER_S (a job killed on another node). Otherwise a
  second job stops with RunLocked.
  """

  path: Path
  _stop: threading.Event = field(default_factory=threading.Event, repr=False)

  @classmethod
  def for_run(cls, run_dir: Path) -> "RunLock":
    return cls(run_dir / RUN_FILES / "lock.json")

  def holder(self) -> dict[str, Any] | None:
    """The lock record; None when there is no lock; {} when lock.json is torn (not a lock record)."""
    if self.path.is_dir():
      raise ConfigError(f"{self.path} is a directory, not a run lock; remove it (rmdir) and run again")
    try:
      held = json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
      return {}
    pid = held.get("pid") if isinstance(held, dict) else None
    ok = isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and isinstance(held.get("host"), str)
    return held if ok else {}

  def stale_reason(self, held: dict[str, Any]) -> str | None:
    if not held:
      return "lock.json is empty or torn, not a lock record: no live job writes one like that"
    age = time.time() - self.path.stat().st_mtime
    if held.get("host") == socket.gethostname() and not _pid_alive(held["pid"]):
      return f"its process {held.get('pid')} on this host is gone"
    if age > STALE_AFTER_S:
      return f"not refreshed for {age:.0f} s"
    return None

  def _refusal(self, held: dict[str, Any]) -> RunLocked:
    age = time.time() - self.path.stat().st_mtime
    if age < -HEARTBEAT_S:  # a clock ahead of ours (another node's, or a touched file): say the real wait
      refreshed = f"its time stamp is {-age:.0f} s in the future (clocks differ?)"
    else:
      refreshed = f"lock refreshed {max(age, 0):.0f} s ago"
    wait = STALE_AFTER_S - age
    return RunLocked(
        f"run directory {self.path.parent.parent} is in use by host {held.get('host')} pid {held.get('pid')} "
        f"since {held.get('started')} ({refreshed}); pick another run_name, or if that job is dead wait "
        f"{wait:.0f} s for the lock to go stale (or delete {self.path})")

  def _write_new(self, me: dict[str, Any]) -> bool:
    """True if this call created lock.json (whole); False if one exists."""
    tmp = self.path.with_name(f"lock.json.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
      tmp.write_text(json.dumps(me))
      os.link(tmp, self.path)
      return True
    except FileExistsError:
      return False
    except OSError as e:  # a full or read-only disk: name the lock, not its temporary file
      raise OSError(e.errno, e.strerror, str(self.path)) from e
    finally:
      tmp.unlink(missing_ok=True)

  def acquire(self) -> None:
    self.path.parent.mkdir(parents=True, exist_ok=True)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
          "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    for _ in range(2):
      if self._write_new(me):
        threading.Thread(target=self._heartbeat, name="maxtext-moe-lock", daemon=True).start()
        return
      held = self.holder()
      if held is None:  # released between our attempt and the look
        continue
      reason = self.stale_reason(held)
      if reason is None:
        raise self._refusal(held)
      whose = f": host {held.get('host')} pid {held.get('pid')} since {held.get('started')}" if held else ""
      print(f"[maxtext-moe] taking over a stale lock ({reason}){whose}", flush=True)
      self.path.unlink(missing_ok=True)
    raise RunLocked(f"could not take the lock {self.path} (another job took it at the same moment)")

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        os.utime(self.path)
      except OSError:
        return

  def release(self) -> None:
    self._stop.set()
    try:
      held = self.holder()
    except ConfigError:
      return
    if held and held.get("pid") == os.getpid() and held.get("host") == socket.gethostname():
      self.path.unlink(missing_ok=True)


# --- what a resume may change -------------------------------------------------


def checkpoint_steps(run_dir: Path) -> list[int]:
  """The checkpoints a run resumes from: orbax's commit marker and our record (MaxText/checkpoint_records.py)."""
  return checkpoint_records.complete_steps(run_dir)


def unusable_steps(run_dir: Path) -> list[tuple[int, str]]:
  """(step, why) for each step directory that is not a checkpoint."""
  found = ((step, checkpoint_records.problem(run_dir, step)) for step, _ in checkpoint_records.step_dirs(run_dir))
  return [(step, why) for step, why in found if why is not None]


def set_aside_unusable(run_dir: Path, dry_run: bool = False) -> list[str]:
  """Moves each step directory that is not a checkpoint out of orbax's sight (its files kept): orbax counts
  any directory named by a number, so an empty checkpoints/99/ would be its latest step, and it saves no
  step below its latest. Returns one line for each.

  A run whose committed steps all predate our records (no maxtext-moe/checkpoints/ at all) is refused
  instead: setting its checkpoints aside would start it over, and they cannot be verified.
  """
  committed = [step for step, path in checkpoint_records.step_dirs(run_dir)
               if (path / checkpoint_records.COMMIT_MARKER).is_file() and (path / "items" / "_METADATA").is_file()]
  if committed and not (run_dir / RUN_FILES / checkpoint_records.RECORDS).is_dir():
    raise ConfigError(
        f"run {run_dir} holds checkpoints ({', '.join(map(str, committed))}) but no records of them "
        f"({run_dir / RUN_FILES / checkpoint_records.RECORDS}/): written before maxtext-moe kept them, or the "
        "folder was deleted, so they cannot be verified; resume with the maxtext-moe that wrote them, or pick "
        "another run_name (nothing was moved)")
  lines = []
  for step, why in unusable_steps(run_dir):
    where = run_dir / "checkpoints" / str(step)
    if dry_run:
      lines.append(f"WARNING: {where} is not a checkpoint ({why}): the run would set it aside")
    else:
      lines.append(f"WARNING: {where} is not a checkpoint ({why}): set aside as "
                   f"{checkpoint_records.set_aside(run_dir, step).name}")
  return lines


# The keys that define the learning-rate schedule of upstream's optimizer
# (maxtext_utils.create_learning_rate_schedule). steps enters through
# learning_rate_schedule_steps, which upstream sets to steps when it is -1.
SCHEDULE_KEYS = ("learning_rate", "learning_rate_schedule_steps", "warmup_steps_fraction",
                 "learning_rate_final_fraction", "lr_schedule_type",
                 "wsd_decay_steps_fraction", "wsd_decay_style")

# The data a run trains on and how it is tokenized, per dataset_type (upstream's input pipelines): a resume
# on other data would go on from the checkpoint's weights with nothing said (a synthetic run resumed on
# grain data with another vocabulary trained on).
DATA_KEYS = {
    "synthetic": ("vocab_size",),
    "grain": ("grain_train_files", "grain_file_type", "grain_train_mixture_config_path", "train_data_columns",
              "tokenizer_type", "tokenizer_path", "vocab_size"),
    "hf": ("hf_path", "hf_name", "hf_data_dir", "hf_train_files", "train_data_columns", "tokenizer_type",
           "tokenizer_path", "vocab_size"),
    "tfds": ("dataset_path", "dataset_name", "train_data_columns", "tokenizer_type", "tokenizer_path", "vocab_size"),
}


def _plain(value: Any) -> Any:
  value = getattr(value, "value", value)  # upstream's str enums (DatasetType.GRAIN) as their value
  return list(value) if isinstance(value, (list, tuple)) else value


def schedule_of(config: Any) -> dict[str, Any]:
  return {k: getattr(config, k) for k in SCHEDULE_KEYS if hasattr(config, k)}


def data_of(config: Any) -> dict[str, Any]:
  kind = str(_plain(getattr(config, "dataset_type", "synthetic")))
  return {"dataset_type": kind, **{k: _plain(getattr(config, k)) for k in DATA_KEYS.get(kind, ()) if hasattr(config, k)}}


def check_resume(run_dir: Path, config: Any, allow_schedule_change: bool,
                 allow_data_change: bool = False) -> tuple[int | None, list[str]]:
  """Before anything is written: what this invocation does to an existing run.

  Returns (the checkpoint step it resumes from or None, warnings). Raises
  FinishedRun when the run has already finished, and ConfigError when the resume
  would not continue the run: checkpointing turned off (upstream would train
  from step 0 over it), a silent change of the learning-rate schedule of the
  steps already taken or of the data, or a record of either that is missing or
  garbled (a change could not be told).
  """
  steps = checkpoint_steps(run_dir)
  if not steps:
    return None, []
  last = steps[-1]
  if last + 1 >= int(config.steps):
    raise FinishedRun(f"run {run_dir} already finished: its last checkpoint is step {last} and steps={config.steps}; "
                      f"nothing to train (raise steps to continue, or pick another run_name)")
  if not config.enable_checkpointing:
    raise ConfigError(
        f"config key 'enable_checkpointing' = False: run {run_dir} holds checkpoints up to step {last}, which this "
        "run would neither resume nor extend (it would train from step 0 and replace the run's summary); set "
        "enable_checkpointing=true to resume it, or pick another run_name")
  where = f"resuming {run_dir} at step {last + 1}"
  warnings = _schedule_warnings(run_dir, config, last, where, allow_schedule_change)
  warnings += _data_warnings(run_dir, config, where, allow_data_change)
  return last, warnings


def _recorded(path: Path, what: str, where: str, allow_key: str, allowed: bool) -> tuple[dict | None, list[str]]:
  """A record the resume is checked against; (None, [warning]) or ConfigError when missing or garbled."""
  try:
    record = json.loads(path.read_text())
    why = None if isinstance(record, dict) else "is not a JSON object"
  except FileNotFoundError:
    why = "is missing"
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    why = f"cannot be read ({' '.join(str(e).split())[:80]})"
  if why is None:
    return record, []
  if not allowed:
    raise ConfigError(f"{where}: its {what} record {path} {why}, so a change of {what} cannot be told; set "
                      f"{allow_key}=true to resume with this run's {what} (recorded anew)")
  return None, [f"WARNING: the {what} record {path} {why}; {allow_key}=true: this run's {what} is recorded anew"]


def _schedule_warnings(run_dir: Path, config: Any, last: int, where: str, allowed: bool) -> list[str]:
  recorded, warnings = _recorded(run_dir / RUN_FILES / "schedule.json", "learning-rate schedule", where,
                                 "allow_schedule_change", allowed)
  if recorded is None:
    return warnings
  now = schedule_of(config)
  changed = [k for k in SCHEDULE_KEYS if k in recorded and k in now and recorded[k] != now[k]]
  if not changed:
    return []
  what = ", ".join(f"{k} {recorded[k]} -> {now[k]}" for k in changed)
  stop = _read_json(run_dir / RUN_FILES / NONFINITE_RECORD)
  if (changed == ["learning_rate"] and stop and stop.get("checkpoint") == last
      and now["learning_rate"] < recorded["learning_rate"]):  # the remedy an exit 4 advises
    return [f"WARNING: {what} after the non-finite stop at step {stop.get('step')}: steps up to {last} followed "
            f"the old rate, steps from {last + 1} the new one"]
  if not allowed:
    pins = " ".join(f"{k}={recorded[k]}" for k in changed)
    raise ConfigError(f"{where} would change its learning-rate schedule ({what}), so the steps already taken "
                      f"followed another schedule; pin {pins} to continue it, or set allow_schedule_change=true")
  return [f"WARNING: the learning-rate schedule changes on resume ({what}); allow_schedule_change=true"]


def _data_warnings(run_dir: Path, config: Any, where: str, allowed: bool) -> list[str]:
  recorded, warnings = _recorded(run_dir / RUN_FILES / "data.json", "data", where, "allow_data_change", allowed)
  if recorded is None:
    return warnings
  now = data_of(config)
  changed = [k for k in dict.fromkeys([*recorded, *now]) if recorded.get(k) != now.get(k)]
  if not changed:
    return []
  what = ", ".join(f"{k} {recorded.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}" for k in changed[:4])
  if not allowed:
    raise ConfigError(f"{where} would train on other data ({what}), so the steps already taken saw other tokens; "
                      "set allow_data_change=true to go on from its weights with the new data")
  return [f"WARNING: the data changes on resume ({what}); allow_data_change=true"]


def record_schedule(run_dir: Path, config: Any) -> None:
  _write_json(run_dir / RUN_FILES / "schedule.json", schedule_of(config))


def record_data(run_dir: Path, config: Any) -> None:
  _write_json(run_dir / RUN_FILES / "data.json", data_of(config))


def _write_json(path: Path, record: dict[str, Any]) -> None:
  """Atomically: a full disk leaves the previous record, never half of one."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  try:
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


class FinishedRun(Exception):
  """Re-running a run that has already trained to `steps`: nothing to do."""


def _read_json(path: Path) -> dict[str, Any] | None:
  try:
    record = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None
  return record if isinstance(record, dict) else None


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
  _write_json(run_dir / RUN_FILES / NONFINITE_RECORD, record)
  return record


def nonfinite_stop(run_dir: Path) -> dict[str, Any] | None:
  """The record of the last non-finite stop, if there is one that can be read."""
  return _read_json(run_dir / RUN_FILES / NONFINITE_RECORD)


def batches_to_skip(run_dir: Path, restored: int, skip_at_least: int) -> tuple[int, dict[str, Any]] | None:
  """(batches, record) to skip after restoring checkpoint `restored`; None when no record applies. A record
  that exists but cannot be read is a ConfigError when a skip was asked for: replaying would be silent."""
  path = run_dir / RUN_FILES / NONFINITE_RECORD
  record = _read_json(path)
  if skip_at_least <= 0 or not path.exists():
    return None
  if not isinstance(record, dict) or not isinstance(record.get("batches_past_checkpoint", 0), int):
    raise ConfigError(f"config key 'nonfinite_skip_batches' = {skip_at_least}: the record of the last non-finite "
                      f"stop, {path}, cannot be read, so the batches to skip are unknown; delete it to replay them, "
                      "or set nonfinite_skip_batches=0")
  if record.get("checkpoint") != restored:
    return None
  return max(skip_at_least, int(record["batches_past_checkpoint"])), record
