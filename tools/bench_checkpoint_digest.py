"""What the checkpoint digest costs: the guard's pass before each save (non-finite count + digests,
MaxText/checkpoint_records.scan) against the finite check it replaced, on one device, in one run.

  python tools/bench_checkpoint_digest.py [--mib 512] [--reps 7] [--json OUT]

The state is bf16 weights and f32 optimizer moments (a third / two thirds of the bytes, as AdamW with bf16
params keeps them), in arrays of 4-64 MiB. Rows: the old finite check and the guard's pass, each's median ms
and GB/s, and their ratio. The last line scales the measured rate to a 671B recipe's
state per GPU (29.8 GiB: docs/cluster.md's save-grace figure), once per save. Run on CPU here; on a GPU
machine the same command measures the GPU (`JAX_PLATFORMS=cuda`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from MaxText import checkpoint_records  # noqa: E402

STATE_671B_PER_GPU_GIB = 29.8  # a 671B recipe's checkpoint per GPU (docs/cluster.md, one save-grace period)


def state(mib: int) -> list[jax.Array]:
  """bf16 weights and f32 moments, random (a digest's input is bits: zeros would flatter nothing, but be honest)."""
  key = jax.random.key(0)
  arrays, total, size = [], 0, 4
  while total < mib * 2**20:
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float32):
      key, sub = jax.random.split(key)
      n = size * 2**20 // jnp.dtype(dtype).itemsize
      arrays.append(jax.random.normal(sub, (n // 1024, 1024), dtype))
      total += arrays[-1].nbytes
    size = min(size * 2, 64)
  return arrays


def _old_finite_pass(arrays):
  """The guard's finite check before the digest: one all() reduction per array."""
  return jnp.stack([jnp.isfinite(x).all() for x in arrays])


def timed(fn, arrays, reps: int) -> float:
  jax.block_until_ready(fn(arrays))  # compile
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(arrays))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--mib", type=int, default=512)
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--json")
  opts = parser.parse_args()
  arrays = state(opts.mib)
  nbytes = sum(x.nbytes for x in arrays)
  old_s = timed(jax.jit(_old_finite_pass), arrays, opts.reps)
  scan = jax.jit(checkpoint_records._scan)  # pylint: disable=protected-access  # the guard's pass, without the host copy
  both_s = timed(scan, arrays, opts.reps)
  device = jax.devices()[0].device_kind
  gbps = lambda s: nbytes / s / 1e9  # noqa: E731
  rows = {"device": device, "state_mib": nbytes / 2**20, "arrays": len(arrays), "old_finite_ms": old_s * 1e3,
          "finite_and_digest_ms": both_s * 1e3, "ratio_to_old": both_s / old_s, "finite_and_digest_gbps": gbps(both_s),
          "671b_per_gpu_s": STATE_671B_PER_GPU_GIB * 2**30 / (nbytes / both_s)}
  print(f"{device}: state {rows['state_mib']:.0f} MiB in {len(arrays)} arrays")
  print(f"  old finite check (all() per array)   {old_s * 1e3:9.1f} ms  {gbps(old_s):7.2f} GB/s")
  print(f"  the guard's pass (count + digest)    {both_s * 1e3:9.1f} ms  {gbps(both_s):7.2f} GB/s")
  print(f"  the guard's pass takes {both_s / old_s:.2f}x the old finite check's time (one variadic reduction per "
        "array reads it once)")
  print(f"  a 671B recipe's {STATE_671B_PER_GPU_GIB} GiB per GPU at this rate: {rows['671b_per_gpu_s']:.2f} s per save")
  if opts.json:
    with open(opts.json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
