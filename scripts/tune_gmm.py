"""Sweep tilings of the mgpu grouped-GEMM kernels and print the best per (op, K, N), as
entries for `MaxText/moe/gmm/mgpu_tiling.TABLE` (copy them there; comments cite this run).

  python scripts/tune_gmm.py --m 65536 --g 32 --dist zipf1.2 --out /tmp/tune

Each variant is checked against a float32 reference (rel err < 1e-2) before it is timed;
variants that exceed shared memory or fail to compile are reported and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_gmm as bench  # noqa: E402
from MaxText.moe.gmm import mgpu_kernels as mk  # noqa: E402
from MaxText.moe.gmm import mgpu_tiling as mt  # noqa: E402

# (op, K, N, transpose_rhs): the DeepSeek-V3 products (dlhs = fwd with K, N swapped).
PROBLEMS = {
    "up": ("fwd", 7168, 2048, False),
    "down": ("fwd", 2048, 7168, False),
    "dlhs_down": ("fwd", 7168, 2048, True),  # dout[M,7168] @ w_down[g]^T (w_down [G,2048,7168])
    "dw_up": ("tgmm", 7168, 2048, False),
    "dw_down": ("tgmm", 2048, 7168, False),
}
FWD_VARIANTS = [dict(stages=s, grid_block_n=b) for s in (3, 4) for b in (4, 16)]
TGMM_VARIANTS = [dict(block_k=64, stages=4), dict(block_k=64, stages=6),
                 dict(block_k=128, stages=3),
                 dict(warp_specialized=True, stages=3, grid_block_n=4),   # not yet timed
                 dict(warp_specialized=True, stages=3, grid_block_n=16)]


def run_problem(name, m, g, dist, seed):
  op, k, n, transpose = PROBLEMS[name]
  sizes = bench.group_sizes(dist, m, g, np.random.default_rng(seed))
  gs = jnp.asarray(sizes)
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  results = []
  if op == "fwd":
    wshape = (g, n, k) if transpose else (g, k, n)
    w = (jax.random.normal(kw, wshape, jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    ref = bench.ref_fwd(x, jnp.swapaxes(w, 1, 2) if transpose else w, sizes)
    variants = [dataclasses.replace(mt.FwdTiling(), **v) for v in FWD_VARIANTS]
  else:
    d = jax.random.normal(kw, (m, n), jnp.bfloat16)
    ref = bench.ref_tgmm(x, d, sizes)
    variants = [dataclasses.replace(mt.TgmmTiling(), **v) for v in TGMM_VARIANTS]
  starts, ends = mk.local_group_bounds(gs, 0, g, m)
  for t in variants:
    if op == "fwd":
      fn = jax.jit(lambda x, w, gs, t=t: mk.grouped_matmul(
          x, w, mk.work_table(gs, 0, g, m, t.block_m), tiling=t, transpose_rhs=transpose,
          out_dtype=jnp.bfloat16))
      args = (x, w, gs)
    else:
      fn = jax.jit(lambda x, d, s, e, t=t: mk.transposed_grouped_matmul(
          x, d, s, e, tiling=t, out_dtype=jnp.bfloat16))
      args = (x, d, starts, ends)
    rec = dict(problem=name, op=op, k=k, n=n, tiling=dataclasses.asdict(t))
    try:
      err = bench.rel_err(fn(*args), ref)
      ms, _ = bench.time_ms(fn, args, reps=5, target_s=0.03)
      rec.update(err=err, ms=ms, tflops=2.0 * m * k * n / ms / 1e9)
    except Exception as e:
      rec.update(err=None, ms=None, tflops=0.0, error=f"{type(e).__name__}: {str(e)[:200]}")
      traceback.print_exc(limit=2)
    print(json.dumps(rec), flush=True)
    results.append(rec)
  return results


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--m", type=int, default=65536)
  ap.add_argument("--g", type=int, default=32)
  ap.add_argument("--dist", default="zipf1.2")
  ap.add_argument("--problems", default=",".join(PROBLEMS))
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  allres = []
  for i, name in enumerate(args.problems.split(",")):
    allres += run_problem(name, args.m, args.g, args.dist, 100 + i)
  best = {}
  for r in allres:
    if r["ms"] is None or not (r["err"] is not None and r["err"] < bench.TOL):
      continue
    key = (r["op"], r["k"], r["n"], r["problem"])
    if key not in best or r["ms"] < best[key]["ms"]:
      best[key] = r
  print("# best tilings (op, K, N) <- problem: TF/s")
  for (op, k, n, prob), r in best.items():
    print(f"({op!r}, {k}, {n}): {r['tiling']},  # {prob} {r['tflops']:.0f} TF/s")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.json"), "w") as fh:
      json.dump(allres, fh, indent=1)


if __name__ == "__main__":
  main()
