"""Progress lines for long work: what a compile is doing, a heartbeat while a child
process works, an ETA over a list of candidates, and when a checkpoint reached disk.

Each piece takes its clock as an argument, so tests drive it with a fake one.

  CompileWatch   a jitted function's compile phases (tracing, lowering, compiling) from
                 jax.monitoring's public events: the trainer's "compiling the train step...",
                 the planner child's phase file
  wait_beating   waits for a child process, calling a heartbeat every period (the planner)
  StatusLine     that heartbeat's line: rewritten in place on a terminal, a line a minute in a log
  Eta            "candidate k of n" with an ETA from the mean time so far (plan --search)
  watch_save     a background thread that reports a checkpoint's size and duration once
                 its step directory is final (patches/checkpoint_guard.py)
  say, log       a line in one write, which that thread's lines cannot split (log: the run's own
                 "[maxtext-moe] ..." lines)
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable


def say(text: str, stream=None) -> None:
  """text and its newline in one write, flushed. A checkpoint's watch thread (watch_save) writes its line while the
  main thread writes its own, and print() writes a text and its newline apart: a save's line once landed between
  the two, inside a progress line (tests/test_train.py in CI's slow tier)."""
  stream = stream or sys.stdout
  stream.write(f"{text}\n")
  stream.flush()


def log(msg: str) -> None:
  """One of the run's own lines on stdout, "[maxtext-moe] msg", said whole."""
  say(f"[maxtext-moe] {msg}")


def fmt_seconds(seconds: float) -> str:
  """44s, 2m30s, 1h05m."""
  if not math.isfinite(seconds):
    return "?"
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def fmt_bytes(n: float) -> str:
  """Bytes in the largest binary unit that keeps them >= 1."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


# --- compile phases -----------------------------------------------------------------

# jax's own compile events (jax/_src/dispatch.py). Each phase reports its start through
# jax.monitoring.record_scalar (the start time, with fun_name) and its end through
# record_event_duration_secs: both public listener APIs.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PHASES = {TRACE_EVENT: "tracing", LOWER_EVENT: "lowering", COMPILE_EVENT: "compiling"}


def base_name(fun_name: str | None) -> str:
  """jax names a traced function 'f' and its module and executable 'jit(f)' (older jax: 'jit_f')."""
  m = re.fullmatch(r"jit\((.*)\)|jit_(.*)|(.*)", fun_name or "")
  return next(g for g in m.groups() if g is not None)


@dataclasses.dataclass
class CompileWatch:
  """Follows the top-level compiles of the jitted functions named `fun_name` in this process.

  on_phase(phase) at the start of each phase ("tracing", "lowering", "compiling");
  on_compiled(seconds) when the executable is ready, timed from the latest trace's start
  (trace + lower + compile: what the user waited for). A compile served from jax's cache
  still reports, with its short time. `compiles` keeps every time.
  """

  fun_name: str
  on_phase: Callable[[str], None] = lambda phase: None
  on_compiled: Callable[[float], None] = lambda seconds: None
  clock: Callable[[], float] = time.monotonic
  compiles: list[float] = dataclasses.field(default_factory=list)
  _began: float | None = dataclasses.field(default=None, repr=False)

  def scalar(self, event: str, value: float, **kwargs) -> None:  # pylint: disable=unused-argument
    if event not in PHASES or base_name(kwargs.get("fun_name")) != self.fun_name:
      return
    if event == TRACE_EVENT or self._began is None:  # lowered from a trace we did not see: time from here
      self._began = self.clock()
    self.on_phase(PHASES[event])

  def duration(self, event: str, seconds: float, **kwargs) -> None:  # pylint: disable=unused-argument
    if event != COMPILE_EVENT or base_name(kwargs.get("fun_name")) != self.fun_name or self._began is None:
      return
    took, self._began = self.clock() - self._began, None
    self.compiles.append(took)
    self.on_compiled(took)

  def start(self) -> "CompileWatch":
    from jax import monitoring  # pylint: disable=import-outside-toplevel

    monitoring.register_scalar_listener(self.scalar)
    monitoring.register_event_duration_secs_listener(self.duration)
    return self

  def stop(self) -> None:
    from jax import monitoring  # pylint: disable=import-outside-toplevel

    for unregister, listener in ((monitoring.unregister_scalar_listener, self.scalar),
                                 (monitoring.unregister_event_duration_listener, self.duration)):
      try:
        unregister(listener)
      except (AssertionError, ValueError):  # never registered
        pass


def write_phase(path: str | os.PathLike | None, phase: str) -> None:
  """The planner child's phase, for its parent's heartbeat: written beside, then renamed over."""
  if not path:
    return
  tmp = Path(f"{path}.tmp")
  tmp.write_text(phase)
  os.replace(tmp, path)


def read_phase(path: str | os.PathLike, default: str = "starting") -> str:
  try:
    return Path(path).read_text().strip() or default
  except FileNotFoundError:
    return default


# --- a heartbeat while a child works --------------------------------------------------


def wait_beating(wait: Callable[[float], int], timeout_s: float, period_s: float, beat: Callable[[float], None],
                 clock: Callable[[], float] = time.monotonic) -> int:
  """The exit code of `wait` (Popen.wait: returns the code, or raises TimeoutExpired after its
  argument's seconds); beat(elapsed) every period_s while it runs (period_s <= 0: never).
  Raises subprocess.TimeoutExpired once timeout_s have passed."""
  start = clock()
  next_beat = period_s if period_s > 0 else math.inf
  while True:
    elapsed = clock() - start
    if elapsed >= timeout_s:
      raise subprocess.TimeoutExpired("compile", timeout_s)
    try:
      return wait(max(0.0, min(timeout_s, next_beat) - elapsed))
    except subprocess.TimeoutExpired:
      elapsed = clock() - start
      if next_beat <= elapsed < timeout_s:
        beat(elapsed)
        while next_beat <= elapsed:  # a slow wait does not queue up beats
          next_beat += period_s


TERMINAL_REFRESH_S = 2.0  # how often a status line on a terminal is rewritten


class StatusLine:
  """A long wait's status, one line: on a terminal it is rewritten in place (carriage return, the line cleared)
  and ended with a newline by `close`; in a log (stdout not a terminal) `update` prints a line only once
  `log_every_s` has passed since the last it printed, so a 13-minute compile is 13 lines, not one per beat."""

  def __init__(self, prefix: str, log_every_s: float = 60.0, stream=None, clock: Callable[[], float] = time.monotonic):
    self.prefix, self.log_every_s, self.clock = prefix, log_every_s, clock
    self.stream = stream or sys.stdout
    self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
    self._last_printed = -math.inf
    self._open = False

  @property
  def period_s(self) -> float:
    """How often the caller should call `update`: TERMINAL_REFRESH_S on a terminal, else log_every_s."""
    return min(TERMINAL_REFRESH_S, self.log_every_s) if self.terminal else self.log_every_s

  def update(self, text: str) -> None:
    if self.terminal:
      self.stream.write(f"\r\033[K{self.prefix}{text}")
      self._open = True
    elif self.clock() - self._last_printed >= self.log_every_s:
      self.stream.write(f"{self.prefix}{text}\n")
      self._last_printed = self.clock()
    self.stream.flush()

  def close(self) -> None:
    """Ends the terminal's line, so what follows starts on its own."""
    if self._open:
      self.stream.write("\n")
      self.stream.flush()
      self._open = False


# --- k of n with an ETA ---------------------------------------------------------------


@dataclasses.dataclass
class Eta:
  """`candidate k of n` lines; the ETA is the mean time of the candidates done so far times
  the candidates left (this one included)."""

  total: int
  clock: Callable[[], float] = time.monotonic
  durations: list[float] = dataclasses.field(default_factory=list)
  _began: float | None = dataclasses.field(default=None, repr=False)

  def start(self, label: str) -> str:
    k = len(self.durations) + 1
    self._began = self.clock()
    line = f"candidate {k} of {self.total}: {label}"
    if self.durations:
      mean = sum(self.durations) / len(self.durations)
      line += f" (ETA {fmt_seconds(mean * (self.total - k + 1))}, {fmt_seconds(mean)} a candidate so far)"
    return line

  def done(self) -> float:
    took = self.clock() - self._began
    self.durations.append(took)
    return took


# --- when a checkpoint reaches disk ---------------------------------------------------


def dir_bytes(path: Path) -> int:
  """The bytes of every file under path (what the checkpoint holds on disk)."""
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.stat(os.path.join(root, name)).st_size
      except FileNotFoundError:  # removed while walking (a concurrent cleanup)
        pass
  return total


def save_poll_s(elapsed: float) -> float:
  """How long to wait before looking again: 5% of the time so far, within [0.05, 1] s. A save of minutes
  is seen within a second of its end, a tiny one within 50 ms, and a shared filesystem's metadata server
  sees at most one stat a second from one process."""
  return min(1.0, max(0.05, elapsed / 20))


def watch_save(step_dir: Path, began: float, on_saved: Callable[[float, int], None], stop: threading.Event,
               clock: Callable[[], float] = time.monotonic) -> threading.Thread:
  """A daemon thread that calls on_saved(seconds since `began`, bytes) once `step_dir` exists: orbax
  writes a step under a temporary name and renames it to the step number when the save is complete,
  asynchronous or not. `stop` ends the watch unreported (a save that never completes)."""

  def run():
    while not stop.is_set():
      if step_dir.is_dir():
        on_saved(clock() - began, dir_bytes(step_dir))
        return
      stop.wait(save_poll_s(clock() - began))

  thread = threading.Thread(target=run, name=f"maxtext-moe-save-{step_dir.name}", daemon=True)
  thread.start()
  return thread
