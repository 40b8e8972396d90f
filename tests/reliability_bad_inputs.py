"""Hostile but realistic cases on the tiny config, and whether each keeps the README's exit-code promises.

  PYTHONPATH=$PWD python tests/reliability_bad_inputs.py [--subprocess] [--no-train | --train-only]
      [--async-checkpoints] [-k WORD ...] [--bases DIR] [--jax-cache DIR]

Each case is a command line a user runs (`python -m MaxText.train`, or `python -m MaxText.plan`), with what
it finds on disk (a broken data file, a damaged checkpoint, a torn lock, a full disk) and what must come of
it: the documented exit code, one `maxtext-moe:` line on stderr naming the key, value or path (or, for a
run that goes on, the warning on stdout), and the promise behind it (nothing written for a refused new run,
a refused resume leaves the run's records as they were, the resumed steps are the ones expected).

Each outcome is one of: clean; traceback (a Python traceback, or exit 1); silent (accepted without the line
that says what happened, or an exit 0 where a refusal was due); lost (steps or records lost); other (another
exit code or line). Prints one line per case and the counts last; exit 0 only when every case is clean.

Cases without a training step run in this process (file descriptors 1 and 2 captured, so C-level writes
count; `--subprocess`: each its own `python -m`); those that train, set an environment, send a signal or
need a private mount namespace (a small tmpfs for a full disk: `unshare -m`, as root) run as subprocesses.
The run-directory cases are in tests/reliability_run_cases.py; `--no-train` leaves out those that train.
`--async-checkpoints` runs the cases that resume or write checkpoints again with async_checkpointing=true
(upstream's default, the recipes'), their base runs too; the others are left out.

A damaged checkpoint's case holds its promise when the resume names the damage in any of the words the restore
has for it (it does not load, it holds non-finite values, its digests differ) and sets the step aside: which check
meets flipped bytes first depends on where they fell, not on the damage being caught.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
# The repository, then the session's own path (tests/conftest.py: the tests' XLA flags).
_PYTHONPATH = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
TINY = str(REPO / "configs/deepseek3-tiny.yml")
HANG_S = 600  # a case still running after this hangs
SETUP_FAILED = 97  # a case's shell setup (a private mount namespace, a tmpfs) failed: it did not run
# --bases, --jax-cache: the base runs and the compile cache of the cases that train, kept across invocations (the
# slow tier's three share its session's: they would otherwise train the same base runs and compile the same tiny
# steps once each); None: under the invocation's temporary directory.
SHARED: dict[str, Path | None] = {"bases": None, "jax_cache": None}


@dataclasses.dataclass
class Result:
  code: int | None  # None: it hung
  stdout: str
  stderr: str
  run_dir: Path
  seconds: float = 0.0  # the command's wall time


@dataclasses.dataclass
class Case:
  """One command line and the promise it must keep.

  args: after the config (`config`; None: args are the whole command line, e.g. a broken YAML first).
  says: a regular expression the one `maxtext-moe:` line on stderr must match (for exit 0 without such a
    line, a run that goes on: `warns`, on stdout).
  base: a run to copy into the run directory first ("trained": checkpoints 0, 4, 8, 9 of steps=10;
    "diverged": an exit-4 stop at step 2 after checkpoints 0, 1).
  setup(run_dir, data): changes files before the run; `data` is the fixture folder (tests/text_fixture.py).
  check(result): a promise beyond the line: returns "lost: ..." or "silent: ..." when broken, else None.
  shell: sh commands run first in a private mount namespace ($OUT: base_output_directory, $RUN: the run
    directory); `post` runs after the command there (its stdout is kept: the tmpfs ends with it).
  """

  args: tuple[str, ...]
  code: int = 2
  says: str = ""
  warns: str = ""
  name: str = ""
  config: str | None = TINY
  tool: str = "train"
  base: str | None = None
  setup: Callable[[Path, Path], None] | None = None
  check: Callable[[Result], str | None] | None = None
  env: dict[str, str] | None = None
  trains: bool = False
  own_process: bool = False
  shell: str = ""
  post: str = ""
  signal_at: tuple[int, int] | None = None  # (signal, step): sent when "[progress] step STEP/" is printed
  memory_limit: int | None = None  # bytes of address space (RLIMIT_AS) the command may take: a real allocation fails

  @property
  def subprocess(self) -> bool:
    return bool(self.trains or self.own_process or self.env or self.shell or self.signal_at or self.memory_limit)


def _files(tmp: Path) -> dict[str, str]:
  """Broken config files (written once)."""
  files = {
      "syntax.yml": "steps: [1, 2\n",
      "list.yml": "- steps\n- 3\n",
      "cycle_a.yml": "base_config: cycle_b.yml\n",
      "cycle_b.yml": "base_config: cycle_a.yml\n",
      "nobase.yml": "base_config: no-such-base.yml\nsteps: 3\n",
      "typo.yml": f"base_config: {TINY}\nnum_expertz: 4\n",
      "badtype.yml": f"base_config: {TINY}\nsteps: soon\n",
      "base42.yml": "base_config: 42\nsteps: 3\n",
      "baselist.yml": f"base_config: [{TINY}, 7]\n",
      "basemap.yml": "base_config: {path: deepseek3-tiny.yml}\n",
      "interp.yml": f"base_config: {TINY}\nsteps: ${{nosuch}}\n",
  }
  for name, text in files.items():
    (tmp / name).write_text(text)
  return {name: str(tmp / name) for name in files}


def config_cases(tmp: Path) -> list[Case]:
  """Bad input that must stop before anything is written: exit 2, one line, no run directory."""
  f = _files(tmp)
  overrides = [
      # unknown keys and typos
      "stepz=3", "num_expertz=4", "learning_rat=1e-3", "moe_gmm_backnd=xla", "per_device_batchsize=2",
      # wrong types
      "steps=abc", "learning_rate=fast", "per_device_batch_size=two", "enable_checkpointing=maybe",
      "num_experts=4.5", "vocab_size=abc", "checkpoint_period=soon", "progress_every=often",
      # out of range
      "per_device_batch_size=0", "per_device_batch_size=-2", "vocab_size=-1",
      "vocab_size=0", "max_target_length=0", "max_target_length=-8", "checkpoint_period=-5",
      "steps=-5", "steps=0", "learning_rate=-1", "base_emb_dim=0", "base_num_decoder_layers=0",
      "num_experts_per_tok=16", "num_experts_per_tok=0", "num_experts=0", "progress_every=-1",
      "moe_a2a_padded_capacity_factor=0", "moe_te_ncclep_alignment=3", "base_num_query_heads=0",
      # ranges that crashed later: a ZeroDivisionError after the first checkpoint, an int32 overflow
      "log_period=0", "log_period=-3", "steps=100000000000000000000", "learning_rate_schedule_steps=3000000000",
      "checkpoint_period=9999999999",
      # accepted, then a failure after the compile or a run that trains nothing and says nothing
      "learning_rate=.inf", "learning_rate=nan", "learning_rate_schedule_steps=0", "learning_rate_schedule_steps=-2",
      # names that are not one of the choices
      "attention=nosuch", "attention_type=weird", "hardware=abacus", "moe_gmm_backend=cutlass", "moe_block=fancy",
      "moe_dispatch_backend=carrier_pigeon", "decoder_block=nosuch", "xla_presets=[nosuch]", "dataset_type=nosuch",
      "remat_policy=nosuch", "remat_policy=Full", "context_parallel_strategy=nosuch", "routed_score_func=nosuch",
      "mlp_activations=[silu,nosuch]",
      # combinations, and backends this machine cannot run
      "base_config=models/deepseek3-tiny.yml",
      "hardware=gpu", "recipe_num_gpus=8", "moe_gmm_backend=mgpu", "moe_gmm_backend=tokamax",
      "moe_gmm_backend=te",
      # paths and the run's name
      "base_output_directory=/proc/maxtext-out", "base_output_directory=/no/such/parent/out",
      "base_output_directory=/etc/hostname",
      # override syntax and interpolations
      "steps", "=3", "steps:3", "steps=${nosuch}", "steps=${oc.env:MAXTEXT_MOE_NO_SUCH_VARIABLE}", "steps=${steps}",
  ]
  out = [Case((o,)) for o in overrides]
  # Bad values held to the words of their line too (one of each kind: a range, a choice this machine cannot run, a
  # backend that is not installed, a value that once crashed after the compile), and refused before any compile
  # (checkpoint_period=0 once took 49 s and a traceback).
  before_compile = lambda r: None if r.seconds < 60 else f"slow: refused after {r.seconds:.0f} s"  # noqa: E731
  out += [Case((o,), says=re.escape(s), check=before_compile) for o, s in (
      ("per_device_batch_size=0.5", "global batch of 0.5"),
      ("hardware=tpu", "config key 'hardware' = 'tpu' (as set), but jax found 1 CPU device(s)"),
      ("moe_block=te", "'moe_block' = 'te' needs Transformer Engine"),
      ("checkpoint_period=0", "'checkpoint_period' = 0"))]
  # Keys that contradict upstream's block (pinned: the tiny config's block may be ours).
  out += [Case(("moe_block=upstream", o)) for o in ("moe_dispatch_backend=te_ncclep", "moe_dispatch_backend=ring")]
  out += [Case(("moe_block=upstream", "moe_gmm_backend=xla", o)) for o in ("sparse_matmul=false", "megablox=false")]
  out += [
          Case(("moe_block=ours", "moe_dispatch_backend=ragged_a2a"), says="'moe_dispatch_backend' = 'ragged_a2a'"),
          Case(("moe_block=ours", "moe_dispatch_backend=te_ncclep"), says="cannot run on this CPU machine")]
  out += [Case((), config=str(REPO / "configs/no-such-file.yml"))]
  out += [Case((), config=f[name]) for name in ("syntax.yml", "list.yml", "cycle_a.yml", "nobase.yml", "typo.yml",
                                                 "badtype.yml", "base42.yml", "baselist.yml", "basemap.yml",
                                                 "interp.yml")]
  # A run name must stay inside base_output_directory, in a name the filesystem takes.
  for name in ("../escape", "a/b", "..", "x" * 300):
    out.append(Case((f"run_name={name}",), says="config key 'run_name'", name=f"run_name={name[:40]}"))
  # --dry-run runs the same checks.
  out += [Case(("--dry-run", o), says=s) for o, s in (("remat_policy=nosuch", "'remat_policy' = 'nosuch'"),
                                                      ("log_period=0", "'log_period' = 0"),
                                                      ("moe_gmm_backend=mgpu", "'moe_gmm_backend' = 'mgpu'"),
                                                      ("learning_rate=.inf", "'learning_rate' = inf"))]
  # A remat location another policy never reads: the offload asked for would silently not happen.
  out += [Case(("remat_policy=full", "moe_mlpwi_0=offload"), says="'moe_mlpwi_0' = 'offload' .* does nothing"),
          Case(("--dry-run", "remat_policy=minimal", "decoder_layer_input=offload"),
               says="'decoder_layer_input' = 'offload' .* does nothing")]
  # jax asked for a platform this machine lacks (an AssertionError with no message inside jax, for cuda).
  for platforms in ("cuda", "nosuch", "tpu"):
    out.append(Case((), says=f"environment JAX_PLATFORMS='{platforms}'", env={"JAX_PLATFORMS": platforms},
                    name=f"JAX_PLATFORMS={platforms}"))
  # The planner's options, refused before its compile.
  out += [Case(("--json", str(tmp)), tool="plan", says="--json .*: is a directory"),
          Case(("--json", "/proc/no/such.json"), tool="plan", says="--json /proc/no/such.json: cannot be written"),
          Case(("--timeout", "abc"), tool="plan", says="--timeout abc: give seconds"),
          Case(("--heartbeat", "-1"), tool="plan", says="--heartbeat -1: give seconds")]
  return out


def cases(tmp: Path) -> list[Case]:
  import reliability_run_cases  # pylint: disable=import-outside-toplevel  # this folder is on sys.path

  return config_cases(tmp) + reliability_run_cases.cases(tmp)


# --- running one case ---------------------------------------------------------------------------


def _command_args(case: Case, out_dir: Path, cache: Path) -> list[str]:
  args = ([case.config] if case.config else []) + list(case.args)
  if case.tool == "plan":
    return args
  if not any(a.startswith("base_output_directory=") for a in args):
    args.append(f"base_output_directory={out_dir}")
  if not any(a.startswith("run_name=") for a in args):
    args.append("run_name=bad")
  if case.subprocess:
    args.append(f"jax_cache_dir={cache}")  # one compile cache for the cases that train
  return args


def _run_inprocess(case: Case, args: list[str]) -> tuple[int, str, str]:
  from MaxText.run import main as train  # pylint: disable=import-outside-toplevel
  from MaxText.plan import __main__ as plan  # pylint: disable=import-outside-toplevel

  with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryFile("w+") as out:
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
    try:
      try:
        code = (plan.main if case.tool == "plan" else train.main)(args)
      except BaseException as e:  # pylint: disable=broad-exception-caught
        import traceback  # pylint: disable=import-outside-toplevel

        traceback.print_exc()
        code = -1 if not isinstance(e, SystemExit) else e.code
      sys.stdout.flush(), sys.stderr.flush()
    finally:
      os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    err.seek(0), out.seek(0)
    return code, out.read(), err.read()


def _run_subprocess(case: Case, args: list[str], out_dir: Path, run_dir: Path) -> tuple[int | None, str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env.update({"PYTHONPATH": _PYTHONPATH, **(case.env or {})})
  module = "MaxText.plan" if case.tool == "plan" else "MaxText.train"
  cmd = [sys.executable, "-m", module, *args]
  if case.shell:  # its setup must succeed (a mount needs root): else the case did not run, exit SETUP_FAILED
    out_dir.mkdir(parents=True, exist_ok=True)
    quoted = " ".join(f"'{a}'" for a in cmd)
    script = (f"OUT={out_dir}; RUN={run_dir}; ( set -e; {case.shell} ) || exit {SETUP_FAILED}\n"
              f"{quoted}; rc=$?\n{case.post}\nexit $rc")
    cmd = ["unshare", "-m", "sh", "-c", script]
  limit = case.memory_limit
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))) if limit else None)
  stdout: list[str] = []
  stderr: list[str] = []
  readers = [threading.Thread(target=lambda p, acc: acc.extend(p), args=(pipe, acc), daemon=True)
             for pipe, acc in ((proc.stdout, stdout), (proc.stderr, stderr))]
  for reader in readers:
    reader.start()
  deadline = time.monotonic() + HANG_S
  sent = False
  while proc.poll() is None and time.monotonic() < deadline:
    if case.signal_at and not sent and any(f"[progress] step {case.signal_at[1]}/" in line for line in list(stdout)):
      proc.send_signal(case.signal_at[0])
      sent = True
    time.sleep(0.2)
  if proc.poll() is None:
    proc.kill()
    proc.wait()
    code = None
  else:
    code = proc.returncode
  for reader in readers:
    reader.join(timeout=30)
  return code, "".join(stdout), "".join(stderr)


def _records(run_dir: Path) -> dict[str, bytes]:
  """The run's records a refusal must leave alone: our files, the summary, the checkpoint folder's names."""
  files = list((run_dir / "maxtext-moe").rglob("*.json")) + [run_dir / "summary.json"]
  found = {str(p.relative_to(run_dir)): p.read_bytes() for p in files if p.is_file() and p.name != "lock.json"}
  if (run_dir / "checkpoints").is_dir():
    found["checkpoints/"] = " ".join(sorted(p.name for p in (run_dir / "checkpoints").iterdir())).encode()
  return found


def verdict(case: Case, result: Result, before: dict[str, bytes] | None) -> tuple[str, str]:
  """(outcome, why): outcome one of clean, traceback, silent, lost, hang, other."""
  lines = [line for line in result.stderr.splitlines() if line.startswith("maxtext-moe:")]
  said = lines[0] if lines else ""
  if result.code is None:
    return "hang", f"still running after {HANG_S} s"
  if case.shell and result.code == SETUP_FAILED:
    return "not run", f"its setup failed (needs `unshare -m` and mount, as root): {result.stderr[-200:]!r}"
  if "Traceback (most recent call last)" in result.stderr or result.code in (1, -1):
    return "traceback", result.stderr.strip().splitlines()[-1][:150] if result.stderr.strip() else ""
  if result.code != case.code:
    kind = "silent" if result.code == 0 else "other"
    return kind, f"exit {result.code}, expected {case.code}: {said or result.stderr[-150:]!r}"
  if len(lines) > 1 or (case.code != 0 and not lines):
    return ("silent" if not lines else "other"), f"{len(lines)} 'maxtext-moe:' lines"
  if case.says and not re.search(case.says, said):
    return ("silent" if not said else "other"), f"the line does not say {case.says!r}: {said[:150]!r}"
  if case.warns and not re.search(case.warns, result.stdout, re.S):
    return "silent", f"no {case.warns!r} on stdout"
  if case.code == 2 and before is None and result.run_dir.exists() and case.tool == "train":
    return "lost", f"a refused new run wrote {result.run_dir}"
  if case.code not in (0, 75) and before is not None and _records(result.run_dir) != before:
    changed = sorted(k for k in set(before) | set(_records(result.run_dir))
                     if before.get(k) != _records(result.run_dir).get(k))
    return "lost", f"the refusal changed the run's records: {changed}"
  if case.check is not None and (broken := case.check(result)):
    return broken.split(":")[0], broken
  return "clean", said or next((line for line in result.stdout.splitlines() if "WARNING" in line), "")[:150]


def run_case(case: Case, tmp: Path, index: int, force_subprocess: bool, show: bool = False) -> tuple[str, str]:
  import reliability_run_cases  # pylint: disable=import-outside-toplevel

  out_dir = tmp / f"case{index}"
  run_dir = out_dir / "bad"
  cache = SHARED["jax_cache"] or tmp / "jax_cache"
  data = reliability_run_cases.data_fixture(tmp)
  if case.base:
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(reliability_run_cases.base_run(SHARED["bases"] or tmp / "bases", case.base, cache), run_dir,
                    symlinks=True)
  if case.setup:
    out_dir.mkdir(parents=True, exist_ok=True)
    case.setup(run_dir, data)
  before = _records(run_dir) if case.base else None
  args = _command_args(case, out_dir, cache)
  started = time.monotonic()
  if case.subprocess or force_subprocess:
    code, stdout, stderr = _run_subprocess(case, args, out_dir, run_dir)
  else:
    code, stdout, stderr = _run_inprocess(case, args)
  outcome = verdict(case, Result(code, stdout, stderr, run_dir, time.monotonic() - started), before)
  if show and outcome[0] != "clean":
    at = stderr.find("Traceback")
    shown = stderr[max(0, at - 500): at + 5000] if at >= 0 else stderr[-5000:]
    print(f"--- stdout ---\n{stdout[-2000:]}\n--- stderr ---\n{shown}", flush=True)
  return outcome


def _shown(case: Case, tmp: Path) -> str:
  text = case.name or " ".join(case.args) or Path(case.config or "").name
  if case.config not in (TINY, None) and not case.name and case.args:
    text = f"{Path(case.config).name} {text}"
  return (f"plan {text}" if case.tool == "plan" else text).replace(str(tmp) + "/", "").replace(str(REPO) + "/", "")


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--subprocess", action="store_true", help="every case in its own python -m, as a user runs it")
  parser.add_argument("--no-train", action="store_true", help="leave out the cases that train")
  parser.add_argument("--train-only", action="store_true", help="only the cases that train")
  parser.add_argument("--async-checkpoints", action="store_true",
                      help="the cases that resume or write checkpoints, with async_checkpointing=true")
  parser.add_argument("-k", action="append", default=[],
                      help="only the cases whose command line or name holds this (given again: any of them)")
  parser.add_argument("--show", action="store_true", help="print the output of each case that is not clean")
  parser.add_argument("--bases", type=Path, help="train the base runs here once, for every invocation given it")
  parser.add_argument("--jax-cache", type=Path, help="the compile cache of the cases that train (default: a new one)")
  opts = parser.parse_args()
  SHARED.update(bases=opts.bases, jax_cache=opts.jax_cache)
  if opts.jax_cache:  # a cache with a size limit locks each entry it reads and writes (tests/conftest.py)
    from conftest import JAX_CACHE_ENV  # pylint: disable=import-outside-toplevel  # this folder is on sys.path

    for key, value in JAX_CACHE_ENV.items():
      os.environ.setdefault(key, value)
  counts: dict[str, int] = {}
  with tempfile.TemporaryDirectory() as tmp_name:
    tmp = Path(tmp_name)
    chosen = cases(tmp)
    if opts.async_checkpoints:
      import reliability_run_cases  # pylint: disable=import-outside-toplevel

      chosen = [a for a in map(reliability_run_cases.saves_async, chosen) if a is not None]
    selected = [c for c in chosen if any(k in _shown(c, tmp) for k in opts.k or [""]) and not (opts.no_train and c.trains)
                and not (opts.train_only and not c.trains)]
    for i, case in enumerate(selected):
      started = time.monotonic()
      outcome, why = run_case(case, tmp, i, opts.subprocess, opts.show)
      counts[outcome] = counts.get(outcome, 0) + 1
      print(f"{'PASS' if outcome == 'clean' else 'FAIL'}  {outcome:9s} exit {case.code:<3d} {time.monotonic() - started:5.0f}s"
            f"  {_shown(case, tmp)[:60]:60s}  {why[:170]!r}", flush=True)
  total = sum(counts.values())
  print(f"\n{total} cases: {counts.get('clean', 0)} clean, {counts.get('traceback', 0)} tracebacks, "
        f"{counts.get('silent', 0)} silent, {counts.get('lost', 0)} lost, {counts.get('hang', 0)} hangs, "
        f"{counts.get('other', 0)} other" + (f", {counts['not run']} not run" if counts.get("not run") else ""))
  return 0 if counts.get("clean", 0) == total else 1


if __name__ == "__main__":
  sys.exit(main())
