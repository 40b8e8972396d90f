"""A multi-process job's survivor ends in one line of ours naming the lost process (exit EXIT_PROCESS_LOST).

When a process of the job dies, jax.distributed's coordination service declares it dead after the heartbeat
timeout (MaxText/run/launch.py) and every survivor ends by a fatal log inside XLA, on one of XLA's own threads:
"Terminating process because the JAX distributed service detected fatal errors", the service's status, a C++
stack trace, SIGABRT (exit 134). A dead coordinator (process 0 hosts the service) reaches the others at once when
its connection closes, or after the heartbeat timeout when its node went silent. Nothing inside the process can
turn that into a line of ours: jaxlib 0.11.2's client takes a `missed_heartbeat_callback`, but it is called with
the non-OK absl::Status, which jaxlib's caster refuses to hand to Python (std::bad_cast, std::terminate, SIGABRT,
on the polling thread; the Python callable never runs: measured with jaxlib 0.11.2, a peer killed and the
coordinator killed). So
the trainer runs as a child of a small keeper that computes nothing:

  - the child's stderr comes through the keeper, line by line, unchanged, until XLA's fatal line for the
    coordination service; from there on it is dropped (the status, the stack trace, any traceback the dying
    process still prints), and the records XLA logs on its way there (the service's "Use error polling ...",
    the agent's "Polled an error ...") are held HOLD_S and dropped when the fatal follows, and so is everything
    after a collective's word that a peer's connection closed (gloo's "Connection closed by peer": orbax's
    threads log their tracebacks then), for as long as the verdict can take (verdict_wait_s);
  - once the child has ended, the keeper says which process was lost, read from the status, and exits
    EXIT_PROCESS_LOST; any other end of the child is passed on as it was (its code, or 128 + its signal);
  - the child runs in its own session, so a signal meant for the job (Ctrl-C, SIGTERM, SIGUSR1) reaches it once,
    through the keeper; the child dies with the keeper (PR_SET_PDEATHSIG), never outliving it unwatched.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import time
from typing import Sequence

from MaxText.config.command_line import EXIT_PROCESS_LOST

KEPT_ENV = "MAXTEXT_MOE_KEPT"  # set in the child: it is the one kept, and starts no keeper of its own
HEARTBEAT_TIMEOUT_S = 60  # the default of MAXTEXT_MOE_HEARTBEAT_TIMEOUT_S (jax's own is 100 s)
COORDINATOR_TIMEOUT_S = 300  # the default of MAXTEXT_MOE_COORDINATOR_TIMEOUT_S: the job's start waits this long
HOLD_S = 2.0  # XLA logs the service's error a millisecond before its fatal line (measured); this is margin
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)

# XLA's fatal line when the coordination service reports an error (xla/pjrt/distributed/client.h, jaxlib 0.11.2).
FATAL = re.compile(rb"^F\d{4} [\d:.]+ +\d+ client\.h:\d+\] Terminating process because the JAX distributed service")
# A record XLA logs about the service's error before its fatal line (glog's prefix, then the file it came from).
PRELUDE = re.compile(rb"^[EW]\d{4} [\d:.]+ +\d+ (coordination_service\w*|preemption_\w+|client)\.cc:\d+\]")
GLOG_RECORD = re.compile(rb"^[IWEF]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\]")

# What a collective says when a peer's connection closed under it (gloo on CPU, NCCL on GPU): the peer is gone.
PEER_GONE = re.compile(r"Gloo \w+ failed|Connection closed by peer|Connection reset by peer|NCCL (error|WARN)|"
                       r"remote process exited or there was a network error", re.I)


def verdict_wait_s() -> float:
  """How long the coordination service's verdict on a lost process can take: twice the heartbeat timeout and a
  margin (a dead peer is declared after one timeout; a silent coordinator is given up on after about one)."""
  return 2 * heartbeat_timeout_s() + 10


def heartbeat_timeout_s() -> int:
  """How long the coordination service waits for a silent process before declaring it dead (launch.py passes it)."""
  return int(os.environ.get("MAXTEXT_MOE_HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S))


def coordinator_timeout_s() -> int:
  """How long jax.distributed's start waits for every process to join (MaxText/run/launch.py passes it)."""
  return int(os.environ.get("MAXTEXT_MOE_COORDINATOR_TIMEOUT_S", COORDINATOR_TIMEOUT_S))


def _never_joined(status: str) -> bool:
  """The start's wait ran out: a process never registered with the service (it died at start, or never began)."""
  return "RegisterTask" in status


def lost_process(status: str, own_rank: int | None = None) -> str:
  """Which process the coordination service's status (the text after XLA's fatal line) says was lost, in words."""
  if _never_joined(status):
    return (f"not every process joined the job within the start's wait of {coordinator_timeout_s()} s "
            "(MAXTEXT_MOE_COORDINATOR_TIMEOUT_S): one died at start or never began; its own log says why")
  if m := re.search(r"unhealthy \(stopped sending heartbeats\):\s*([\d\s,]+)", status):
    ranks = sorted({int(r) for r in re.findall(r"\d+", m[1])})
    return f"process{'es' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped heartbeating"
  if m := re.search(r"Task (\d+) heartbeat timeout", status):
    return f"process {m[1]} stopped heartbeating"
  if own_rank != 0 and re.search(r"UNAVAILABLE|DEADLINE_EXCEEDED|Socket closed|Connection refused", status):
    return "process 0, the coordinator, stopped answering"
  said = next((line.strip() for line in status.splitlines() if line.strip()), "no status")
  return f"a process of the job was lost ({said[:160]})"


def line(status: str, own_rank: int | None) -> str:
  """Our one line for a survivor: who was lost, that this process stopped too, the bound, what to do."""
  timeout = heartbeat_timeout_s()
  rank = f"process {own_rank}" if own_rank is not None else "this process"
  if _never_joined(status):
    return f"maxtext-moe: process lost: {lost_process(status, own_rank)}; {rank} stopped too, before any step"
  return (f"maxtext-moe: process lost: {lost_process(status, own_rank)}; {rank} stopped too (heartbeat timeout "
          f"{timeout} s, MAXTEXT_MOE_HEARTBEAT_TIMEOUT_S): run the job again with the same run_name to resume from "
          "the last complete checkpoint")


def _die_with_parent() -> None:
  """In the child, before exec: SIGKILL when the keeper dies (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
  except (AttributeError, OSError):
    pass


class _Relay:
  """The child's stderr, copied to ours until XLA's fatal line; holds what may precede it (see the module)."""

  def __init__(self, out_fd: int):
    self.out_fd, self.partial, self.held = out_fd, b"", []
    self.release_at: float | None = None  # when the held lines are passed on, if no fatal line came
    self.fatal: list[bytes] | None = None  # XLA's fatal line and everything after it
    self.in_prelude = False  # the lines after a held record that belong to it (no glog prefix of their own)

  def feed(self, data: bytes) -> None:
    *lines, self.partial = (self.partial + data).split(b"\n")
    for raw in lines:
      self._line(raw + b"\n")

  def _hold(self, raw: bytes, for_s: float) -> None:
    self.held.append(raw)
    self.release_at = max(self.release_at or 0.0, time.monotonic() + for_s)

  def _line(self, raw: bytes) -> None:
    if self.fatal is not None:
      self.fatal.append(raw)
    elif FATAL.match(raw):
      self.fatal, self.held = [raw], []
    elif PEER_GONE.search(raw.decode(errors="replace")):  # a peer's connection closed: the verdict is coming
      self._hold(raw, verdict_wait_s())
    elif PRELUDE.match(raw) or (self.in_prelude and not GLOG_RECORD.match(raw)):
      self.in_prelude = True
      self._hold(raw, HOLD_S)
    else:
      self.in_prelude = False
      if self.held:
        self._hold(raw, 0.0)  # in order, after what is held
      else:
        self._write(raw)

  def release(self, at_end: bool = False) -> None:
    """Passes the held lines on once their time is up (at_end: now), unless XLA's fatal line came."""
    if self.held and self.fatal is None and (at_end or time.monotonic() >= self.release_at):
      held, self.held, self.release_at, self.in_prelude = self.held, [], None, False
      self._write(b"".join(held))

  def finish(self) -> None:
    if self.partial:
      self._line(self.partial)
    self.partial = b""
    self.release(at_end=True)

  def _write(self, data: bytes) -> None:
    try:
      os.write(self.out_fd, data)
    except OSError:
      pass  # our stderr is gone (its reader stopped): the child's own end does not change


def keep(command: Sequence[str], own_rank: int | None = None) -> int:
  """Runs `command` as the kept child (see the module); returns the exit code the keeper should end with."""
  child = subprocess.Popen(list(command), stderr=subprocess.PIPE, env={**os.environ, KEPT_ENV: "1"},
                           start_new_session=True, preexec_fn=_die_with_parent)  # pylint: disable=subprocess-popen-preexec-fn
  for sig in FORWARDED:
    signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
  relay, fd = _Relay(sys.stderr.fileno()), child.stderr.fileno()
  while True:
    ready, _, _ = select.select([fd], [], [], HOLD_S / 4)
    if ready:
      data = os.read(fd, 65536)
      if not data:
        break
      relay.feed(data)
    relay.release()
  relay.finish()
  code = child.wait()
  if relay.fatal is None:
    return code if code >= 0 else 128 - code
  status = b"".join(relay.fatal).decode(errors="replace").split("absl::Status:", 1)[-1]
  print(line(status.split("*** Check failure stack trace", 1)[0], own_rank), file=sys.stderr, flush=True)
  return EXIT_PROCESS_LOST


def kept() -> bool:
  """Whether this process is the keeper's child (it must not start a keeper of its own)."""
  return os.environ.get(KEPT_ENV) == "1"


def await_verdict(e: BaseException) -> None:
  """In the kept child, a collective that failed because a peer's connection closed: wait for the coordination
  service's verdict (XLA's fatal line, which the keeper turns into our line naming the lost process) instead of
  printing a traceback that names no process. Returns (the caller re-raises) when this is not that, or when no
  verdict came within twice the heartbeat timeout and a margin."""
  seen: set[int] = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if PEER_GONE.search(str(e)):
      break
    e = e.__cause__ or e.__context__
  else:
    return
  if not kept():
    return
  time.sleep(verdict_wait_s())
