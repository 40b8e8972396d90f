"""Re-plan the shipped recipes and write each plan's summary beside them (configs/recipes/plans/<recipe>.json).

  python3 tools/replan_recipes.py --jobs 6 --timeout 1500                  # all twelve, compile-only
  python3 tools/replan_recipes.py --only '*-8xh100' --jobs 1 --timeout 900  # the six one-node family recipes
  python3 tools/replan_recipes.py --headers                                 # rewrite the headers from the summaries
  python3 tools/replan_recipes.py --table                                   # BENCHMARKS.md's system-table rows

Each recipe is planned as a user would plan it, `python -m MaxText.plan <recipe> --json ...` in its own process,
--jobs at a time, each given --timeout seconds (the planner's own limit; the process is killed a minute after).
Compile-only for the recipe's target_gpu (H100/H200) by default, on any machine; --mock compiles on this machine's
GPU with a mocked topology instead (one at a time: the compile autotunes on the GPU). A 1,024-GPU compile holds
about 2.5 GB of host memory and one core for 4 minutes (2-core CPU, idle). The commit planned at is HEAD ("+dirty"
where tracked files differ). The full plans go to --plans (default: a temporary directory), the logs beside them.

Prints a row per recipe: exit, memory and verdict, step, TFLOP/s/GPU, whether the one account holds, and the
collectives off the layout's arithmetic. Exit 0 when every plan ran and its account holds, else 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from MaxText.plan import summary  # noqa: E402  pylint: disable=wrong-import-position
from MaxText.plan.__main__ import EXIT_INVARIANT  # noqa: E402  pylint: disable=wrong-import-position

RECIPES = REPO / "configs" / "recipes"
PLANS = RECIPES / "plans"


def recipes(only: list[str]) -> list[Path]:
  """The shipped recipes: every configs/recipes/<model>-<N>x<gpu>.yml (not the *-common.yml they share)."""
  found = sorted(p for p in RECIPES.glob("*x*.yml") if not p.stem.endswith("-common"))
  return [p for p in found if not only or any(fnmatch.fnmatch(p.stem, pattern) for pattern in only)]


def head_commit() -> str:
  git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, check=False)  # noqa: E731
  commit = git("rev-parse", "--short=7", "HEAD").stdout.strip() or "unknown"
  dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
  return commit + ("+dirty" if dirty else "")


def plan_one(recipe: Path, plans: Path, timeout_s: int, mock: bool = False, hlo: bool = False,
             overrides: tuple[str, ...] = (), env: dict[str, str] | None = None, name: str = "") -> tuple[int, Path]:
  """(exit, the plan's JSON) of `python -m MaxText.plan RECIPE [overrides]`, its log beside it under `name`
  (default: the recipe's); `env` is added to this process's environment."""
  name = name or recipe.stem
  out, log = plans / f"{name}.plan.json", plans / f"{name}.log"
  cmd = [sys.executable, "-m", "MaxText.plan", str(recipe.relative_to(REPO)), *overrides, "--json", str(out),
         "--timeout", str(timeout_s), "--heartbeat", "0", *(["--mock"] if mock else []),
         *(["--hlo", str(plans / f"{name}.hlo")] if hlo else [])]
  with open(log, "w") as f:
    try:
      rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s + 60, check=False,
                          env={**os.environ, **(env or {})}).returncode
    except subprocess.TimeoutExpired:
      rc = 124
  return rc, out


def row(name: str, rc: int, s: dict | None) -> str:
  if s is None:
    return f"{name:34s} exit {rc}"
  m = s["memory"]
  off = "; ".join(f"{r['kind']} {','.join(r['axes'])}: {r['cause'][:60]}" for r in s["collectives_off_the_arithmetic"])
  return (f"{name:34s} exit {rc}  {m['device_gib']:.2f}/{m['usable_gib']:.2f} GiB {'fits' if m['fits'] else 'NO FIT'}  "
          f"step {s['step_s']:.4g} s  {s['tflops_per_gpu']:.1f} TFLOP/s/GPU  account "
          f"{'holds' if s['account']['ok'] else 'VIOLATED'}  off the arithmetic: {off or 'none'}")


def write_header(recipe: Path, s: dict) -> None:
  """Replaces the recipe's plan block (or puts one under its first line) with summary.header_lines."""
  lines = recipe.read_text().splitlines()
  block = summary.header_lines(s, str((PLANS / f"{recipe.stem}.json").relative_to(REPO)))
  begin = next((i for i, l in enumerate(lines) if l.startswith(summary.HEADER_BEGIN)), None)
  if begin is None:
    lines[1:1] = block
  else:
    end = lines.index(summary.HEADER_END, begin)
    lines[begin:end + 1] = block
  recipe.write_text("\n".join(lines) + "\n")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--jobs", type=int, default=1, help="plans at once (each one process, about one core)")
  ap.add_argument("--timeout", type=int, default=1500, help="seconds a plan may take")
  ap.add_argument("--only", nargs="*", default=[], help="recipe name patterns (fnmatch), e.g. '*-8xh100'")
  ap.add_argument("--out", type=Path, default=PLANS, help="where the summaries go (default configs/recipes/plans)")
  ap.add_argument("--plans", type=Path, default=None, help="keep the full plans and logs here")
  ap.add_argument("--mock", action="store_true", help="compile on this machine's GPU, mocked topology (--jobs 1)")
  ap.add_argument("--hlo", action="store_true", help="keep each compiled step's HLO beside its plan (up to 70 MB)")
  ap.add_argument("--headers", action="store_true", help="only rewrite the recipes' headers from the summaries")
  ap.add_argument("--table", action="store_true", help="only print BENCHMARKS.md's rows from the summaries")
  a = ap.parse_args()
  chosen = recipes(a.only)
  if a.headers or a.table:
    for recipe in chosen:
      path = a.out / f"{recipe.stem}.json"
      if path.exists():
        s = json.loads(path.read_text())
        write_header(recipe, s) if a.headers else print(summary.table_row(s, recipe.stem))
    return 0
  plans = a.plans or Path(tempfile.mkdtemp(prefix="replan-"))
  plans.mkdir(parents=True, exist_ok=True)
  a.out.mkdir(parents=True, exist_ok=True)
  commit, date = head_commit(), datetime.date.today().isoformat()
  print(f"[replan] {len(chosen)} recipes, {a.jobs} at a time, {a.timeout} s each, at {commit}; plans and logs in {plans}",
        flush=True)
  ok = True
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
    futures = {pool.submit(plan_one, r, plans, a.timeout, a.mock, a.hlo): r for r in chosen}
    for future in concurrent.futures.as_completed(futures):
      recipe, (rc, out) = futures[future], future.result()
      s = None
      if rc in (0, EXIT_INVARIANT) and out.exists():  # 9: planned, its account violated (named in the summary)
        s = summary.of(json.loads(out.read_text()), commit, date)
        (a.out / f"{recipe.stem}.json").write_text(json.dumps(s, indent=1) + "\n")
      ok &= s is not None and s["account"]["ok"]
      print(row(recipe.stem, rc, s), flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
