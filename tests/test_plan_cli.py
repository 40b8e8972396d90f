"""`python -m MaxText.plan`'s command line: argparse with key=value overrides beside it, the help's exit codes,
one line for a bad option, Ctrl-C and SIGTERM leaving no compile child and no /tmp/maxtext-plan-* behind; and the
plan command every shipped GPU config's dry run prints runs as printed."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from MaxText import config as fork_config
from MaxText.run import launch
from MaxText.config import report as config_report
from MaxText.plan import __main__ as plan_cli
from MaxText.plan import planner

TINY = str(REPO / "configs/deepseek3-tiny.yml")


def test_help_lists_the_options_and_every_exit_code(capsys):
  assert plan_cli.main(["--help"]) == 0
  out = capsys.readouterr().out
  for option in ("--json PATH", "--timeout S", "--heartbeat S", "--hlo PATH", "--mock", "--cpu", "--search"):
    assert option in out, option
  for code, meaning in plan_cli.EXIT_CODES.items():
    assert f"\n  {code:>3}  {meaning}\n" in out, code
  assert sorted(plan_cli.EXIT_CODES) == [0, 1, 2, 9, 130, 143]


@pytest.mark.parametrize("args, message", [
    ([TINY, "--timeout", "abc"], "--timeout abc: give seconds, a number >= 0"),
    ([TINY, "--json"], "argument --json: expected one argument"),
    ([TINY, "--jsn", "x.json"], "option '--jsn' is not one of the planner's (--help lists them)"),
    ([TINY, "--mock", "--cpu"], "--mock and --cpu exclude each other"),
])
def test_a_bad_option_is_one_line_before_anything_loads(args, message, capsys, monkeypatch):
  monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("planned despite a bad option"))
  assert plan_cli.main(args) == 2
  assert capsys.readouterr().err.startswith(f"maxtext-moe: plan error: {message}")


def test_overrides_and_options_mix_in_any_order(monkeypatch):
  seen = {}
  monkeypatch.setattr(planner, "plan", lambda args, timeout_s, hlo_path, mode, heartbeat_s: seen.update(
      args=args, timeout_s=timeout_s, mode=mode, heartbeat_s=heartbeat_s) or {})
  monkeypatch.setattr(planner, "print_report", lambda report: None)
  assert plan_cli.main(["--cpu", TINY, "steps=3", "--timeout", "60", "--heartbeat", "0", "recipe_num_gpus=1"]) == 0
  assert seen == {"args": [TINY, "steps=3", "recipe_num_gpus=1"], "timeout_s": 60.0, "mode": "cpu", "heartbeat_s": 0.0}


def test_search_marks_a_plan_whose_account_is_violated_keeps_it_out_of_the_best_and_exits_9(tmp_path, monkeypatch,
                                                                                             capsys):
  """--search on the tiny config, every candidate's plan a report: the fastest has a violated account. It is
  marked in the table, not among the best, and the search exits 9 with one line, as a single plan does (before: it
  was ranked first and the search exited 0)."""
  wrong = "rows = walk: all-gather over fsdp 3 in the rows, 2 walked"
  calls = []

  def plan(args, timeout_s, heartbeat_s):  # the run as given is the fastest, and violated
    calls.append(args)
    violations = [wrong] if len(calls) == 1 else []
    return {"verdict": {"fits": True}, "memory": {"device_total": 2**30},
            "estimate": {"step_s": 0.1, "tflops_per_gpu": 900.0 if len(calls) == 1 else 100.0 + len(calls)},
            "account": {"ok": not violations, "lines": [], "violations": violations}}

  monkeypatch.setattr(planner, "plan", plan)
  assert plan_cli.main([TINY, "recipe_num_gpus=4", "--search", "--json", str(tmp_path / "s.json")]) == 9
  out, err = capsys.readouterr()
  assert len(calls) >= 2
  row = next(l for l in out.splitlines() if l.strip().startswith("(as given)"))
  assert f"ACCOUNT VIOLATED (1): {wrong}" in row
  best = out.split("\nbest ")[1]
  assert best.startswith(f"{min(3, len(calls) - 1)} (") and "1 left out: account violated" in best.splitlines()[0]
  assert "900.0" not in best and "(as given)" not in best
  assert err == (f"maxtext-moe: plan invariant violated in 1 of {len(calls)} layouts (left out of the best): "
                 f"(as given): {wrong}\n")
  assert (tmp_path / "s.json").exists()


def _children_of(tmp: Path) -> list[int]:
  """Processes whose command line names the folder: the compile child reads its request from there."""
  found = []
  for proc in Path("/proc").iterdir():
    try:
      if proc.name.isdigit() and str(tmp) in (proc / "cmdline").read_bytes().decode(errors="replace"):
        found.append(int(proc.name))
    except OSError:
      pass
  return found


def _stop_mid_compile(tmp_path: Path, command: list[str], sig: int, env: dict | None = None, limit_s: float = 120):
  """Starts the planner with TMPDIR in tmp_path, sends `sig` once its compile child runs; (exit code, stderr)."""
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  environ = {**os.environ, **(env or {}), "TMPDIR": str(tmp)}
  proc = subprocess.Popen(command, cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + limit_s
    while not _children_of(tmp):
      assert proc.poll() is None, proc.communicate()
      assert time.monotonic() < deadline, "no compile child started"
      time.sleep(0.2)
    assert list(tmp.glob("maxtext-plan-*")), "the compile's folder is there while it runs"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert not _children_of(tmp), "the compile child outlived the planner"
  assert list(tmp.iterdir()) == [], list(tmp.iterdir())
  return proc.returncode, err


# About 5 s each: the planner imports upstream and starts its compile before the signal. SIGINT takes the same path.
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_a_stop_signal_ends_the_compile_child_and_leaves_nothing(tmp_path, sig, code):
  rc, err = _stop_mid_compile(
      tmp_path, [sys.executable, "-m", "MaxText.plan", TINY, "recipe_num_gpus=1", "--cpu"], sig)
  assert rc == code, err[-2000:]
  lines = [line for line in err.splitlines() if line.startswith("maxtext-moe:")]
  assert lines == [f"maxtext-moe: plan stopped by {signal.Signals(sig).name}: the compile was ended and its temporary "
                   "files removed"], err[-2000:]
  assert "Traceback" not in err


# --- the plan command each shipped config's dry run prints ---

def _gpu_run_configs() -> list[Path]:
  """Every shipped config a user runs on GPUs (model files and the recipes' shared bases are not run alone)."""
  found = []
  for path in sorted((REPO / "configs").rglob("*.yml")):
    if "models" in path.parts or path.name.endswith("-common.yml") or "plans" in path.parts:
      continue
    if str(fork_config.load([str(path)]).upstream.get("hardware", "")).startswith("gpu"):
      found.append(path)
  return found


GPU_CONFIGS = _gpu_run_configs()


class _Compiling(Exception):
  """Raised where the planner would start its compile: every check before it passed."""


def test_every_dry_run_plan_hint_of_the_shipped_gpu_configs_passes_the_planners_checks(monkeypatch):
  """For each shipped GPU config, the plan command its dry run prints (MaxText/config/report.py plan_command), run as
  printed through the planner's own main up to the compile (every check before it: the command line, the config,
  the GPU count, the mesh, the target). The compile itself is the slow test below, for the config whose hint
  needed more than its name (upstream-model.yml: no GPU count)."""
  assert len(GPU_CONFIGS) >= 20 and REPO / "configs/upstream-model.yml" in GPU_CONFIGS
  monkeypatch.chdir(REPO)
  started = []

  def compile_in_child(args, topology, *rest, **kwargs):
    started.append(topology.num_devices)
    raise _Compiling()

  monkeypatch.setattr(planner, "compile_in_child", compile_in_child)
  for path in GPU_CONFIGS:
    command, _ = config_report.plan_command(fork_config.load([str(path)]))
    words = shlex.split(command)
    assert words[0] == "scripts/plan.sh", command  # the script that installs the GPU compiler
    with pytest.raises(_Compiling):
      plan_cli.main(words[1:])
  assert len(started) == len(GPU_CONFIGS)


def test_the_dry_run_prints_the_plan_command_with_the_command_lines_overrides(monkeypatch):
  monkeypatch.chdir(REPO)
  run = fork_config.load(["configs/upstream-model.yml", "model_name=mixtral-8x7b"])
  process = launch.ProcessInfo(scheduler="single", coordinator_address=None, num_processes=1, process_id=0)
  lines = config_report.dry_run_report(run, process, "hardware=gpu, this machine has 1 CPU device", ["model_name=mixtral-8x7b"])
  assert lines[1].endswith("; scripts/plan.sh configs/upstream-model.yml model_name=mixtral-8x7b recipe_num_gpus=8 "
                           "target_gpu=h100 compiles the train step for one node of 8 H100s (set recipe_num_gpus and "
                           "target_gpu to your cluster's) and checks both")


@pytest.mark.slow  # the dry run, then the planner to its compile: about 30 s
def test_upstream_models_dry_run_hint_compiles_as_printed_and_sigterm_leaves_nothing(tmp_path):
  """configs/upstream-model.yml sets no GPU count; its dry run's plan command (which exited 2 when it said only
  the config) is run as printed, through scripts/plan.sh, until its compile runs; then SIGTERM."""
  dry = subprocess.run([sys.executable, "-m", "MaxText.train", "--dry-run", "configs/upstream-model.yml"], cwd=REPO,
                       capture_output=True, text=True, timeout=300, check=False)
  assert dry.returncode == 0, dry.stderr[-2000:]
  (hint,) = [line for line in dry.stdout.splitlines() if "not checked here" in line]
  command = hint.split("; ", 1)[1].split(" compiles the train step")[0]
  assert command.startswith("scripts/plan.sh configs/upstream-model.yml recipe_num_gpus=8"), command
  rc, err = _stop_mid_compile(tmp_path, ["bash", "-c", command], signal.SIGTERM, limit_s=600)
  assert rc == plan_cli.EXIT_TERMINATED, err[-2000:]
  assert "plan error" not in err
