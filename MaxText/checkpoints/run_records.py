"""The one owner of a run directory's records: the training loop (MaxText/run/loop.py) calls it at a few points
and knows none of the records' rules.

  check()             before anything is compiled: the checkpoint a resume would restore, and the parameters a
                      new run loads, against this run (the routing bias's semantics, the pipeline layout)
  preview()           a dry run: what open() would do, nothing written
  open()              under the run's lock, before upstream's main: sets aside the step directories that are not
                      checkpoints and checks what a resume changes (schedule, data); the lines to print
  start(restored)     once upstream's restore settled where the run starts: the step and data pass of its first
                      batch; records the pipeline layout, and the schedule and data of a new run or an allowed change
  data_pass(p, step)  each new pass over the data (data_exhausted=repeat) records its first step
  nonfinite_stop()    a stop at a non-finite step records the batches a later resume may skip
  changed_since()     a config error raised during a resume names the keys changed since the last invocation
  files               <run>/maxtext-moe/, where our records (and a multi-process job's summaries) are kept

Only the lead process (process 0 of a multi-process job) writes; every process reads. The records themselves,
each with its rules, are MaxText/checkpoints/resume.py's (schedule, data, data passes, non-finite stops, which
step directories are checkpoints) and compat.py's (routing bias, pipeline layout).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from MaxText.checkpoints import compat, resume
from MaxText.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Start:
  """Where this invocation's first batch falls: `step` (0 for a new run, the restored checkpoint's step + 1 for a
  resume) and `data_pass`, the pass over the data that batch is read in (1: the first)."""

  step: int
  data_pass: int


class RunRecords:
  """The records of `run.run_dir` for one invocation; `config` is upstream's resolved config."""

  def __init__(self, run: RunConfig, config: Any, lead: bool = True):
    self.run, self.config, self.lead = run, config, lead
    self.resumed_from: int | None = None  # the checkpoint step this invocation resumes (open())
    self._warnings: list[str] = []  # the resume's allowed changes: the schedule and data are recorded anew
    self._previous: dict[str, Any] = {}  # the last invocation's upstream overrides (effective_config.json)

  @property
  def files(self) -> Path:
    return self.run.run_dir / resume.RUN_FILES

  def check(self) -> None:
    """ConfigError when the checkpoint this run would resume, or the parameters it loads, hold the routing bias
    the other way, or the checkpoint was written with another pipeline layout."""
    compat.check_resume(self.run)
    compat.check_pipeline_resume(self.run, self.config)
    compat.check_load_parameters(self.run)

  def preview(self) -> list[str]:
    """What open() would do (nothing written): the step directories it would set aside and the checkpoint it would
    resume; FinishedRun or a refused resume raise as they would under the lock, as does a garbled record of a
    non-finite stop whose batches nonfinite_skip_batches would skip."""
    lines = resume.set_aside_unusable(self.run.run_dir, dry_run=True)
    resumed_from, warnings = self._check_resume()
    if resumed_from is not None:
      resume.batches_to_skip(self.run.run_dir, resumed_from, self.run.fork.nonfinite_skip_batches)
      lines.append(f"the run would resume from checkpoint step {resumed_from}")
    return lines + warnings

  def open(self) -> list[str]:
    """Under the run's lock, before upstream lists the checkpoints: the lines to print. Raises FinishedRun (nothing
    to train) and ConfigError (a resume that would not continue the run)."""
    run_dir, fork = self.run.run_dir, self.run.fork
    lines = resume.set_aside_unusable(run_dir) if self.lead else []  # before orbax lists the steps
    self.resumed_from, self._warnings = self._check_resume()
    self._previous = _previous_overrides(self.files)
    if self.resumed_from is not None:
      lines.append(f"resuming from checkpoint step {self.resumed_from}")
      stop = resume.nonfinite_stop(run_dir) or {}
      if not fork.nonfinite_skip_batches and stop.get("checkpoint") == self.resumed_from:
        lines.append("this run last stopped at a non-finite step after this checkpoint and replays its batches; "
                     "nonfinite_skip_batches=K skips them")
    return lines + self._warnings

  def start(self, restored: int | None) -> Start:
    """Once upstream's restore settled where the run starts (`restored`: the checkpoint step, None for a start from
    step 0); a resume refused there calls nothing, so writes nothing."""
    run_dir = self.run.run_dir
    start = Start(0 if restored is None else restored + 1, resume.data_pass_at(run_dir, restored))
    if self.lead:
      compat.record_pipeline_layout(self.run, self.config)
      if restored is None or self._warnings:  # a new run (or one whose checkpoints all failed), or an allowed change
        resume.record_schedule(run_dir, self.config)
        resume.record_data(run_dir, self.config)
    return start

  def data_pass(self, pass_no: int, step: int) -> None:
    """Pass `pass_no` over the data starts at step `step` (the passes recorded after it are dropped)."""
    if self.lead:
      resume.record_data_pass(self.run.run_dir, pass_no, step)

  def nonfinite_stop(self, step: int | None, skipped: dict[str, int] | None) -> None:
    """The run stopped at non-finite step `step` (None: before any step); `skipped`: {"checkpoint", "batches"} of
    a skip this invocation applied on its resume (patches/checkpoint_restore.py), else None."""
    if self.lead and step is not None:
      resume.record_nonfinite(self.run.run_dir, step,
                              (skipped["checkpoint"], skipped["batches"]) if skipped else None)

  def changed_since(self) -> str:
    """The upstream keys this resume changed since the last invocation ('' for a new run): a ConfigError raised
    while resuming names them, as the likely cause."""
    if self.resumed_from is None:
      return ""
    before, now = self._previous, self.run.upstream
    keys = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k) and k not in ("steps", "run_name"))
    return ", ".join(f"{k} {before.get(k, '(default)')} -> {now.get(k, '(default)')}" for k in keys[:6])

  def _check_resume(self) -> tuple[int | None, list[str]]:
    fork = self.run.fork
    return resume.check_resume(self.run.run_dir, self.config, fork.allow_schedule_change, fork.allow_data_change)


def _previous_overrides(files: Path) -> dict[str, Any]:
  try:
    previous = json.loads((files / "effective_config.json").read_text())
    return dict(previous["upstream_overrides"])
  except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
    return {}  # only the refusal's hint uses it: without it, the hint names no keys
