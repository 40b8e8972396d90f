"""What a resume may change, read from the run directory: which step directories are checkpoints, the
schedule and data a run was started with, and the batches a non-finite stop skips."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from MaxText.checkpoints import records as checkpoint_records
from MaxText.config import ConfigError

RUN_FILES = "maxtext-moe"  # our files inside the run directory


def checkpoint_steps(run_dir: Path) -> list[int]:
  """The checkpoints a run resumes from: orbax's commit marker and our record (MaxText/checkpoint_records.py)."""
  return checkpoint_records.complete_steps(run_dir)


def unusable_steps(run_dir: Path) -> list[tuple[int, str]]:
  """(step, why) for each step directory that is not a checkpoint."""
  found = ((step, checkpoint_records.problem(run_dir, step)) for step, _ in checkpoint_records.step_dirs(run_dir))
  return [(step, why) for step, why in found if why is not None]


def set_aside_unusable(run_dir: Path, dry_run: bool = False) -> list[str]:
  """Moves each step directory that is not a checkpoint out of orbax's sight (its files kept): orbax counts
  any directory named by a number, so an empty checkpoints/99/ would be its latest step, and it saves no
  step below its latest. Returns one line for each.

  A run whose committed steps all predate our records (no maxtext-moe/checkpoints/ at all) is refused
  instead: setting its checkpoints aside would start it over, and they cannot be verified.
  """
  committed = [step for step, path in checkpoint_records.step_dirs(run_dir)
               if (path / checkpoint_records.COMMIT_MARKER).is_file() and (path / "items" / "_METADATA").is_file()]
  if committed and not (run_dir / RUN_FILES / checkpoint_records.RECORDS).is_dir():
    raise ConfigError(
        f"run {run_dir} holds checkpoints ({', '.join(map(str, committed))}) but no records of them "
        f"({run_dir / RUN_FILES / checkpoint_records.RECORDS}/): written before maxtext-moe kept them, or the "
        "folder was deleted, so they cannot be verified; resume with the maxtext-moe that wrote them, or pick "
        "another run_name (nothing was moved)")
  lines = incomplete_saves(run_dir, dry_run)
  for step, why in unusable_steps(run_dir):
    where = run_dir / "checkpoints" / str(step)
    if dry_run:
      lines.append(f"WARNING: {where} is not a checkpoint ({why}): the run would set it aside")
    else:
      lines.append(f"WARNING: {where} is not a checkpoint ({why}): set aside as "
                   f"{checkpoint_records.set_aside(run_dir, step).name}")
  return lines


def incomplete_saves(run_dir: Path, dry_run: bool = False) -> list[str]:
  """One line for each save the last run never finished: a step orbax was still writing under its in-flight name
  (`<step>.orbax-checkpoint-tmp*`) when the process died, an async save's commit cut short. Orbax never lists such
  a folder as a step, so the resume skips it by itself; before, only orbax's own warning hinted at it."""
  root = run_dir / "checkpoints"
  if not root.is_dir():
    return []
  partial = sorted((int(p.name.split(".")[0]), p.name) for p in root.iterdir()
                   if checkpoint_records.IN_FLIGHT in p.name and p.name.split(".")[0].isdigit())
  complete = checkpoint_records.complete_steps(run_dir) if partial else []
  lines = []
  for step, name in partial:
    newest = "the newest save" if not complete or step > complete[-1] else "a save"
    older = [s for s in complete if s < step]
    start = f"from checkpoint {older[-1]}" if older else "at step 0: no complete checkpoint precedes it"
    lines.append(f"WARNING: {newest}, of step {step}, was incomplete (checkpoints/{name}: the run ended while "
                 f"writing it) and {'would be' if dry_run else 'is'} skipped; the run resumes {start}")
  return lines


# The keys that define the learning-rate schedule of upstream's optimizer
# (maxtext_utils.create_learning_rate_schedule). steps enters through
# learning_rate_schedule_steps, which upstream sets to steps when it is -1.
SCHEDULE_KEYS = ("learning_rate", "learning_rate_schedule_steps", "warmup_steps_fraction",
                 "learning_rate_final_fraction", "lr_schedule_type",
                 "wsd_decay_steps_fraction", "wsd_decay_style")

# The data a run trains on and how it is tokenized, per dataset_type (upstream's input pipelines): a resume
# on other data would go on from the checkpoint's weights with nothing said (a synthetic run resumed on
# grain data with another vocabulary trained on).
DATA_KEYS = {
    "synthetic": ("vocab_size",),
    "grain": ("grain_train_files", "grain_file_type", "grain_train_mixture_config_path", "train_data_columns",
              "tokenizer_type", "tokenizer_path", "vocab_size"),
    "hf": ("hf_path", "hf_name", "hf_data_dir", "hf_train_files", "train_data_columns", "tokenizer_type",
           "tokenizer_path", "vocab_size"),
    "tfds": ("dataset_path", "dataset_name", "train_data_columns", "tokenizer_type", "tokenizer_path", "vocab_size"),
}


def _plain(value: Any) -> Any:
  value = getattr(value, "value", value)  # upstream's str enums (DatasetType.GRAIN) as their value
  return list(value) if isinstance(value, (list, tuple)) else value


def schedule_of(config: Any) -> dict[str, Any]:
  return {k: getattr(config, k) for k in SCHEDULE_KEYS if hasattr(config, k)}


def data_of(config: Any) -> dict[str, Any]:
  kind = str(_plain(getattr(config, "dataset_type", "synthetic")))
  return {"dataset_type": kind, **{k: _plain(getattr(config, k)) for k in DATA_KEYS.get(kind, ()) if hasattr(config, k)}}


def check_resume(run_dir: Path, config: Any, allow_schedule_change: bool,
                 allow_data_change: bool = False) -> tuple[int | None, list[str]]:
  """Before anything is written: what this invocation does to an existing run.

  Returns (the checkpoint step it resumes from or None, warnings). Raises
  FinishedRun when the run has already finished, and ConfigError when the resume
  would not continue the run: checkpointing turned off (upstream would train
  from step 0 over it), a silent change of the learning-rate schedule of the
  steps already taken or of the data, or a record of either that is missing or
  garbled (a change could not be told).
  """
  steps = checkpoint_steps(run_dir)
  if not steps:
    return None, []
  last = steps[-1]
  if last + 1 >= int(config.steps):
    raise FinishedRun(f"run {run_dir} already finished: its last checkpoint is step {last} and steps={config.steps}; "
                      f"nothing to train (raise steps to continue, or pick another run_name)")
  if not config.enable_checkpointing:
    raise ConfigError(
        f"config key 'enable_checkpointing' = False: run {run_dir} holds checkpoints up to step {last}, which this "
        "run would neither resume nor extend (it would train from step 0 and replace the run's summary); set "
        "enable_checkpointing=true to resume it, or pick another run_name")
  where = f"resuming {run_dir} at step {last + 1}"
  warnings = _schedule_warnings(run_dir, config, last, where, allow_schedule_change)
  warnings += _data_warnings(run_dir, config, where, allow_data_change)
  return last, warnings


def _recorded(path: Path, what: str, where: str, allow_key: str, allowed: bool) -> tuple[dict | None, list[str]]:
  """A record the resume is checked against; (None, [warning]) or ConfigError when missing or garbled."""
  try:
    record = json.loads(path.read_text())
    why = None if isinstance(record, dict) else "is not a JSON object"
  except FileNotFoundError:
    why = "is missing"
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    why = f"cannot be read ({' '.join(str(e).split())[:80]})"
  if why is None:
    return record, []
  if not allowed:
    raise ConfigError(f"{where}: its {what} record {path} {why}, so a change of {what} cannot be told; set "
                      f"{allow_key}=true to resume with this run's {what} (recorded anew)")
  return None, [f"WARNING: the {what} record {path} {why}; {allow_key}=true: this run's {what} is recorded anew"]


def _schedule_warnings(run_dir: Path, config: Any, last: int, where: str, allowed: bool) -> list[str]:
  recorded, warnings = _recorded(run_dir / RUN_FILES / "schedule.json", "learning-rate schedule", where,
                                 "allow_schedule_change", allowed)
  if recorded is None:
    return warnings
  now = schedule_of(config)
  changed = [k for k in SCHEDULE_KEYS if k in recorded and k in now and recorded[k] != now[k]]
  if not changed:
    return []
  what = ", ".join(f"{k} {recorded[k]} -> {now[k]}" for k in changed)
  stop = _read_json(run_dir / RUN_FILES / NONFINITE_RECORD)
  if (changed == ["learning_rate"] and stop and stop.get("checkpoint") == last
      and now["learning_rate"] < recorded["learning_rate"]):  # the remedy an exit 4 advises
    return [f"WARNING: {what} after the non-finite stop at step {stop.get('step')}: steps up to {last} followed "
            f"the old rate, steps from {last + 1} the new one"]
  if not allowed:
    pins = " ".join(f"{k}={recorded[k]}" for k in changed)
    raise ConfigError(f"{where} would change its learning-rate schedule ({what}), so the steps already taken "
                      f"followed another schedule; pin {pins} to continue it, or set allow_schedule_change=true")
  return [f"WARNING: the learning-rate schedule changes on resume ({what}); allow_schedule_change=true"]


def _data_warnings(run_dir: Path, config: Any, where: str, allowed: bool) -> list[str]:
  recorded, warnings = _recorded(run_dir / RUN_FILES / "data.json", "data", where, "allow_data_change", allowed)
  if recorded is None:
    return warnings
  now = data_of(config)
  changed = [k for k in dict.fromkeys([*recorded, *now]) if recorded.get(k) != now.get(k)]
  if not changed:
    return []
  what = ", ".join(f"{k} {recorded.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}" for k in changed[:4])
  if not allowed:
    raise ConfigError(f"{where} would train on other data ({what}), so the steps already taken saw other tokens; "
                      "set allow_data_change=true to go on from its weights with the new data")
  return [f"WARNING: the data changes on resume ({what}); allow_data_change=true"]


def record_schedule(run_dir: Path, config: Any) -> None:
  _write_json(run_dir / RUN_FILES / "schedule.json", schedule_of(config))


def record_data(run_dir: Path, config: Any) -> None:
  _write_json(run_dir / RUN_FILES / "data.json", data_of(config))


def _write_json(path: Path, record: dict[str, Any]) -> None:
  """Atomically: a full disk leaves the previous record, never half of one."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  try:
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


# `<run_dir>/maxtext-moe/data_passes.json`: {"starts": {"2": 92, "3": 184}}, the first step of each pass over the
# grain data after the first (data_exhausted=repeat, patches/data_passes.py). A resume from checkpoint C reads
# the pass C's batch was in; the starts after C are dropped when the resumed run passes them again.
DATA_PASSES = "data_passes.json"


def _data_pass_starts(run_dir: Path) -> dict[int, int]:
  record = _read_json(run_dir / RUN_FILES / DATA_PASSES) or {}
  starts = record.get("starts")
  if not isinstance(starts, dict):
    return {}
  return {int(p): int(s) for p, s in starts.items() if str(p).isdigit() and isinstance(s, int)}


def data_pass_at(run_dir: Path, step: int | None) -> int:
  """The pass over the data that step `step`'s batch came from (1: the first; a new run, step None, is in it)."""
  if step is None:
    return 1
  return max([1, *(p for p, s in _data_pass_starts(run_dir).items() if s <= step)])


def record_data_pass(run_dir: Path, pass_no: int, step: int) -> None:
  starts = {p: s for p, s in _data_pass_starts(run_dir).items() if s < step and p < pass_no}
  starts[pass_no] = step
  _write_json(run_dir / RUN_FILES / DATA_PASSES, {"starts": {str(p): s for p, s in sorted(starts.items())}})


class FinishedRun(Exception):
  """Re-running a run that has already trained to `steps`: nothing to do."""


def _read_json(path: Path) -> dict[str, Any] | None:
  try:
    record = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None
  return record if isinstance(record, dict) else None


# --- skipping the batches of a non-finite stop --------------------------------
#
# `<run_dir>/maxtext-moe/nonfinite.json`, written when a run stops at a
# non-finite step (exit 4): {"step": N, "checkpoint": C, "batches_past_checkpoint": B}.
# C is the last (finite) checkpoint at the stop, B how many batches the data
# iterator had read past C's position when step N's batch was the latest: N - C,
# plus any batches an earlier skip from the same C had already passed over.
# On the next resume from C with nonfinite_skip_batches=K > 0,
# patches/checkpoint_restore.py advances the restored iterator by max(K, B)
# batches, so the batch that went non-finite is never trained on again. Keyed on
# C: once the resumed run saves a later checkpoint (whose iterator position
# already includes the skip), the record no longer applies.

NONFINITE_RECORD = "nonfinite.json"


def record_nonfinite(run_dir: Path, step: int, skipped_since: tuple[int, int] | None) -> dict[str, Any]:
  """Writes the record atomically. `skipped_since`: (checkpoint, batches) of a skip this run applied."""
  steps = checkpoint_steps(run_dir)
  last = steps[-1] if steps else None
  past = None
  if last is not None:
    past = step - last + (skipped_since[1] if skipped_since and skipped_since[0] == last else 0)
  record = {"step": int(step), "checkpoint": last, "batches_past_checkpoint": past}
  _write_json(run_dir / RUN_FILES / NONFINITE_RECORD, record)
  return record


def nonfinite_stop(run_dir: Path) -> dict[str, Any] | None:
  """The record of the last non-finite stop, if there is one that can be read."""
  return _read_json(run_dir / RUN_FILES / NONFINITE_RECORD)


def batches_to_skip(run_dir: Path, restored: int, skip_at_least: int) -> tuple[int, dict[str, Any]] | None:
  """(batches, record) to skip after restoring checkpoint `restored`; None when no record applies. A record
  that exists but cannot be read is a ConfigError when a skip was asked for: replaying would be silent."""
  path = run_dir / RUN_FILES / NONFINITE_RECORD
  record = _read_json(path)
  if skip_at_least <= 0 or not path.exists():
    return None
  if not isinstance(record, dict) or not isinstance(record.get("batches_past_checkpoint", 0), int):
    raise ConfigError(f"config key 'nonfinite_skip_batches' = {skip_at_least}: the record of the last non-finite "
                      f"stop, {path}, cannot be read, so the batches to skip are unknown; delete it to replay them, "
                      "or set nonfinite_skip_batches=0")
  if record.get("checkpoint") != restored:
    return None
  return max(skip_at_least, int(record["batches_past_checkpoint"])), record
