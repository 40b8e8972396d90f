"""Real data through our entry point: a generated text corpus in ArrayRecord,
tokenized by a SentencePiece model from the maxtext wheel, read by upstream's
grain pipeline; a resume restores the data iterator."""

from __future__ import annotations

import math

import pytest

import text_fixture
from conftest import run_train

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


@pytest.mark.slow
def test_resume_restores_the_data_iterator_bit_identically(tmp_path, corpus):
  unbroken = run_train(tmp_path, *_grain(corpus), "steps=6", run_name="unbroken")
  assert unbroken.returncode == 0, unbroken.stderr[-3000:]
  losses = unbroken.losses()
  assert sorted(losses) == list(range(6)) and all(math.isfinite(v) for v in losses.values())
  assert len(set(losses.values())) == 6  # real batches differ step to step (a fixed synthetic batch would not)

  first = run_train(tmp_path, *_grain(corpus), "steps=3", run_name="resumed")
  assert first.returncode == 0, first.stderr[-3000:]
  assert (first.run_dir / "checkpoints" / "2" / "iter").is_dir()  # the iterator's position is checkpointed
  first_losses = first.losses()  # summary.json describes the latest invocation
  second = run_train(tmp_path, *_grain(corpus), "steps=6", run_name="resumed")
  assert second.returncode == 0, second.stderr[-3000:]
  assert sorted(second.losses()) == [3, 4, 5]
  assert {**first_losses, **second.losses()} == losses  # the same batches, bit-identical losses
