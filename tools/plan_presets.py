"""The XLA collective presets' effect on each shipped recipe: planned as shipped and with the other choice.

  python3 tools/plan_presets.py --only '*-8xh100' --jobs 2          # the six family recipes (about 2 min each)
  python3 tools/plan_presets.py --only 'deepseek3-671b-256xh100'    # a 671B recipe (5-10 min each)
  python3 tools/plan_presets.py --only 'deepseek3-671b-128xh200' --split --jobs 2   # without each preset in turn

The collective presets are deepseek_v3_reference's: lhs, pipelined_collectives, multistream, combine_thresholds.
A recipe that ships them (the 671B ones) is planned again without them: its other presets stay (gpu_runtime,
no_command_buffers, host_offload) and so do deepseek_v3_reference's own two flags, cuBLAS GEMMs and no
memory-pressure rematerialization pass (without which the 671B compile aborts), given as XLA_FLAGS. A recipe
that ships none (the family recipes) is planned again with them. The shipped side is the committed summary
(configs/recipes/plans/<recipe>.json) unless --both. Compile-only for the recipe's target GPU, as
tools/replan_recipes.py plans. Prints a row per plan: step, TFLOP/s/GPU, collectives and their exposed part, and
whether the compiled schedule changed at all (the same figures to the last digit: "no change").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import replan_recipes  # noqa: E402  pylint: disable=wrong-import-position
from MaxText import config as fork_config  # noqa: E402  pylint: disable=wrong-import-position
from MaxText.config import xla_presets  # noqa: E402  pylint: disable=wrong-import-position
from MaxText.plan import summary  # noqa: E402  pylint: disable=wrong-import-position

COLLECTIVE = ("lhs", "pipelined_collectives", "multistream", "combine_thresholds")
REFERENCE = "deepseek_v3_reference"


def variants(recipe: Path, split: bool) -> list[tuple[str, list[str], dict[str, str]]]:
  """(what it is, the override, extra environment) of the recipe's other choice; with split, for a recipe that
  ships the collective presets, one plan without each of them in turn instead (which one does the work)."""
  shipped = list(fork_config.load([str(recipe)]).fork.xla_presets)
  names = [p.name for p in xla_presets.expand(shipped)]
  if not any(n in COLLECTIVE for n in names):
    return [("with the collective presets", [f"xla_presets=[{','.join([*shipped, *COLLECTIVE])}]"], {})]
  kept = [n for n in shipped if n != REFERENCE] + ["gpu_runtime", "no_command_buffers"]
  own = xla_presets.PRESETS[REFERENCE].flags
  env = {"XLA_FLAGS": " ".join(f"--{k}={v}" for k, v in own.items())}
  if not split:
    return [("without the collective presets", [f"xla_presets=[{','.join(dict.fromkeys(kept))}]"], env)]
  out = []
  for left_out in COLLECTIVE:  # with any preset that includes it (multistream includes lhs)
    holders = [c for c in COLLECTIVE if c != left_out and left_out in [p.name for p in xla_presets.expand([c])]]
    rest = [c for c in COLLECTIVE if c != left_out and c not in holders]
    what = f"without {left_out}" + "".join(f" and {h} (includes it)" for h in holders)
    out.append((what, [f"xla_presets=[{','.join(dict.fromkeys([*kept, *rest]))}]"], env))
  return out


def figures(s: dict) -> tuple:
  t = s["terms_s"]
  return (s["step_s"], s["tflops_per_gpu"], t["collectives_s"], t["exposed_collectives_s"], s["memory"]["device_gib"])


def row(name: str, what: str, s: dict | None, rc: int = 0, shipped: dict | None = None) -> str:
  if s is None:
    return f"{name:30s} {what:44s} exit {rc}"
  step, tflops, coll, exposed, gib = figures(s)
  same = "" if shipped is None else ("  no change" if figures(shipped) == figures(s) else "")
  return (f"{name:30s} {what:44s} step {step:.4g} s  {tflops:6.1f} TFLOP/s/GPU  collectives {coll:.4g} s, "
          f"exposed {exposed:.4g} s  {gib:.2f} GiB{same}")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--only", nargs="*", default=[], help="recipe name patterns (fnmatch)")
  ap.add_argument("--jobs", type=int, default=1)
  ap.add_argument("--timeout", type=int, default=1500)
  ap.add_argument("--both", action="store_true", help="plan the shipped side too, not its committed summary")
  ap.add_argument("--plans", type=Path, default=None, help="keep the plans and logs here")
  ap.add_argument("--split", action="store_true",
                  help="a recipe that ships the collective presets: planned without each one in turn")
  a = ap.parse_args()
  plans = a.plans or Path(tempfile.mkdtemp(prefix="presets-"))
  plans.mkdir(parents=True, exist_ok=True)
  commit, date = replan_recipes.head_commit(), datetime.date.today().isoformat()
  jobs = []
  for recipe in replan_recipes.recipes(a.only):
    jobs += [(recipe, what, override, env) for what, override, env in variants(recipe, a.split)]
    if a.both:
      jobs.append((recipe, "as shipped", [], {}))
  print(f"[presets] {len(jobs)} plans, {a.jobs} at a time, at {commit}; plans and logs in {plans}", flush=True)
  done: dict[tuple[str, str], tuple[int, dict | None]] = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
    futures = {pool.submit(replan_recipes.plan_one, r, plans, a.timeout, overrides=tuple(o), env=e,
                           name=f"{r.stem}.{'-'.join(w.split()[:2])}"): (r, w)
               for r, w, o, e in jobs}
    for future in concurrent.futures.as_completed(futures):
      recipe, what = futures[future]
      rc, out = future.result()
      s = summary.of(json.loads(out.read_text()), commit, date) if out.exists() else None
      done[recipe.stem, what] = (rc, s)
      print(f"[presets] planned: {row(recipe.stem, what, s, rc)}", flush=True)
  print()
  shown: set[Path] = set()
  for recipe, what, _, _ in jobs:
    if what == "as shipped":
      continue
    shipped = done.get((recipe.stem, "as shipped"), (0, None))[1]
    if shipped is None and (replan_recipes.PLANS / f"{recipe.stem}.json").exists():
      shipped = json.loads((replan_recipes.PLANS / f"{recipe.stem}.json").read_text())
    if recipe not in shown:  # the shipped row once a recipe
      shown.add(recipe)
      print(row(recipe.stem, f"as shipped ({shipped['planned_at']['commit'] if shipped else '-'})", shipped))
    rc, s = done[recipe.stem, what]
    print(row(recipe.stem, what, s, rc, shipped))
  return 0


if __name__ == "__main__":
  sys.exit(main())
