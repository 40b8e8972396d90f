"""The cases of tests/reliability_bad_inputs.py that meet something on disk: real data files and tokenizers,
an existing run (its checkpoints, records and lock), a full disk, a signal without checkpointing.

Two base runs are trained once per invocation (or once for all invocations given the same --bases) and copied
into each case's run directory: "trained"
(steps=10, checkpoint_period=4: checkpoints 0, 4, 8 and the final 9, schedule pinned to 12 steps) and
"diverged" (learning_rate=1e6 after a warm-up from 0: exit 4 after checkpoint 0, the initial state). A resume
of "trained" runs to steps=12, so it trains steps 10 and 11 unless a checkpoint is damaged.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from reliability_bad_inputs import REPO, TINY, Case, Result  # pylint: disable=import-error

RESUME = ("steps=12", "checkpoint_period=4", "learning_rate_schedule_steps=12")
BASES = {
    "trained": (("steps=10", "checkpoint_period=4", "learning_rate_schedule_steps=12"), 0),
    "diverged": (("learning_rate=1e6", "warmup_steps_fraction=0.5", "checkpoint_period=100", "steps=6",
                  "learning_rate_schedule_steps=6"), 4),
}
ASYNC = "async_checkpointing=true"  # upstream's default and the recipes': orbax commits each save in the background
PY = f"PYTHONPATH={REPO} {sys.executable}"
SUMMARY_SIZE = "echo \"[case] summary.json $(wc -c < $RUN/summary.json 2>/dev/null || echo absent)\""  # in `post`
COMPLETE = f"{PY} -c 'import sys; from MaxText.checkpoints import resume; print(\"[case] complete\", resume.checkpoint_steps(__import__(\"pathlib\").Path(sys.argv[1])))' $RUN"


# --- fixtures -----------------------------------------------------------------------------------


def data_fixture(tmp: Path) -> Path:
  """tmp/data: a good ArrayRecord corpus and broken ones, a garbage tokenizer (written once)."""
  data = tmp / "data"
  if (data / "done").exists():
    return data
  sys.path.insert(0, str(REPO / "tests"))
  import text_fixture  # pylint: disable=import-outside-toplevel

  good = text_fixture.write_arrayrecord(data / "good.array_record", text_fixture.documents(200))
  text_fixture.write_arrayrecord(data / "small.array_record", text_fixture.documents(20))  # 10 batches of the tiny config
  raw = good.read_bytes()
  (data / "empty.array_record").write_bytes(b"")
  (data / "random.array_record").write_bytes(random.Random(0).randbytes(len(raw)))
  (data / "truncated.array_record").write_bytes(raw[: len(raw) // 2])
  (data / "a_directory.array_record").mkdir()
  (data / "garbage.model").write_bytes(random.Random(1).randbytes(4096))
  (data / "empty_hf_tokenizer").mkdir()
  (data / "mixture_missing.json").write_text(json.dumps({"a": {"path": str(good), "weight": 1},
                                                         "b": {"path": str(data / "nope.array_record"), "weight": 1}}))
  (data / "mixture_garbled.json").write_text('{"a": {"path": ')
  (data / "done").write_text("")
  return data


def grain(data: Path, *changes: str) -> tuple[str, ...]:
  """A real-data run (tests/test_real_data.py's), with `changes` replacing its keys."""
  import text_fixture  # pylint: disable=import-outside-toplevel

  base = {"dataset_type": "grain", "grain_file_type": "arrayrecord",
          "grain_train_files": str(data / "good.array_record"), "grain_worker_count": "1",
          "tokenizer_type": "sentencepiece", "tokenizer_path": str(text_fixture.tokenizer_path()),
          "vocab_size": "32000", "max_target_length": "64"}
  base.update(c.split("=", 1) for c in changes)
  return tuple(f"{k}={v}" for k, v in base.items())


def base_run(bases: Path, kind: str, jax_cache: Path) -> Path:
  """The run directory of base run `kind` ("trained", or "trained-async": its saves with ASYNC) under `bases`,
  trained on first use. Invocations given the same `bases` (--bases: the slow tier's, on several workers at once)
  train each base once: the first takes a file lock and trains it, the others wait for it."""
  run_dir = bases / kind
  bases.mkdir(parents=True, exist_ok=True)
  with open(bases / f"{kind}.lock", "w", encoding="utf-8") as held:
    fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes, or when a process holding it dies
    if (run_dir / "summary.json").exists() or (run_dir / "maxtext-moe" / "nonfinite.json").exists():
      return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)  # a base run that died half-way is trained again from nothing
    name, _, variant = kind.partition("-")
    args, code = BASES[name]
    args = (*args, ASYNC) if variant == "async" else args
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
    proc = subprocess.run([sys.executable, "-m", "MaxText.train", TINY, *args, f"base_output_directory={bases}",
                           f"run_name={kind}", f"jax_cache_dir={jax_cache}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == code, f"base run {kind}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
  return run_dir


# --- what a case does to the run directory -------------------------------------------------------


def _largest_data_file(step_dir: Path) -> Path:
  return max((p for p in (step_dir / "items").rglob("*") if p.is_file() and "/d/" in str(p)),
             key=lambda p: p.stat().st_size)


def flip_bytes(step: int, count: int, bits: bool = False):
  def damage(run_dir: Path, data: Path) -> None:  # pylint: disable=unused-argument
    f = _largest_data_file(run_dir / "checkpoints" / str(step))
    raw = bytearray(f.read_bytes())
    rng = random.Random(step)
    for _ in range(count):
      raw[rng.randrange(len(raw))] ^= (1 << rng.randrange(8)) if bits else 0xFF
    f.write_bytes(bytes(raw))
  return damage


def truncate(step: int):
  def damage(run_dir: Path, data: Path) -> None:  # pylint: disable=unused-argument
    f = _largest_data_file(run_dir / "checkpoints" / str(step))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  return damage


def remove(relative: str):
  def damage(run_dir: Path, data: Path) -> None:  # pylint: disable=unused-argument
    path = run_dir / relative
    shutil.rmtree(path) if path.is_dir() else path.unlink()
  return damage


def write(relative: str, text: str):
  def damage(run_dir: Path, data: Path) -> None:  # pylint: disable=unused-argument
    path = run_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return damage


def empty_step(step: int):
  def damage(run_dir: Path, data: Path) -> None:  # pylint: disable=unused-argument
    step_dir = run_dir / "checkpoints" / str(step)
    shutil.rmtree(step_dir)
    step_dir.mkdir()
  return damage


def lock(record, mtime_offset: float = 0.0):
  def damage(run_dir: Path, data: Path) -> None:  # pylint: disable=unused-argument
    path = run_dir / "maxtext-moe" / "lock.json"
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    if mtime_offset:
      t = path.stat().st_mtime + mtime_offset
      os.utime(path, (t, t))
  return damage


def mkdir(relative: str):
  def damage(run_dir: Path, data: Path) -> None:  # pylint: disable=unused-argument
    (run_dir / relative).mkdir(parents=True)
  return damage


def both(*damages):
  def damage(run_dir: Path, data: Path) -> None:
    for d in damages:
      d(run_dir, data)
  return damage


# --- what must hold after --------------------------------------------------------------------------


def trained_steps(first: int, last: int = 11):
  """The run trained exactly steps first..last (summary.json of this invocation)."""
  def check(result: Result) -> str | None:
    try:
      losses = json.loads((result.run_dir / "summary.json").read_text())["losses"]
    except (OSError, ValueError, KeyError):
      return "lost: no summary.json"
    steps = sorted(int(s) for s in losses)
    if steps != list(range(first, last + 1)):
      return f"lost: trained steps {steps[:3]}..{steps[-1:]} , expected {first}..{last}"
    return None
  return check


def checkpoints_are(steps: list[int]):
  def check(result: Result) -> str | None:
    from MaxText.checkpoints import resume  # pylint: disable=import-outside-toplevel

    found = resume.checkpoint_steps(result.run_dir)
    return None if found == steps else f"lost: checkpoints {found}, expected {steps}"
  return check


def set_aside(*names: str, then=None):
  def check(result: Result) -> str | None:
    missing = [n for n in names if not (result.run_dir / "checkpoints" / n).is_dir()]
    if missing:
      return f"lost: checkpoints/{missing[0]} not kept"
    return then(result) if then else None
  return check


def printed(text: str, then=None):
  def check(result: Result) -> str | None:
    if text not in result.stdout:
      return f"lost: {text!r} not printed: {result.stdout[-200:]!r}"
    return then(result) if then else None
  return check


def summary_as_said(result: Result) -> str | None:
  """A line that says "summary.json not written" leaves none (a full disk once left a 0-byte one), and one that says
  it was written leaves a whole one (SUMMARY_SIZE, run in `post`)."""
  size = next((line.split()[-1] for line in result.stdout.splitlines() if line.startswith("[case] summary.json ")), None)
  if "summary.json not written" in result.stderr and size != "absent":
    return f"lost: the line says summary.json was not written, and one of {size} bytes is there"
  if "summary.json written" in result.stderr and (size is None or not size.isdigit() or int(size) == 0):
    return f"lost: the line says summary.json was written, and it is {size}"
  return None


def dangling_link(relative: str):
  def damage(run_dir: Path, data: Path) -> None:  # pylint: disable=unused-argument
    path = run_dir / relative
    if path.is_dir():
      shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(run_dir.parent / "unmounted-scratch" / relative)
  return damage


def same_refusal_twice(result: Result) -> str | None:
  """The refused resume left effective_config.json alone: run again, the line still names the key."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  again = subprocess.run([sys.executable, "-m", "MaxText.train", TINY, *RESUME, "base_emb_dim=32",
                          f"base_output_directory={result.run_dir.parent}", "run_name=bad"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900, check=False)
  if "base_emb_dim 64 -> 32" not in again.stderr:
    return f"lost: the second refusal no longer names base_emb_dim: {again.stderr[-300:]!r}"
  return None


# --- the cases --------------------------------------------------------------------------------------


def data_cases(tmp: Path) -> list[Case]:
  """Real data and its tokenizer, checked before anything is written."""
  data = tmp / "data"
  bad = lambda *changes, says="", name="": Case(grain(data, *changes), says=says, name=name)  # noqa: E731
  return [
      bad(f"grain_train_files={data}/nope.array_record", says="'grain_train_files' = .*: no file matches it",
          name="grain_train_files: missing"),
      bad(f"grain_train_files={data}/*.nosuch", says="no file matches it", name="grain_train_files: a glob of none"),
      bad(f"grain_train_files={data}/empty.array_record", says="empty.array_record is empty", name="... an empty file"),
      bad(f"grain_train_files={data}/random.array_record", says="random.array_record cannot be read as arrayrecord",
          name="grain_train_files: random bytes"),
      bad(f"grain_train_files={data}/truncated.array_record", says="truncated.array_record cannot be read as arrayrecord",
          name="grain_train_files: truncated"),
      bad(f"grain_train_files={data}/a_directory.array_record", says="is not a file",
          name="grain_train_files: a directory"),
      bad(f"grain_train_files={data}/good.array_record,0.5;{data}/nope.array_record,0.5", says="nope.array_record' ",
          name="grain_train_files: a mixture with a missing member"),
      bad(f"grain_train_files={data}/good.array_record;{data}/good.array_record", says="not 'pattern,weight'",
          name="grain_train_files: a mixture without weights"),
      bad("grain_train_files=", says="config key 'grain_train_files'", name="grain_train_files: empty"),
      bad(f"grain_train_mixture_config_path={data}/mixture_missing.json",
          says="'grain_train_mixture_config_path' = .*nope.array_record' .*: no file matches it",
          name="mixture config naming a missing file"),
      bad(f"grain_train_mixture_config_path={data}/mixture_garbled.json", says="not a readable mixture config",
          name="mixture config garbled"),
      bad(f"grain_train_mixture_config_path={data}/nope.json", says="not a readable mixture config",
          name="mixture config missing"),
      bad("train_data_columns=[content]", says="Column 'content' not found", name="train_data_columns: no such column"),
      bad("grain_file_type=nosuch", says="'grain_file_type' = 'nosuch'", name="grain_file_type: nosuch"),
      bad("grain_file_type=tfrecord", says="cannot be read as tfrecord", name="an ArrayRecord file read as tfrecord"),
      bad("grain_file_type=parquet", says="cannot be read as parquet", name="an ArrayRecord file read as parquet"),
      bad(f"tokenizer_path={data}/nope.model", says="'tokenizer_path' = .*nope.model.*: no such file",
          name="tokenizer_path: missing"),
      bad(f"tokenizer_path={data}/garbage.model", says="does not load as a sentencepiece tokenizer",
          name="tokenizer_path: garbage"),
      bad("tokenizer_type=tiktoken", says="does not load as a tiktoken tokenizer",
          name="a SentencePiece model read as tiktoken"),
      bad("tokenizer_type=huggingface", f"tokenizer_path={data}/empty_hf_tokenizer",
          says="does not load as a huggingface tokenizer", name="an empty Hugging Face tokenizer folder"),
      bad("vocab_size=1024", says="'vocab_size' = 1024 .* is smaller than the 32000 tokens of tokenizer_path",
          name="vocab_size=1024 with Llama 2's 32,000-token tokenizer"),
      bad("vocab_size=31999", says="smaller than the 32000 tokens", name="vocab_size one short of the tokenizer"),
      Case(("--dry-run", *grain(data, "vocab_size=1024")), says="is smaller than the 32000 tokens",
           name="--dry-run: vocab_size=1024 with Llama 2's tokenizer"),
  ]


def existing_run_cases(tmp: Path) -> list[Case]:
  """An existing run: resumes that must be refused (nothing changed), lock files, what a dry run says."""
  data = tmp / "data"
  return [
      Case(("enable_checkpointing=false", *RESUME), base="trained",
           says="'enable_checkpointing' = False: run .* holds checkpoints up to step 9",
           name="enable_checkpointing=false on a run with checkpoints"),
      Case(RESUME, base="trained", setup=remove("maxtext-moe/schedule.json"), says="schedule.json is missing",
           name="resume: schedule.json deleted"),
      Case(RESUME, base="trained", setup=write("maxtext-moe/schedule.json", '{"learning_rate": 0.0'),
           says="schedule.json cannot be read", name="resume: schedule.json garbled"),
      Case(RESUME, base="trained", setup=remove("maxtext-moe/data.json"), says="data.json is missing",
           name="resume: data.json deleted"),
      Case(RESUME, base="trained", setup=write("maxtext-moe/data.json", "[]"), says="data.json is not a JSON object",
           name="resume: data.json garbled"),
      Case((*RESUME, *grain(data)), base="trained",
           says="would train on other data \\(dataset_type 'synthetic' -> 'grain', vocab_size 1024 -> 32000",
           name="a synthetic run resumed on grain data, another vocabulary"),
      Case((*RESUME, "learning_rate=2e-3"), base="trained", says="\\(learning_rate 0.001 -> 0.002\\).*pin learning_rate=0.001 ",
           name="resume with another learning_rate: the hint names it"),
      Case(("steps=14", "learning_rate_schedule_steps=14"), base="trained",
           says="pin learning_rate_schedule_steps=12 ", name="resume stretching the schedule"),
      Case(("steps=10",), base="trained", code=0, says="already finished: its last checkpoint is step 9",
           name="rerun of a finished run"),
      Case(("steps=10",), base="trained", setup=mkdir("checkpoints/99"), code=0,
           says="already finished: its last checkpoint is step 9", name="a finished run with a stray checkpoints/99"),
      Case(RESUME, base="trained", setup=lambda r, d: (r / "maxtext-moe" / "lock.json").mkdir(),
           says="lock.json is a directory, not a run lock", name="lock.json is a directory"),
      Case(RESUME, base="trained", setup=lock({"host": os.uname().nodename, "pid": 1, "started": "then"}), code=5,
           says="in use by host .* pid 1 since then", name="a live job's lock (pid 1 here)"),
      Case(RESUME, base="trained", setup=lock({"host": "node-7", "pid": 4242, "started": "then"}), code=5,
           says="in use by host node-7 pid 4242 .*lock refreshed \\d s ago.*wait \\d+ s", name="a fresh lock of another node"),
      Case(RESUME, base="trained", setup=lock({"host": "node-7", "pid": 4242, "started": "then"}, 3600), code=5,
           says="time stamp is 3\\d{3} s in the future.*wait 3[67]\\d\\d s", name="a lock stamped an hour ahead"),
      Case(("--dry-run", *RESUME), base="trained", setup=mkdir("checkpoints/99"), code=0,
           warns="checkpoints/99 is not a checkpoint .*the run would set it aside[^$]*would resume from checkpoint step 9",
           check=set_aside("99"), name="--dry-run: a stray checkpoints/99"),
      Case(("--dry-run", *RESUME), base="trained", setup=remove("maxtext-moe/checkpoints/9.json"), code=0,
           warns="checkpoints/9 is not a checkpoint \\(no record of ours.*would resume from checkpoint step 8",
           name="--dry-run: checkpoint 9's record deleted"),
      Case(("--dry-run", *RESUME), base="trained", setup=remove("checkpoints/9/commit_success.txt"), code=0,
           warns="checkpoints/9 is not a checkpoint \\(no orbax commit marker", name="--dry-run: 9's commit marker gone"),
      # The kinds of step directory that are not checkpoints, told apart by the check a resume makes before it sets
      # one aside (the move itself: training_cases); a dry run moves nothing.
      *(Case(("--dry-run", *RESUME), base="trained", setup=setup, code=0, check=set_aside("9"), name=f"--dry-run: {name}",
             warns=f"checkpoints/9 is not a checkpoint \\({why}.*the run would set it aside[^$]*would resume from "
             "checkpoint step 8")
        for setup, name, why in ((remove("checkpoints/9/items/_METADATA"), "checkpoint 9: _METADATA deleted",
                                  "its items/_METADATA is missing"),
                                 (remove("checkpoints/9/items"), "checkpoint 9: items/ deleted", "its items/_METADATA"),
                                 (empty_step(9), "checkpoint 9: an empty step directory", "no orbax commit marker"),
                                 (write("maxtext-moe/checkpoints/9.json", "{"), "checkpoint 9: our record garbled",
                                  "our record .* cannot be read"))),
      # Torn locks are stale: taken over under the lock, before the resume's checks (here: nothing left to train).
      *(Case(("steps=10",), base="trained", setup=lock(record), code=0, name=name,
             says="already finished: its last checkpoint is step 9", warns=f"taking over a stale lock \\({why}")
        for record, name, why in (("", "an empty lock.json (a disk that filled)", "lock.json is empty"),
                                  ('{"host": "n", "pid": "12"}', "lock.json: pid a string", ""),
                                  ("[1, 2]", "lock.json: a JSON list", ""))),
      Case(("--dry-run", "enable_checkpointing=false", *RESUME), base="trained", says="'enable_checkpointing' = False",
           name="--dry-run: enable_checkpointing=false on a run with checkpoints"),
      Case(("--dry-run", *RESUME, "learning_rate=2e-3"), base="trained", says="pin learning_rate=0.001 ",
           name="--dry-run: another learning_rate"),
      Case(RESUME, base="trained", setup=remove("maxtext-moe/checkpoints"),
           says="holds checkpoints \\(0, 4, 8, 9\\) but no records of them .*nothing was moved",
           name="a run whose checkpoint records are gone (an older version's)"),
      Case((*BASES["diverged"][0], "nonfinite_skip_batches=3"), base="diverged",
           setup=write("maxtext-moe/nonfinite.json", '{"step": 3, "checkp'),
           says="'nonfinite_skip_batches' = 3: the record of the last non-finite stop, .* cannot be read",
           name="nonfinite.json garbled, a skip asked for"),
      Case(RESUME, base="trained", setup=dangling_link("checkpoints"),
           says="checkpoints is a symbolic link to '.*unmounted-scratch/checkpoints', which does not exist",
           name="a dangling checkpoints symlink"),
      Case(("steps=3",), setup=lambda r, d: dangling_link(r.name)(r.parent, d),
           says="bad is a symbolic link to '.*', which does not exist", name="a run directory that is a dangling link"),
      Case(RESUME, base="trained", shell="mount --bind $RUN $RUN && mount -o remount,bind,ro $RUN",
           says="config key 'run_name' = 'bad': .*bad cannot be written here \\(Read-only file system\\)",
           name="a read-only run directory"),
      Case((*RESUME, "base_emb_dim=32"), base="trained", own_process=True, check=same_refusal_twice,
           says="the model's shape changed: .*config keys changed since: base_emb_dim 64 -> 32",
           name="resume with another model shape, twice"),
  ]


def training_cases(tmp: Path) -> list[Case]:
  """Resumes that train: damaged checkpoints, a stale lock, the remedy of an exit 4, a stop without checkpoints."""
  resumed = lambda setup, name, warns, first, aside=(): Case(  # noqa: E731
      RESUME, code=0, base="trained", setup=setup, trains=True, name=name, warns=warns,
      check=set_aside(*aside, then=trained_steps(first)))
  damaged = "WARNING: checkpoint 9 of .* is damaged \\({}.*set aside as checkpoints/9.unusable; trying checkpoint 8"
  # Flipped bytes are caught in whichever check meets them first: a read that fails, a value that is not finite, or a
  # digest that differs (each seen for the same 400 flipped bytes); any of them, named, is the promise kept.
  any_damage = "(it does not load|it holds non-finite values|the content of \\d+ arrays differs from its digest)"
  stray = "WARNING: .*checkpoints/9 is not a checkpoint \\({}.*set aside as 9.unusable"
  data = tmp / "data"
  return [
      resumed(mkdir("checkpoints/99"), "a stray empty checkpoints/99", "checkpoints/99 is not a checkpoint",
              10, ("99.unusable",)),
      resumed(truncate(9), "checkpoint 9: a data file truncated", damaged.format("it does not load"), 9,
              ("9.unusable",)),
      resumed(flip_bytes(9, 400), "checkpoint 9: 400 bytes flipped", damaged.format(any_damage), 9,
              ("9.unusable",)),
      resumed(flip_bytes(9, 1, bits=True), "checkpoint 9: one bit flipped", damaged.format(any_damage),
              9, ("9.unusable",)),
      # The step directories that are not checkpoints (a deleted _METADATA, items/ or record, an empty step, a garbled
      # record) are told apart before training, by the check a --dry-run makes too (existing_run_cases); every kind
      # is set aside by the same move: this case and the stray checkpoints/99 train after it.
      resumed(remove("maxtext-moe/checkpoints/9.json"), "checkpoint 9: our record deleted",
              stray.format("no record of ours"), 9),
      # Checkpoint 0 takes 400 flipped bytes, not one bit: the data files' layout varies from run to run, and one bit
      # landed once where the restore reads nothing (slow tier, 2026-12-07: checkpoint 0 restored, its digest matched).
      resumed(both(flip_bytes(9, 1, bits=True), truncate(8), flip_bytes(4, 400), flip_bytes(0, 400)),
              "every checkpoint damaged", "none of the 4 checkpoint\\(s\\) of .* could be restored: training starts "
              "at step 0", 0),
      resumed(write("maxtext-moe/state_shapes.json", "{"), "an older run's state_shapes.json garbled (not read)",
              "resuming from checkpoint step 9", 10),
      # A stale lock is taken over before anything is compiled: the torn ones are existing_run_cases (a finished
      # run, nothing to train); this one trains after the takeover.
      resumed(lock({"host": "node-7", "pid": 4242, "started": "then"}, -600), "a lock of a dead node (10 min old)",
              "taking over a stale lock \\(not refreshed for 6\\d\\d s\\): host node-7 pid 4242", 10),
      Case(("learning_rate=1e-4", "warmup_steps_fraction=0.5", "checkpoint_period=100", "steps=6",
            "learning_rate_schedule_steps=6"), code=0, base="diverged", trains=True, check=trained_steps(1, 5),
           warns="WARNING: learning_rate 1000000.0 -> 0.0001 after the non-finite stop at step \\d",
           name="after exit 4, the advised lower learning_rate"),
      Case((*RESUME, "allow_schedule_change=true"), code=0, base="trained", setup=remove("maxtext-moe/schedule.json"),
           trains=True, check=trained_steps(10), warns="schedule.json is missing; allow_schedule_change=true",
           name="schedule.json deleted, allow_schedule_change=true"),
      # The data runs out (20 documents: 10 batches) before steps=14: a saved stop, or another pass (the default;
      # tests/test_data_passes.py holds what the second pass reads). The stop's run is the only one that holds it.
      Case(grain(data, f"grain_train_files={data}/small.array_record", "steps=14", "checkpoint_period=100",
                 "data_exhausted=stop"), code=11, trains=True,
           check=lambda r: checkpoints_are([0, 9])(r) or trained_steps(0, 9)(r),
           says="data exhausted: grain_train_files '.*small.array_record' ran out at step 10 .*checkpoint of step 9, "
           "the last step trained, saved", name="grain data that runs out, data_exhausted=stop"),
      Case(grain(data, f"grain_train_files={data}/small.array_record", "steps=14", "checkpoint_period=100"), code=0,
           trains=True, warns="data: pass 1 over .*small.array_record ended before step 10; starting pass 2",
           check=trained_steps(0, 13), name="grain data that runs out: another pass"),
      # A step that needs about 100 GiB under a 12 GB address-space limit: the host's allocation fails for real.
      Case(("steps=2", "per_device_batch_size=512", "max_target_length=2048"), code=7, trains=True, memory_limit=12 * 10**9,
           says="out of host memory: .*Out of memory allocating \\d+ bytes", name="a step beyond the host's memory"),
      Case(("enable_checkpointing=false", "steps=40"), code=75, trains=True, signal_at=(signal.SIGTERM, 3),
           says="stopped by SIGTERM after step \\d+: checkpointing is off .*so the \\d+ steps trained are lost; a rerun "
           "starts at step 0", name="SIGTERM with checkpointing off"),
  ]


def disk_cases(tmp: Path) -> list[Case]:
  """A small tmpfs in a private mount namespace: full at start, or filled by another writer mid-run."""
  mount = "mount -t tmpfs -o size={} tmpfs $OUT"
  fill = "(dd if=/dev/zero of=$OUT/filler bs=64k >/dev/null 2>&1 || true)"
  after_4 = "(while [ ! -e $RUN/checkpoints/4/commit_success.txt ]; do sleep 0.1; done; {}) &"
  full = "maxtext-moe: (storage full: could not write|checkpoint not saved: )"
  kept = lambda steps: lambda r: summary_as_said(r) or (  # noqa: E731
      None if f"[case] complete {steps}" in r.stdout else f"lost: {r.stdout[-300:]!r}")
  kept_4 = kept([0, 4])
  post = f"{COMPLETE}; {SUMMARY_SIZE}"
  mid = ("steps=40", "checkpoint_period=4", "log_period=1")
  return [
      Case(("steps=3",), code=6, shell=f"{mount.format('1m')} && {fill}; true",
           says="storage full: could not write .*bad/maxtext-moe/lock.json: No space left on device",
           post="ls $RUN/maxtext-moe", check=lambda r: "lost: lock.json left" if "lock.json" in r.stdout else None,
           name="a disk full at start"),
      Case(("steps=3",), code=6,
           shell=f"{mount.format('1m')} && mkdir -p $RUN/maxtext-moe && : > $RUN/maxtext-moe/lock.json && {fill}; true",
           says="storage full: could not write .*lock.json", name="a disk full at start, an empty lock.json left"),
      Case(mid, code=6, trains=True, says=full, post=post, check=kept_4,
           shell=f"{mount.format('64m')} && " + after_4.format(fill), name="a disk that fills mid-run (TensorBoard on)"),
      Case((*mid, "enable_tensorboard=false"), code=6, trains=True, says=full, post=post, check=kept_4,
           shell=f"{mount.format('64m')} && " + after_4.format(fill), name="a disk that fills mid-run (TensorBoard off)"),
      Case(("steps=40", "checkpoint_period=100", "log_period=1"), code=6, trains=True,
           says="maxtext-moe: storage full: could not write .*/tensorboard/bad/events.out.tfevents.*: No space left on "
           "device; 0.0 MiB free there; the last complete checkpoint \\(step 0\\) is kept; summary.json not written",
           post=post, check=kept([0]),
           shell=f"{mount.format('64m')} && " + after_4.replace("/4/", "/0/").format(fill),
           name="a disk that fills mid-run: TensorBoard writes next"),
  ]


def saves_async(case: Case) -> Case | None:
  """The case again with its checkpoints saved asynchronously (its base run's too); None for a case that neither
  resumes nor writes a checkpoint."""
  if "enable_checkpointing=false" in case.args or not (case.base or case.trains):
    return None
  return dataclasses.replace(case, args=(*case.args, ASYNC), base=case.base and f"{case.base}-async",
                             name=f"{case.name or ' '.join(case.args)} (async saves)")


def cases(tmp: Path) -> list[Case]:
  data_fixture(tmp)
  return data_cases(tmp) + existing_run_cases(tmp) + training_cases(tmp) + disk_cases(tmp)
