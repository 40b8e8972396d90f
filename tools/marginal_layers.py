#!/usr/bin/env python3
"""What one more decoder layer costs each variant: two tools/bench_train.py runs of the same variants at two layer
counts, differenced.

  python3 tools/bench_train.py --variants ours,ours_fp8 --steps 40 --out /tmp/bt4
  python3 tools/bench_train.py --variants ours,ours_fp8 --steps 40 --out /tmp/bt6 base_num_decoder_layers=6
  python3 tools/marginal_layers.py 4:/tmp/bt4/bench_train.json 6:/tmp/bt6/bench_train.json

Why: the 1xH200 proxy (configs/bench/proxy-1xh200.yml) has 4 decoder layers (1 dense, 3 MoE) and DeepSeek-V3's
129,280-entry output head, which alone is a sixth of its step; DeepSeek-V3 has 61 layers, 58 of them MoE. The
layers added past the proxy's 4 are MoE layers (first_num_dense_layers stays 1), so the difference of the two
median steps over the layers added is the step time of one MoE decoder layer (its forward, full remat, backward
and optimizer update), the part of a DeepSeek-V3 step that a change to the MoE block scales. Printed per variant:
both median steps, the seconds per added layer, and the first variant's per-layer time over this one's (its
speed-up per layer). The two runs should be the same day and GPU; the difference carries both runs' spread.

Exit 2, with one line naming the argument or variant, for other than two arguments, a malformed one, an unreadable
file, equal layer counts, a variant without a step time in either run, or one whose run with more layers was not
slower (the layer counts named are then not the runs').
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class InputError(ValueError):
  pass


def parse_run(arg: str) -> tuple[int, Path]:
  """'6:/tmp/bt6/bench_train.json' -> (6, path)."""
  layers, sep, path = arg.partition(":")
  if not sep or not layers.isdigit() or int(layers) < 1 or not path:
    raise InputError(f"run {arg!r}: expected LAYERS:PATH to a bench_train.json, e.g. 6:/tmp/bt6/bench_train.json")
  return int(layers), Path(path)


def step_times(path: Path) -> dict[str, float]:
  """Variant -> median step seconds of every variant that trained in a bench_train.json."""
  try:
    rows = json.loads(path.read_text())["rows"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise InputError(f"{path}: not a readable bench_train.json ({type(e).__name__}: {e})") from e
  return {r["variant"]: r["median_step_time_s"] for r in rows if r.get("median_step_time_s")}


def marginal(fewer: tuple[int, dict[str, float]], more: tuple[int, dict[str, float]]) -> list[dict]:
  """Per variant (in the order of the run with fewer layers): steps, seconds per added layer, and the first
  variant's per-layer seconds over its own."""
  (l1, t1), (l2, t2) = sorted([fewer, more], key=lambda run: run[0])
  if l1 == l2:
    raise InputError(f"both runs have {l1} layers: the layer counts must differ")
  missing = sorted(set(t1) ^ set(t2))
  if missing:
    raise InputError(f"variant(s) {', '.join(missing)} have a step time in only one run")
  rows = [{"variant": v, "layers": (l1, l2), "step_s": (t1[v], t2[v]), "per_layer_s": (t2[v] - t1[v]) / (l2 - l1)}
          for v in t1]
  if slower := [r["variant"] for r in rows if r["per_layer_s"] <= 0]:
    raise InputError(f"variant(s) {', '.join(slower)} did not run slower with {l2} layers than with {l1}: "
                     "are those the runs' layer counts?")
  for row in rows:
    row["speedup_per_layer"] = rows[0]["per_layer_s"] / row["per_layer_s"]
    row["speedup_step"] = tuple(a / b for a, b in zip(rows[0]["step_s"], row["step_s"]))
  return rows


def format_rows(rows: list[dict]) -> str:
  l1, l2 = rows[0]["layers"]
  ref = rows[0]["variant"]
  header = (f"{'variant':<20} {f'step s, {l1} layers':>18} {f'step s, {l2} layers':>18} {'s per added layer':>18} "
            f"{f'{ref} / this, per layer':>24} {'same, whole steps':>18}")
  lines = [header, "-" * len(header)]
  for r in rows:
    whole = " / ".join(f"{s:.3f}x" for s in r["speedup_step"])
    lines.append(f"{r['variant']:<20} {r['step_s'][0]:>18.3f} {r['step_s'][1]:>18.3f} {r['per_layer_s']:>18.4f} "
                 f"{r['speedup_per_layer']:>23.3f}x {whole:>18}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  args = sys.argv[1:] if argv is None else argv
  if any(a in ("-h", "--help") for a in args):
    print(__doc__.strip())
    return 0
  try:
    if len(args) != 2:
      raise InputError(f"expected two runs, LAYERS:PATH LAYERS:PATH, got {len(args)} argument(s) (--help)")
    runs = [(layers, step_times(path)) for layers, path in map(parse_run, args)]
    print(format_rows(marginal(*runs)))
  except InputError as e:
    print(f"marginal_layers: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
