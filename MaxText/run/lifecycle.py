"""A run's life on a cluster: stop signals and the run-directory lock."""

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

from MaxText.checkpoints.resume import RUN_FILES
from MaxText.config import ConfigError
from MaxText.config import command_line


class RunLocked(RuntimeError):
  """Another live job holds the run directory."""


# --- stop signals -------------------------------------------------------------


DUPLICATE_S = 0.1  # a forwarded copy lands within milliseconds; a person's second Ctrl-C takes longer


@dataclass
class StopRequest:
  """Set by SIGTERM / SIGUSR1 / the first SIGINT; read at each step boundary.

  The training loop is never interrupted mid-step: the handler only records the
  signal, and patches/checkpoint_guard.py saves and stops at the next boundary.
  A second SIGINT aborts now: it runs the cleanups registered with `on_abort` (the
  run-directory lock) and then `abort`, which ends the process (MaxText/run/main.py:
  exit 130), there in the handler; without `abort` it raises KeyboardInterrupt.
  Raised at whatever bytecode the main thread was at, the exception can be caught
  on its way: in CI it became a SystemError inside numpy's dtype code, and the run
  exited 1 (CI's slow tier). In a multi-process job
  the processes must stop at the same step, so there the signal is turned into
  a SIGTERM for JAX's preemption service (jax.distributed's notifier agrees on a
  step across processes; upstream asks it at every step).
  The same signal again within DUPLICATE_S is one delivery, not a second: a job's signal (scancel, SLURM's
  time-limit USR1) reaches both the trainer and its keeper (MaxText/run/keeper.py), which forwards it, so the
  trainer gets it twice within a millisecond; a second SIGINT a person means comes later.
  """

  signal_name: str | None = None
  received_at: float | None = None
  multi_process: bool = False
  abort: Callable[[], None] | None = None  # the second SIGINT's exit; it must not return
  _sigints: int = field(default=0, repr=False)
  _last: tuple[int, float] = field(default=(0, -1e9), repr=False)  # (signum, time.monotonic()) of the last one
  _cleanups: list[Callable[[], None]] = field(default_factory=list, repr=False)

  def on_abort(self, cleanup: Callable[[], None]) -> None:
    """Run `cleanup` before an abort (last registered, first run); its exceptions are ignored."""
    self._cleanups.append(cleanup)

  def __call__(self, signum: int, frame: Any) -> None:  # pylint: disable=unused-argument
    now = time.monotonic()
    if self._last[0] == signum and now - self._last[1] < DUPLICATE_S:
      return  # the keeper's forwarded copy of a signal sent to the whole job
    self._last = (signum, now)
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
                   f"(exit {command_line.EXIT_PREEMPTED}){'; SIGINT again aborts at once' if signum == signal.SIGINT else ''}\n"
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


