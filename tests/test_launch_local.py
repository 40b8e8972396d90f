"""scripts/launch_local.sh's watch over its ranks, with stand-in ranks that start at once (no Python, no jax):
a copy of the launcher beside a stand-in bootstrap whose "python" is a small bash script (`rank` below) that does
what FAKE_RANK_<rank> says. The launcher used to wait on rank 0 first, so a rank that died at start went
unnoticed while rank 0 waited for it (jax.distributed's start: 300 s), the job then ended with the survivor's code,
a SIGTERM to the launcher ended only the launcher, and no line named the lost rank."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO

LAUNCHER = REPO / "scripts" / "launch_local.sh"  # stand-in ranks: no training run starts (tests/test_tiers.py)
BOUND_S = 20  # each case ends in a second or two; the old launcher waited on rank 0 for good

RANK = r"""#!/usr/bin/env bash
# A stand-in rank: `rank -m MaxText.train ...` as the launcher starts it; FAKE_RANK_<rank> says what it does.
r="$JAX_PROCESS_ID"; mode="FAKE_RANK_$r"; mode="${!mode:-serve}"
echo $$ > "$FAKE_DIR/rank$r.pid"
others_up() { [ "$(ls "$FAKE_DIR" | grep -c '^up')" -ge "$((JAX_NUM_PROCESSES - 1))" ]; }
case "$mode" in
  exit*) until others_up; do sleep 0.05; done; echo "rank $r failing"; exit "${mode#exit }" ;;
  deaf) trap '' TERM; echo "serving, deaf"; touch "$FAKE_DIR/up$r"; exec sleep 1000 ;;  # as in jax.distributed's start
  serve) trap 'echo "stopping on TERM"; exit 75' TERM; echo serving; touch "$FAKE_DIR/up$r"; while :; do sleep 0.1; done ;;
esac
"""


@pytest.fixture
def launcher(tmp_path):
  """Runs the launcher copy with -n N and FAKE_RANK_<r> modes; returns (process, the pid file of each rank)."""
  (tmp_path / "scripts").mkdir()
  shutil.copy(LAUNCHER, tmp_path / "scripts" / "launch_local.sh")
  bootstrap = tmp_path / "scripts" / "bootstrap.sh"
  bootstrap.write_text(f"#!/usr/bin/env bash\necho {tmp_path / 'rank'}\n")
  (tmp_path / "rank").write_text(RANK)
  for script in (bootstrap, tmp_path / "rank"):
    script.chmod(0o755)
  started = []

  def start(nproc: int, grace_s: int = 30, **modes: str) -> subprocess.Popen:
    env = {**os.environ, "FAKE_DIR": str(tmp_path), "MAXTEXT_PORT": "1", "MAXTEXT_LAUNCH_GRACE_S": str(grace_s),
           "PATH": "/usr/bin:/bin", **{f"FAKE_RANK_{r}": m for r, m in modes.items()}}
    proc = subprocess.Popen(["bash", str(tmp_path / "scripts" / "launch_local.sh"), "-n", str(nproc)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started.append(proc)
    return proc

  yield start, tmp_path
  for proc in started:
    if proc.poll() is None:
      proc.kill()
  _kill_stand_ins(tmp_path)


def _kill_stand_ins(tmp_path: Path) -> None:
  """Any stand-in rank still running: a launcher that left it fails its test, and it goes now."""
  for pid_file in tmp_path.glob("rank*.pid"):
    pid = int(pid_file.read_text() or 0)
    if pid and _alive(pid):
      os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
  try:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _ended(proc: subprocess.Popen, tmp_path: Path) -> tuple[int, str, str]:
  try:
    out, err = proc.communicate(timeout=BOUND_S)
  except subprocess.TimeoutExpired:
    proc.kill()
    _kill_stand_ins(tmp_path)  # they hold the launcher's output pipes open
    out, err = proc.communicate(timeout=10)
    pytest.fail(f"the launcher was still waiting after {BOUND_S} s; it said: {out[-2000:]} {err[-2000:]}")
  return proc.returncode, out, err


def _pids(tmp_path: Path, nproc: int, up: int | None = None, timeout_s: float = BOUND_S) -> list[int]:
  """The stand-ins' pids, once `up` of them (default: all) serve."""
  deadline = time.monotonic() + timeout_s
  files = [tmp_path / f"rank{r}.pid" for r in range(nproc)]
  while not all(f.exists() and f.read_text().strip() for f in files):
    assert time.monotonic() < deadline, "the ranks did not start"
    time.sleep(0.05)
  while len(list(tmp_path.glob("up*"))) < (nproc if up is None else up) and time.monotonic() < deadline:
    time.sleep(0.05)  # a stand-in that serves is up once its trap is set (one that fails never is)
  return [int(f.read_text()) for f in files]


def _none_left(pids: list[int]) -> None:
  deadline = time.monotonic() + 5
  while any(_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not [p for p in pids if _alive(p)], "ranks left running after the launcher ended"


def test_a_rank_that_fails_at_once_ends_the_job_with_its_code_naming_it(launcher):
  start, tmp_path = launcher
  proc = start(3, **{"2": "exit 3"})  # ranks 0 and 1 serve until told to stop
  code, out, err = _ended(proc, tmp_path)
  pids = _pids(tmp_path, 3, up=2)
  assert code == 3, (code, out, err)
  assert (f"launch_local.sh: rank 2 (pid {pids[2]}) exited 3, the job's first failure; ending rank 0 (pid "
          f"{pids[0]}), rank 1 (pid {pids[1]}) (SIGTERM, then SIGKILL after 30 s)") in err.splitlines(), err
  assert "[p0] stopping on TERM" in out and "[p1] stopping on TERM" in out and "[p2] rank 2 failing" in out, out
  _none_left(pids)


def test_a_rank_deaf_to_sigterm_is_killed_after_the_grace_and_the_line_says_so(launcher):
  start, tmp_path = launcher
  code, out, err = _ended(start(2, grace_s=1, **{"0": "deaf", "1": "exit 7"}), tmp_path)
  pids = _pids(tmp_path, 2, up=1)
  assert code == 7, (code, out, err)
  lines = [line for line in err.splitlines() if line.startswith("launch_local.sh:")]
  assert lines == [
      f"launch_local.sh: rank 1 (pid {pids[1]}) exited 7, the job's first failure; ending rank 0 (pid {pids[0]}) "
      "(SIGTERM, then SIGKILL after 1 s)",
      f"launch_local.sh: rank 0 (pid {pids[0]}) still running 1 s after SIGTERM (MAXTEXT_LAUNCH_GRACE_S): "
      "killed (SIGKILL)"], err
  _none_left(pids)


def test_a_sigterm_to_the_launcher_reaches_every_rank_and_none_is_left(launcher):
  start, tmp_path = launcher
  proc = start(2)
  pids = _pids(tmp_path, 2)
  proc.send_signal(signal.SIGTERM)
  code, out, err = _ended(proc, tmp_path)
  assert code == 75, (code, out, err)  # the ranks' own code for a stop that saved
  assert "[p0] stopping on TERM" in out and "[p1] stopping on TERM" in out, out
  assert not re.search(r"first failure", err), err
  _none_left(pids)


def test_a_rank_killed_by_a_signal_is_named_with_it(launcher):
  start, tmp_path = launcher
  proc = start(2, **{"0": "serve", "1": "serve"})
  pids = _pids(tmp_path, 2)
  os.kill(pids[1], signal.SIGKILL)  # as the kernel's out-of-memory killer ends a rank
  code, _, err = _ended(proc, tmp_path)
  assert code == 137, err
  assert f"launch_local.sh: rank 1 (pid {pids[1]}) was killed by SIGKILL (exit 137), the job's first failure" in err
  _none_left(pids)
