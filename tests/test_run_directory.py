"""The run directory on storage that misbehaves, without training: a dangling symlink where the run writes, a
read-only disk's words, and a summary that does not fit (MaxText/config/checks.py's check_run_directory,
MaxText/run/disk_full.py, MaxText/run/metrics.py's write_summary). The same cases through the CLI, a read-only bind mount
included: tests/reliability_run_cases.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SUBPROCESS_PYTHONPATH
from MaxText.config import checks as config_checks
from MaxText.run import disk_full
from MaxText.config import ConfigError


@pytest.mark.parametrize("entry", ["checkpoints", "maxtext-moe", "tensorboard"])
def test_a_dangling_symlink_where_the_run_writes_is_one_line_naming_it(tmp_path, entry):
  """A scratch disk not mounted: orbax's mkdir met the link and raised FileExistsError after the compile."""
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / entry).symlink_to(tmp_path / "scratch" / entry)
  with pytest.raises(ConfigError, match=rf"config key 'run_name' = 'run': {run_dir / entry} is a symbolic link to "
                                        rf"'{tmp_path / 'scratch' / entry}', which does not exist \(a disk not mounted"):
    config_checks.check_run_directory(run_dir)


def test_the_run_directory_itself_a_dangling_link_or_a_file_is_refused(tmp_path):
  (tmp_path / "run").symlink_to(tmp_path / "nowhere")
  with pytest.raises(ConfigError, match="run is a symbolic link to .*nowhere', which does not exist"):
    config_checks.check_run_directory(tmp_path / "run")
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "checkpoints").write_text("")
  with pytest.raises(ConfigError, match="other/checkpoints exists and is not a directory"):
    config_checks.check_run_directory(tmp_path / "other")
  config_checks.check_run_directory(tmp_path / "new")  # a new run: nothing there yet


def test_a_read_only_disk_mid_run_is_not_called_full(tmp_path):
  """EROFS (a disk remounted read-only), EACCES: exit 6 as a full disk, in words that say what happened."""
  path = tmp_path / "run" / "tensorboard" / "events.out"
  line = disk_full.line(OSError(errno.EROFS, os.strerror(errno.EROFS), str(path)), tmp_path / "run", False)
  assert line.startswith(f"storage not writable: could not write {path}: Read-only file system; the last complete "
                         "checkpoint (none) is kept; summary.json not written; make it writable"), line
  full = disk_full.line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)), tmp_path / "run")
  assert full.startswith(f"storage full: could not write {path}: No space left on device; "), full


def test_a_full_disk_met_first_by_tensorboard_while_an_async_save_is_written_names_the_save(tmp_path):
  """A disk that fills during an async save: TensorBoard's next write in the main thread fails first, but the
  writes that filled the disk were the save's, and the exit does not wait for it. The line names the checkpoint
  write (before: only the TensorBoard file); with no save in flight it names the file that failed, as before."""
  run_dir = tmp_path / "run"
  events = run_dir / "tensorboard" / "run" / "events.out.tfevents.1.vm"
  (run_dir / "checkpoints" / "8.orbax-checkpoint-tmp-1796614770").mkdir(parents=True)
  (run_dir / "checkpoints" / "unrelated.orbax-checkpoint-tmp-1").mkdir()
  line = disk_full.line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(events)), run_dir, False)
  assert line.startswith(f"checkpoint not saved: the disk filled while checkpoint 8 was being written to "
                         f"{run_dir / 'checkpoints'} in the background ({events} could not be written either: No space "
                         "left on device); "), line
  assert line.endswith("the last complete checkpoint (none) is kept; summary.json not written; free space or move "
                       "base_output_directory"), line
  (run_dir / "checkpoints" / "8.orbax-checkpoint-tmp-1796614770").rmdir()
  assert disk_full.line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(events)), run_dir).startswith(
      f"storage full: could not write {events}: No space left on device; ")


SUMMARY_PAST_THE_LIMIT = r"""
import json, resource, signal, sys
from pathlib import Path
from MaxText.run import metrics
out = Path(sys.argv[1])
metrics.write_summary({"losses": {"0": 1.0}}, out)  # the previous invocation's, 28 bytes
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
for directory in (out, out / "fresh"):
  try:
    metrics.write_summary({"losses": {str(i): 1.0 for i in range(100)}}, directory)
  except OSError as e:
    print("refused", e.errno)
"""


def test_a_summary_the_disk_cannot_hold_leaves_the_previous_one_or_none(tmp_path):
  """A write that fails midway (the file size limit stands in for a full disk) leaves no empty or torn summary.json:
  the line that says "summary.json not written" is then true."""
  proc = subprocess.run([sys.executable, "-c", SUMMARY_PAST_THE_LIMIT, str(tmp_path)], cwd=REPO, capture_output=True,
                        text=True, timeout=60, check=False, env={**os.environ, "PYTHONPATH": SUBPROCESS_PYTHONPATH})
  assert proc.stdout.split() == ["refused", str(errno.EFBIG)] * 2, proc.stderr[-2000:]
  assert json.loads((tmp_path / "summary.json").read_text()) == {"losses": {"0": 1.0}}
  assert not (tmp_path / "fresh" / "summary.json").exists()
  assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["summary.json"]
  (tmp_path / "summary.json").unlink()  # a stand-in, not a run's: the fast tier's guard looks for one
