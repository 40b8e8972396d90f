"""OUT_DIR, written whole and durably by one run at a time: what export_hf and import_hf write into.

A run claims OUT_DIR before it reads or converts anything: it creates and locks OUT_DIR.lock (flock, which the
kernel drops when a run dies however it dies). A parent it cannot write fails there, at once (exit 6); a second
run into the same OUT_DIR while the first lives is refused, naming the first's pid (exit 2), instead of deleting the
first's OUT_DIR.tmp as it did when each run began by clearing it. Holding the lock, a run removes what a killed
run left (OUT_DIR.tmp, orbax's OUT_DIR.tmp.orbax-checkpoint-tmp-*), writes into OUT_DIR.tmp, fsyncs every file and
directory in it, renames it to OUT_DIR and fsyncs the parent: after a crash there is either no OUT_DIR or the whole
one. Any failure, and a signal (MaxText/hf/stop.py), removes OUT_DIR.tmp, orbax's folders and the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Iterator

from MaxText.hf.errors import BadInput, NotWritten
from MaxText.hf import reap
from MaxText.hf.reap import lock_path, partial, tmp_dir

# What storage answers a write it refuses (full, over quota or a file-size limit, read-only, forbidden, failing):
# NotWritten. Any other OSError on the way is not the output's, and keeps its traceback (exit 1).
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}

# OUT_DIR -> the descriptor of its lock, for the OUT_DIRs this process holds; and every OUT_DIR it has claimed.
# Process-wide because signals are: stop.py's handler removes partial output only where this process holds the
# lock (not another run's), and says it removed it where this process wrote.
_HELD: dict[Path, int] = {}
_CLAIMED: set[Path] = set()


def held(out_dir: Path) -> bool:
  return out_dir in _HELD


def claimed(out_dir: Path) -> bool:
  """Whether this process has held out_dir's lock (and so wrote, and removed, its partial output)."""
  return out_dir in _CLAIMED


def remove_partial(out_dir: Path) -> None:
  """Removes OUT_DIR.tmp and orbax's folders beside it, where this process holds the lock; else nothing (they are
  another live run's)."""
  if held(out_dir):
    for path in partial(out_dir):
      shutil.rmtree(path, ignore_errors=True)


def claim(out_dir: Path) -> None:
  """Takes OUT_DIR.lock: NotWritten when the parent refuses a new file, BadInput when another live run holds it.
  The lock file is unlinked by its holder on the way out, so a lock taken on a file that was unlinked meanwhile is
  dropped and taken again on the new one."""
  lock = lock_path(out_dir)
  while True:
    try:
      out_dir.parent.mkdir(parents=True, exist_ok=True)
      fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise NotWritten(f"{out_dir} cannot be written: {lock} cannot be created ({e.strerror or e})") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
      os.close(fd)
      raise BadInput(f"{out_dir} is being written by another run (pid {pid} holds {lock}): wait for it to end or "
                     "choose another OUT_DIR") from None
    try:
      if os.stat(lock).st_ino == os.fstat(fd).st_ino:
        break
    except FileNotFoundError:
      pass
    os.close(fd)
  os.ftruncate(fd, 0)
  os.pwrite(fd, str(os.getpid()).encode(), 0)
  _HELD[out_dir] = fd
  _CLAIMED.add(out_dir)


def exit_reaped(out_dir: Path, code: int) -> None:
  """Ends the process with `code` through reap.py, which removes the partial output and the lock once this
  process's writer threads are gone. SIGTERM and SIGINT stay blocked through the exec (the mask survives it), so a
  further signal cannot cut the removal short. Returns only if the exec failed (the caller then removes them
  itself)."""
  os.set_inheritable(_HELD[out_dir], True)
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
  try:
    os.execv(sys.executable, [sys.executable, "-I", "-S", reap.__file__, str(code), str(out_dir)])
  except OSError:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def release(out_dir: Path) -> None:
  fd = _HELD.pop(out_dir, None)
  if fd is not None:
    with contextlib.suppress(OSError):
      os.unlink(lock_path(out_dir))
    os.close(fd)


def _fsync(path: str, flags: int) -> None:
  fd = os.open(path, flags)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def durable(tmp: Path) -> None:
  """Every file under tmp, then each directory (bottom up), on disk: the rename after it publishes only data that
  a crash cannot take back."""
  for root, _dirs, files in os.walk(tmp, topdown=False):
    for name in files:
      _fsync(os.path.join(root, name), os.O_RDONLY)
    _fsync(root, os.O_RDONLY | os.O_DIRECTORY)


@contextlib.contextmanager
def writing(out_dir: Path) -> Iterator[Path]:
  """Claims out_dir, yields OUT_DIR.tmp (not yet created) to write into, and publishes it when the block ends. An
  existing OUT_DIR is BadInput; a write the disk refuses is NotWritten (exit 6); whatever ends the block early (that,
  any error, a signal's Stopped) removes the partial output and the lock."""
  if out_dir.exists():
    raise BadInput(f"{out_dir} already exists: choose a new OUT_DIR")
  claim(out_dir)
  tmp = tmp_dir(out_dir)
  try:
    if out_dir.exists():  # a run that held the lock before this one finished
      raise BadInput(f"{out_dir} already exists: choose a new OUT_DIR")
    for path in partial(out_dir):  # a killed run's
      if path.exists():
        shutil.rmtree(path)
    yield tmp
    durable(tmp)
    tmp.rename(out_dir)
    _fsync(str(out_dir.parent), os.O_RDONLY | os.O_DIRECTORY)
  except OSError as e:
    remove_partial(out_dir)
    release(out_dir)
    if e.errno not in WRITE_ERRNOS:
      raise
    raise NotWritten(f"{tmp} could not be written: {e.strerror or e}") from None
  except Exception:
    remove_partial(out_dir)
    release(out_dir)
    raise
  except BaseException:  # a signal's Stopped: removed now, and the lock kept for stop.exit_stopped, which removes
    remove_partial(out_dir)  # what writer threads still add once none is left (reap.py)
    raise
  release(out_dir)
