"""Kill and signal trials on the tiny config: steps lost, and whether the resumed
run's losses equal an unbroken run's.

  PYTHONPATH=$PWD python tests/reliability_preemption.py [--steps 12] [--period 4] [--async-checkpoints] SIGNAL@STEP ...

e.g. `SIGTERM@3 SIGUSR1@6 SIGINT@8 SIGKILL@6`. Each trial starts a run, sends
the signal when `[progress] step STEP/` is printed, resumes it with the same
command, and compares every step's loss with one unbroken run (same schedule).
Steps lost = steps trained before the signal that had to be trained again. `--async-checkpoints`: every run
(the unbroken one too) saves with async_checkpointing=true, upstream's default and the recipes'.
Prints PASS/FAIL per trial and a table last.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

from conftest import BackgroundRun, run_train  # this folder is on sys.path when the script runs


ASYNC: list[str] = []  # ["async_checkpointing=true"] with --async-checkpoints


def _args(steps: int, period: int) -> tuple[str, ...]:
  return ("configs/deepseek3-tiny.yml", f"steps={steps}", f"checkpoint_period={period}",
          f"learning_rate_schedule_steps={steps}", *ASYNC)


def _trained(stdout: str) -> int:
  """The last step a run's progress lines reported."""
  return max((int(line.split()[2].split("/")[0]) for line in stdout.splitlines()
              if line.startswith("[progress] step ")), default=0)


def trial(out: Path, name: str, sig: signal.Signals, at: int, steps: int, period: int) -> dict:
  with BackgroundRun(out, *_args(steps, period), run_name=name) as run:  # every wait with a deadline
    run.wait_for(f"[progress] step {at}/")
    run.send_signal(sig)
    stopped = run.finish(timeout=600)
  trained, err, code = _trained(stopped.stdout), stopped.stderr, stopped.returncode
  first = stopped.losses() if sig != signal.SIGKILL else {}
  resumed = run_train(out, *_args(steps, period), run_name=name)
  second = resumed.losses() if resumed.returncode == 0 else {}
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
  parser.add_argument("--async-checkpoints", action="store_true", help="save with async_checkpointing=true")
  opts = parser.parse_args()
  ASYNC[:] = ["async_checkpointing=true"] if opts.async_checkpoints else []
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp)
    unbroken = run_train(out, *_args(opts.steps, opts.period), run_name="unbroken")
    assert unbroken.returncode == 0, unbroken.stderr[-2000:]
    reference = unbroken.losses()
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
