#!/usr/bin/env python3
"""Every MoE family's one-GPU proxy end to end: upstream's best path, ours and the dense equivalent, one table.

Runs `tools/bench_train.py`'s variants on each family's run config (configs/bench/<family>-proxy-1xh200.yml) in one
invocation, so every ratio is against references measured in the same run on the same GPU, and holds each
family's planner estimate (the `# The planner's estimate` line of its run config) against the measured step.

  python3 tools/bench_families.py --families all --steps 10 --budget-s 540 --out outputs/bench_families
  python3 tools/bench_families.py --families qwen3-moe,mixtral --variants ours,dense_equivalent

A device call has a hard time limit, so --budget-s bounds the whole run: a variant is started only when the
longest run so far still fits in what is left; the rest are reported as "not run (budget)", never silently
dropped. The families run round-robin by variant order inside each family, one family after another, so a cut
budget loses whole families last-first. Prints one table last: per family, each variant's step and
TFLOP/s/device, ours against upstream's best and against dense, and the planner's estimate against ours.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import bench_train  # tools/ is sys.path[0] when run as a script

REPO = Path(__file__).resolve().parent.parent
# family -> its one-GPU run config. DeepSeek-V3's proxy (configs/bench/proxy-1xh200.yml) is bench_train's own.
FAMILY_CONFIGS = {
    "qwen3-moe": "configs/bench/qwen3-moe-proxy-1xh200.yml",
    "mixtral": "configs/bench/mixtral-proxy-1xh200.yml",
    "gpt-oss": "configs/bench/gpt-oss-proxy-1xh200.yml",
    "llama4": "configs/bench/llama4-proxy-1xh200.yml",
    "deepseek2": "configs/bench/deepseek2-proxy-1xh200.yml",
    "kimi-k2": "configs/bench/kimi-k2-proxy-1xh200.yml",
}
DEFAULT_VARIANTS = "upstream_tokamax,ours,dense_equivalent"
_ESTIMATE = re.compile(r"^# The planner's estimate.*?step ([0-9.]+) ms")


def planner_estimate_ms(config_path: Path) -> float | None:
  """The step the planner estimated for this run config, from its header (None: no estimate recorded)."""
  for line in config_path.read_text().splitlines():
    if m := _ESTIMATE.match(line):
      return float(m.group(1))
  return None


def fits_budget(elapsed_s: float, budget_s: float | None, walls_s: list[float]) -> bool:
  """Whether one more run fits: the longest run so far (or a third of the budget before any) must fit in what is
  left. A run is mostly its compile, so the longest one is a fair bound for the next."""
  if budget_s is None:
    return True
  expected = max(walls_s) if walls_s else budget_s / 3
  return elapsed_s + expected <= budget_s


def family_row(family: str, rows: list[dict], estimate_ms: float | None) -> dict:
  """Ratios for one family from its variants' rows: ours against upstream's best (the fastest upstream variant
  that trained) and against the dense equivalent, and the planner's estimate over ours' measured step."""
  by = {r["variant"]: r for r in rows if r.get("median_step_time_s")}
  upstream = [r for name, r in by.items() if name.startswith("upstream")]
  best_up = min(upstream, key=lambda r: r["median_step_time_s"]) if upstream else None
  ours = by.get("ours")
  dense = by.get("dense_equivalent")
  out = {"family": family, "estimate_ms": estimate_ms}
  if ours:
    out["ours_s"] = ours["median_step_time_s"]
    if best_up:
      out["best_upstream"] = best_up["variant"]
      out["ours_over_upstream"] = best_up["median_step_time_s"] / ours["median_step_time_s"]
    if dense:
      out["ours_over_dense"] = dense["median_step_time_s"] / ours["median_step_time_s"]
    if estimate_ms:
      out["estimate_over_measured"] = estimate_ms / 1e3 / ours["median_step_time_s"]
  return out


def _fmt(value, spec: str) -> str:
  """format(value, spec), or a dash as wide as the spec's width when there is no value."""
  width = int(re.match(r"\d*", spec).group() or 0)
  return "-".rjust(width) if value is None else format(value, spec)


def format_tables(results: list[dict], peak: float | None) -> str:
  lines = [f"{'family':<10} {'variant':<18} {'step s':>7} {'TFLOP/s':>8} {'peak GiB':>8}  note"]
  for res in results:
    for r in res["rows"]:
      note = r.get("error", "") if r.get("returncode") != 0 else bench_train.above_peak_note(
          r.get("median_tflops_per_device"), peak)
      lines.append(f"{res['family']:<10} {r['variant']:<18} {_fmt(r.get('median_step_time_s'), '7.3f')} "
                   f"{_fmt(r.get('median_tflops_per_device'), '8.1f')} {_fmt(r.get('peak_device_memory_gib'), '8.1f')}"
                   f"  {note}")
  lines += ["", f"{'family':<10} {'ours/upstream':>13} {'ours/dense':>10} {'planned ms':>10} {'measured ms':>11} "
                f"{'est/meas':>8}"]
  for res in results:
    s = res["summary"]
    lines.append(f"{s['family']:<10} {_fmt(s.get('ours_over_upstream'), '13.2f')} {_fmt(s.get('ours_over_dense'), '10.3f')} "
                 f"{_fmt(s.get('estimate_ms'), '10.0f')} {_fmt(s.get('ours_s') and 1e3 * s['ours_s'], '11.0f')} "
                 f"{_fmt(s.get('estimate_over_measured'), '8.2f')}")
  lines.append("ours/upstream: upstream's best variant's step over ours' (> 1: ours faster); ours/dense: the dense "
               "equivalent's step over ours'")
  if peak:
    lines.append(f"dense bf16 GEMM 8192^3 measured in this run: {peak:.0f} TF/s")
  return "\n".join(lines)


def write_results(out: str, peak: float | None, results: list[dict]) -> None:
  """Every row so far, after each run: a device call cut at its limit keeps what finished."""
  Path(out).mkdir(parents=True, exist_ok=True)
  (Path(out) / "bench_families.json").write_text(json.dumps({"peak_tflops": peak, "results": results}, indent=2,
                                                            default=str))


def main() -> int:
  sys.stdout.reconfigure(line_buffering=True)
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--families", default="all", help=f"comma-separated, or all: {', '.join(FAMILY_CONFIGS)}")
  ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="bench_train.py variants, comma-separated")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--timeout", type=int, default=300,
                  help="seconds per variant, compile included (a fresh machine's first compile autotunes: allow 150+)")
  ap.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (see above)")
  ap.add_argument("--out", default="outputs/bench_families")
  ap.add_argument("--configs", default=None,
                  help="family=config.yml,... replacing FAMILY_CONFIGS' run configs (e.g. the CPU tiny configs)")
  ap.add_argument("--loss-ref", default=None, help="the variant each family's losses are compared with")
  ap.add_argument("extra", nargs="*", help="key=value overrides applied to every run")
  args = ap.parse_args()
  configs = dict(FAMILY_CONFIGS)
  if args.configs:
    configs.update(dict(item.split("=", 1) for item in args.configs.split(",")))
  families = list(FAMILY_CONFIGS) if args.families == "all" else args.families.split(",")
  variants = args.variants.split(",")
  unknown = [f for f in families if f not in configs] + [v for v in variants if v not in bench_train.VARIANTS]
  if unknown:
    ap.error(f"unknown family or variant {unknown}; families: {', '.join(configs)}; "
             f"variants: {', '.join(bench_train.VARIANTS)}")
  args.out = str(Path(args.out).absolute())
  started = time.monotonic()
  peak = bench_train.dense_gemm_peak_tflops()
  walls: list[float] = []
  results = []
  for family in families:
    config = configs[family]
    run_args = argparse.Namespace(config=config, steps=args.steps, out=str(Path(args.out) / family),
                                  timeout=args.timeout, profile=False, extra=args.extra)
    rows = []
    for name in variants:
      if not fits_budget(time.monotonic() - started, args.budget_s, walls):
        rows.append({"variant": name, "returncode": "not run", "error": "not run (budget)"})
        print(f"[bench_families] {family} {name}: not run (budget)", flush=True)
        continue
      overrides = bench_train.variant_overrides(name, config)
      print(f"[bench_families] {family} {name}: {' '.join(overrides)}", flush=True)
      row = bench_train.run_variant(name, overrides, run_args)
      walls.append(row["wall_s"])
      rows.append(row)
      print(f"[bench_families] {family} {name}: rc={row['returncode']} {row.get('median_step_time_s', '')} s/step "
            f"{row.get('error', '')} ({row['wall_s']:.0f} s)", flush=True)
      write_results(args.out, peak, [*results, {"family": family, "config": config, "rows": rows}])
    summary = family_row(family, rows, planner_estimate_ms(REPO / config))
    results.append({"family": family, "config": config, "rows": rows, "summary": summary})
    write_results(args.out, peak, results)
    if losses := bench_train.format_losses(rows, args.loss_ref):
      print(f"{family}:\n{losses}", flush=True)
  print(format_tables(results, peak))
  return 0 if all(r["returncode"] == 0 for res in results for r in res["rows"]) else 1


if __name__ == "__main__":
  sys.exit(main())
