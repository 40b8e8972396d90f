"""Grain data that runs out before `steps` (patches/data_passes.py): another pass (data_exhausted=repeat, the
default) or a saved stop with exit 11 (data_exhausted=stop); a dataset that cannot fill one batch is refused
before the compile. Upstream ended such a run with exit 0, no line, and the steps since its last checkpoint lost."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys

import pytest

import text_fixture
import patches
from conftest import REPO, SUBPROCESS_PYTHONPATH, run_train
from MaxText.checkpoints import resume
from MaxText.config import ConfigError
from MaxText.run import loop

TINY = "configs/deepseek3-tiny.yml"
PEER_TIMEOUT_S = 90  # two processes start (jax, orbax) and save once: about 20 s on two busy cores


def _iterator(n_batches: int):
  """Upstream's MultiHostDataLoadIterator over n_batches batches of [1, 4] int32 (one CPU device)."""
  import grain  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from maxtext.input_pipeline import multihost_dataloading  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  ds = grain.MapDataset.range(n_batches).map(lambda i: {"inputs": np.full((1, 4), i, np.int32)}).to_iter_dataset()
  return multihost_dataloading.MultiHostDataLoadIterator(ds, mesh)


class _Config:
  grain_train_files = "corpus.array_record"
  grain_train_mixture_config_path = ""
  global_batch_size_to_load = 1
  max_target_length = 4
  enable_data_shuffling = False  # the stand-in iterators above read in order; _upstream_maker shuffles
  data_shuffle_seed = 0
  num_epoch = 1


def _upstream_maker(n_batches: int):
  """A stand-in for upstream's maker that shuffles, repeats num_epoch times and shards as upstream's does for
  every grain file type (grain_data_processing._apply_mapdataset_transforms, its own function), over batch
  numbers 0..n_batches-1, and builds upstream's MultiHostDataLoadIterator over them."""
  import grain  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from maxtext.input_pipeline import grain_data_processing, multihost_dataloading  # pylint: disable=import-outside-toplevel

  def make(config, mesh, process_indices):  # pylint: disable=unused-argument
    ds = grain_data_processing._apply_mapdataset_transforms(  # pylint: disable=protected-access
        grain.MapDataset.range(n_batches), config.enable_data_shuffling, config.data_shuffle_seed, config.num_epoch,
        0, 1, 1, 1)
    ds = ds.map(lambda i: {"inputs": np.full((1, 4), i, np.int32)})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    return multihost_dataloading.MultiHostDataLoadIterator(ds, mesh)

  return make


def _config(**keys) -> _Config:
  config = _Config()
  for key, value in keys.items():
    setattr(config, key, value)
  return config


@pytest.fixture
def seam(monkeypatch):
  """The seam applied (data_exhausted=mode), its replacement wrapped around a stand-in for upstream's maker that
  returns the iterator given to it."""
  from patches import data_passes  # pylint: disable=import-outside-toplevel

  def apply(mode: str, on_pass=lambda p, s: None):
    patches.apply_module(data_passes, type("Fork", (), {"data_exhausted": mode})(),
                         patches.Hooks(on_data_pass=on_pass))
    return lambda it, config=None: data_passes.wrap(it if callable(it) else lambda c, m, i: it)(
        config or _Config(), None, [0])

  yield apply
  patches.undo_module(data_passes)


def test_repeat_starts_another_pass_and_counts_it(seam):
  from patches import data_passes  # pylint: disable=import-outside-toplevel

  passes = []
  it = seam("repeat", on_pass=lambda p, s: passes.append((p, s)))(_iterator(3))
  data_passes.start(0, 1)
  firsts = [int(next(it)["inputs"][0, 0]) for _ in range(7)]
  assert firsts == [0, 1, 2, 0, 1, 2, 0]  # pass 2 from the first batch, and pass 3
  assert passes == [(2, 3), (3, 6)] and data_passes.current_pass() == 3 and not data_passes.exhausted


def _batches(it, n: int) -> list[int]:
  return [int(next(it)["inputs"][0, 0]) for _ in range(n)]


@pytest.mark.parametrize("num_epoch", [1, 2])
def test_repeat_shuffles_each_pass_as_upstreams_num_epoch_does(seam, num_epoch):
  """Pass p reads what upstream's own pipeline with num_epoch * p epochs reads in its last num_epoch of them:
  grain's shuffle seeds epoch k with data_shuffle_seed + k. Before, every pass replayed pass 1's order."""
  from patches import data_passes  # pylint: disable=import-outside-toplevel

  n, per_pass = 8, 8 * num_epoch
  wrap = seam("repeat")
  it = wrap(_upstream_maker(n), _config(enable_data_shuffling=True, data_shuffle_seed=3, num_epoch=num_epoch))
  data_passes.start(0, 1)
  read = _batches(it, 3 * per_pass)
  passes = [read[i * per_pass:(i + 1) * per_pass] for i in range(3)]
  assert passes[0] != passes[1] != passes[2] != passes[0]
  assert all(sorted(p) == sorted(list(range(n)) * num_epoch) for p in passes)  # each pass reads every batch
  upstream = _upstream_maker(n)(_config(enable_data_shuffling=True, data_shuffle_seed=3, num_epoch=3 * num_epoch),
                                None, [0])
  assert read == _batches(upstream, 3 * per_pass) and data_passes.current_pass() == 3
  assert data_passes.epochs_per_pass() == num_epoch  # the summary's "epochs 5-6" of pass 3 at num_epoch=2
  again = wrap(_upstream_maker(n), _config(enable_data_shuffling=True, data_shuffle_seed=3, num_epoch=num_epoch))
  data_passes.start(0, 1)
  assert _batches(again, 3 * per_pass) == read  # the same seed, the same order, pass after pass
  other = wrap(_upstream_maker(n), _config(enable_data_shuffling=True, data_shuffle_seed=4, num_epoch=num_epoch))
  data_passes.start(0, 1)
  assert _batches(other, 3 * per_pass) != read


def test_a_resume_in_a_later_pass_reads_that_pass_from_the_position_restored(seam):
  from patches import data_passes  # pylint: disable=import-outside-toplevel

  config = _config(enable_data_shuffling=True, data_shuffle_seed=3)
  it = seam("repeat")(_upstream_maker(8), config)
  data_passes.start(0, 1)
  unbroken = _batches(it, 24)
  resumed = seam("repeat")(_upstream_maker(8), config)  # built for pass 1, as upstream builds it before the restore
  resumed.local_iterator.set_state({"next_index": 3})  # upstream's restore of a checkpoint in pass 2 (step 10)
  data_passes.start(11, 2)
  assert _batches(resumed, 13) == unbroken[11:24] and data_passes.current_pass() == 3


def test_without_shuffling_each_pass_reads_the_files_in_the_same_order(seam):
  from patches import data_passes  # pylint: disable=import-outside-toplevel

  it = seam("repeat")(_upstream_maker(5), _config(enable_data_shuffling=False))
  data_passes.start(0, 1)
  assert _batches(it, 10) == [0, 1, 2, 3, 4] * 2  # upstream's own repeat without a shuffle


def test_stop_fills_exhausted_naming_the_files_and_the_step(seam):
  from patches import data_passes  # pylint: disable=import-outside-toplevel

  it = seam("stop")(_iterator(2))
  data_passes.start(5, 2)  # resumed after checkpoint 4, in the data's second pass
  next(it), next(it)
  with pytest.raises(StopIteration):  # upstream's loader turns it into StopTraining: its loop ends normally
    next(it)
  # No step trained in this process (checkpoint_guard saw none): nothing saved, the last checkpoint kept.
  assert data_passes.exhausted == {"step": 7, "pass": 2, "saved": None, "files": "corpus.array_record"}


def _two_processes(monkeypatch, other_has_a_batch: bool):
  """This process as process 0 of 2, the all-gather answered for process 1 (whether it read a batch)."""
  from patches import checkpoint_restore, data_passes  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(data_passes, "_process_count", lambda: 2)
  monkeypatch.setattr(checkpoint_restore, "agree", lambda ok: [ok, other_has_a_batch])


def test_with_several_processes_stop_agrees_and_puts_back_a_batch_the_others_lack(seam, monkeypatch):
  from patches import data_passes  # pylint: disable=import-outside-toplevel

  it = seam("stop")(_iterator(3))
  data_passes.start(0, 1)
  _two_processes(monkeypatch, other_has_a_batch=True)
  assert [int(next(it)["inputs"][0, 0]) for _ in range(2)] == [0, 1]
  _two_processes(monkeypatch, other_has_a_batch=False)  # process 1's shard ran out before step 2
  with pytest.raises(StopIteration):
    next(it)
  assert data_passes.exhausted == {"step": 2, "pass": 1, "saved": None, "files": "corpus.array_record",
                                   "processes": [1]}
  assert it.local_iterator.get_state() == {"next_index": 2}  # batch 2 is put back: a resume reads it
  assert loop.data_exhausted_line(data_passes.exhausted).startswith(
      "data exhausted: grain_train_files 'corpus.array_record' ran out at step 2 on process 1 (pass 1, ")


def test_a_process_whose_shard_cannot_fill_its_part_of_a_batch_stops_every_process(seam, monkeypatch):
  _two_processes(monkeypatch, other_has_a_batch=False)
  with pytest.raises(ConfigError, match="config key 'grain_train_files' = 'corpus.array_record': process 1 of 2 "
                     r"\(grain shards the data per process\) reads too little to fill 0 of a batch's 1 sequences"):
    seam("stop")(_iterator(3))


def test_a_dataset_without_one_batch_is_refused(seam):
  with pytest.raises(ConfigError, match="config key 'grain_train_files' = 'corpus.array_record': the data does not "
                     "fill one batch of 1 sequences of max_target_length=4"):
    seam("repeat")(_iterator(0))


def test_a_resume_reads_the_pass_of_its_checkpoint(tmp_path):
  assert resume.data_pass_at(tmp_path, None) == 1 and resume.data_pass_at(tmp_path, 40) == 1
  resume.record_data_pass(tmp_path, 2, 10)
  resume.record_data_pass(tmp_path, 3, 20)
  assert [resume.data_pass_at(tmp_path, s) for s in (9, 10, 19, 20, 99)] == [1, 2, 2, 3, 3]
  resume.record_data_pass(tmp_path, 2, 10)  # resumed from checkpoint 9, which is in pass 1: pass 2 starts again
  assert json.loads((tmp_path / "maxtext-moe" / "data_passes.json").read_text()) == {"starts": {"2": 10}}


def _grain(corpus, *more):
  return (TINY, "dataset_type=grain", "grain_file_type=arrayrecord", f"grain_train_files={corpus}",
          "grain_worker_count=1", "tokenizer_type=sentencepiece", f"tokenizer_path={text_fixture.tokenizer_path()}",
          "vocab_size=32000", "max_target_length=64", "checkpoint_period=100", *more)


@pytest.fixture
def small_corpus(tmp_path):
  """20 documents: 10 batches of the tiny config at max_target_length=64."""
  return text_fixture.write_arrayrecord(tmp_path / "data" / "small.array_record", text_fixture.documents(20))


# A saved stop (data_exhausted=stop) end to end: exit 11, its one line naming the files and the step, checkpoints 0
# and 9, steps 0-9 trained: the reliability harness's case "grain data that runs out, data_exhausted=stop"
# (tests/test_reliability_cases.py, test_every_case_that_trains_is_clean).


@pytest.mark.slow
def test_data_that_runs_out_starts_another_pass_by_default(tmp_path, small_corpus):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # pylint: disable=import-outside-toplevel

  # learning_rate=0: the weights stay as they start (V3's router bias still moves a little), so a loss tells its batch.
  result = run_train(tmp_path, *_grain(small_corpus, "steps=14", "learning_rate=0"))
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"data: pass 1 over {small_corpus} ended before step 10; starting pass 2" in result.stdout
  losses = result.losses()
  assert result.summary["data_passes"] == 2 and sorted(losses) == list(range(14))
  # Pass 2 is shuffled anew through upstream's own pipeline (patches/data_passes.py's _PassConfig): its batches
  # are not pass 1's in pass 1's order, which gave the same losses to 0.003.
  moved = [abs(losses[step] - losses[step - 10]) for step in range(10, 14)]
  assert sum(d > 0.01 for d in moved) >= 3, moved  # 0.044, 0.064, 0.0002, 0.045 at data_shuffle_seed 0
  assert "pass 2 over the grain data" in result.stdout
  events = glob.glob(str(result.run_dir / "tensorboard" / "**" / "events.out.tfevents.*"), recursive=True)
  acc = EventAccumulator(events[0], size_guidance={"scalars": 0})
  acc.Reload()
  passes = {e.step: e.value for e in acc.Scalars("data/pass")}
  assert passes[9] == 1 and passes[10] == 2, passes


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_processes_whose_shards_run_out_at_different_steps_stop_together(tmp_path):
  """Two CPU processes, 3 batches on one and 2 on the other (tests/data_passes_peer.py): both stop before step 2
  and save step 1 together, the position saved for the process that had a third batch before it. Before the
  agreement, the process that ran out checked and saved its state alone while the other waited in step 2's
  collective: both hung for good (JAX's preemption notifier takes SIGTERM, so only a SIGKILL ended them)."""
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": SUBPROCESS_PYTHONPATH,
         "JAX_PLATFORMS": "cpu"}
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, "tests/data_passes_peer.py", str(i), port, str(tmp_path)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=PEER_TIMEOUT_S))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    said = [p.communicate()[0].strip().splitlines()[-1:] for p in procs]
    pytest.fail(f"the processes hung (still running after {PEER_TIMEOUT_S} s); their last lines: {said}")
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  for result in results:
    assert result["steps"] == 2 and result["w"] == 4 * (1 + 2 + 3 + 4), result  # steps 0 and 1: batches 1+2, 3+4
    assert result["exhausted"] == {"step": 2, "pass": 1, "saved": 1, "files": "corpus.array_record",
                                   "processes": [1]}, result
  assert resume.checkpoint_steps(tmp_path) == [1]
  iterators = tmp_path / "checkpoints" / "1" / "iter"  # grain's position a process, saved with step 1
  positions = {p.name: json.loads(p.read_text()) for p in iterators.glob("process_*.json")}
  # Process 0 read its third batch before the agreement and put it back: a resume reads it again.
  assert positions == {f"process_{i}-of-2.json": {"next_index": 2} for i in range(2)}, positions
