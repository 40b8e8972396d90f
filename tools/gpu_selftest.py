#!/usr/bin/env python3
"""GPU self-test of the grouped-GEMM backends (MaxText/moe/gmm) against a float32 reference.

    PYTHONPATH=. python3 tools/gpu_selftest.py            # every backend available here
    python3 tools/gpu_selftest.py --backends tokamax,mgpu
    python3 tools/gpu_selftest.py --cpu-smoke             # xla and xla_fp8, small cases, on CPU

For each backend (xla as the reference path, then tokamax, mgpu, te, mgpu_fp8 where
they can run) and each case it runs the public, differentiable `gmm` under jit,
forward and backward (dlhs, drhs through the custom VJP), in bf16, and prints
PASS/FAIL per case and a table at the end. A case passes when:
  * every row of the local groups is finite and within relative error 1e-2 of a
    float32 reference computed group by group (max |err| / max |ref|); for the FP8
    backends, of the same blockwise quantization in float32 (xla_fp8);
  * every other row (padding, other shards' groups) is exactly zero, although
    lhs holds NaN in those rows and the allocator was filled with NaN first;
  * dlhs and drhs meet the same bound and are finite.
Inputs are fresh random normals (never zeros). Exit status 1 if any case fails, 3 if
--deadline-s left cases unrun, 0 only when every case ran and passed.

Imports only jax, numpy and our MaxText.moe.gmm (never upstream maxtext), so it
runs in the bare GPU image with the repository on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-2  # bf16 inputs and outputs, float32 accumulation
# Blockwise-FP8 backends are held to their quantization, not to the unquantized product (3.6% away by
# design, docs/fp8.md "Accuracy"): the reference is xla_fp8's, the same tiles and blocks in float32, and the
# bound the same 1e-2 (bf16 outputs; the FP8 MMA's own accumulation adds ~3e-4: BENCHMARKS.md "FP8 kernels").
FP8_BACKENDS = ("mgpu_fp8", "xla_fp8")


@dataclasses.dataclass(frozen=True)
class Case:
  """A problem: rows per global group (sum may be < M), and the local groups' range."""

  name: str
  group_sizes: tuple[int, ...]
  num_rows: int
  k: int
  n: int
  num_local: int | None = None
  group_offset: int = 0

  @property
  def local(self) -> int:
    return self.num_local or len(self.group_sizes)


def _split(rows: int, weights) -> tuple[int, ...]:
  """`rows` split over groups in proportion to weights (exact sum)."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  w = np.asarray(weights, np.float64) / np.sum(weights)
  sizes = np.floor(w * rows).astype(int)
  sizes[np.argmax(w)] += rows - sizes.sum()
  return tuple(int(s) for s in sizes)


def small_cases() -> list[Case]:
  return [
      Case("balanced", (4, 4, 4, 4), 16, 8, 6),
      Case("empty_groups", (5, 0, 0, 6), 11, 8, 6),
      Case("all_rows_one_group", (0, 0, 12, 0), 12, 8, 6),
      Case("padding_rows", (3, 2, 4, 1), 16, 8, 6),
      Case("m37_untiled", (10, 0, 20, 5), 37, 64, 48),
      Case("ring_offset_2_of_4", (5, 3, 6, 2), 20, 64, 48, num_local=2, group_offset=2),
      Case("m1000_k320_n200", _split(1000, [3, 1, 0, 5, 2, 7, 1, 1]), 1000, 320, 200),
  ]


def deepseek_v3_cases() -> list[Case]:
  """DeepSeek-V3 expert shapes: 8192 rows (tokens x top-k), 32 experts."""
  zipf = [1.0 / (r + 1) ** 1.2 for r in range(32)]
  hot = [0.9 * 31] + [0.1] * 31  # one expert takes 90%
  some_empty = [0 if g % 4 == 1 else 1 for g in range(32)]
  return [
      Case("dsv3_up_balanced", _split(8192, [1] * 32), 8192, 7168, 2048),
      Case("dsv3_up_zipf1.2", _split(8192, zipf), 8192, 7168, 2048),
      Case("dsv3_down_zipf1.2", _split(8192, zipf), 8192, 2048, 7168),
      Case("dsv3_up_one_expert_90pct", _split(8192, hot), 8192, 7168, 2048),
      Case("dsv3_up_empty_and_padding", _split(7000, some_empty), 8192, 7168, 2048),
      Case("dsv3_up_ring_16_of_32", _split(8192, zipf), 8192, 7168, 2048, num_local=16, group_offset=16),
  ]


def run_case(gmm_lib, backend: str, case: Case, seed: int) -> dict[str, float]:
  """Relative errors of out, dlhs, drhs; raises AssertionError on a broken row."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  sizes = np.asarray(case.group_sizes)
  ends = np.cumsum(sizes)
  starts = ends - sizes
  local_groups = range(case.group_offset, case.group_offset + case.local)
  local_M = np.zeros(case.num_rows, bool)
  for g in local_groups:
    local_M[starts[g]:ends[g]] = True

  keys = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(keys[0], (case.num_rows, case.k), jnp.float32)
  lhs = jnp.where(jnp.asarray(local_M)[:, None], lhs, jnp.nan).astype(jnp.bfloat16)  # poisoned rows
  rhs = (jax.random.normal(keys[1], (case.local, case.k, case.n), jnp.float32) / np.sqrt(case.k)).astype(jnp.bfloat16)
  dout = jax.random.normal(keys[2], (case.num_rows, case.n), jnp.float32).astype(jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)

  def fwd_bwd(lhs, rhs, dout):
    out, vjp = jax.vjp(
        lambda l, r: gmm_lib.gmm(l, r, gs, backend=backend, group_offset=case.group_offset), lhs, rhs
    )
    return (out, *vjp(dout))

  fn = jax.jit(fwd_bwd)
  # Fill the allocator with NaN so that an output row the kernel never writes shows up.
  poison = [jnp.full(x.shape, jnp.nan, x.dtype) for x in (lhs, rhs, dout, dout)]
  jax.block_until_ready(poison)
  del poison
  out, dlhs, drhs = (np.asarray(x.astype(jnp.float32)) for x in jax.block_until_ready(fn(lhs, rhs, dout)))

  if backend in FP8_BACKENDS:  # the same quantization, in float32 (bf16 inputs are exact in f32)
    def fp8_reference(lhs, rhs, dout):
      out, vjp = jax.vjp(lambda l, r: gmm_lib.gmm(l, r, gs, backend="xla_fp8", group_offset=case.group_offset),
                         lhs, rhs)
      return (out, *vjp(dout))

    want_out, want_dlhs, want_drhs = (np.asarray(x) for x in jax.jit(fp8_reference)(
        *(x.astype(jnp.float32) for x in (lhs, rhs, dout))))
  else:
    want_out, want_dlhs, want_drhs = _reference(lhs, rhs, dout, local_groups, starts, ends, out.shape, drhs.shape)

  for name, got in (("out", out), ("dlhs", dlhs)):
    outside = got[~local_M]
    assert np.all(outside == 0), f"{name}: {np.sum(np.any(outside != 0, axis=-1))} rows outside the local groups not zero"
    assert np.all(np.isfinite(got)), f"{name}: {np.sum(~np.isfinite(got))} non-finite values"
  assert np.all(np.isfinite(drhs)), f"drhs: {np.sum(~np.isfinite(drhs))} non-finite values"
  return {name: _rel_err(got, want) for name, got, want in
          (("out", out, want_out), ("dlhs", dlhs, want_dlhs), ("drhs", drhs, want_drhs))}


def _reference(lhs, rhs, dout, local_groups, starts, ends, out_shape, drhs_shape):
  """float32 out, dlhs, drhs, one dense GEMM per local group (bf16-rounded inputs), on the host:
  on the device every group's row count is a new shape to compile and autotune (the first
  DeepSeek-V3 case took 389 s on the H200 that way)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  lhs32, rhs32, dout32 = (np.asarray(x.astype(jnp.float32)) for x in (lhs, rhs, dout))
  want_out = np.zeros(out_shape, np.float32)
  want_dlhs = np.zeros(lhs32.shape, np.float32)
  want_drhs = np.zeros(drhs_shape, np.float32)
  for i, g in enumerate(local_groups):
    s, e = int(starts[g]), int(ends[g])
    if e > s:
      want_out[s:e] = lhs32[s:e] @ rhs32[i]
      want_dlhs[s:e] = dout32[s:e] @ rhs32[i].T
      want_drhs[i] = lhs32[s:e].T @ dout32[s:e]
  return want_out, want_dlhs, want_drhs


def _rel_err(got, want) -> float:
  import numpy as np  # pylint: disable=import-outside-toplevel

  scale = float(np.max(np.abs(want)))
  err = float(np.max(np.abs(got.astype(np.float64) - want)))
  return err / scale if scale > 0 else err  # all-zero reference: any value is an absolute error


def _override_fwd_tilings(spec: str) -> None:
  """Apply 'field=int,...' to every forward tiling mgpu looks up (table and default)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from MaxText.moe.gmm.mgpu import tiling as mgpu_tiling  # pylint: disable=import-outside-toplevel

  fields = {f.name for f in dataclasses.fields(mgpu_tiling.FwdTiling)}
  changes = {}
  for item in spec.split(","):
    key, _, value = item.partition("=")
    if key not in fields or not value.lstrip("-").isdigit():
      raise SystemExit(f"--fwd-tiling: {item!r} is not field=integer; fields: {sorted(fields)}")
    changes[key] = int(value)
  fwd = lambda t: dataclasses.replace(t, **changes) if isinstance(t, mgpu_tiling.FwdTiling) else t
  mgpu_tiling.TABLE.update({key: fwd(t) for key, t in mgpu_tiling.TABLE.items()})
  mgpu_tiling.DEFAULTS["fwd"] = fwd(mgpu_tiling.DEFAULTS["fwd"])
  print(f"forward tilings with {changes}")


def main(argv=None) -> int:
  # Lines reach a redirected log even when a time limit kills the run.
  sys.stdout.reconfigure(line_buffering=True)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--backends", default="xla,tokamax,mgpu,te,mgpu_fp8", help="comma-separated; default: all")
  parser.add_argument("--cpu-smoke", action="store_true", help="xla and xla_fp8 only, small cases, on CPU")
  parser.add_argument("--skip-large", action="store_true", help="leave out the DeepSeek-V3 shapes")
  parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
  parser.add_argument("--deadline-s", type=float, default=None,
                      help="start no case after this many seconds (cases not run print 'not run'); a case at "
                           "DeepSeek-V3 size costs ~40-80 s on a fresh machine, mostly compilation")
  parser.add_argument("--fwd-tiling", default=None,
                      help="mgpu: replace the table's forward tilings' fields, e.g. 'chain=1,stages=4', "
                           "to check a tiling on the GPU before it becomes the table's")
  parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000, help="inputs' seed (default: fresh)")
  args = parser.parse_args(argv)
  started = time.monotonic()
  if args.cpu_smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"  # before jax initializes its backends
  sys.path.insert(0, REPO)
  import jax  # pylint: disable=import-outside-toplevel
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  if args.fwd_tiling:
    _override_fwd_tilings(args.fwd_tiling)
  backends = ["xla", "xla_fp8"] if args.cpu_smoke else [b.strip() for b in args.backends.split(",") if b.strip()]
  cases = small_cases() + ([] if args.cpu_smoke or args.skip_large else deepseek_v3_cases())
  if args.cases:
    by_name = {c.name: c for c in small_cases() + deepseek_v3_cases()}
    wanted = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
      parser.error(f"unknown case(s) {unknown}; valid: {', '.join(by_name)}")
    cases = [by_name[n] for n in wanted]
  print(f"jax {jax.__version__}, devices: {[d.device_kind for d in jax.devices()]}, seed {args.seed}")

  results: dict[tuple[str, str], str] = {}
  for backend in backends:
    reason = gmm_lib.unavailable_reason(backend)
    if reason is not None:
      print(f"SKIP {backend}: unavailable here: {reason}")
      for case in cases:
        results[backend, case.name] = "n/a"
      continue
    for i, case in enumerate(cases):
      if args.deadline_s is not None and time.monotonic() - started > args.deadline_s:
        results[backend, case.name] = "not run"
        continue
      start = time.perf_counter()
      try:
        errs = run_case(gmm_lib, backend, case, args.seed + i)
        ok = all(e < TOLERANCE for e in errs.values())
        detail = " ".join(f"{k}={v:.2e}" for k, v in errs.items())
      except Exception as e:  # pylint: disable=broad-exception-caught
        ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        traceback.print_exc(limit=3)
      results[backend, case.name] = "PASS" if ok else "FAIL"
      took = time.perf_counter() - start
      print(f"{'PASS' if ok else 'FAIL'} {backend:8s} {case.name:28s} {detail} ({took:.1f} s)", flush=True)

  width = max(len(c.name) for c in cases)
  print("\n" + "case".ljust(width) + "".join(f"  {b:>8s}" for b in backends))
  for case in cases:
    print(case.name.ljust(width) + "".join(f"  {results[b, case.name]:>8s}" for b in backends))
  failed = [k for k, v in results.items() if v == "FAIL"]
  not_run = sum(v == "not run" for v in results.values())
  verdict = f"{len(failed)} FAILED" if failed else (f"INCOMPLETE: {not_run} not run" if not_run else "ALL PASS")
  print(f"\n{verdict} ({sum(v == 'PASS' for v in results.values())} pass, {len(failed)} fail, "
        f"{sum(v == 'n/a' for v in results.values())} n/a, {not_run} not run before --deadline-s)")
  return 1 if failed else (3 if not_run else 0)  # an incomplete check is not a pass


if __name__ == "__main__":
  sys.exit(main())
