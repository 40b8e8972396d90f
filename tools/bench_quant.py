"""The one-pass FP8 quantization kernels (MaxText/moe/gmm/mgpu/fp8_quant_kernels.py) on one Hopper GPU, at the 1-GPU
proxy's shapes (16,384 tokens x top-8 = 131,072 rows), against an XLA copy-like pass measured in the same process
and, with --against, another version of the module timed beside this one.

  python tools/bench_quant.py [--against OLD_MODULE.py] [--rows 131072] [--groups 32] [--out DIR]

  git show REV:MaxText/moe/gmm/mgpu/fp8_quant_kernels.py > old.py   # a module to compare (it imports today's helpers)

Per kernel: median ms, its bytes (reads + writes) per ms as TB/s, and that as a share of XLA's x * 2 on the same
bf16 [rows, K] (2 B read and 2 B written a value): a reference, not a roof (3.3 TB/s on the H200, where the row-tile
kernel reaches 3.9; XLA's bf16 -> e4m3 convert, 2.5 TB/s, was no roof either). With --against:
the old module's time on the same inputs, and the share of e4m3 bytes on which the two disagree (another
rounding formula moves a value across an e4m3 rounding boundary only when it sits within an f32 ulp of one).
Kernels, as the step calls them (BENCHMARKS.md "FP8 kernels"):
  row tiles      1x128 tiles of a materialized [rows, K] (the SwiGLU output; its gradient, K = 2,048)
  group blocks   dW's 128x1 tiles of a materialized [rows, K] (K = 2,048)
  requantize     dW's 128x1 tiles from the 1x128 tiles that crossed the dispatch (x and the combine's
                 cotangent, K = 7,168): 1 B read and 1 B written a value, plus the row scales
Then the weights' 128x128 blocks in both layouts (w01 [32, 7168, 4096] and w2 [32, 2048, 7168]): the one-pass
kernel `quantize_weight_blocks_both` that the step runs (mgpu/fp8.py quantize_weight), for a few chunks, against XLA's
passes (`fp8_quant.quantize_weight_blocks` and the forward's transposed copy), with the bytes on which they
disagree (none, if bit for bit).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.moe.gmm import fp8_quant  # noqa: E402
from MaxText.moe.gmm.mgpu import fp8_quant_kernels as mgpu_fp8_quant  # noqa: E402
from tools.bench_gmm import group_sizes, time_ms  # noqa: E402


def load_module(path: str):
  if not os.path.isfile(path):
    raise SystemExit(f"bench_quant: --against {path}: no such file (e.g. git show REV:MaxText/moe/gmm/mgpu/fp8_quant_kernels.py)")
  spec = importlib.util.spec_from_file_location("mgpu_fp8_quant_against", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def cases(rows: int, groups: int):
  """(label, K, bytes moved, make(module) -> (jitted fn, args)) per kernel as the step calls it."""
  gs = jnp.asarray(group_sizes("zipf1.2", rows, groups, np.random.default_rng(3)))
  p = fp8_quant.num_padded_rows(rows, groups)

  def row_tiles(k):
    x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
    return lambda mod: (jax.jit(mod.quantize_row_tiles), (x,))

  def group_blocks(k):
    x = jax.random.normal(jax.random.key(2), (rows, k), jnp.bfloat16)
    def make(mod):
      return jax.jit(lambda x, gs: mod.quantize_group_row_blocks(x, fp8_quant.group_blocks(gs, 0, groups, rows))), (x, gs)
    return make

  def requantize(k):
    tiles = jax.jit(fp8_quant.quantize_rows)(jax.random.normal(jax.random.key(3), (rows, k), jnp.bfloat16))
    def make(mod):
      return jax.jit(lambda t, gs: mod.requantize_group_row_blocks(
          t, fp8_quant.group_blocks(gs, 0, groups, rows), jnp.bfloat16)), (tiles, gs)
    return make

  k_ffn, k_model = 2048, 7168
  return [
      ("row tiles", k_ffn, rows * k_ffn * 3 + rows * k_ffn // 32, row_tiles(k_ffn)),
      ("group blocks", k_ffn, rows * k_ffn * 2 + p * k_ffn * 1 + p * k_ffn // 32, group_blocks(k_ffn)),
      ("requantize", k_model, rows * k_model * (1 + 4 / 128) + p * k_model * (1 + 4 / 128), requantize(k_model)),
  ]


# quantize_weight_blocks_both's chunk (column blocks per grid block): its default first.
WEIGHT_CHUNKS = (mgpu_fp8_quant.WEIGHT_CHUNK, 2, 8)


def weight_rows(groups: int, shapes=((7168, 4096), (2048, 7168)), chunks=WEIGHT_CHUNKS) -> list[dict]:
  """The weights' blocks in both layouts: the one-pass kernel (each chunk) against XLA's passes, per DeepSeek-V3
  weight ([K, N] per expert: w0|w1 fused, w2)."""
  xla = jax.jit(lambda w: (lambda q, s: (q, q.swapaxes(1, 2), s))(*fp8_quant.quantize_weight_blocks(w)))
  rows = []
  for shape in ((groups, k, n) for k, n in shapes):
    w = (jax.random.normal(jax.random.key(4), shape, jnp.float32) / np.sqrt(shape[1])).astype(jnp.bfloat16)
    xla_ms, want = time_ms(xla, (w,))[0], xla(w)
    for chunk in chunks:
      kernel = jax.jit(lambda w, chunk=chunk: mgpu_fp8_quant.quantize_weight_blocks_both(w, chunk=chunk))
      row = dict(kernel="weight blocks", shape=list(shape), chunk=chunk, ms=time_ms(kernel, (w,))[0], xla_ms=xla_ms)
      row["tbs"] = np.prod(shape) * 4 / row["ms"] / 1e9  # 2 B read, 1 B written twice, a value
      row["e4m3_bytes_differing"] = max(e4m3_disagreement(a, b) for a, b in zip(kernel(w)[:2], want[:2]))
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def e4m3_disagreement(a, b) -> float:
  qa, qb = (np.asarray(jax.tree.leaves(x)[0]).view(np.uint8) for x in (a, b))
  return float(np.mean(qa != qb))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--against", default=None, help="another mgpu_fp8_quant.py, timed beside this one")
  ap.add_argument("--rows", type=int, default=131072)
  ap.add_argument("--groups", type=int, default=32)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  other = load_module(args.against) if args.against else None
  results = []
  for label, k, nbytes, make in cases(args.rows, args.groups):
    x = jax.random.normal(jax.random.key(0), (args.rows, k), jnp.bfloat16)
    x2_ms = time_ms(jax.jit(lambda x: x * 2), (x,))[0]
    x2_tbs = args.rows * k * 4 / x2_ms / 1e9
    fn, fn_args = make(mgpu_fp8_quant)
    row = dict(kernel=label, rows=args.rows, k=k, ms=time_ms(fn, fn_args)[0], x2_tbs=x2_tbs)
    row["tbs"] = nbytes / row["ms"] / 1e9
    if other is not None:
      old_fn, old_args = make(other)
      row["against_ms"] = time_ms(old_fn, old_args)[0]
      row["e4m3_bytes_differing"] = e4m3_disagreement(fn(*fn_args), old_fn(*old_args))
    results.append(row)
    print(json.dumps(row), flush=True)
  weights = weight_rows(args.groups)
  print(f"\n[bench_quant] {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, rows {args.rows}, Zipf-1.2 over {args.groups} groups")
  print(f"{'kernel':14s} {'K':>5s} {'ms':>7s} {'TB/s':>6s} {'of x*2':>7s}" + ("  against ms  speedup  e4m3 differing" if other else ""))
  for r in results:
    print(f"{r['kernel']:14s} {r['k']:5d} {r['ms']:7.3f} {r['tbs']:6.2f} {r['tbs'] / r['x2_tbs']:7.2f}"
          + (f"  {r['against_ms']:10.3f}  {r['against_ms'] / r['ms']:6.2f}x  {r['e4m3_bytes_differing']:.2e}" if other else ""))
  for r in weights:
    print(f"weight blocks {r['shape']} chunk {r['chunk']}: one-pass kernel {r['ms']:.3f} ms "
          f"({r['tbs']:.2f} TB/s), XLA "
          f"{r['xla_ms']:.3f} ms: {r['xla_ms'] / r['ms']:.2f}x, e4m3 bytes differing {r['e4m3_bytes_differing']:.2e}")
  results += weights
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "bench_quant.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
