"""Kill and signal trials on the tiny config: steps lost, and whether the resumed
run's losses equal an unbroken run's.

  PYTHONPATH=$PWD python tests/reliability_preemption.py [--steps 12] [--period 4] SIGNAL@STEP ...

e.g. `SIGTERM@3 SIGUSR1@6 SIGINT@8 SIGKILL@6`. Each trial starts a run, sends
the signal when `[progress] step STEP/` is printed, resumes it with the same
command, and compares every step's loss with one unbroken run (same schedule).
Steps lost = steps trained before the signal that had to be trained again.
Prints PASS/FAIL per trial and a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _cmd(out: Path, name: str, steps: int, period: int) -> list[str]:
  return [sys.executable, "-m", "MaxText.train", "configs/deepseek3-tiny.yml", f"steps={steps}",
          f"checkpoint_period={period}", f"learning_rate_schedule_steps={steps}", f"base_output_directory={out}",
          f"run_name={name}"]


def _env() -> dict[str, str]:
  return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}


def _losses(run_dir: Path) -> dict[int, float]:
  return {int(k): v for k, v in json.loads((run_dir / "summary.json").read_text())["losses"].items()}


def trial(out: Path, name: str, sig: signal.Signals, at: int, steps: int, period: int) -> dict:
  proc = subprocess.Popen(_cmd(out, name, steps, period), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  trained = 0
  for line in proc.stdout:
    if line.startswith("[progress] step "):
      trained = int(line.split()[2].split("/")[0])
    if f"[progress] step {at}/" in line:
      proc.send_signal(sig)
      break
  rest, err = proc.communicate(timeout=600)
  for line in rest.splitlines():
    if line.startswith("[progress] step "):
      trained = int(line.split()[2].split("/")[0])
  first = _losses(out / name) if sig != signal.SIGKILL else {}
  code = proc.returncode
  resumed = subprocess.run(_cmd(out, name, steps, period), cwd=REPO, env=_env(), capture_output=True, text=True,
                           timeout=600, check=False)
  second = _losses(out / name) if resumed.returncode == 0 else {}
  restart = min(second) if second else None
  lost = max(trained - restart, 0) if restart is not None else None
  return {"signal": sig.name, "at": at, "exit": code, "trained_before": trained, "resumed_at": restart,
          "steps_lost": lost, "resume_exit": resumed.returncode, "losses": {**first, **second},
          "lines": [l for l in err.splitlines() if l.startswith("maxtext-moe:")],
          "resume_lines": [l for l in resumed.stdout.splitlines() if "stale lock" in l]}


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("trials", nargs="+")
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--period", type=int, default=4)
  opts = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp)
    unbroken = subprocess.run(_cmd(out, "unbroken", opts.steps, opts.period), cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=600, check=False)
    assert unbroken.returncode == 0, unbroken.stderr[-2000:]
    reference = _losses(out / "unbroken")
    rows = []
    for i, spec in enumerate(opts.trials):
      name, at = spec.split("@")
      r = trial(out, f"t{i}", signal.Signals[name], int(at), opts.steps, opts.period)
      # SIGKILL leaves no summary: only the resumed run's steps are compared (they start at the last checkpoint).
      expected = reference if r["signal"] != "SIGKILL" else {s: v for s, v in reference.items() if s >= r["resumed_at"]}
      exact = r["resume_exit"] == 0 and r["losses"] == expected
      r["exact"] = exact
      rows.append(r)
      print(f"{'PASS' if exact else 'FAIL'}  {spec}: exit {r['exit']}, trained {r['trained_before']}, resumed at "
            f"step {r['resumed_at']}, steps lost {r['steps_lost']}, losses equal unbroken: {exact}  "
            f"{r['lines'] + r['resume_lines']}",
            flush=True)
  print(f"\n| signal | at step | exit | resumed at | steps lost | losses == unbroken |\n|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['signal']} | {r['at']} | {r['exit']} | {r['resumed_at']} | {r['steps_lost']} | {r['exact']} |")
  return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
