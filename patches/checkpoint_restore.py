"""Seam: maxtext.common.checkpointing.load_state_if_possible (maxtext 0.2.5).

On resume upstream restores the latest step orbax lists, trusting it: an empty `checkpoints/99/` is
"the latest", a truncated or deleted file ends in an orbax traceback without the step before being
tried, and flipped bytes that still decompress restore silently (measured: a few flipped bits in the
tiny model's largest data file load as other numbers). Here:

  1. the candidates are the run's checkpoints (MaxText/checkpoints/records.py: orbax's commit marker
     and our record), newest first; the trainer has set every other step directory aside before
     upstream started, and orbax's step list is reloaded so that every process sees the same;
  2. a candidate whose record's shapes differ from the state this config builds is a config change,
     not damage: ShapeMismatch (a ConfigError) names the first array, as before orbax would fail;
  3. each candidate is restored by upstream (`step=` given), then checked: the restored arrays the same
     set of names as at save, finite, and equal to the digests taken at save (integer step counts and RNG keys
     included). In a multi-process job the processes first agree whether every one loaded it (`agree`: one
     all-gather), so all set it aside or none does. A candidate that fails to load with the
     checkpoint's own damage (tensorstore's OUT_OF_RANGE, DATA_LOSS, ...; orbax's layout errors), or
     fails the check, is reported in one line and set aside (`<step>.unusable`, its files kept), and
     the one before is tried, down to none: then the run starts at step 0, as one line says. Any other
     load error (out of memory, ...) is raised: it is not the checkpoint's fault.

After the restore, a run that last stopped at a non-finite step (exit 4) and sets
nonfinite_skip_batches=K > 0 advances the restored data iterator past the batches that led there
(MaxText/checkpoints/resume.py's record says how many), as Megatron users skip a loss spike's batches:
next() on upstream's iterator, exactly as the training loop would read them, and one log line saying
which. Only grain's iterator position is in a checkpoint (upstream restores it in place right here);
synthetic data is one fixed batch, so skipping would change nothing, and tfds/hf iterators restart
from the data's start, so neither is skipped (the log line says so).

`on_restored(step or None)` (patches.Hooks) is called once the run's starting point is settled: the
trainer writes the run's records then, so a resume refused here leaves them as they were.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Callable

from MaxText.console import ending
from MaxText.console.progress import log as _log
from patches._seam import Seam

SEAM = Seam(
    name="checkpoint_restore",
    module="maxtext.common.checkpointing",
    attr="load_state_if_possible",
    sha256="68a6096cc1e87041",
)


def _shape_mismatch_error():
  from MaxText.config.keys import ConfigError  # pylint: disable=import-outside-toplevel

  class ShapeMismatch(ConfigError):
    """The config builds a state whose shapes differ from the checkpoint's."""

  return ShapeMismatch


ShapeMismatch = None  # bound in apply() (our ConfigError is imported lazily: patches sit below MaxText)
_skip_at_least = 0  # fork.nonfinite_skip_batches, set by apply()
_on_restored: Callable[[int | None], None] = lambda step: None  # hooks.on_restored, set by apply()
skipped: dict[str, int] = {}  # filled when a skip was applied: {"checkpoint", "batches"}


def skip_nonfinite_batches(run_dir: Path, restored: int, data_iterator, dataset_type: str | None) -> None:
  """Advances the iterator restored at checkpoint `restored` past a non-finite stop's batches."""
  from MaxText.checkpoints import resume  # pylint: disable=import-outside-toplevel

  found = resume.batches_to_skip(run_dir, restored, _skip_at_least)
  if found is None:
    return
  batches, record = found
  first, last = restored + 1, restored + batches
  what = (f"step {record['step']} went non-finite after checkpoint {restored}; nonfinite_skip_batches="
          f"{_skip_at_least}")
  if dataset_type != "grain" or not data_iterator:
    why = ("synthetic data is one fixed batch, so skipping changes nothing" if dataset_type == "synthetic" else
           f"dataset_type={dataset_type}'s position is not in the checkpoint (only grain's is)")
    _log(f"{what}: no batches skipped: {why}")
    return
  for iterator in data_iterator if isinstance(data_iterator, list) else [data_iterator]:
    for _ in range(batches):
      next(iterator)
  skipped.update(checkpoint=restored, batches=batches)
  _log(f"{what}: skipped {batches} batches, those an unbroken run reads at steps {first}..{last}; "
       f"step {first} trains on the batch of step {last + 1}")


def first_difference(recorded: dict[str, list], current: dict[str, list]) -> str | None:
  """'name: checkpoint (shape) dtype, this config (shape) dtype' for the first array that differs."""
  for name, (shape, dtype) in recorded.items():
    if name not in current:
      return f"'{name}' is in the checkpoint {tuple(shape)} but not in the state this config builds"
    if list(current[name][0]) != list(shape) or current[name][1] != dtype:
      return (f"'{name}' is {tuple(shape)} {dtype} in the checkpoint but {tuple(current[name][0])} "
              f"{current[name][1]} in the state this config builds")
  extra = [name for name in current if name not in recorded]
  return f"'{extra[0]}' is in the state this config builds but not in the checkpoint" if extra else None


def _sync(name: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    multihost_utils.sync_global_devices(name)


def agree(ok: bool) -> list[bool]:
  """Every process's `ok`, by process index (one all-gather of an int32 a process; just [ok] with one process).

  A checkpoint's files are read by every process, each its own shards: one process can fail to load what the
  others loaded. Before any process checks the digests (a computation over the global arrays, which every process
  must join) or sets the step aside, they agree, so that none goes on with a state the others dropped, and none
  waits in a collective the others never reach."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1:
    return [ok]
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return [bool(x) for x in np.asarray(multihost_utils.process_allgather(np.int32(ok))).reshape(-1)]


def _set_aside(checkpoint_manager, run_dir: Path, step: int) -> str:
  """Process 0 renames the step directory; every process then reloads orbax's step list."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel

  name = f"{step}{checkpoint_records.SET_ASIDE}"
  if jax.process_index() == 0:
    name = checkpoint_records.set_aside(run_dir, step).name
  _sync(f"maxtext-moe-set-aside-{step}")
  checkpoint_manager.reload()
  return name


# asyncio's words for a task's or a bare future's error that nothing awaited (base_events.call_exception_handler).
UNRETRIEVED = ("Task exception was never retrieved", "Future exception was never retrieved")


class _DropFailedReadEchoes(logging.Filter):
  """orbax reads a checkpoint's arrays in parallel asyncio tasks; when one fails for the checkpoint's damage, the
  others' errors are never retrieved, and asyncio logs each with a traceback when the task is collected, at any
  time later. orbax's own worker threads (futures._SignalingThread) log the same damage with logging.exception
  (the error's text, then its traceback: CI's slow tier, a truncated data file under async saves). The damage is
  already said in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    failed = record.exc_info[1] if record.exc_info else None
    return not (record.getMessage().startswith(UNRETRIEVED) or _of_the_failed_read(failed))


# The loggers the echoes come through: asyncio's default exception handler, and absl's, which orbax logs with.
ECHO_LOGGERS = ("asyncio", "absl")


def _of_the_failed_read(exc: BaseException | None) -> bool:
  """A closed event loop's error, or the damage itself, raised again by a read orbax abandoned."""
  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel

  closed = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
  return exc is not None and (closed or checkpoint_records.damage(exc) is not None)


def _an_abandoned_orbax_read(obj: Any) -> bool:
  """A coroutine of orbax's own collected with its error still in it (the error alone, without the cause that
  named the damage, does not say so: "Encountered error while reading array index")."""
  return "/orbax/checkpoint/" in getattr(getattr(obj, "cr_code", None), "co_filename", "")


def _quiet_failed_reads() -> None:
  """After a read that failed for the checkpoint's damage: orbax closes its event loop while tensorstore still
  completes the other reads, whose callbacks then raise "Event loop is closed" on tensorstore's threads, each
  printed with a traceback (PyErr_Print, through sys.excepthook), and the abandoned reads' coroutines are
  collected with the damage still in them (an unraisable exception). Those, the same errors ending a Python
  thread (threading.excepthook, which sys.excepthook does not see), asyncio's unretrieved tasks and orbax's
  threads' logs of the same damage are dropped; every other error prints as before."""
  if _quieted:
    return
  _quieted.append(_DropFailedReadEchoes())
  for name in ECHO_LOGGERS:
    logging.getLogger(name).addFilter(_quieted[0])
  _quieted.append(ending.drop_errors(
      _of_the_failed_read,
      lambda unraisable: _of_the_failed_read(unraisable.exc_value) or _an_abandoned_orbax_read(unraisable.object)))


_quieted: list[Any] = []  # the echoes' log filter and the hooks' undo, once a damaged read was quieted
# Set once any read failed for damage in this process: its abandoned reads' errors surface whenever their tasks are
# collected, which may be after a later restore's good read (upstream restores more than once a run; the harness
# runs cases in one process), so from then on the quiet stays until undo().
_a_read_failed: list[bool] = []


def _unquiet() -> None:
  if _quieted:
    for name in ECHO_LOGGERS:
      logging.getLogger(name).removeFilter(_quieted[0])
    _quieted[1]()
    _quieted.clear()


def _iterator_states(data_iterator) -> list[Any] | None:
  """Each grain iterator's position before a restore moves it (None when it has none to give)."""
  iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
  local = [getattr(it, "local_iterator", None) for it in iterators]
  if not all(hasattr(it, "get_state") and hasattr(it, "set_state") for it in local):
    return None
  return [it.get_state() for it in local]


def _restore_iterators(data_iterator, states: list[Any] | None) -> None:
  if states is not None:
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    for it, state in zip(iterators, states):
      it.local_iterator.set_state(state)


def _restore_verified(original, bound: inspect.BoundArguments, run_dir: Path):
  """Tries the run's checkpoints newest first; (restored, step) of the first that loads and checks out."""
  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel

  from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

  manager = bound.arguments["checkpoint_manager"]
  _sync("maxtext-moe-checkpoints")  # process 0 set stray step directories aside before upstream started
  manager.reload()
  abstract = checkpoint_guard._leaves_with_paths(bound.arguments["abstract_unboxed_pre_state"])  # pylint: disable=protected-access
  data_iterator = bound.arguments["data_iterator"]
  before = _iterator_states(data_iterator)
  steps = checkpoint_records.complete_steps(run_dir)
  for i, step in enumerate(reversed(steps)):
    record = checkpoint_records.read_record(run_dir, step)
    current = {name: [list(x.shape), str(x.dtype)] for name, x in checkpoint_records.covered(record, abstract)}
    diff = first_difference(checkpoint_records.shapes_of(record), current)
    if diff:
      raise ShapeMismatch(f"resuming {run_dir} from checkpoint step {step}: the model's shape changed: {diff}")
    bound.arguments["step"] = step
    # Quieted before the read: the other reads' callbacks may fire while the failed one is still propagating.
    _quiet_failed_reads()
    why = None
    try:
      restored = original(*bound.args, **bound.kwargs)
    except Exception as e:  # pylint: disable=broad-exception-caught
      why = checkpoint_records.damage(e)
      if why is None:
        raise
      why = f"it does not load: {why}"
      _a_read_failed[:] = [True]
    failed = [i for i, ok in enumerate(agree(why is None)) if not ok]  # every process, or none, goes on
    if why is None and failed:
      why = f"it does not load on process {failed[0]} (its log says why)"
    if why is None:
      if not _a_read_failed:
        _unquiet()  # no read has failed: nothing is left behind to quiet
      items = restored[0]["items"] if restored[0] is not None else None
      named = checkpoint_guard._leaves_with_paths(items) if items is not None else []  # pylint: disable=protected-access
      named = checkpoint_records.covered(record, named)
      finite, digests = checkpoint_records.scan([x for _, x in named])  # global arrays: the same on every process
      why = checkpoint_records.mismatch(record, named, finite, digests)
      if why is None:
        if i:
          _log(f"resumed from checkpoint step {step} instead (loaded, finite, digests as at save)")
        return restored, step
    name = _set_aside(manager, run_dir, step)
    nxt = f"trying checkpoint {steps[-2 - i]}" if i + 1 < len(steps) else "no checkpoint is left"
    _log(f"WARNING: checkpoint {step} of {run_dir} is damaged ({why}); set aside as checkpoints/{name}; {nxt}")
  if steps:
    _log(f"WARNING: none of the {len(steps)} checkpoint(s) of {run_dir} could be restored: training starts at step 0")
    _restore_iterators(data_iterator, before)
  return None, None


def _wrap(original):
  signature = inspect.signature(original)

  def load_state_if_possible(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    manager = bound.arguments["checkpoint_manager"]
    restored, step = None, None
    if manager is not None:
      run_dir = Path(str(manager.directory)).parent
      restored, step = _restore_verified(original, bound, run_dir)
    if restored is None:  # no checkpoint: upstream's own start (load_parameters_path, ... or a fresh state)
      bound.arguments["checkpoint_manager"] = None
      restored = original(*bound.args, **bound.kwargs)
    else:
      config = bound.arguments.get("maxtext_config")
      skip_nonfinite_batches(run_dir, int(step), bound.arguments["data_iterator"],
                             getattr(config, "dataset_type", None))
    _on_restored(step)
    return restored

  load_state_if_possible.__wrapped__ = original
  return load_state_if_possible


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  global ShapeMismatch, _skip_at_least, _on_restored
  if ShapeMismatch is None:
    ShapeMismatch = _shape_mismatch_error()
  _skip_at_least = int(getattr(fork, "nonfinite_skip_batches", 0))
  _on_restored = getattr(hooks, "on_restored", None) or (lambda step: None)
  skipped.clear()
  SEAM.apply(_wrap)


def undo() -> None:
  global _skip_at_least, _on_restored
  _a_read_failed.clear()
  _unquiet()
  _skip_at_least = 0
  _on_restored = lambda step: None  # noqa: E731
  SEAM.undo()
