"""The partial output of a write to OUT_DIR, and its removal by a process image that no writer thread survives.

orbax's and tensorstore's writer threads go on writing after a signal stops the main thread, and tensorstore
creates the parent folders of each file it writes: a folder removed while they live can come back before the
process ends (CI's slow tier: `OUT_DIR.tmp.orbax-checkpoint-tmp` left by an import signalled mid-write). execve
ends every other thread of the process at once and keeps its pid, its signal mask and its inheritable
descriptors, so stop.py ends a signalled run by executing this file: it removes what the write left and the lock
(still held through the inherited descriptor), then exits with the run's code. It is stdlib only because it runs
as `python -I -S reap.py`, outside the package.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def tmp_dir(out_dir: Path) -> Path:
  return out_dir.with_name(out_dir.name + ".tmp")


def lock_path(out_dir: Path) -> Path:
  return out_dir.with_name(out_dir.name + ".lock")


def partial(out_dir: Path) -> list[Path]:
  """What a write to out_dir leaves when cut short: OUT_DIR.tmp, and orbax's `OUT_DIR.tmp.orbax-checkpoint-tmp*`
  (a checkpoint is written there first and renamed)."""
  tmp = tmp_dir(out_dir)
  return [tmp, *tmp.parent.glob(f"{tmp.name}.orbax-checkpoint-tmp*")]


def _main(code: str, out_dir: str) -> None:
  out = Path(out_dir)
  for path in partial(out):
    shutil.rmtree(path, ignore_errors=True)
  try:
    os.unlink(lock_path(out))
  except OSError:
    pass
  os._exit(int(code))  # pylint: disable=protected-access


if __name__ == "__main__":
  _main(*sys.argv[1:])
