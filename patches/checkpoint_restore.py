"""Seam: maxtext.common.checkpointing.load_state_if_possible (maxtext 0.2.5).

On resume upstream restores the run's latest checkpoint into the state this
config builds (`abstract_unboxed_pre_state`). After a change of model shape
orbax fails deep in the restore (57 tracebacks on the tiny config, the cause
at line 154). Before that, we compare the abstract state with the shapes the
checkpoint guard recorded at the run's first save (<run>/maxtext-moe/
state_shapes.json) and raise ShapeMismatch, one line naming the first array
that differs. Runs without the record restore as upstream does.
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
    return original(checkpoint_manager, data_iterator, load_parameters_from_path, load_full_state_from_path,
                    checkpoint_storage_concurrent_gb, abstract_unboxed_pre_state, *args, **kwargs)

  load_state_if_possible.__wrapped__ = original
  return load_state_if_possible


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  global ShapeMismatch
  if ShapeMismatch is None:
    ShapeMismatch = _shape_mismatch_error()
  SEAM.apply(_wrap)


def undo() -> None:
  SEAM.undo()
