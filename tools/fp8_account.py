#!/usr/bin/env python3
"""Where a step's FP8 time goes: tools/bench_fp8.py's kernel and quantization times, scaled to a model's MoE layers.

  python3 tools/fp8_account.py BENCH_FP8_JSON [--dist balanced] [--rows 131072] [--tokens 16384]
      [--moe-layers 3] [--remat full]

Prints per step, bf16 against FP8: the routed GEMMs (forward, its remat, dlhs, dW) and each quantization pass
FP8 adds, then the total. BENCHMARKS.md "FP8 end to end" puts this account beside a bench_train.py run. The
defaults are the 1xH200 proxy (configs/bench/proxy-1xh200.yml): 16,384 tokens, top-8, so 131,072 rows per MoE
layer, 3 MoE layers, full remat.

What each row assumes, from how our block runs (MaxText/moe/block.py, MaxText/moe/fp8_dispatch.py):
  * times scale with rows from bench_fp8's M (65,536): the kernels' tiles and XLA's passes are row-parallel;
  * per layer, the forward is wi_0 and wi_1 at the "up" shape (K 7168, N 2048) and wo at "down"; dlhs is wo's at
    "up" and wi_0's and wi_1's at "down"; dW is two "up" and one "down" (bench_fp8 times each shape's dW);
  * x is quantized over the T token rows before the dispatch, once per forward pass, and the combine's cotangent
    over T rows before the backward's exchange (--bf16-backward-exchange: not, the code before ffcbd11); the
    SwiGLU output over all rows, once per forward pass;
  * dlhs quantizes its douts over all rows: dh0 and dh1 (2048 columns); wo's dy (7168) is the combine's cotangent,
    which crossed as tiles and is multiplied as they are (--before-cotangent-tiles: XLA quantized it);
  * materialized rows (the SwiGLU output, dh0, dh1) go to the one-pass 1x128 kernel as a product's lhs, at its
    time where the file has it (bench_fp8 since f32c8fd), else at XLA's; dy, a gather of token rows, is XLA's;
  * dW quantizes x (shared by wi_0 and wi_1), dh0, dh1, the SwiGLU output and dy into 128x1 tiles: 20,480
    columns. x and dy are requantized from the tiles that crossed (the dispatch's, the combine's cotangent's;
    --before-cotangent-tiles: dy, a gather of token rows, by XLA) and the SwiGLU output, dh0 and dh1 are
    materialized rows, all by one-pass kernels
    (mgpu/fp8_quant_kernels.py), at the bf16 kernel's cost per column where the file has it (bench_fp8 since
    2f00e9e), else at XLA's; --before-one-pass-lhs: the code before 6a4031d (x by XLA, every lhs by XLA);
  * the three weights are quantized once per step (CSE merges the forward's, the remat's and dlhs's).

Known bias (measured at 2af30cb, 2026-12-03): XLA's passes over a gather of token rows are charged at bench_fp8's
rate for materialized rows. Taking wo's dy as the moved tiles removed two such passes, 11.6 ms here, for a 3.1 ms
requantization: -8.5 ms
predicted, about -2 measured (bench_train, 100 steps). Those passes fuse the gather and read the compact token rows,
and the tiles they replace are still materialized by XLA's gather (byte-wide then, ~0.8 TB/s; in uint32 words since
2ca37d2, ~1.66 TB/s, tools/bench_packed_gather.py at 2b6d1c1): so the account overstates what removing a gathered pass saves,
by roughly 2x.
"""

from __future__ import annotations

import argparse
import json
import sys

BENCH_ROWS = 65536
UP_K, DOWN_K = 7168, 2048


def times(results: list[dict], dist: str) -> dict[str, dict[str, float]]:
  """{"up"|"down": {what: ms}} for one group-size distribution of a bench_fp8.json."""
  out: dict[str, dict[str, float]] = {}
  for row in results:
    if row.get("kind") == "speed" and row["case"].endswith(f" {dist}"):
      out.setdefault(row["case"].split()[0], {})[row["what"]] = row["ms"]
  if set(out) != {"up", "down"}:
    raise SystemExit(f"fp8_account: the file has no up and down speed rows for dist {dist!r}")
  return out


def at_dense_fp8(t: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
  """The same times with each FP8 kernel (forward/dlhs and dW) at its case's dense FP8 cuBLASLt time: what the
  account gives if the kernels reached dense-FP8 speed and nothing else changed."""
  return {shape: {**rows, "mgpu_fp8": rows["dense fp8"], "dW mgpu_fp8": rows["dense fp8"]} for shape, rows in t.items()}


def account(t: dict[str, dict[str, float]], *, rows: int, tokens: int, moe_layers: int, remat: str,
            fp8_backward_exchange: bool = True, one_pass_lhs: bool = True, cotangent_tiles: bool = True) -> list[tuple]:
  """[(what, bf16 ms, fp8 ms)] per step."""
  up, down = t["up"], t["down"]
  per_row = rows / BENCH_ROWS
  passes = 2 if remat == "full" else 1  # the forward, and its recompute under full remat
  scale = per_row * moe_layers

  def gemms(what, n_up, n_down):  # per step: n_up products per layer at the "up" shape, n_down at "down"
    return (n_up * up[what] + n_down * down[what]) * scale

  def dw_quant_per_column(what):
    return (up[what] + down[what]) / 2 / (UP_K + DOWN_K)

  xla_dw_quant = dw_quant_per_column("dW quantize x and dout (128x1)")
  one_pass = "dW quantize x and dout (one-pass kernel)"
  kernel_dw_quant = dw_quant_per_column(one_pass) if one_pass in up and one_pass in down else xla_dw_quant
  one_pass_rows = "quantize x (1x128, one-pass kernel)"
  row_tiles = {shape: ms[one_pass_rows] if one_pass_lhs and one_pass_rows in ms else ms["quantize x (1x128)"]
               for shape, ms in t.items()}
  # dW's x: requantized from the dispatch's tiles in one pass (since 6a4031d), at the bf16 kernel's rate per
  # column (it reads e4m3, half the bytes: an upper bound); before, XLA's through the gather.
  x_dw_quant = kernel_dw_quant if one_pass_lhs else xla_dw_quant
  token_share = tokens / BENCH_ROWS * moe_layers
  # wo's dy: the combine's cotangent, moved as tiles. Since 2af30cb dlhs multiplies those tiles (no pass) and dW
  # requantizes them in one pass, as x's; before, XLA quantized its bf16 values through the gather for both.
  dy_tiles = cotangent_tiles and fp8_backward_exchange and one_pass_lhs
  dlhs_dy = 0.0 if dy_tiles else up["quantize x (1x128)"]
  return [
      ("routed GEMMs: forward" + (" + remat" if passes == 2 else ""), passes * gemms("mgpu bf16", 2, 1),
       passes * gemms("mgpu_fp8", 2, 1)),
      ("routed GEMMs: dlhs", gemms("mgpu bf16", 1, 2), gemms("mgpu_fp8", 1, 2)),
      ("routed GEMMs: dW", gemms("dW mgpu bf16", 2, 1), gemms("dW mgpu_fp8", 2, 1)),
      ("quantize: x over T rows (FP8 dispatch), per forward pass", 0.0, passes * up["quantize x (1x128)"] * token_share),
      ("quantize: SwiGLU output, per forward pass", 0.0, passes * row_tiles["down"] * scale),
      ("quantize: combine's cotangent over T rows (FP8 backward exchange)", 0.0,
       up["quantize x (1x128)"] * token_share if fp8_backward_exchange else 0.0),
      ("quantize: dlhs douts (dh0 and dh1; dy moved as tiles)" if dy_tiles else
       "quantize: dlhs douts (dy gathered, dh0 and dh1)", 0.0, (dlhs_dy + 2 * row_tiles["down"]) * scale),
      ("quantize: dW's x, 128x1 (from the dispatch's tiles: one pass)" if one_pass_lhs else
       "quantize: dW's x, 128x1 (gathered from token rows: XLA)", 0.0, x_dw_quant * UP_K * scale),
      ("quantize: dW's dy, 128x1 (from the combine's tiles: one pass)" if dy_tiles else
       "quantize: dW's dy, 128x1 (gathered from token rows: XLA)", 0.0,
       (kernel_dw_quant if dy_tiles else xla_dw_quant) * UP_K * scale),
      ("quantize: dW operands materialized, 128x1 (h, dh0, dh1: one pass)", 0.0, kernel_dw_quant * 3 * DOWN_K * scale),
      ("quantize: three weights, once per step", 0.0, 3 * up["quantize w (128x128, N-major copy)"] * moe_layers),
  ]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("bench_fp8_json")
  ap.add_argument("--dist", default="balanced")
  ap.add_argument("--rows", type=int, default=131072, help="dispatched rows per MoE layer (tokens x top-k)")
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--moe-layers", type=int, default=3)
  ap.add_argument("--remat", choices=("full", "none"), default="full")
  ap.add_argument("--bf16-backward-exchange", action="store_true",
                  help="the combine's cotangent crosses in bf16 (the code before ffcbd11)")
  ap.add_argument("--before-one-pass-lhs", action="store_true",
                  help="the SwiGLU output, dh0, dh1 (as a product's lhs) and dW's x quantized by XLA (the code before "
                       "6a4031d)")
  ap.add_argument("--before-cotangent-tiles", action="store_true",
                  help="wo's dy (the combine's cotangent) quantized by XLA for dlhs and dW, not taken as the tiles that "
                       "crossed (the code before 2af30cb)")
  ap.add_argument("--kernels-at-dense-fp8", action="store_true",
                  help="each FP8 kernel at its case's dense FP8 cuBLASLt time from the same file (a ceiling)")
  args = ap.parse_args(argv)
  try:
    with open(args.bench_fp8_json, encoding="utf-8") as f:
      results = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise SystemExit(f"fp8_account: {args.bench_fp8_json}: {e}") from None
  t = times(results, args.dist)
  rows = account(at_dense_fp8(t) if args.kernels_at_dense_fp8 else t, rows=args.rows, tokens=args.tokens,
                 moe_layers=args.moe_layers, remat=args.remat, fp8_backward_exchange=not args.bf16_backward_exchange,
                 one_pass_lhs=not args.before_one_pass_lhs, cotangent_tiles=not args.before_cotangent_tiles)
  print(f"{'per step (' + str(args.moe_layers) + ' MoE layers, ' + args.dist + ')':66s} {'bf16 ms':>8s} {'FP8 ms':>8s} {'FP8 - bf16':>10s}")
  for what, bf16, fp8 in rows:
    print(f"{what:66s} {bf16:8.1f} {fp8:8.1f} {fp8 - bf16:+10.1f}")
  bf16, fp8 = sum(r[1] for r in rows), sum(r[2] for r in rows)
  print(f"{'total':66s} {bf16:8.1f} {fp8:8.1f} {fp8 - bf16:+10.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
