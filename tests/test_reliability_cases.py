"""The hostile cases of tests/reliability_bad_inputs.py (with tests/reliability_run_cases.py), every one held to
the README's exit-code promises: no traceback, nothing silent, nothing lost. The command is the one the README's
reliability table counts with, in a process of its own (its in-process cases patch upstream). The cases train tiny
runs, so they are in the slow tier; each check they rely on has its own fast test (tests/test_input_checks.py,
test_lifecycle.py, test_checkpoint_records.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import (_SHARED_JAX_CACHE, JAX_CACHE_ENV, REPO,  # pylint: disable=protected-access
                      SUBPROCESS_PYTHONPATH)


def _harness(*options: str) -> tuple[int, int, str]:
  """(cases, clean, the FAIL lines) of one run of the harness. The three runs below share their base runs and the
  session's compile cache (tests/conftest.py): each trained its own bases and compiled them cold before."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env.update({**JAX_CACHE_ENV, "PYTHONPATH": SUBPROCESS_PYTHONPATH})
  cache = _SHARED_JAX_CACHE[0]
  shared = ("--bases", str(cache.parent / "reliability_bases"), "--jax-cache", str(cache))
  proc = subprocess.run([sys.executable, "tests/reliability_bad_inputs.py", "--show", *shared, *options], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=3600, check=False)
  found = re.search(r"^(\d+) cases: (\d+) clean", proc.stdout, re.M)
  assert found, proc.stdout[-3000:] + proc.stderr[-3000:]
  fails = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("FAIL"))
  # --show printed each unclean case's output (its traceback first): CI's log keeps only the assertion's message.
  shown = proc.stdout.find("--- stdout ---")
  return int(found.group(1)), int(found.group(2)), fails + ("\n" + proc.stdout[shown:shown + 6000] if shown >= 0 else "")


DAMAGE_NAMED = ("it does not load: ValueError: DATA_LOSS: Error reading shard entry {0, 0}",
                "it holds non-finite values in 37 arrays (first opt_state/1/0/mu/w)",
                "the content of 2 arrays differs from its digest at save (first params/w): bytes changed on disk")


@pytest.mark.parametrize("why", DAMAGE_NAMED)
def test_a_damaged_checkpoint_named_in_any_words_is_clean(tmp_path, why):
  """The harness's verdict on "checkpoint 9: 400 bytes flipped": each way the restore names the damage (all three
  seen for those bytes) is the promise kept; a resume that names none stays silent."""
  import reliability_bad_inputs as harness  # pylint: disable=import-outside-toplevel
  import reliability_run_cases  # pylint: disable=import-outside-toplevel

  case = next(c for c in reliability_run_cases.training_cases(tmp_path) if c.name == "checkpoint 9: 400 bytes flipped")
  run_dir = tmp_path / "bad"
  (run_dir / "checkpoints" / "9.unusable").mkdir(parents=True)
  (run_dir / "summary.json").write_text(json.dumps({"losses": {str(s): 1.0 for s in (9, 10, 11)}}))
  said = (f"[maxtext-moe] WARNING: checkpoint 9 of {run_dir} is damaged ({why}); set aside as "
          "checkpoints/9.unusable; trying checkpoint 8\n")
  assert harness.verdict(case, harness.Result(0, said, "", run_dir), {})[0] == "clean"
  assert harness.verdict(case, harness.Result(0, "resuming from checkpoint step 9\n", "", run_dir), {})[0] == "silent"
  (run_dir / "summary.json").unlink()  # a stand-in, not a run's: the fast tier's guard looks for one


@pytest.mark.slow
def test_every_case_that_stops_before_training_is_clean():
  """Bad config, data, tokenizers, run directories, locks and full disks at start: one line, the documented code;
  torn locks taken over, and each kind of step directory that is not a checkpoint told apart (a dry run)."""
  total, clean, fails = _harness("--no-train")
  assert total >= 165 and clean == total, fails


@pytest.mark.slow
def test_every_case_that_trains_is_clean():
  """Damaged checkpoints and stray steps set aside, a dead node's lock taken over, the remedy of an exit 4, a stop
  without checkpoints, disks that fill. A damaged checkpoint is clean when the resume names its damage in any words
  (does not load, non-finite values, digests that differ) and sets it aside: 400 flipped bytes meet whichever check
  they reach first."""
  total, clean, fails = _harness("--train-only")
  assert total >= 17 and clean == total, fails


# With async_checkpointing=true (upstream's default, the recipes'), orbax commits each save in the background. The
# cases whose outcome depends on that: our record written after the background commit, a restore that falls through
# every checkpoint so written, and orbax's commit thread meeting a full disk. Damage to a finished checkpoint reads
# the same however it was written: the sync run (test_every_case_that_trains_is_clean) holds those cases.
ASYNC_CASES = ("checkpoint 9: our record deleted", "every checkpoint damaged",
               "a disk that fills mid-run (TensorBoard off)")  # orbax's commit thread met the full disk: one line


@pytest.mark.slow
def test_checkpoint_cases_with_async_saves_are_clean():
  total, clean, fails = _harness("--train-only", "--async-checkpoints", *(a for k in ASYNC_CASES for a in ("-k", k)))
  assert total == len(ASYNC_CASES) and clean == total, fails
