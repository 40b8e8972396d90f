"""Real data through our entry point: a generated text corpus in ArrayRecord,
tokenized by a SentencePiece model from the maxtext wheel, read by upstream's
grain pipeline; a resume restores the data iterator."""

from __future__ import annotations

import math

import pytest

import text_fixture
import patches
from conftest import REPO, SUBPROCESS_PYTHONPATH, run_train
from MaxText.checkpoints import resume

TINY = "configs/deepseek3-tiny.yml"


@pytest.fixture
def corpus(tmp_path):
  return text_fixture.write_arrayrecord(tmp_path / "data" / "train.array_record", text_fixture.documents(200))


def _grain(corpus):
  return (TINY, "dataset_type=grain", "grain_file_type=arrayrecord", f"grain_train_files={corpus}",
          "grain_worker_count=1", "tokenizer_type=sentencepiece", f"tokenizer_path={text_fixture.tokenizer_path()}",
          "vocab_size=32000", "max_target_length=64", "learning_rate_schedule_steps=6", "checkpoint_period=3")


def test_the_fixture_tokenizes_offline_with_the_shipped_model(corpus):
  import sentencepiece  # pylint: disable=import-outside-toplevel

  sp = sentencepiece.SentencePieceProcessor(model_file=str(text_fixture.tokenizer_path()))
  assert sp.vocab_size() == 32000
  ids = sp.encode(text_fixture.documents(1)[0])
  assert len(ids) > 20 and max(ids) < 32000 and sp.decode(ids) == text_fixture.documents(1)[0]
  assert corpus.stat().st_size > 10_000


def test_a_grain_iterator_without_a_parent_closes_without_an_assertion():
  """The seam behind the traceback every real-data run printed at exit: upstream's close step asks
  hasattr(it, "_parent"), and grain's iterator at the top of a pipeline raises AssertionError there."""
  import grain  # pylint: disable=import-outside-toplevel
  from maxtext.input_pipeline import multihost_dataloading  # pylint: disable=import-outside-toplevel

  from patches import grain_iterator_close  # pylint: disable=import-outside-toplevel

  it = iter(grain.MapDataset.range(8).to_iter_dataset())
  assert next(it) == 0
  it.close()  # upstream's first step (_close_iterator), then the seam
  with pytest.raises(AssertionError):
    multihost_dataloading._terminate_iterator_workers(it)  # pylint: disable=protected-access
  patches.apply_module(grain_iterator_close)
  try:
    multihost_dataloading._terminate_iterator_workers(it)  # pylint: disable=protected-access
  finally:
    patches.undo_module(grain_iterator_close)


# A resumed run's data iterator kept to exit (patches/checkpoint_guard.py holds the last step's arguments), as the
# trainer's process ends. The sleeping finalizer sits between the set-state queue's (priority 10, whose feeder
# thread then closes the queue's pipe) and grain's _close_if_alive (1), so the race CI lost once is lost every time
# on an idle machine.
_EXIT_RACE = """
import multiprocessing.util, sys, time
import numpy as np
_held = []

def main(close_first):
  import grain, jax, patches
  from absl import flags
  from jax.sharding import Mesh
  from maxtext.input_pipeline import multihost_dataloading
  from patches import grain_iterator_close
  flags.FLAGS(sys.argv[:1])  # grain reads its absl flags
  patches.apply_module(grain_iterator_close)
  ds = grain.MapDataset.range(64).map(lambda i: {"x": np.full((4,), i, np.int32)}).to_iter_dataset()
  ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=1))
  loader = multihost_dataloading.MultiHostDataLoadIterator(ds, Mesh(np.array(jax.devices()[:1]), ("data",)))
  _held.append(loader)
  it = loader.local_iterator
  next(it)
  it.set_state(it.get_state())  # a resume: the set-state queue's feeder thread starts
  print("batch", int(next(it)["x"][0]), flush=True)
  multiprocessing.util.Finalize(None, time.sleep, args=(1.0,), exitpriority=5)
  if close_first:
    grain_iterator_close.close_open_iterators()  # what MaxText/run/loop.py does when training returns

if __name__ == "__main__":  # grain's worker is spawned, and imports this file again
  main(sys.argv[1:] == ["close-first"])
"""


@pytest.mark.slow
def test_a_resumed_iterator_closed_when_training_returns_is_not_drained_by_exits_finalizers(tmp_path):
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  script = tmp_path / "exit_race.py"
  script.write_text(_EXIT_RACE)
  env = {**os.environ, "PYTHONPATH": SUBPROCESS_PYTHONPATH, "JAX_PLATFORMS": "cpu"}
  runs = {how: subprocess.run([sys.executable, str(script), *how], capture_output=True, text=True, timeout=180,
                              env=env, check=False) for how in ((), ("close-first",))}
  for run in runs.values():
    assert run.returncode == 0 and run.stdout == "batch 1\n", run.stderr[-3000:]
  # Left to exit, the iterator fails in a finalizer: grain's _close_if_alive on the closed pipe (the race CI lost), or,
  # on a loaded machine, its shared-memory batches' __del__ first (CI's slow tier, 2026-12-07); either is exit's
  # finalizers meeting an open iterator, which the close-first run below never does.
  lost = runs[()].stderr
  assert ("OSError: handle is closed" in lost and "_close_if_alive" in lost) or (
      "Exception ignored in" in lost and "SharedMemoryArray.__del__" in lost), lost[-3000:]
  assert "_close_if_alive" not in runs[("close-first",)].stderr, runs[("close-first",)].stderr[-3000:]
  assert "handle is closed" not in runs[("close-first",)].stderr


def _no_traceback(result) -> None:
  assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_resume_restores_the_data_iterator_bit_identically(tmp_path, corpus):
  unbroken = run_train(tmp_path, *_grain(corpus), "steps=6", run_name="unbroken")
  assert unbroken.returncode == 0, unbroken.stderr[-3000:]
  losses = unbroken.losses()
  assert sorted(losses) == list(range(6)) and all(math.isfinite(v) for v in losses.values())
  assert len(set(losses.values())) == 6  # real batches differ step to step (a fixed synthetic batch would not)
  _no_traceback(unbroken)  # grain's iterator closes at exit without upstream's AssertionError (grain_iterator_close)

  first = run_train(tmp_path, *_grain(corpus), "steps=3", run_name="resumed")
  assert first.returncode == 0, first.stderr[-3000:]
  assert (first.run_dir / "checkpoints" / "2" / "iter").is_dir()  # the iterator's position is checkpointed
  first_losses = first.losses()  # summary.json describes the latest invocation
  second = run_train(tmp_path, *_grain(corpus), "steps=6", run_name="resumed")
  assert second.returncode == 0, second.stderr[-3000:]
  assert sorted(second.losses()) == [3, 4, 5]
  _no_traceback(first)
  _no_traceback(second)
  assert {**first_losses, **second.losses()} == losses  # the same batches, bit-identical losses


@pytest.mark.slow
def test_a_resume_after_a_non_finite_stop_skips_its_batches(tmp_path, corpus):
  """learning_rate=0 and routed_bias_update_rate=0 (the router's bias moves with the load, not the learning
  rate) keep every weight at its init, so a step's loss is a function of its batch alone: the resumed step j
  matches the unbroken run's step j + skipped exactly when it trains on that batch."""
  args = (*_grain(corpus), "learning_rate=0", "routed_bias_update_rate=0", "learning_rate_schedule_steps=10")
  unbroken = run_train(tmp_path, *args, "steps=10", run_name="unbroken")
  assert unbroken.returncode == 0, unbroken.stderr[-3000:]
  losses = unbroken.losses()
  assert len(set(losses.values())) == 10  # one loss per batch: the losses name the batches

  first = run_train(tmp_path, *args, "steps=3", run_name="skipped")  # checkpoint 2
  assert first.returncode == 0, first.stderr[-3000:]
  # As MaxText/run/loop.py records an exit-4 stop at step 4 (tests/test_train_lifecycle.py: a real one, synthetic).
  assert resume.record_nonfinite(first.run_dir, 4, None)["batches_past_checkpoint"] == 2
  resumed = run_train(tmp_path, *args, "steps=7", "nonfinite_skip_batches=3", run_name="skipped")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert ("step 4 went non-finite after checkpoint 2; nonfinite_skip_batches=3: skipped 3 batches, those an "
          "unbroken run reads at steps 3..5; step 3 trains on the batch of step 6") in resumed.stdout
  assert {step: resumed.losses()[step] for step in (3, 4, 5, 6)} == {step: losses[step + 3] for step in (3, 4, 5, 6)}


def test_the_real_text_corpus_cuts_files_at_line_ends_in_path_order_up_to_its_cap(tmp_path):
  """tools/text_corpus.py: documents of whole lines, files in sorted order, non-text skipped, the cap honoured."""
  from tools import text_corpus  # pylint: disable=import-outside-toplevel

  src = tmp_path / "src"
  (src / "b").mkdir(parents=True)
  (src / "a.py").write_text("".join(f"line {i}\n" for i in range(10)))  # 70 characters
  (src / "b" / "c.txt").write_text("only one line\n")
  (src / "d.py").write_bytes(b"\xff\xfe not utf-8")
  (src / "e.bin").write_text("not a chosen suffix\n")
  docs = text_corpus.documents(src, (".py", ".txt"), max_chars=10**6, doc_chars=30)
  assert docs == ["line 0\nline 1\nline 2\nline 3\n", "line 4\nline 5\nline 6\nline 7\n", "line 8\nline 9\n",
                  "only one line\n"]
  assert text_corpus.documents(src, (".py", ".txt"), max_chars=50, doc_chars=30) == docs[:2]  # stops at the cap

  out = tmp_path / "c.array_record"
  assert text_corpus.main([str(out), "--source", str(src), "--suffixes", ".py,.txt"]) == 0 and out.stat().st_size
  assert text_corpus.main([str(out), "--source", str(tmp_path / "missing")]) == 2


def test_the_readme_corpus_directory_is_git_ignored():
  """The README's real-data example writes its corpus to data/ at the repository root."""
  assert "/data/" in (REPO / ".gitignore").read_text().splitlines()
