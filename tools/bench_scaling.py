#!/usr/bin/env python3
"""Weak scaling on one multi-GPU host: the one-GPU proxy at FSDP=N and EP=N against itself on one GPU, each with
upstream's best path and the dense equivalent, and the planner's estimate of every mesh held to its measured step.

  python3 tools/bench_scaling.py --gpus 8 --out outputs/bench_scaling               # on an 8-GPU host
  python3 tools/bench_scaling.py --gpus 2 --meshes fsdp,ep --variants ours --steps 10
  python3 tools/bench_scaling.py --gpus 2 --config configs/deepseek3-tiny.yml --variants ours --no-plan   # CPU check

Weak scaling keeps the per-device batch, so each mesh's step should take the one-GPU step's time: efficiency is the
one-GPU step over the mesh's (the same variant, the same invocation, the same machine). Every mesh is one process
over the host's N GPUs (`recipe_num_gpus=N` and the mesh axis set to N). Runs start only while the longest so far
still fits --budget-s; the rest are reported "not run (budget)". With --plan (the default), each mesh is planned
first (`python -m MaxText.plan ... --json`, compiled for this host's GPU) and the table sets the estimate beside the
measured step. Prints one table last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import bench_families  # tools/ is sys.path[0] when run as a script
import bench_train

REPO = Path(__file__).resolve().parent.parent
MESH_AXES = {"fsdp": "ici_fsdp_parallelism", "ep": "ici_expert_parallelism"}


def mesh_overrides(mesh: str, gpus: int) -> list[str]:
  """The overrides that lay the run over `gpus` devices along one axis (one: the proxy as it is)."""
  if gpus == 1:
    return []
  return [f"recipe_num_gpus={gpus}", f"{MESH_AXES[mesh]}={gpus}"]


def efficiency(one_gpu_s: float | None, mesh_s: float | None) -> float | None:
  """Weak scaling: the one-GPU step over the mesh's (1.0: perfect)."""
  return one_gpu_s / mesh_s if one_gpu_s and mesh_s else None


def plan_step_s(config: str, overrides: list[str], out: Path, timeout: int) -> float | None:
  """The planner's step estimate for one mesh (None when the plan fails)."""
  path = out / "plan.json"
  out.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "MaxText.plan", config, *overrides, "--json", str(path)]
  try:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return None
  (out / "plan.log").write_text(proc.stdout + proc.stderr)
  if proc.returncode != 0 or not path.exists():
    return None
  return json.loads(path.read_text()).get("estimate", {}).get("step_s")


def format_table(rows: list[dict]) -> str:
  fmt = bench_families._fmt  # pylint: disable=protected-access
  lines = [f"{'mesh':<8} {'variant':<18} {'step s':>7} {'TFLOP/s':>8} {'efficiency':>10} {'ours/up':>7} "
           f"{'planned s':>9} {'est/meas':>8}  note"]
  for r in rows:
    lines.append(f"{r['mesh']:<8} {r['variant']:<18} {fmt(r.get('median_step_time_s'), '7.3f')} "
                 f"{fmt(r.get('median_tflops_per_device'), '8.1f')} {fmt(r.get('efficiency'), '10.3f')} "
                 f"{fmt(r.get('ours_over_upstream'), '7.2f')} {fmt(r.get('planned_s'), '9.3f')} "
                 f"{fmt(r.get('estimate_over_measured'), '8.2f')}  {r.get('error', '') if r.get('returncode') else ''}")
  lines.append("efficiency: the same variant's one-GPU step over this mesh's (weak scaling); ours/up: upstream's "
               "best variant's step over ours' at this mesh")
  return "\n".join(lines)


def annotate(rows: list[dict]) -> None:
  """Efficiency against the one-GPU row of the same variant, ours against upstream's best at each mesh."""
  one = {r["variant"]: r.get("median_step_time_s") for r in rows if r["mesh"] == "1"}
  for r in rows:
    r["efficiency"] = efficiency(one.get(r["variant"]), r.get("median_step_time_s"))
    if r.get("planned_s") and r.get("median_step_time_s"):
      r["estimate_over_measured"] = r["planned_s"] / r["median_step_time_s"]
  for mesh in {r["mesh"] for r in rows}:
    at = [r for r in rows if r["mesh"] == mesh and r.get("median_step_time_s")]
    ups = [r["median_step_time_s"] for r in at if r["variant"].startswith("upstream")]
    for r in at:
      if r["variant"] == "ours" and ups:
        r["ours_over_upstream"] = min(ups) / r["median_step_time_s"]


def main() -> int:
  sys.stdout.reconfigure(line_buffering=True)
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gpus", type=int, required=True, help="the host's GPU count: each mesh's size")
  ap.add_argument("--meshes", default="fsdp,ep", help=f"comma-separated, from: {', '.join(MESH_AXES)}")
  ap.add_argument("--config", default=bench_train.DEFAULT_CONFIG)
  ap.add_argument("--variants", default="ours,upstream_tokamax,dense_equivalent")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--timeout", type=int, default=300, help="seconds per run (and per plan)")
  ap.add_argument("--budget-s", type=float, default=None, help="seconds for the whole invocation")
  ap.add_argument("--no-plan", dest="plan", action="store_false", help="skip the planner's estimates")
  ap.add_argument("--out", default="outputs/bench_scaling")
  ap.add_argument("extra", nargs="*", help="key=value overrides applied to every run")
  args = ap.parse_args()
  meshes, variants = args.meshes.split(","), args.variants.split(",")
  unknown = [m for m in meshes if m not in MESH_AXES] + [v for v in variants if v not in bench_train.VARIANTS]
  if unknown or args.gpus < 2:
    ap.error(f"--gpus must be >= 2; unknown mesh or variant {unknown}: meshes {', '.join(MESH_AXES)}; variants "
             f"{', '.join(bench_train.VARIANTS)}")
  out = Path(args.out).absolute()
  started, walls, rows = time.monotonic(), [], []
  layouts = [("1", [])] + [(f"{m}{args.gpus}", mesh_overrides(m, args.gpus)) for m in meshes]
  for mesh, overrides in layouts:
    planned = None
    if args.plan and bench_families.fits_budget(time.monotonic() - started, args.budget_s, walls):
      planned = plan_step_s(args.config, [*overrides, *args.extra], out / mesh, args.timeout)
    run_args = argparse.Namespace(config=args.config, steps=args.steps, out=str(out / mesh), timeout=args.timeout,
                                  profile=False, extra=[*overrides, *args.extra])
    for name in variants:
      row = {"mesh": mesh, "variant": name, "planned_s": planned if name == "ours" else None}
      if not bench_families.fits_budget(time.monotonic() - started, args.budget_s, walls):
        rows.append({**row, "returncode": "not run", "error": "not run (budget)"})
        continue
      result = bench_train.run_variant(name, bench_train.variant_overrides(name, args.config), run_args)
      walls.append(result["wall_s"])
      rows.append({**result, **row})
      print(f"[bench_scaling] {mesh} {name}: rc={result['returncode']} {result.get('median_step_time_s', '')} s/step "
            f"{result.get('error', '')}", flush=True)
      annotate(rows)
      bench_families.write_results(str(out), None, rows)
  annotate(rows)
  bench_families.write_results(str(out), None, rows)
  print(format_table(rows))
  return 0 if all(r.get("returncode") == 0 for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
