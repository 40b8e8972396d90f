"""The test tiers: every test that starts a training run is marked `slow`.

`scripts/test.sh` runs `-m "not slow"` (a newcomer's second command, minutes);
`scripts/test.sh --all` runs everything. A training run takes 20 s to minutes on
two cores, so one unmarked training test is what breaks the fast tier. An interpreted
kernel with too many warpgroup threads is what can hang the slow tier (conftest's guard).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO, runs_left_under

TESTS = REPO / "tests"
# How a test starts a training run: the conftest helper and fixture, or a launcher.
TRAINING_NAMES = {"run_train", "train"}
TRAINING_LAUNCHERS = ("launch_local.sh",)


def _marked_slow(decorators: list[ast.expr]) -> bool:
  return any(ast.unparse(d) in ("pytest.mark.slow", "mark.slow") for d in decorators)


def _starts_training(fn: ast.FunctionDef) -> str | None:
  """The reason `fn` starts a training run, or None."""
  if "train" in [a.arg for a in fn.args.args]:
    return "uses the `train` fixture"
  for node in ast.walk(fn):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in TRAINING_NAMES:
      return f"calls {node.func.id}()"
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(TRAINING_LAUNCHERS):
      return f"runs {node.value!r}"
  return None


def unmarked_training_tests(path: Path) -> list[str]:
  tree = ast.parse(path.read_text(), filename=str(path))
  module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                    and "slow" in ast.unparse(n.value) for n in tree.body)
  found = []
  for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
    reason = _starts_training(fn)
    if reason and not module_slow and not _marked_slow(fn.decorator_list):
      found.append(f"{path.name}::{fn.name} {reason} but is not marked @pytest.mark.slow")
  return found


def test_every_test_that_trains_is_marked_slow():
  found = [line for path in sorted(TESTS.glob("test_*.py")) for line in unmarked_training_tests(path)]
  assert found == [], "\n".join(found)


def test_the_check_sees_each_way_of_starting_a_run(tmp_path):
  sample = tmp_path / "test_sample.py"
  sample.write_text(
      "import pytest\n"
      "def test_fixture(train): train('steps=1')\n"
      "def test_helper(tmp_path): run_train(tmp_path, 'steps=1')\n"
      "def test_launcher(): subprocess.run(['bash', 'scripts/launch_local.sh', '-n', '2'])\n"
      "def test_refused(tmp_path): run_rejected(tmp_path, 'stepz=1')\n"
      "@pytest.mark.slow\n"
      "def test_marked(train): train('steps=1')\n"
  )
  assert [line.split()[0] for line in unmarked_training_tests(sample)] == [
      "test_sample.py::test_fixture", "test_sample.py::test_helper", "test_sample.py::test_launcher"]


def test_the_run_time_guard_finds_what_a_run_leaves(tmp_path_factory):
  """conftest's hook fails an unmarked test that leaves these behind, however the run started."""
  tmp_path = tmp_path_factory.mktemp("guard")  # not this test's tmp_path, which the hook inspects
  assert runs_left_under(tmp_path) == []
  (tmp_path / "outputs" / "r" / "maxtext-moe").mkdir(parents=True)
  (tmp_path / "outputs" / "r" / "maxtext-moe" / "effective_config.json").write_text("{}")
  (tmp_path / "elsewhere.json").write_text("{}")
  assert runs_left_under(tmp_path) == [tmp_path / "outputs" / "r" / "maxtext-moe" / "effective_config.json"]


def test_interpreted_kernel_with_four_threads_is_refused_in_the_suites_process():
  """conftest's guard: four warpgroup threads at once (the FP8 kernel's count, which deadlocked on 2 cores) are
  refused when the kernel is traced, before any thread starts, unless the test runs through in_own_process."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  if len(jax.devices("cpu")) >= 8:
    pytest.skip("8 host devices: the guard lets the kernel run")

  def body(out_ref):
    out_ref[...] = jnp.zeros_like(out_ref)

  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32), num_threads=4, thread_name="wg")
  refused = pytest.raises(RuntimeError, match="runs 4 warpgroup threads at once, more than 3")
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()), refused:
    jax.jit(kernel)()


def test_test_sh_help_is_its_own_usage(tmp_path):
  """scripts/test.sh --help says what the tiers are, and does so before the environment is built (a copy of the
  script next to a bootstrap that fails proves it stops first); it used to pass --help on to pytest."""
  import shutil  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel

  (tmp_path / "scripts").mkdir()
  shutil.copy(REPO / "scripts/test.sh", tmp_path / "scripts/test.sh")
  (tmp_path / "scripts/bootstrap.sh").write_text("#!/usr/bin/env bash\necho bootstrap ran >&2\nexit 99\n")
  (tmp_path / "scripts/bootstrap.sh").chmod(0o755)
  for flag in ("--help", "-h"):
    proc = subprocess.run(["bash", str(tmp_path / "scripts/test.sh"), flag], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("usage: scripts/test.sh [--all] [pytest args ...]")
    assert '-m "not slow"' in proc.stdout and "--all" in proc.stdout and "-k WORD" in proc.stdout


def test_test_sh_runs_two_workers_unless_told_otherwise(tmp_path):
  """The fast tier on two pytest-xdist workers by default; a -n of the user's own, -p no:xdist, a debugger or one
  named test runs as asked (a copy of the script next to a bootstrap whose "python" prints the arguments)."""
  import shutil  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel

  (tmp_path / "scripts").mkdir()
  shutil.copy(REPO / "scripts/test.sh", tmp_path / "scripts/test.sh")
  (tmp_path / "py").write_text('#!/usr/bin/env bash\necho "$@"\n')
  (tmp_path / "py").chmod(0o755)
  (tmp_path / "scripts/bootstrap.sh").write_text(f"#!/usr/bin/env bash\necho {tmp_path / 'py'}\n")
  (tmp_path / "scripts/bootstrap.sh").chmod(0o755)

  def argv(*args: str) -> str:
    proc = subprocess.run(["bash", str(tmp_path / "scripts/test.sh"), *args], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()

  assert argv() == "-m pytest -m not slow -n 2"
  assert argv("-q", "tests/test_configs.py", "-k", "yaml") == "-m pytest -m not slow -n 2 -q tests/test_configs.py -k yaml"
  assert argv("-n", "0") == "-m pytest -m not slow -n 0"
  assert argv("-n4") == "-m pytest -m not slow -n4"
  assert argv("--numprocesses=3") == "-m pytest -m not slow --numprocesses=3"
  assert argv("-p", "no:xdist") == "-m pytest -m not slow -p no:xdist"
  assert argv("--pdb") == "-m pytest -m not slow --pdb"
  assert argv("tests/test_x.py::test_y") == "-m pytest -m not slow tests/test_x.py::test_y"
  assert argv("-m", "slow", "-x") == "-m pytest -n 2 -m slow -x"
