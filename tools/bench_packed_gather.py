#!/usr/bin/env python3
"""The FP8 dispatch's moved rows: pack -> the local dispatcher's gather -> unpack, with the packed row in words of
uint8 or uint32 (`fp8_dispatch.pack`'s `word`), on this device.

  python3 tools/bench_packed_gather.py [--tokens 16384] [--top-k 8] [--experts 32] [--dim 7168]

Why: a profile of the proxy's FP8 step (2026-12-03) had XLA gathering the packed rows byte by byte, at about
0.8 TB/s (1.2-1.46 ms a gather at [131,072, 7,392] bytes); the result is in BENCHMARKS.md "Dispatch and expert
parallelism". Each case is one jit that
reads the T token rows' tiles (already quantized) and writes the M = T x top-k rows' e4m3 bytes and f32 scales,
as the step's dispatch does, then again with the backward's select of routed rows on the words. The results are
checked bit for bit against the uint8 path. Prints one table last: ms per gather and the bytes written per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.moe import dispatch, fp8_dispatch
from MaxText.moe.gmm import fp8_quant

WORDS = {"uint8": jnp.uint8, "uint32": jnp.uint32}


def moved(dispatcher, k_padded: int, weighted: bool):
  def run(packed_TW, ids_TK, weight_M1):
    packed_MW, _ = dispatcher.dispatch(packed_TW, ids_TK)
    routed = weight_M1 != 0
    if weighted:  # the backward's (fp8_dispatch._weighted_cotangent_tiles): rows no slot points at become zeros
      packed_MW = jnp.where(routed, packed_MW, jnp.zeros((), packed_MW.dtype))
    tiles = fp8_dispatch.unpack(packed_MW, k_padded)
    if weighted:  # ... of scale 1
      return tiles.q_MK, jnp.where(routed, tiles.scale_MKb * weight_M1, 1.0)
    return tiles
  return jax.jit(run)


def time_ms(fn, args, reps=20):
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / reps * 1e3)
  return statistics.median(samples)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--top-k", type=int, default=8)
  ap.add_argument("--experts", type=int, default=32)
  ap.add_argument("--dim", type=int, default=7168)
  args = ap.parse_args(argv)
  if args.dim % fp8_quant.BLOCK:
    raise SystemExit(f"bench_packed_gather: --dim {args.dim} must be a multiple of {fp8_quant.BLOCK}")
  kx, ki = jax.random.split(jax.random.key(0))
  tiles = fp8_quant.quantize_rows(jax.random.normal(kx, (args.tokens, args.dim), jnp.bfloat16))
  ids_TK = jnp.argsort(jax.random.uniform(ki, (args.tokens, args.experts)), axis=1)[:, :args.top_k].astype(jnp.int32)
  rows = args.tokens * args.top_k
  weight_M1 = jnp.ones((rows, 1), jnp.float32).at[::7].set(0.0)
  dispatcher = dispatch.make("local", num_experts=args.experts)
  written = rows * args.dim * (1 + 4 / fp8_quant.BLOCK)
  table, reference = [], {}
  for weighted in (False, True):
    for name, word in WORDS.items():
      fn = moved(dispatcher, args.dim, weighted)
      fn_args = (fp8_dispatch.pack(tiles, word), ids_TK, weight_M1)
      out = [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(fn(*fn_args))]
      same = all((a == b).all() for a, b in zip(out, reference.setdefault(weighted, out)))
      ms = time_ms(fn, fn_args)
      table.append((("backward (weighted) " if weighted else "forward ") + name, ms, written / ms / 1e9, same))
      print(f"{'PASS' if same else 'FAIL'} {table[-1][0]}: bit for bit the uint8 path's", flush=True)
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}: {args.tokens} tokens x top-{args.top_k} -> "
        f"[{rows}, {args.dim}] e4m3 rows and their scales")
  print(f"{'case':34s} {'ms':>8s} {'TB/s written':>13s}")
  for case, ms, tbs, _ in table:
    print(f"{case:34s} {ms:8.3f} {tbs:13.2f}")
  return 0 if all(t[3] for t in table) else 1


if __name__ == "__main__":
  raise SystemExit(main())
