"""A process of a multi-process job that dies cannot hang the others, and each survivor ends in one line of ours
naming it, with exit EXIT_PROCESS_LOST (MaxText/run/keeper.py): two CPU processes over jax.distributed on
localhost (tests/dead_process_peer.py, kept as `python -m MaxText.train` is), one of which ends itself, with
SIGKILL or SIGSTOP (silent, its sockets open: the survivor stays inside the collective), in a step, in a save
(orbax sync and async) and in a restore, as the coordinator (process 0, which hosts the coordination service) or
as the other. Before the keeper, each survivor ended through XLA's fatal log: exit 134, a C++ stack trace, and
for a peer killed between collectives a Python traceback of gloo's "Connection closed by peer" first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, SUBPROCESS_PYTHONPATH
from MaxText.config.command_line import EXIT_PROCESS_LOST
from MaxText.run import keeper

HEARTBEAT_S = 5
# The survivor ends within the heartbeat timeout of the victim's last heartbeat (a dead coordinator: at once, when
# its connection closes); the margin is for two busy cores. jax's own default timeout, 100 s, would fail this.
BOUND_S = HEARTBEAT_S + 15


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _survivor(tmp_path, mode: str, victim: int, how: str = "kill", **env: str) -> tuple[int, str, float]:
  """Runs the two processes; the victim ends itself (see the peer); returns the survivor's code, stderr and the
  seconds it took to end after the victim said it was dying."""
  full_env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": SUBPROCESS_PYTHONPATH,
              "JAX_PLATFORMS": "cpu", "MAXTEXT_MOE_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S), **env}
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, "tests/dead_process_peer.py", mode, str(i), port, str(tmp_path),
                             str(victim), how], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    for line in procs[victim].stdout:
      if line.startswith("dying"):
        break
    dying = time.monotonic()
    _, err = procs[1 - victim].communicate(timeout=120)
    took = time.monotonic() - dying
  finally:
    for p in procs:  # the victim's keeper; its child (SIGSTOPped) dies with it
      if p.poll() is None:
        p.kill()
      p.wait()
  return procs[1 - victim].returncode, err, took


def _assert_one_line(code: int, err: str, took: float, lost: str) -> None:
  assert code == EXIT_PROCESS_LOST, (code, err[-3000:])
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("maxtext-moe: process lost: ") and lost in lines[0], err[-3000:]
  assert "Traceback" not in err and "stack trace" not in err, err[-3000:]
  assert took < BOUND_S, (took, err)


CASES = [  # mode, victim, how, env, what the line names
    ("step", 1, "kill", {}, "process 1 stopped heartbeating"),
    ("step", 0, "kill", {}, "process 0, the coordinator, stopped answering"),
    ("step", 1, "stop", {}, "process 1 stopped heartbeating"),  # the survivor is stuck inside the all-gather
    ("step", 0, "stop", {}, "process 0, the coordinator, stopped answering"),
    ("save", 1, "kill", {"ASYNC": "1"}, "process 1 stopped heartbeating"),
    ("save", 1, "kill", {}, "process 1 stopped heartbeating"),
    ("restore", 1, "kill", {}, "process 1 stopped heartbeating"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,victim,how,env,lost", CASES,
                         ids=[f"{c[0]}{'-async' if c[3] else ''}-{c[2]}-process{c[1]}" for c in CASES])
def test_the_survivor_ends_in_one_line_naming_the_lost_process(tmp_path, mode, victim, how, env, lost):
  _assert_one_line(*_survivor(tmp_path, mode, victim, how, **env), lost)


def test_the_line_names_the_lost_process_from_the_services_status():
  """XLA's status texts (jaxlib 0.11.2, as the survivors above printed them) -> the words of our line."""
  unhealthy = ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks have "
               "crashed. Check the task logs")
  assert keeper.lost_process(unhealthy, 0) == "process 1 stopped heartbeating"
  assert keeper.lost_process("INTERNAL: Barrier failed because: ... Task 3 heartbeat timeout.", 0) == \
      "process 3 stopped heartbeating"
  assert keeper.lost_process("DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: .../Heartbeat", 1) == \
      "process 0, the coordinator, stopped answering"
  assert keeper.lost_process("\nAdditional GRPC error ... :UNAVAILABLE:Stream removed (Socket closed)", 2) == \
      "process 0, the coordinator, stopped answering"
  assert keeper.lost_process("INTERNAL: something new", 1) == "a process of the job was lost (INTERNAL: something new)"


def test_a_peer_that_never_joined_is_named_with_the_wait_that_ran_out(monkeypatch):
  """Process 0's status (jaxlib 0.11.2) when another died at start: its wait for the job to form ran out. The line
  said "a process of the job was lost (DEADLINE_EXCEEDED: Deadline Exceeded)" and gave the heartbeat timeout."""
  monkeypatch.setenv("MAXTEXT_MOE_COORDINATOR_TIMEOUT_S", "5")
  status = ("DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/RegisterTask\n"
            "=== Source Location Trace: === \nexternal/xla+/xla/pjrt/distributed/coordination/coordination_service_"
            "error_util.cc:64\n")
  assert keeper.line(status, 0) == (
      "maxtext-moe: process lost: not every process joined the job within the start's wait of 5 s "
      "(MAXTEXT_MOE_COORDINATOR_TIMEOUT_S): one died at start or never began; its own log says why; process 0 "
      "stopped too, before any step")


def test_the_relay_passes_lines_on_and_drops_xlas_fatal_and_its_prelude():
  """What the keeper copies of its child's stderr: everything until XLA's fatal line for the coordination service;
  the records XLA logs on the way there are dropped with it, and passed on when no fatal follows."""
  read, write = os.pipe()
  relay = keeper._Relay(write)  # pylint: disable=protected-access
  relay.feed(b"a line of ours\nE1206 08:42:01.217415   18632 coordination_service.cc:1518] Use error polling to "
             b"propagate: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n")
  relay.feed(b"F1206 08:42:01.218566   18643 client.h:86] Terminating process because the JAX distributed service "
             b"detected fatal errors. absl::Status: ...\n*** Check failure stack trace: ***\n    @  0x7f2e  ...\n")
  relay.finish()
  os.close(write)
  assert os.read(read, 65536) == b"a line of ours\n" and relay.fatal is not None
  read, write = os.pipe()
  relay = keeper._Relay(write)  # pylint: disable=protected-access
  relay.feed(b"W1206 08:40:19.634576   17297 preemption_sync_manager.cc:147] Failed to retrieve a notice\nmore\n"
             b"next line\n")
  relay.finish()
  os.close(write)
  assert os.read(read, 65536).splitlines()[-1] == b"next line" and relay.fatal is None
