"""Seam: maxtext.common.checkpointing.load_state_if_possible (maxtext 0.2.5).

On resume upstream restores the run's latest checkpoint into the state this
config builds (`abstract_unboxed_pre_state`). After a change of model shape
orbax fails deep in the restore (57 tracebacks on the tiny config, the cause
at line 154). Before that, we compare the abstract state with the shapes the
checkpoint guard recorded at the run's first save (<run>/maxtext-moe/
state_shapes.json) and raise ShapeMismatch, one line naming the first array
that differs. Runs without the record restore as upstream does.

After the restore, a run that last stopped at a non-finite step (exit 4) and
sets nonfinite_skip_batches=K > 0 advances the restored data iterator past the
batches that led there (MaxText/lifecycle.py's record says how many), as
Megatron users skip a loss spike's batches: next() on upstream's iterator,
exactly as the training loop would read them, and one log line saying which.
Only grain's iterator position is in a checkpoint (upstream restores it in
place right here); synthetic data is one fixed batch, so skipping would change
nothing, and tfds/hf iterators restart from the data's start, so neither is
skipped (the log line says so).
"""

from __future__ import annotations

import json
from pathlib import Path

from patches._seam import Seam

SEAM = Seam(
    name="checkpoint_restore",
    module="maxtext.common.checkpointing",
    attr="load_state_if_possible",
    sha256="68a6096cc1e87041",
)


def _shape_mismatch_error():
  from MaxText.config import ConfigError  # pylint: disable=import-outside-toplevel

  class ShapeMismatch(ConfigError):
    """The config builds a state whose shapes differ from the checkpoint's."""

  return ShapeMismatch


ShapeMismatch = None  # bound in apply() (our ConfigError is imported lazily: patches sit below MaxText)
_skip_at_least = 0  # fork.nonfinite_skip_batches, set by apply()
skipped: dict[str, int] = {}  # filled when a skip was applied: {"checkpoint", "batches"}


def skip_nonfinite_batches(run_dir: Path, restored: int, data_iterator, dataset_type: str | None) -> None:
  """Advances the iterator restored at checkpoint `restored` past a non-finite stop's batches."""
  from MaxText import lifecycle  # pylint: disable=import-outside-toplevel

  found = lifecycle.batches_to_skip(run_dir, restored, _skip_at_least)
  if found is None:
    return
  batches, record = found
  first, last = restored + 1, restored + batches
  what = (f"step {record['step']} went non-finite after checkpoint {restored}; nonfinite_skip_batches="
          f"{_skip_at_least}")
  if dataset_type != "grain" or not data_iterator:
    why = ("synthetic data is one fixed batch, so skipping changes nothing" if dataset_type == "synthetic" else
           f"dataset_type={dataset_type}'s position is not in the checkpoint (only grain's is)")
    print(f"[maxtext-moe] {what}: no batches skipped: {why}", flush=True)
    return
  for iterator in data_iterator if isinstance(data_iterator, list) else [data_iterator]:
    for _ in range(batches):
      next(iterator)
  skipped.update(checkpoint=restored, batches=batches)
  print(f"[maxtext-moe] {what}: skipped {batches} batches, those an unbroken run reads at steps {first}..{last}; "
        f"step {first} trains on the batch of step {last + 1}", flush=True)


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


def _wrap(original):
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

  def load_state_if_possible(checkpoint_manager, data_iterator, load_parameters_from_path, load_full_state_from_path,
                             checkpoint_storage_concurrent_gb, abstract_unboxed_pre_state, *args, **kwargs):
    step = checkpointing.latest_step(checkpoint_manager) if checkpoint_manager is not None else None
    if step is not None:
      run_dir = Path(str(checkpoint_manager.directory)).parent
      record = run_dir / "maxtext-moe" / "state_shapes.json"
      if record.is_file():
        current = {name: [list(x.shape), str(x.dtype)]
                   for name, x in checkpoint_guard._leaves_with_paths(abstract_unboxed_pre_state)}  # pylint: disable=protected-access
        diff = first_difference(json.loads(record.read_text()), current)
        if diff:
          raise ShapeMismatch(f"resuming {run_dir} from checkpoint step {step}: the model's shape changed: {diff}")
    restored = original(checkpoint_manager, data_iterator, load_parameters_from_path, load_full_state_from_path,
                        checkpoint_storage_concurrent_gb, abstract_unboxed_pre_state, *args, **kwargs)
    if step is not None and restored[0] is not None:
      config = kwargs.get("maxtext_config")
      skip_nonfinite_batches(Path(str(checkpoint_manager.directory)).parent, int(step), data_iterator,
                             getattr(config, "dataset_type", None))
    return restored

  load_state_if_possible.__wrapped__ = original
  return load_state_if_possible


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  global ShapeMismatch, _skip_at_least
  if ShapeMismatch is None:
    ShapeMismatch = _shape_mismatch_error()
  _skip_at_least = int(getattr(fork, "nonfinite_skip_batches", 0))
  skipped.clear()
  SEAM.apply(_wrap)


def undo() -> None:
  global _skip_at_least
  _skip_at_least = 0
  SEAM.undo()
