"""export_hf and import_hf when the output cannot be written, the input is damaged or another run writes the same
OUT_DIR: the documented exit code after under 20 s of CPU, one line of ours on stderr and nothing on stdout (no
library's chatter, no traceback), and nothing left beside OUT_DIR (OUT_DIR.tmp, orbax's temporary folders, the
lock).

Each CLI runs in its own process, as a user starts it: chatter printed while modules load, and threads that keep a
process from exiting, show only there. The run is written without training (tools/bench_hf_memory.py --write:
random parameters, the trainer's checkpoint and digest record, tiny widths) and exported once whole (the import's
input).
"""

from __future__ import annotations

import fcntl
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from MaxText.hf import export_cli as export_hf
from MaxText.hf import output
from MaxText.hf.errors import BAD_INPUT, DAMAGED, NOT_WRITTEN

# Slow tier: the module's run is written without training (about 25 s) and each CLI starts in its own process;
# the fast tier's 5 minutes on 2 cores has no room for its 47 s.
pytestmark = pytest.mark.slow

# Under 20 s of the process's CPU time: a shared CI machine stretches the wall time of the same work (7 s of CPU
# took 13.6 s beside other jobs on 2 cores) and its CPU time too (the full-disk import read 10.5 s of CPU there,
# 7 s alone). The wall time has a hang's bound: the import that waited on orbax's threads took 323 s.
CPU_S, WALL_S = 20, 60


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Path]:
  """(run directory, its complete export)."""
  root = tmp_path_factory.mktemp("written")
  made = subprocess.run([sys.executable, "tools/bench_hf_memory.py", "--write", "configs/deepseek3-tiny.yml",
                         str(root)], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert made.returncode == 0, made.stderr[-3000:]
  assert export_hf.main([str(root / "run"), str(root / "hf"), "--dtype", "f32"]) == 0
  return root / "run", root / "hf"


def _command(cli: str, written: tuple[Path, Path], out: Path) -> list[str]:
  return [sys.executable, "-m", f"MaxText.{cli}", str(written[0] if cli == "export_hf" else written[1]), str(out)]


def _refused(cmd: list[str], code: int, out: Path, file_limit: int | None = None) -> str:
  """Runs cmd; asserts its exit code, the time, one line of ours and nothing else; returns the line."""
  cli = cmd[2].split(".")[-1]  # [python, -m, MaxText.<cli>, ...]
  if file_limit:  # a full disk, without root: a write past file_limit bytes fails (EFBIG); by default SIGXFSZ
    # would kill the writer. Set in a launcher that execs cmd (a preexec_fn would fork this process, JAX threads
    # and all).
    cmd = [sys.executable, "-c", "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_limit}, {file_limit})); os.execv(sys.argv[1], "
           "sys.argv[1:])", *cmd]
  start, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  took, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  assert proc.returncode == code and proc.stdout == "" and proc.stderr.count("\n") == 1, (proc.returncode, proc.stdout,
                                                                                         proc.stderr[-3000:])
  assert proc.stderr.startswith(f"{cli}: "), proc.stderr
  assert cpu < CPU_S and took < WALL_S, f"{cpu:.1f} s of CPU, {took:.1f} s"
  left = sorted(p.name for p in out.parent.glob(f"{out.name}*"))
  assert left == [], left
  return proc.stderr.strip()


@pytest.fixture
def read_only(tmp_path):
  """A directory no file can be created in, for root too: root ignores file modes, so there a read-only tmpfs, or
  where mounting is not allowed, /sys (sysfs creates no files on request)."""
  path, mounted = tmp_path / "ro", False
  path.mkdir()
  if os.geteuid() != 0:
    path.chmod(0o555)
  else:
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True,
                             check=False).returncode == 0
    path = path if mounted else Path("/sys")
  with pytest.raises(OSError):
    (path / "probe").touch()
  yield path
  if mounted:
    subprocess.run(["umount", str(path)], check=True)
  (tmp_path / "ro").chmod(0o755)


@pytest.mark.parametrize("cli", ["export_hf", "import_hf"])
def test_a_read_only_parent_is_exit_6_at_once(cli, written, read_only):
  """Before, the import printed the line, then orbax's three TimeoutError tracebacks, and exited after 323 s."""
  out = read_only / "out"
  line = _refused(_command(cli, written, out), NOT_WRITTEN, out)
  assert line.startswith(f"{cli}: {out} cannot be written: {out}.lock cannot be created ("), line


@pytest.mark.parametrize("cli", ["export_hf", "import_hf"])
def test_a_full_disk_is_exit_6_and_leaves_nothing(cli, written, tmp_path):
  """Before, the import gave exit 1, about 500 lines of traceback, and left OUT.tmp.orbax-checkpoint-tmp."""
  out = tmp_path / "out"
  line = _refused(_command(cli, written, out), NOT_WRITTEN, out, file_limit=64 << 10)  # the model: 1.8 MB
  assert line.startswith(f"{cli}: {out}.tmp could not be written: File too large"), line


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_a_damaged_shard_is_exit_8_in_one_line(how, written, tmp_path):
  hf = shutil.copytree(written[1], tmp_path / "hf")
  shard = next(hf.glob("*.safetensors"))
  shard.write_bytes(b"" if how == "empty" else shard.read_bytes()[:-100])
  out = tmp_path / "out"
  line = _refused(_command("import_hf", (None, hf), out), DAMAGED, out)
  assert line.startswith(f"import_hf: {shard}"), line


def test_a_second_import_into_the_same_out_is_refused_and_leaves_the_firsts_work(written, tmp_path):
  """Before, each run began by removing OUT_DIR.tmp: two runs deleted each other's. The first run here is this
  process holding OUT_DIR's lock, as a live import does, with its OUT_DIR.tmp half written."""
  out = tmp_path / "out"
  lock = os.open(output.lock_path(out), os.O_RDWR | os.O_CREAT)
  fcntl.flock(lock, fcntl.LOCK_EX)
  os.write(lock, str(os.getpid()).encode())
  (out.with_name("out.tmp")).mkdir()
  (out.with_name("out.tmp") / "half").write_text("the first run's")
  proc = subprocess.run(_command("import_hf", written, out), cwd=REPO, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == BAD_INPUT and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
  assert proc.stderr.startswith(f"import_hf: {out} is being written by another run (pid {os.getpid()} holds "), \
      proc.stderr
  assert (out.with_name("out.tmp") / "half").read_text() == "the first run's"
  os.close(lock)  # the first run killed (its lock gone with it), its files left: the next run clears them
  proc = subprocess.run(_command("import_hf", written, out), cwd=REPO, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted(p.name for p in tmp_path.glob("out*")) == ["out"] and not (out / "half").exists()


def test_every_file_is_fsynced_before_the_rename_and_the_parent_after(written, tmp_path, monkeypatch):
  events = []
  fsync, rename = os.fsync, Path.rename

  def recording_fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    fsync(fd)

  def recording_rename(self, target):
    events.append(("rename", str(self)))
    return rename(self, target)

  monkeypatch.setattr(output.os, "fsync", recording_fsync)
  monkeypatch.setattr(Path, "rename", recording_rename)
  out = tmp_path / "out"
  assert export_hf.main([str(written[0]), str(out), "--dtype", "f32"]) == 0
  at = events.index(("rename", str(out.with_name("out.tmp"))))
  synced = {path for what, path in events[:at] if what == "fsync"}
  written_files = {str(p).replace(str(out), str(out.with_name("out.tmp"))) for p in out.rglob("*")}
  assert written_files | {str(out.with_name("out.tmp"))} <= synced, written_files - synced
  assert ("fsync", str(tmp_path)) in events[at:]
