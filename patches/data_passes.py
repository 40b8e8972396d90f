"""Seam: maxtext.input_pipeline.input_pipeline_interface.make_grain_train_iterator (maxtext 0.2.5).

Upstream builds the grain pipeline with `dataset.repeat(num_epoch)` (base.yml: num_epoch 1), so a corpus
smaller than `steps` batches runs out. Its data loader turns the StopIteration into StopTraining
(common/data_loader.py, loader_exception_guard), which its loop takes for a normal end: the run stopped with
exit 0, no line, and nothing saved since the last periodic checkpoint; a rerun resumed there and stopped at
the same step again (a 200-document corpus at steps=400 ended at step 92, every time).

`create_data_iterator` looks the maker up by this name when it is called, so the replacement sees every
grain train iterator (the eval iterator is another function: its end is the end of an eval pass). It
  1. refuses a dataset that cannot fill even one batch before the train step is compiled (a ConfigError
     naming grain_train_files: one line, exit 2), from a probe iterator of its own, closed after; with several
     processes, on every process when any one's shard is that short (named);
  2. gives the iterator (upstream's MultiHostDataLoadIterator) a subclass whose __next__ meets the end of the
     data as fork key `data_exhausted` says:
       repeat  starts another pass over the same files, says so in one line, and counts the passes: the step's
               `data/pass` scalar in TensorBoard, `data_passes` in the summary, each pass's first step in
               <run>/maxtext-moe/data_passes.json (MaxText/checkpoints/run_records.py, through
               hooks.on_data_pass) so that a resume knows which pass its checkpoint was in. Each pass is shuffled
               anew, as upstream's num_epoch shuffles each epoch (grain's shuffle seeds epoch e with seed + e):
               pass p is upstream's pipeline built again with data_shuffle_seed moved on by the epochs of the
               passes before, (p - 1) * num_epoch; a resume in pass p builds it so too, then takes the restored
               position. With enable_data_shuffling=false each pass reads the files in the same order, as
               upstream's own repeat does;
       stop    saves the last step trained (patches/checkpoint_guard.save_last_step), fills `exhausted`, and
               ends upstream's loop through its own StopTraining; MaxText/run/loop.py then exits 11 with one
               line naming the files and the step. With several processes, whose shards end at different steps,
               every batch is agreed on first (one all-gather of a flag): all stop at the first step any process
               lacks a batch for, and one that had read it puts it back (grain's get_state/set_state).
The elastic and colocated iterators are other classes and are left as upstream builds them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from MaxText.console.progress import log as _log
from patches._seam import Seam

SEAM = Seam(
    name="data_passes",
    module="maxtext.input_pipeline.input_pipeline_interface",
    attr="make_grain_train_iterator",
    sha256="32bcf0b0625b11d7",  # grain_data_processing's function, bound here by `from ... import`
)
# The subclass leans on the iterator's __next__, reset() and local_iterator: its class is checked too.
ITERATOR = Seam(name="data_passes (iterator)", module="maxtext.input_pipeline.multihost_dataloading",
                attr="MultiHostDataLoadIterator", sha256="e6e016e9c8965beb")

# Set by apply() (fork.data_exhausted) and MaxText/run/loop.py (the start of this invocation).
_mode = ["repeat"]
_on_pass: Callable[[int, int], None] = lambda pass_no, step: None  # hooks.on_data_pass(pass, first step)
_position = {"pass": 1, "step": 0, "files": "", "epochs": 1}  # the pass being read, the step the next batch is for
exhausted: dict[str, Any] = {}  # filled when the data ran out with data_exhausted=stop: {"step", "pass", "saved", "files"}


_live: list[Any] = []  # a weak reference to this process's DataPasses iterator, once built


def start(step: int, pass_no: int) -> None:
  """Where this invocation's first batch falls: the step after the restored checkpoint (0 for a new run) and the
  pass that checkpoint's iterator was in. The iterator, built before the restore for pass 1, then reads that
  pass's order from the position restored."""
  _position.update(step=step, **{"pass": pass_no})
  it = _live[0]() if _live else None
  if it is not None and it.pass_built != pass_no and it.shuffled():
    old = it.local_iterator
    it.read_pass(pass_no)
    it.local_iterator.set_state(old.get_state())
    _close(old)


class _PassConfig:
  """Upstream's config as pass `pass_no` reads it: data_shuffle_seed moved on by the epochs of the passes before
  (upstream's pipeline holds num_epoch epochs, the k-th shuffled with seed + k), every other key as it is."""

  def __init__(self, config: Any, pass_no: int):
    self._config = config
    epochs_before = (pass_no - 1) * max(1, int(config.num_epoch))
    self.data_shuffle_seed = (int(config.data_shuffle_seed) + epochs_before) % 2**32  # grain's seeds are uint32

  def __getattr__(self, name: str) -> Any:
    return getattr(self._config, name)


def current_pass() -> int:
  return _position["pass"]


def epochs_per_pass() -> int:
  """Upstream's num_epoch: the epochs one pass of its pipeline holds (dataset.repeat(num_epoch))."""
  return _position["epochs"]


def reading() -> bool:
  """Whether this process reads its batches through a grain train iterator of ours."""
  return bool(_position["files"])


def _close(iterator) -> None:
  """Upstream's own two-step close (grain's close, then leftover workers): a pass's iterator or the probe."""
  from maxtext.input_pipeline import multihost_dataloading  # pylint: disable=import-outside-toplevel

  multihost_dataloading._close_iterator(iterator)  # pylint: disable=protected-access
  try:
    multihost_dataloading._terminate_iterator_workers(iterator)  # pylint: disable=protected-access
  except AssertionError:
    pass  # grain's _parent on a top-level iterator (patches/grain_iterator_close.py): its workers are closed


def _check_one_batch(it, config) -> None:
  """A ConfigError when the pipeline yields no batch at all: a probe iterator over the same dataset. Every
  process probes its own shard, and all stop, or none: one whose shard is empty would otherwise leave the
  others waiting in the first step's collectives."""
  from MaxText.config.keys import ConfigError  # pylint: disable=import-outside-toplevel
  from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

  probe = iter(it.dataloader)
  try:
    next(probe)
    filled = True
  except StopIteration:
    filled = False
  finally:
    _close(probe)
  filled_by_process = checkpoint_restore.agree(filled)
  empty = [str(i) for i, ok in enumerate(filled_by_process) if not ok]
  n, batch = len(filled_by_process), config.global_batch_size_to_load
  if empty:
    whose = f"the data does not fill one batch of {batch} sequences" if n == 1 else (
        f"{'processes' if len(empty) > 1 else 'process'} {', '.join(empty)} of {n} (grain shards the data per "
        f"process) {'read' if len(empty) > 1 else 'reads'} too little to fill {batch // n} of a batch's {batch} "
        "sequences")
    raise ConfigError(
        f"config key 'grain_train_files' = {_position['files']!r}: {whose} of "
        f"max_target_length={config.max_target_length} tokens "
        "(too few documents, or empty ones), so not even one step could train; add data, or lower "
        "per_device_batch_size or max_target_length")


_classes: dict[type, type] = {}


def _passes_class(base: type) -> type:
  if base not in _classes:
    _classes[base] = _make_passes_class(base)
  return _classes[base]


def _make_passes_class(base):
  class DataPasses(base):
    """Upstream's MultiHostDataLoadIterator, meeting the end of its data as `data_exhausted` says."""

    def __next__(self):
      from patches import metric_logger  # pylint: disable=import-outside-toplevel

      if _mode[0] == "stop" and _process_count() > 1:
        batch = self._next_agreed()
      else:
        try:
          batch = super().__next__()
        except StopIteration:
          batch = self._end_of_pass()
      step = _position["step"]
      metric_logger.add_scalars(step, {"data/pass": float(_position["pass"])})
      _position["step"] = step + 1
      return batch

    def _next_agreed(self):
      """The next batch, once every process has read one: grain shards the data per process, so the processes
      run out at different steps. One that stopped alone would check and save its state while the others wait
      in the next step's collectives, all of them for good. A process that read a batch the others lack puts
      it back, so that the checkpoint's position is that of the last step trained."""
      from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

      before = self.local_iterator.get_state()
      try:
        batch = super().__next__()
      except StopIteration:
        batch = None
      have = checkpoint_restore.agree(batch is not None)  # one all-gather of a flag a process
      if all(have):
        return batch
      if batch is not None:
        self.local_iterator.set_state(before)
      return self._end_of_pass(lacking=[i for i, ok in enumerate(have) if not ok])

    def _end_of_pass(self, lacking: list[int] | None = None):
      step, pass_no, files = _position["step"], _position["pass"], _position["files"]
      if _mode[0] == "stop":
        from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

        saved = checkpoint_guard.save_last_step(f"the data ran out at step {step}")
        exhausted.update(step=step, saved=saved, files=files, **{"pass": pass_no})
        if lacking is not None:
          exhausted["processes"] = lacking  # whose shard ran out (several processes)
        raise StopIteration  # upstream's loader makes it StopTraining, which ends its loop normally
      _log(f"data: pass {pass_no} over {files} ended before step {step}; starting pass {pass_no + 1} "
           "(data_exhausted=repeat)")
      old = self.local_iterator
      if self.shuffled():
        self.read_pass(pass_no + 1)
      else:
        self.reset()  # upstream's: a fresh iterator over the same pipeline, in the same order
      _close(old)
      _position["pass"] = pass_no + 1
      _on_pass(pass_no + 1, step)
      return super().__next__()  # a StopIteration here is a dataset that was checked to fill a batch and no longer does

    def shuffled(self) -> bool:
      return bool(getattr(self.passes_config, "enable_data_shuffling", False))

    def read_pass(self, pass_no: int) -> None:
      """Reads pass `pass_no` from its start: upstream's maker builds the pipeline again with that pass's seed
      (_PassConfig), and this iterator takes the new one's dataloader and grain iterator, as reset() would.
      The caller closes the iterator it replaces."""
      from maxtext.input_pipeline import multihost_dataloading  # pylint: disable=import-outside-toplevel

      fresh = self.make_pass(_PassConfig(self.passes_config, pass_no))
      self.dataloader, self.local_iterator = fresh.dataloader, fresh.local_iterator
      del fresh.dataloader, fresh.local_iterator  # its close(), when it is collected, must leave them to us
      multihost_dataloading._GLOBAL_MULTIHOST_ITERATORS.discard(fresh)  # pylint: disable=protected-access
      self.out_of_data, self.last_local_data, self._reset_and_unread = False, None, True  # as reset() leaves them
      self.pass_built = pass_no

  DataPasses.__name__ = DataPasses.__qualname__ = "DataPasses"
  return DataPasses


def _process_count() -> int:
  import jax  # pylint: disable=import-outside-toplevel

  return jax.process_count()


def wrap(original):
  def make_grain_train_iterator(config, global_mesh, process_indices):
    from maxtext.input_pipeline import multihost_dataloading  # pylint: disable=import-outside-toplevel

    it = original(config, global_mesh, process_indices)
    if type(it) is not multihost_dataloading.MultiHostDataLoadIterator:  # pylint: disable=unidiomatic-typecheck
      return it  # elastic, colocated or several iterators: upstream's own end of data
    _position["files"] = config.grain_train_files or config.grain_train_mixture_config_path or ""
    _position["epochs"] = max(1, int(getattr(config, "num_epoch", 1) or 1))
    _check_one_batch(it, config)
    it.__class__ = _passes_class(multihost_dataloading.MultiHostDataLoadIterator)
    it.passes_config, it.pass_built = config, 1
    it.make_pass = lambda pass_config: original(pass_config, global_mesh, process_indices)
    _live[:] = [weakref.ref(it)]
    return it

  make_grain_train_iterator.__wrapped__ = original
  return make_grain_train_iterator


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True  # inert unless dataset_type=grain


def apply(fork=None, hooks=None) -> None:
  global _on_pass
  _mode[0] = getattr(fork, "data_exhausted", "repeat") or "repeat"
  _on_pass = getattr(hooks, "on_data_pass", None) or (lambda pass_no, step: None)
  _position.update(step=0, files="", epochs=1, **{"pass": 1})
  exhausted.clear()
  _live.clear()
  ITERATOR.check()
  SEAM.apply(wrap)


def undo() -> None:
  global _on_pass
  _mode[0] = "repeat"
  _on_pass = lambda pass_no, step: None  # noqa: E731
  exhausted.clear()
  _live.clear()
  SEAM.undo()
