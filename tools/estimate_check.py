#!/usr/bin/env python3
"""The step estimate's honesty check: the planner's estimate of the 1xH200 proxy against a step of it measured by
tools/bench_train.py, in one invocation on the GPU machine (target: within 10%).

  python3 tools/estimate_check.py --out outputs/estimate_check                 # on one H200: plan, then measure
  python3 tools/estimate_check.py --plan-only --target-gpu h200 --out DIR      # anywhere: the plan alone
  python3 tools/estimate_check.py --config configs/bench/proxy-2xh200-ep2.yml   # on two H200s: the EP=2 proxy

1. `python -m MaxText.plan <--config> <the variant's overrides> --json DIR/plan.json`: on a GPU
   machine compiled for its own GPU; with --target-gpu for compile-only devices of that GPU (no GPU used).
2. `python tools/bench_train.py --config <--config> --variants <variant> --steps N --out DIR/bt` (not with
   --plan-only).
3. Prints the estimate's terms (MaxText/plan/schedule.py), the measured median step and the ratio: PASS within
   --tolerance, else FAIL. Exit 0 on PASS (or a plan alone), 1 on FAIL, 2 when the plan or the run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import bench_train  # tools/ is sys.path[0] when run as a script

REPO = Path(__file__).resolve().parent.parent


def plan_lines(plan: dict) -> list[str]:
  e = plan["estimate"]
  return [f"plan: {plan['target_gpu']['name']} ({plan['platform']}), compiled in {plan['compile_seconds']:.0f} s",
          f"  estimate {e['step_s'] * 1e3:.1f} ms = compute {e['compute_s'] * 1e3:.1f} (GEMMs {e['gemm_s'] * 1e3:.1f}, "
          f"FP8 GEMMs {e['fp8_gemm_s'] * 1e3:.1f}, attention {e['attention_s'] * 1e3:.1f}, hidden "
          f"{e['hidden_flops_s'] * 1e3:.1f}) + memory-bound {e['memory_s'] * 1e3:.1f} + exposed collectives "
          f"{e['exposed_collectives_s'] * 1e3:.1f} (overlapped {e['overlapped_collectives_s'] * 1e3:.1f}) + bubble "
          f"{e['bubble_s'] * 1e3:.1f}",
          f"  {e['gemm_flops'] / 1e12:.1f} T GEMM, {e['fp8_flops'] / 1e12:.1f} T FP8, {e['attention_flops'] / 1e12:.1f} T "
          f"attention FLOPs; {e['memory_bytes'] / 1e9:.1f} GB memory-bound; {e['kernels']} kernels"]


def verdict(plan: dict, bench: dict, tolerance: float) -> tuple[bool, str]:
  """(passed, the line that says so) from the plan's JSON and bench_train.py's."""
  row = bench["rows"][0]
  measured = row["median_step_time_s"]
  ratio = plan["estimate"]["step_s"] / measured
  passed = abs(ratio - 1.0) <= tolerance
  memory = plan.get("memory", {}).get("device_total", 0) / 2**30
  peak = row.get("peak_device_memory_gib")
  mem = f"; memory {memory:.2f} GiB (compiler) / {peak:.2f} GiB (peak)" if peak and memory else ""
  return passed, (f"{'PASS' if passed else 'FAIL'}: estimated {plan['estimate']['step_s'] * 1e3:.1f} ms / measured "
                  f"{measured * 1e3:.1f} ms ({row['variant']}, median) = {ratio:.3f}, within {tolerance:.0%}: "
                  f"{'yes' if passed else 'no'}{mem}")


def run(cmd: list[str], log: Path, timeout: int) -> int:
  print(f"[estimate_check] {' '.join(cmd)}  > {log}", flush=True)
  with open(log, "w") as out:
    try:
      return subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
      return 124


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=bench_train.DEFAULT_CONFIG, help="a run config both plan and measure")
  parser.add_argument("--out", default="outputs/estimate_check")
  parser.add_argument("--variant", default="ours", help=f"a bench_train.py variant: {', '.join(bench_train.VARIANTS)}")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--tolerance", type=float, default=0.10)
  parser.add_argument("--target-gpu", help="plan for compile-only devices of this GPU (h100, h200): no GPU used")
  parser.add_argument("--plan-only", action="store_true", help="the plan and its terms, no measurement")
  parser.add_argument("--plan-timeout", type=int, default=900)
  parser.add_argument("--bench-timeout", type=int, default=900, help="seconds for the bench_train.py variant")
  args = parser.parse_args()
  if args.variant not in bench_train.VARIANTS:
    parser.error(f"unknown variant {args.variant!r}; valid: {', '.join(bench_train.VARIANTS)}")
  out = Path(args.out).absolute()
  out.mkdir(parents=True, exist_ok=True)
  overrides = bench_train.VARIANTS[args.variant][0] + ([f"target_gpu={args.target_gpu}"] if args.target_gpu else [])
  plan_json = out / "plan.json"
  rc = run([sys.executable, "-m", "MaxText.plan", args.config, *overrides, "--json", str(plan_json)], out / "plan.log",
           args.plan_timeout)
  if rc != 0 or not plan_json.exists():
    print(f"[estimate_check] plan failed (exit {rc}): {out / 'plan.log'}")
    return 2
  plan = json.loads(plan_json.read_text())
  print("\n".join(plan_lines(plan)), flush=True)
  if args.plan_only:
    return 0
  rc = run([sys.executable, "tools/bench_train.py", "--config", args.config, "--variants", args.variant, "--steps",
            str(args.steps), "--timeout", str(args.bench_timeout), "--out", str(out / "bt")], out / "bench.log",
           args.bench_timeout + 360)
  bench_json = out / "bt" / "bench_train.json"
  bench = json.loads(bench_json.read_text()) if bench_json.exists() else {"rows": []}
  if rc != 0 or not bench["rows"] or "median_step_time_s" not in bench["rows"][0]:
    print(f"[estimate_check] bench_train.py failed (exit {rc}): {out / 'bench.log'}")
    return 2
  passed, line = verdict(plan, bench, args.tolerance)
  print(line)
  return 0 if passed else 1


if __name__ == "__main__":
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  sys.exit(main())
