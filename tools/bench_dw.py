"""The blockwise-FP8 dW kernel's schedules (`mgpu_fp8_tgmm.DwSchedule`) on one Hopper GPU, at DeepSeek-V3's two
expert shapes (M = 65,536 rows, G = 32): each against the default's output bit for bit (PASS/FAIL: every output
element is the same sequence of promotions whichever warpgroup computes it) and timed against a dense FP8 GEMM of
equal FLOPs (cuBLASLt through XLA), all in this process, on operands quantized beforehand.

  python tools/bench_dw.py [--schedules 2,1;2,0] [--dists balanced,zipf1.2] [--out DIR]

--schedules: 'compute_wgs,overlap' pairs timed beside the default (3 warpgroups, no overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.moe.gmm import fp8_quant, mgpu_fp8_tgmm  # noqa: E402
from tools.bench_fp8 import _dense_fp8  # noqa: E402
from tools.bench_gmm import SHAPES, group_sizes, time_ms  # noqa: E402


def parse(spec: str) -> list[mgpu_fp8_tgmm.DwSchedule]:
  out = []
  for item in filter(None, spec.split(";")):
    wgs, _, overlap = item.partition(",")
    out.append(mgpu_fp8_tgmm.DwSchedule(int(wgs), bool(int(overlap or 0))))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--schedules", default="2,1;2,0")
  ap.add_argument("--dists", default="balanced,zipf1.2")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  schedules = [mgpu_fp8_tgmm.DwSchedule(), *parse(args.schedules)]
  m, g = 65536, 32
  rows = []
  for shape in ("up", "down"):
    k, n = SHAPES[shape]
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    d = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
    x_q, _ = jax.jit(fp8_quant.quantize_row_tiles)(x)
    w_q = jnp.zeros((n, k), fp8_quant.E4M3)
    dense_ms = time_ms(jax.jit(_dense_fp8), (x_q, w_q))[0]
    flops = 2.0 * m * k * n
    for dist in args.dists.split(","):
      gs = jnp.asarray(group_sizes(dist, m, g, np.random.default_rng(3)))

      @jax.jit
      def quantize(x, d, gs):
        layout = fp8_quant.group_blocks(gs, 0, g, m)
        return (*fp8_quant.quantize_group_row_blocks(x, layout), *fp8_quant.quantize_group_row_blocks(d, layout),
                layout.block0_L, layout.blocks_L)

      ops = quantize(x, d, gs)
      want = None
      for sched in schedules:
        fn = jax.jit(lambda *a, sched=sched: mgpu_fp8_tgmm.transposed_grouped_matmul_fp8(*a, schedule=sched))
        try:
          out = np.asarray(jax.block_until_ready(fn(*ops)).astype(jnp.float32))
        except Exception as e:  # pylint: disable=broad-except  # a schedule that does not compile: say so, go on
          print(f"FAIL {shape} {dist} {sched}: {type(e).__name__}: {str(e)[:300]}", flush=True)
          continue
        want = out if want is None else want
        ms = time_ms(fn, ops)[0]
        row = dict(shape=shape, dist=dist, compute_wgs=sched.compute_wgs, overlap=sched.overlap, ms=ms,
                   tflops=flops / ms / 1e9, of_dense_fp8=dense_ms / ms, dense_fp8_ms=dense_ms,
                   same_as_default=bool(np.array_equal(out, want)))
        rows.append(row)
        print(json.dumps(row), flush=True)
  print(f"\n[bench_dw] {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, M {m}, G {g}")
  print(f"{'shape':5s} {'dist':9s} {'wgs':>3s} {'overlap':>7s} {'ms':>7s} {'TF/s':>6s} {'of dense fp8':>12s}  check")
  for r in rows:
    print(f"{r['shape']:5s} {r['dist']:9s} {r['compute_wgs']:3d} {str(r['overlap']):>7s} {r['ms']:7.3f} "
          f"{r['tflops']:6.0f} {r['of_dense_fp8']:12.2f}  {'PASS' if r['same_as_default'] else 'FAIL'}")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "bench_dw.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
