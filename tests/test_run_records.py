"""MaxText/checkpoints/run_records.py: the one owner of a run directory's records, through the calls the training
loop makes (check, preview, open, start, data_pass, nonfinite_stop, changed_since), on a run directory as saves
leave it. The rules of each record are tested on their own in tests/test_lifecycle.py and test_data_passes.py."""

from __future__ import annotations

import json
import types

import pytest

from MaxText import config as fork_config
from MaxText.checkpoints import records as checkpoint_records
from MaxText.checkpoints import resume
from MaxText.checkpoints.run_records import RunRecords, Start

NO_PIPELINE = {"ici_pipeline_parallelism": 1, "dcn_pipeline_parallelism": 1}


def _run(tmp_path, *overrides):
  return fork_config.load(["configs/deepseek3-tiny.yml", f"base_output_directory={tmp_path}", "run_name=r",
                           *overrides])


def _config(**kw):
  values = {"steps": 10, "learning_rate": 1e-3, "learning_rate_schedule_steps": 10, "warmup_steps_fraction": 0.1,
            "enable_checkpointing": True, "dataset_type": "synthetic", "vocab_size": 1024, **NO_PIPELINE}
  return types.SimpleNamespace(**{**values, **kw})


def _save(run_dir, *steps):
  """Complete step directories (orbax's commit marker and metadata, our record) and one save cut short."""
  for step in steps:
    (run_dir / "checkpoints" / str(step) / "items").mkdir(parents=True)
    (run_dir / "checkpoints" / str(step) / "items" / "_METADATA").write_text("{}")
    (run_dir / "checkpoints" / str(step) / checkpoint_records.COMMIT_MARKER).write_text("committed")
    checkpoint_records.write_record(run_dir, step, [], [])
  (run_dir / "checkpoints" / f"{max(steps) + 1}.orbax-checkpoint-tmp-1").mkdir()


def test_a_new_run_records_its_schedule_data_and_layout_at_the_start(tmp_path):
  run = _run(tmp_path)
  records = RunRecords(run, _config())
  records.check()
  assert records.preview() == [] and records.open() == [] and records.resumed_from is None
  assert not records.files.exists()  # nothing is written before upstream's restore settles the start
  assert records.start(None) == Start(step=0, data_pass=1)
  assert {p.name for p in records.files.iterdir()} == {"schedule.json", "data.json", "pipeline_layout.json"}
  assert json.loads((records.files / "schedule.json").read_text())["learning_rate"] == 1e-3
  assert records.changed_since() == ""  # a new run: no earlier invocation to compare with


def test_a_resume_sets_aside_says_where_it_starts_and_keeps_the_records_it_checked(tmp_path):
  run = _run(tmp_path, "learning_rate=5e-4")
  run_dir = run.run_dir
  _save(run_dir, 0, 4)
  first = RunRecords(run, _config())
  first.start(None)  # the first invocation's records
  first.data_pass(2, 3)  # its data ran out after 3 steps: pass 2 from step 3
  first.nonfinite_stop(6, None)  # and it stopped at non-finite step 6
  before = _run(tmp_path).upstream  # the first invocation's keys (loop.write_run_files), at the default rate
  (first.files / "effective_config.json").write_text(json.dumps({"upstream_overrides": before}, default=str))
  (run_dir / "checkpoints" / "99").mkdir()  # not a checkpoint

  records = RunRecords(run, _config(learning_rate=5e-4))  # the advised lower rate
  dry = records.preview()
  assert (run_dir / "checkpoints" / "99").is_dir() and dry[-2] == "the run would resume from checkpoint step 4"
  lines = records.open()
  assert lines[0].startswith("WARNING: the newest save, of step 5, was incomplete")
  assert lines[1].startswith(f"WARNING: {run_dir / 'checkpoints' / '99'} is not a checkpoint")
  assert lines[2:4] == ["resuming from checkpoint step 4",
                        "this run last stopped at a non-finite step after this checkpoint and replays its batches; "
                        "nonfinite_skip_batches=K skips them"]
  assert lines[4].startswith("WARNING: learning_rate 0.001 -> 0.0005 after the non-finite stop at step 6")
  assert records.resumed_from == 4 and not (run_dir / "checkpoints" / "99").exists()
  assert records.changed_since() == "learning_rate 0.001 -> 0.0005"
  assert records.start(4) == Start(step=5, data_pass=2)  # checkpoint 4's batch was in pass 2
  # The allowed change (the warning above) is recorded: the next resume continues from the new rate.
  assert json.loads((records.files / "schedule.json").read_text())["learning_rate"] == 5e-4
  records.nonfinite_stop(7, {"checkpoint": 4, "batches": 3})
  assert resume.nonfinite_stop(run_dir) == {"step": 7, "checkpoint": 4, "batches_past_checkpoint": 6}
  (first.files / "effective_config.json").unlink()  # written by hand above: conftest takes it for a trained run's


def test_a_resume_with_nothing_changed_leaves_the_schedule_record_as_it_was(tmp_path):
  run = _run(tmp_path)
  _save(run.run_dir, 0, 4)
  RunRecords(run, _config()).start(None)
  schedule = run.run_dir / resume.RUN_FILES / "schedule.json"
  schedule.write_text(schedule.read_text() + "\n")  # as written by an earlier invocation
  records = RunRecords(run, _config(steps=20))
  assert records.open()[1:] == ["resuming from checkpoint step 4"]
  assert records.start(4) == Start(step=5, data_pass=1)
  assert schedule.read_text().endswith("}\n")  # not rewritten


def test_only_the_lead_process_writes(tmp_path):
  run = _run(tmp_path)
  _save(run.run_dir, 0, 4)
  (run.run_dir / "checkpoints" / "99").mkdir()
  RunRecords(run, _config()).start(None)
  before = sorted(p.name for p in run.run_dir.rglob("*"))
  other = RunRecords(run, _config(), lead=False)
  assert other.open() == ["resuming from checkpoint step 4"]  # reads, sets nothing aside
  assert other.start(4) == Start(step=5, data_pass=1)
  other.data_pass(2, 7)
  other.nonfinite_stop(6, None)
  assert sorted(p.name for p in run.run_dir.rglob("*")) == before


def test_a_refused_resume_writes_nothing_and_check_names_the_pipeline_layout(tmp_path):
  run = _run(tmp_path)
  _save(run.run_dir, 0, 4)
  RunRecords(run, _config()).start(None)
  staged = _config(ici_pipeline_parallelism=2, num_pipeline_repeats=2, num_layers_per_pipeline_stage=1,
                   scan_layers_per_stage=False, pipeline_parallel_layers=4)
  with pytest.raises(fork_config.ConfigError, match=r"another pipeline layout \(stages .* 1 -> 2"):
    RunRecords(run, staged).check()
  records = RunRecords(run, _config(learning_rate=2e-3))
  with pytest.raises(fork_config.ConfigError, match="pin learning_rate=0.001"):
    records.open()
  assert json.loads((records.files / "schedule.json").read_text())["learning_rate"] == 1e-3
  with pytest.raises(resume.FinishedRun):
    RunRecords(run, _config(steps=5)).open()
