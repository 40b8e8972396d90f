"""Seam: maxtext.common.checkpointing.maybe_save_checkpoint (maxtext 0.2.5).

The training loop calls it right after each train step with the new state
(trainers/pre_train/train.py, training_loop_iteration ~892), and once more
after the loop for the final save; it is the one place that sees every state
before it reaches disk, at a step boundary. Upstream checks the loss only in
its metric logger, which runs a step behind the saves, so a diverged state was
saved before the abort (and restored by every restart). Here, on every step
that would save:

  1. the state is checked for non-finite values first (and its digests taken); a non-finite state is
     never saved (NonFiniteState names the step, which arrays, and the step's
     loss and gradient norm), so the last checkpoint is always finite and a
     resume picks it by itself;
  2. a stop request (SIGTERM, SIGUSR1, SIGINT: MaxText/run/lifecycle.py; or JAX's
     multi-process preemption sync point, which upstream already consults)
     saves this step, waits for it, and ends the loop through upstream's own
     StopTraining (its loop flushes metrics and returns normally);
  3. a save the disk cannot hold is refused before it starts (SaveFailed: the
     path, the bytes needed and the bytes free); one that fails anyway for lack
     of space or permission becomes the same error, its partial directory
     removed; the last complete checkpoint stays.

Each save it starts is timed from its start (after the finite check, which waits
for the step) until orbax renames its step directory to the step number, on process 0
only (MaxText/console/progress.py's watch_save); then one line gives the step directory's size and the
time (`checkpoint 40 saved: 1.23 GiB in 3.4 s`), and `saves` keeps it for the summary.

Before each save starts, our record of the step goes to <run>/maxtext-moe/checkpoints/<step>.json: each
array's shape, dtype and content digest (floats, integer step counts and RNG keys alike), from the same pass as
the finite check (MaxText/checkpoints/records.py). A step directory without it is never resumed from;
patches/checkpoint_restore.py compares the restored arrays with it. After each save the records of steps orbax
has deleted go; a save still in flight (async_checkpointing: orbax commits it in the background) keeps its
record (MaxText/checkpoints/records.py's drop_stale_records).
"""

from __future__ import annotations

import errno
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from MaxText.console import progress
from patches._seam import Seam

SEAM = Seam(
    name="checkpoint_guard",
    module="maxtext.common.checkpointing",
    attr="maybe_save_checkpoint",
    sha256="c9ec828e8728deb3",
)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


class NonFiniteState(RuntimeError):
  """The state about to be saved holds NaN or Inf (or the step's loss is); it was not saved."""

  def __init__(self, message: str, step: int | None = None):
    super().__init__(message)
    self.step = step  # the step that went non-finite (MaxText/checkpoints/resume.py's record_nonfinite)


class SaveFailed(RuntimeError):
  """A checkpoint could not be written; the last complete one is kept."""


# Set by apply(): the stop request's signal name (None: none), and the step's
# scalars (patches/step_metrics.py) for the message.
_stop_signal: Callable[[], str | None] = lambda: None
_step_scalars: Callable[[], dict[str, Any]] = dict
stopped: dict[str, Any] = {}  # filled when a stop request ended the loop: {"step", "signal", "saved"}
saves: list[dict[str, Any]] = []  # each completed save this process watched: {"step", "bytes", "seconds"}
_last: list[Any] = []  # the arguments of the last step's call: (manager, state, config, data_iterator, step)
_watching: list[threading.Thread] = []
_stop_watching = threading.Event()


def _leaves_with_paths(state) -> list[tuple[str, Any]]:
  """Every array of the state by its key path: the floats, and the integer ones (the optimizer's step counts,
  which drive the learning-rate schedule; RNG keys and counters), all digested in each record."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  if isinstance(state, nnx.Module):
    state = nnx.state(state)
  flat, _ = jax.tree_util.tree_flatten_with_path(state)
  return [(jax.tree_util.keystr(path, simple=True, separator="/"), x) for path, x in flat if hasattr(x, "dtype")]


def _scalar(scalars: dict[str, Any], name: str) -> str:
  value = scalars.get(name)
  return "n/a" if value is None else f"{float(value):.6g}"


def check_finite(state, step: int, last_saved: int | None) -> tuple[list[tuple[str, Any]], list[str]]:
  """Raises NonFiniteState naming the step, the arrays and the step's loss and gradient norms; else returns
  the state's arrays (name, array) and their content digests (the same pass: MaxText/checkpoint_records)."""
  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel

  leaves = _leaves_with_paths(state)
  flags, digests = checkpoint_records.scan([x for _, x in leaves])
  if all(flags):
    return leaves, digests
  bad = [name for (name, _), ok in zip(leaves, flags) if not ok]
  params = [n for n in bad if "opt_state" not in n]
  opt = [n for n in bad if "opt_state" in n]
  parts = []
  if params:
    parts.append(f"{len(params)} parameter arrays (first {params[0]})")
  if opt:
    parts.append(f"{len(opt)} optimizer-state arrays (first {opt[0]})")
  s = _step_scalars()
  kept = f"the last checkpoint, step {last_saved}, is finite" if last_saved is not None else "no checkpoint exists yet"
  raise NonFiniteState(
      f"step {step}: non-finite values after the update in {' and '.join(parts)}; this step's loss "
      f"{_scalar(s, 'learning/loss')}, gradient norm {_scalar(s, 'learning/raw_grad_norm')} (after clipping "
      f"{_scalar(s, 'learning/grad_norm')}); not saved, {kept}; lower learning_rate or set gradient_clipping_threshold", step=step)


def _state_nbytes(state) -> int:
  return sum(int(x.size) * getattr(x.dtype, "itemsize", 16) for _, x in _leaves_with_paths(state))  # a key: 16 B


# How storage failures read when they come through tensorstore (orbax's writer)
# as a ValueError rather than an OSError: the status code, or the OS's words.
NO_SPACE_WORDS = ("RESOURCE_EXHAUSTED", "No space left on device", "Disk quota exceeded", "Read-only file system",
                  "Permission denied", "File too large")


def no_space_reason(e: BaseException) -> str | None:
  """The storage failure behind a save error (None: something else failed)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in NO_SPACE:
      return f"{e.strerror} ({e.filename})" if e.filename else str(e.strerror)
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text and "out of memory" in text.lower():
      return None  # XLA's allocator (host or device) shares tensorstore's status code: memory, not storage
    for words in NO_SPACE_WORDS:
      if words in text:
        return "no space left on the device" if words == "RESOURCE_EXHAUSTED" else words
    e = e.__cause__ or e.__context__
  return None


def check_space(state, root: Path, step: int, last: int | None) -> None:
  """Refuses a save the disk cannot hold, before a byte is written.

  The state's in-memory size bounds the checkpoint's (orbax writes it
  uncompressed, plus small metadata); an attempt that fails half-way would
  leave orbax's writer threads printing tracebacks. A save that fails anyway
  (another writer filled the disk) is caught after the fact (_save_failed).
  """
  probe = root if root.exists() else root.parent
  free = shutil.disk_usage(probe).free
  need = _state_nbytes(state)
  if need > free:
    raise SaveFailed(
        f"checkpoint of step {step} not written to {root}: it needs about {need / 2**20:.1f} MiB and "
        f"{free / 2**20:.1f} MiB are free; the last complete checkpoint "
        f"({'step ' + str(last) if last is not None else 'none'}) is kept; free space or move base_output_directory")


def _save_failed(e: BaseException, root: Path, step: int, state, last: int | None) -> SaveFailed:
  """The message: which path, how much the save needed, how much was free."""
  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel

  for partial in root.glob(f"{step}{checkpoint_records.IN_FLIGHT}*"):  # orbax's in-progress name for this step
    shutil.rmtree(partial, ignore_errors=True)
  free = shutil.disk_usage(root).free if root.exists() else 0
  return SaveFailed(
      f"checkpoint of step {step} could not be written to {root}: {no_space_reason(e)}; it needs "
      f"about {_state_nbytes(state) / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free; the partial step was removed "
      f"and the last complete checkpoint ({'step ' + str(last) if last is not None else 'none'}) is kept")


def _report_save(step: int):
  def on_saved(seconds: float, nbytes: int) -> None:
    saves.append({"step": step, "bytes": nbytes, "seconds": seconds})
    # One write: this runs on the watch thread, beside the main thread's own lines (which say() writes whole too).
    progress.say(f"[maxtext-moe] checkpoint {step} saved: {progress.fmt_bytes(nbytes)} in {seconds:.1f} s")

  return on_saved


def _watch_save(root: Path, step: int, began: float) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_index() == 0:  # one process looks: the step directory is shared
    _watching.append(progress.watch_save(root / str(step), began, _report_save(step), _stop_watching))


def finish_save_reports(timeout_s: float = 10.0) -> list[dict[str, Any]]:
  """After the loop (upstream has waited for its saves): lets the watches print their lines, then stops any
  left (a save that never completed); returns `saves`."""
  deadline = time.monotonic() + timeout_s
  for thread in _watching:
    thread.join(max(0.0, deadline - time.monotonic()))
  _stop_watching.set()
  _watching.clear()
  return saves


def _record(run_dir: Path, step: int, leaves, digests) -> None:
  """Our record of the step (MaxText/checkpoints/records.py), before orbax starts: a step directory counts as
  a checkpoint only with it, so one whose save dies has none that could vouch for it."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel

  if jax.process_index() == 0:
    checkpoint_records.write_record(run_dir, step, leaves, digests)


def _drop_stale_records(run_dir: Path) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel

  if jax.process_index() == 0:
    checkpoint_records.drop_stale_records(run_dir)


def _wrap(original):
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel
  from maxtext.utils import exceptions  # pylint: disable=import-outside-toplevel

  def maybe_save_checkpoint(checkpoint_manager, state, config, data_iterator, step=None, _force: str | None = None):
    multi = _multi_process()
    signal_name = _stop_signal()
    if step is not None and not _force:  # the state of the last step trained, for save_last_step
      _last[:] = [checkpoint_manager, state, config, data_iterator, step]
    # Multi-process: only JAX's sync point, which every process reaches at the same step.
    stop = step is not None and ((signal_name is not None and not multi) or _force is not None
                                 or checkpointing.reached_preemption(checkpoint_manager, step))
    if checkpoint_manager is None:
      if stop:
        stopped.update(step=int(step), signal=signal_name or "SIGTERM", saved=None)
        raise exceptions.StopTraining(f"{signal_name or 'preemption'}: stopping at step {step} (checkpointing off)")
      return original(checkpoint_manager, state, config, data_iterator, step)

    actual = int(step) if step is not None else int(
        state.step if config.enable_diloco else state.optimizer.step) - 1
    due = stop or step is None or checkpointing._should_save_checkpoint_at_step(  # pylint: disable=protected-access
        checkpoint_manager, actual, config, False)
    if not due:  # most steps: nothing to check, and no directory listing
      return original(checkpoint_manager, state, config, data_iterator, step)
    done = checkpointing.all_steps(checkpoint_manager)
    root = Path(config.checkpoint_dir.rstrip("/"))
    last = max(done) if done else None
    if actual not in done:
      leaves, digests = check_finite(state, actual, last)  # waits for the step: the save's time starts after it
      check_space(state, root, actual, last)
      _record(root.parent, actual, leaves, digests)
    began = time.monotonic()
    try:
      if stop:
        if actual not in done:
          checkpointing.save_checkpoint(checkpoint_manager, actual, state, config, data_iterator, force=True)
        checkpointing.wait_until_finished(checkpoint_manager)
      else:
        original(checkpoint_manager, state, config, data_iterator, step)
    except exceptions.StopTraining:
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      if no_space_reason(e) is not None:
        raise _save_failed(e, root, actual, state, last) from e
      raise
    if actual not in done:
      _watch_save(root, actual, began)
      _drop_stale_records(root.parent)
    if _force is not None:
      return actual
    if stop:
      stopped.update(step=actual, signal=signal_name or "SIGTERM", saved=actual)
      raise exceptions.StopTraining(f"{signal_name or 'preemption notice'}: checkpoint of step {actual} saved")

  maybe_save_checkpoint.__wrapped__ = original
  return maybe_save_checkpoint


def save_last_step(reason: str) -> int | None:
  """Saves the state of the last step trained, as a stop signal does (the finite check, the space check, our
  record, then the save, waited for), and returns its step; None when no step was trained in this process or
  checkpointing is off. For a stop found between steps (patches/data_passes.py: the data ran out while the next
  batch was read): that state is the one maybe_save_checkpoint last saw, and no train step has consumed
  (donated) it since, because the next step never ran."""
  if not _last or _last[0] is None:
    return None
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  manager, state, config, data_iterator, step = _last
  return checkpointing.maybe_save_checkpoint(manager, state, config, data_iterator, step, _force=reason)


def _multi_process() -> bool:
  import jax  # pylint: disable=import-outside-toplevel

  return jax.process_count() > 1


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  global _stop_signal, _step_scalars
  if hooks is not None:
    _stop_signal, _step_scalars = hooks.stop_signal, hooks.step_scalars
  stopped.clear()
  saves.clear()
  _last.clear()
  _stop_watching.clear()
  SEAM.apply(_wrap)


def undo() -> None:
  global _stop_signal, _step_scalars
  _stop_signal, _step_scalars = (lambda: None), dict
  _last.clear()
  SEAM.undo()
