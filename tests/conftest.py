"""Shared helpers: run `python -m MaxText.train` in a clean subprocess.

Training tests run in subprocesses so that each gets a fresh JAX backend
(device count, XLA_FLAGS) and a fresh set of upstream patches.

Test tiers: a test that starts a real training run is marked `slow` and runs
only in `scripts/test.sh --all`. `run_train` and the `train` fixture start
one; `run_rejected` runs a command line that must stop before the run starts
(and checks that it did). tests/test_tiers.py checks the marks statically, and
the hook below fails an unmarked test that leaves a run behind under tmp_path,
however it started it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Every process a test starts, this one's xdist workers included, compiles XLA's CPU code at LLVM's -O0
# (tests/xla_cpu_o0/sitecustomize.py says what it saves); a process whose environment sets PYTHONPATH whole goes
# without. This process too, before anything initialises jax's backend.
_O0_DIR = str(REPO / "tests" / "xla_cpu_o0")
if _O0_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
  os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_O0_DIR, os.environ.get("PYTHONPATH")) if p)
  _spec = importlib.util.spec_from_file_location("_xla_cpu_o0", f"{_O0_DIR}/sitecustomize.py")
  _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
# A subprocess's PYTHONPATH: the repository, then the session's (which carries the flags above).
SUBPROCESS_PYTHONPATH = os.pathsep.join([str(REPO), os.environ["PYTHONPATH"]])


def require_gpu_plan(gpu: str) -> None:
  """Tests that compile for a compile-only H100/H200 need jax's CUDA compiler plugin (`scripts/bootstrap.sh
  --gpu-plan`). Without it they skip in a plain run; under `scripts/test.sh --all` and CI, which install it and set
  MAXTEXT_MOE_REQUIRE_GPU_PLAN, they fail instead, so the slow tier cannot pass without running them."""
  from MaxText.plan import gpu_target  # pylint: disable=import-outside-toplevel

  if reason := gpu_target.unavailable_reason(gpu):
    if os.environ.get("MAXTEXT_MOE_REQUIRE_GPU_PLAN") == "1":
      pytest.fail(f"MAXTEXT_MOE_REQUIRE_GPU_PLAN=1 but {reason}")
    pytest.skip(reason)


def load_script(name: str, relpath: str):
  """A script under the repo (with or without .py) as a module, loaded once.

  Registered in sys.modules before it runs: dataclasses look their module up there."""
  if name in sys.modules:
    return sys.modules[name]
  loader = importlib.machinery.SourceFileLoader(name, str(REPO / relpath))
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
  sys.modules[name] = module
  loader.exec_module(module)
  return module


@dataclass
class TrainResult:
  returncode: int
  stdout: str
  stderr: str
  run_dir: Path

  @property
  def summary(self) -> dict:
    return json.loads((self.run_dir / "summary.json").read_text())

  def losses(self) -> dict[int, float]:
    return {int(k): v for k, v in self.summary["losses"].items()}


# One compile cache for a test session's training runs, shared by its xdist workers. The tiny programs repeat across
# tests and workers, and on two cores their compile is most of a run: 27 of 35 s, 37 s against 87 s for a repeat
# run while another process competed (2026-12-02). jax writes a cache entry in place (not atomically) unless the
# cache has a size limit, which makes it take a file lock for every read and write (jax/_src/lru_cache.py): the
# runs get one, so that workers sharing the directory never read a half-written entry.
_SHARED_JAX_CACHE: list[Path] = []
JAX_CACHE_ENV = {"JAX_COMPILATION_CACHE_MAX_SIZE": str(32 * 2**30)}


@pytest.fixture(scope="session", autouse=True)
def _shared_jax_cache(tmp_path_factory):
  # Under xdist each worker's base temp directory sits in the session's (popen-gwN under it): share that one.
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent
  _SHARED_JAX_CACHE.append(root / "jax_cache")
  _SHARED_JAX_CACHE[0].mkdir(parents=True, exist_ok=True)
  yield
  _SHARED_JAX_CACHE.clear()


def train_command(tmp_path: Path, *args: str, run_name: str = "run", env: dict | None = None,
                  shared_cache: bool = True) -> tuple[list[str], dict, Path]:
  """(command, environment, run directory) of `python -m MaxText.train` with outputs under
  tmp_path/outputs/<run_name>; with the session's compile cache unless shared_cache=False (a test of where a
  run writes), the run sets its own, or it must compile: a cached program is not compiled again, so it dumps no
  HLO (dump_hlo=true)."""
  out_dir = tmp_path / "outputs"
  full_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  full_env.update(env or {})
  own_cache = any(a.startswith("jax_cache_dir=") or a == "dump_hlo=true" for a in args)
  if shared_cache and _SHARED_JAX_CACHE and not own_cache:
    args = (*args, f"jax_cache_dir={_SHARED_JAX_CACHE[0]}")
    full_env = {**JAX_CACHE_ENV, **full_env}
  cmd = [sys.executable, "-m", "MaxText.train", *args, f"base_output_directory={out_dir}", f"run_name={run_name}"]
  return cmd, full_env, out_dir / run_name


def run_train(tmp_path: Path, *args: str, run_name: str = "run", env: dict | None = None,
              cwd: Path | None = None, timeout: int = 600, shared_cache: bool = True) -> TrainResult:
  """Runs `train_command` to its end. The timeout is a hang's, not a pace: a tiny run takes 35-90 s, and
  more beside another worker on a slow machine (300 s was hit once)."""
  cmd, full_env, run_dir = train_command(tmp_path, *args, run_name=run_name, env=env, shared_cache=shared_cache)
  proc = subprocess.run(cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
                        check=False)
  return TrainResult(proc.returncode, proc.stdout, proc.stderr, run_dir)


class BackgroundRun:
  """`train_command` started and left running, for a test that acts when a line appears (a signal, a twin job).

  Two threads read its stdout and stderr as they come, so neither pipe fills, and every wait has a deadline: a
  test that iterated over the pipe itself could wait forever if the run hung (none was seen to; CI's slow-tier
  hang was the interpreter's, `in_own_process` below). A run still going when the `with` block ends is killed."""

  def __init__(self, tmp_path: Path, *args: str, run_name: str = "run", env: dict | None = None):
    cmd, full_env, self.run_dir = train_command(tmp_path, *args, run_name=run_name, env=env)
    self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
    self._stdout: list[str] = []
    self._stderr: list[str] = []
    self._new_stdout: queue.Queue = queue.Queue()  # each stdout line, then None at its end
    self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self._stdout, self._new_stdout)),
                     threading.Thread(target=self._read, args=(self.proc.stderr, self._stderr, None))]
    for reader in self._readers:
      reader.daemon = True
      reader.start()

  @staticmethod
  def _read(pipe, lines: list[str], new: queue.Queue | None) -> None:
    for line in pipe:
      lines.append(line)
      if new is not None:
        new.put(line)
    if new is not None:
      new.put(None)

  def _fail(self, why: str) -> None:
    self.proc.kill()
    pytest.fail(f"{why}; its stderr ends:\n{''.join(self._stderr)[-3000:]}", pytrace=False)

  def wait_for(self, text: str, timeout: float = 600) -> None:
    """Returns once a stdout line contains `text`; fails the test (run killed) at its end or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
      try:
        line = self._new_stdout.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        self._fail(f"no {text!r} on the run's stdout within {timeout:.0f} s")
      if line is None:
        self._fail(f"the run ended (exit {self.proc.wait()}) without printing {text!r}")
      if text in line:
        return

  def send_signal(self, sig: int) -> None:
    self.proc.send_signal(sig)

  def finish(self, timeout: float = 600) -> TrainResult:
    """Waits for the run's end (the timeout is a hang's) and returns all it printed."""
    try:
      self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self._fail(f"the run did not end within {timeout:.0f} s")
    for reader in self._readers:
      reader.join(timeout=60)
    return TrainResult(self.proc.returncode, "".join(self._stdout), "".join(self._stderr), self.run_dir)

  def __enter__(self) -> "BackgroundRun":
    return self

  def __exit__(self, *exc) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


# Pallas' GPU interpreter runs each simulated warpgroup as a thread inside an XLA CPU execution, and the
# warpgroups of a block (of a cluster, with multicast) must all run at once: they wait on each other's
# barriers. XLA's CPU client runs only a few executions at once on a 2-core machine, so a kernel with more
# threads than that can deadlock at its first barrier, depending on timing: CI's slow tier hung for its whole
# 90 minutes in the 2-SM multicast test (2026-12-03, py-spy: the test's thread in ThreadPoolExecutor.shutdown,
# every simulated warpgroup waiting). With 8 host devices the client has the threads.
OWN_PROCESS_ENV = "MAXTEXT_MOE_TEST_IN_OWN_PROCESS"
MANY_CPU_THREADS = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


# The most warpgroup threads that one interpreted block (or cluster) has run in the suite's own process without a
# deadlock on 2 cores: the bf16 kernels' three. The FP8 kernel's four deadlocked (CI's slow tier, 2026-12-03).
SAFE_INTERPRETED_THREADS = 3


@pytest.fixture(autouse=True, scope="session")
def _interpreted_kernels_have_the_threads():
  """Refuses, when it is traced, an interpreted kernel with more warpgroup threads at once than the suite's
  process can run, instead of letting it hang CI: such a test must run through `in_own_process` with
  MANY_CPU_THREADS."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp  # pylint: disable=import-outside-toplevel

  dims_and_threads = interp._get_grid_and_cluster_dims_and_num_threads  # pylint: disable=protected-access

  def checked(*args, **kwargs):
    grid_dims, cluster_dims, threads_per_block = dims_and_threads(*args, **kwargs)
    at_once = math.prod(cluster_dims) * threads_per_block
    if at_once > SAFE_INTERPRETED_THREADS and len(jax.devices("cpu")) < 8:
      raise RuntimeError(f"an interpreted kernel runs {at_once} warpgroup threads at once, more than "
                         f"{SAFE_INTERPRETED_THREADS}: run its test through conftest.in_own_process(request, "
                         "MANY_CPU_THREADS), or it can deadlock on a 2-core machine")
    return grid_dims, cluster_dims, threads_per_block

  interp._get_grid_and_cluster_dims_and_num_threads = checked  # pylint: disable=protected-access
  yield
  interp._get_grid_and_cluster_dims_and_num_threads = dims_and_threads  # pylint: disable=protected-access


def in_own_process(request, env: dict, timeout: int = 900) -> bool:
  """Runs this test again in a pytest process of its own, with `env` added; True there (run the body), False
  here once that process passed (nothing left to do)."""
  nodeid = request.node.nodeid
  if os.environ.get(OWN_PROCESS_ENV) == nodeid:
    return True
  full_env = {**os.environ, **env, OWN_PROCESS_ENV: nodeid}
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", nodeid],
                        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  return False


def run_rejected(tmp_path: Path, *args: str, **kwargs) -> TrainResult:
  """A command line that must be refused before the run starts: nonzero exit,
  no run directory. No training runs, so the test needs no `slow` mark."""
  result = run_train(tmp_path, *args, **kwargs)
  assert result.returncode != 0, f"expected a refusal, the run exited 0: {result.stdout[-2000:]}"
  assert not result.run_dir.exists(), f"a refused run must not create {result.run_dir}: {result.stderr[-2000:]}"
  return result


def config_error_line(*args: str) -> str:
  """The line `python -m MaxText.train ARGS` prints (exit 2, nothing written) for a config its loader refuses,
  from the loader in this process: MaxText/run/main.py prints every ConfigError as this one line, a path
  tests/test_train.py's test_bad_input_fails_fast_with_one_clear_line holds end to end. A process of its own
  for each bad value would import upstream again (about 3 s of CPU) to prove the same."""
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel

  with pytest.raises(fork_config.ConfigError) as refused:
    fork_config.load(list(args))
  line = f"maxtext-moe: config error: {refused.value}"
  assert "\n" not in line, line
  return line


# What a started run leaves in its run directory (MaxText/run/loop.py writes the
# first right after validation, the second at the end).
RUN_EVIDENCE = ("maxtext-moe/effective_config.json", "summary.json")


def runs_left_under(root: Path) -> list[Path]:
  return sorted(p for name in RUN_EVIDENCE for p in root.rglob(Path(name).name) if p.as_posix().endswith(name))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  result = yield
  tmp = getattr(item, "funcargs", {}).get("tmp_path")
  if tmp is not None and item.get_closest_marker("slow") is None:
    runs = runs_left_under(Path(tmp))
    if runs:
      pytest.fail(f"{item.nodeid} started a training run ({runs[0].relative_to(tmp)}) but is not marked "
                  "@pytest.mark.slow: the fast tier (scripts/test.sh) must not train", pytrace=False)
  return result


@pytest.fixture
def train(tmp_path):
  def _train(*args, **kwargs):
    return run_train(tmp_path, *args, **kwargs)

  return _train


@pytest.fixture(scope="session")
def hf_python() -> str:
  """The torch + transformers environment's python (scripts/hf_env.sh), for the Hugging Face parity tests."""
  from hf_helpers import hf_env_python  # pylint: disable=import-outside-toplevel

  return hf_env_python()
