"""A full (or read-only) disk, whoever writes first: exit 6 with one line ("storage full", or "storage not
writable" for a read-only or forbidden one).

TensorBoard's events (patches/tensorboard.py writes them in the caller's thread), upstream's metrics,
a checkpoint (patches/checkpoint_guard.SaveFailed), the lock, the run's records and summary.json all
land on the same disk. Whichever write fails first, MaxText/run/loop.py turns it into one line: what could
not be written, where, how much is free there, and the last complete checkpoint, which is kept (a save
that failed leaves no step a resume would take: MaxText/checkpoints/records.py). Where an async save is
still being written, the line names it: the disk most likely filled under its writes, and the exit does
not wait for it. The process then exits
without waiting for writer threads or atexit handlers (a full disk once left one waiting forever).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable


# The OS's words for storage that refuses writes with space to spare (EROFS, EACCES, EPERM).
UNWRITABLE = ("Read-only file system", "Permission denied", "Operation not permitted")


class StorageFailure(RuntimeError):
  """The run's storage refused a write (disk full, quota, read-only): one line, exit 6."""


def chain(e: BaseException | None) -> list[BaseException]:
  """An exception and its causes and contexts, outermost first."""
  seen: list[BaseException] = []
  while e is not None and all(e is not x for x in seen):
    seen.append(e)
    e = e.__cause__ or e.__context__
  return seen


def is_storage_failure(e: BaseException) -> bool:
  from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

  return (any(isinstance(x, checkpoint_guard.SaveFailed) for x in chain(e))
          or checkpoint_guard.no_space_reason(e) is not None)


def try_write(write: Callable[[], object]) -> bool:
  """True when `write` succeeded; a disk that is full may well refuse it too."""
  try:
    write()
    return True
  except Exception:  # pylint: disable=broad-exception-caught
    return False


def line(e: BaseException, run_dir: Path, summary_written: bool | None = None) -> str:
  """What could not be written, where, how much is free, and what is kept."""
  from MaxText.checkpoints import resume  # pylint: disable=import-outside-toplevel
  from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

  summary = {True: "; summary.json written", False: "; summary.json not written", None: ""}[summary_written]
  failed = next((x for x in chain(e) if isinstance(x, checkpoint_guard.SaveFailed)), None)
  if failed is not None:
    return f"checkpoint not saved: {failed}{summary}"
  path = next((Path(x.filename) for x in chain(e) if isinstance(x, OSError) and x.filename), run_dir)
  probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
  steps = resume.checkpoint_steps(run_dir)
  reason = str(checkpoint_guard.no_space_reason(e)).replace(f" ({path})", "")
  kept = f"the last complete checkpoint ({'step ' + str(steps[-1]) if steps else 'none'}) is kept{summary}"
  if reason.startswith(UNWRITABLE):  # a disk remounted read-only, permissions: not a lack of space
    return (f"storage not writable: could not write {path}: {reason}; {kept}; make it writable or move "
            "base_output_directory")
  free = f"{shutil.disk_usage(probe).free / 2**20:.1f} MiB free there"
  saving = saves_in_flight(run_dir)
  if saving:  # the write that filled the disk was most likely the save's; this one only came first to the line
    return (f"checkpoint not saved: the disk filled while checkpoint {saving[-1]} was being written to "
            f"{run_dir / 'checkpoints'} in the background ({path} could not be written either: {reason}); {free}; "
            f"{kept}; free space or move base_output_directory")
  return f"storage full: could not write {path}: {reason}; {free}; {kept}; free space or move base_output_directory"


def saves_in_flight(run_dir: Path) -> list[int]:
  """The steps orbax is still writing (async_checkpointing: <step>.orbax-checkpoint-tmp*), oldest first: the exit
  that follows a storage failure does not wait for them, so none of them is saved."""
  from MaxText.checkpoints import records  # pylint: disable=import-outside-toplevel

  root = run_dir / "checkpoints"
  found = (p.name.split(records.IN_FLIGHT)[0] for p in root.glob(f"*{records.IN_FLIGHT}*")) if root.is_dir() else ()
  return sorted({int(step) for step in found if step.isdigit()})
