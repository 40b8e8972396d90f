"""Blockwise-FP8 grouped GEMMs on one Hopper GPU (the forward/dlhs kernel and the dW kernel):
PASS/FAIL per edge case, then speed against dense GEMMs of equal FLOPs (bf16 and FP8 through
XLA/cuBLASLt) and our bf16 kernels, all in this process.

  python tools/bench_fp8.py [--check-only] [--dists balanced,zipf1.2] [--out DIR]

Timed per DeepSeek-V3 expert shape (M=65536 rows, G=32): the kernel on operands quantized
beforehand, and the quantization passes on their own (activations to 1x128 tiles, weights to
128x128 blocks plus the transposed copy the forward reads). The up-proj's dlhs has the
down-proj's (K, N), so the two shapes cover the forward and dlhs products. Each timing row carries
the mean SM clock and board power it ran at (`tools/gpu_clock.py`, from nvidia-smi; none on CPU):
sustained GEMMs on the H200 run at its power limit, below the boost clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.moe.gmm import fp8_quant, xla, xla_fp8  # noqa: E402
from MaxText.moe.gmm.mgpu import bf16 as mgpu, fp8 as mgpu_fp8, fp8_quant_kernels as mgpu_fp8_quant, fp8_tgmm as mgpu_fp8_tgmm, schedule as mgpu_schedule  # noqa: E402
from tools import gpu_clock, kernel_timeline  # noqa: E402
from tools.bench_gmm import SHAPES, group_sizes, rel_err, time_ms  # noqa: E402

# Kernel against its own quantization, dequantized, in float32. Within a 128-wide step Hopper's
# FP8 wgmma accumulates with fewer than f32's mantissa bits (DeepSeek-V3 section 3.3.2: about 14;
# the reason for promoting every 128): measured 2.8e-4 on the H200, where the CPU interpreter's
# f32 sum gives 2e-7. Bound 1e-3. A bf16 output adds one bf16 rounding (2^-9 per element): 1e-2.
TOL_SAME_QUANT = {"float32": 1e-3, "bfloat16": 1e-2}


def edge_cases():
  """name -> (m, k, n, sizes, group_offset, num_local, transpose, nan_foreign)."""
  k, n = 512, 768
  return {
      "balanced": (1024, k, n, [256] * 4, 0, 4, False, False),
      "empty_groups": (1024, k, n, [0, 512, 0, 0, 512], 0, 5, False, False),
      "one_hot_expert": (2048, k, n, [8, 1900, 20, 120], 0, 4, False, False),
      "rows_past_groups": (1024, k, n, [100, 300, 37], 0, 3, False, False),
      "ring_2_of_4_nan_foreign": (1024, k, n, [200, 301, 99, 300], 1, 2, False, True),
      "dlhs_transposed": (1024, n, k, [300, 0, 500, 200], 0, 4, True, False),
      "dsv3_up_zipf": (16384, 7168, 2048, None, 0, 32, False, False),
  }


def run_checks(results, tilings=None, names=None):
  """tilings: forward-kernel variants checked on every forward and dlhs case beside the default;
  names: the edge cases to run (all by default)."""
  for name, (m, k, n, sizes, offset, num_local, transpose, nan_foreign) in edge_cases().items():
    if names and name not in names:
      continue
    rng = np.random.default_rng(0)
    if sizes is None:
      sizes = group_sizes("zipf1.2", m, num_local, rng)
    sizes = np.asarray(sizes, np.int32)
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    if nan_foreign:  # rows of groups before the local ones hold NaN: they must not leak
      x = x.at[:int(sizes[:offset].sum())].set(jnp.nan)
    w_shape = (num_local, n, k) if transpose else (num_local, k, n)
    w = (jax.random.normal(kw, w_shape, jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes)
    check_row_quantize(results, name, x)
    for out_dtype in (jnp.float32, jnp.bfloat16):
      got = mgpu_fp8.gmm(x, w, gs, group_offset=offset, transpose_rhs=transpose, out_dtype=out_dtype)
      want = xla_fp8.gmm(x, w, gs, group_offset=offset, transpose_rhs=transpose, out_dtype=jnp.float32)
      lo = int(sizes[:offset].sum())
      local_rows = (lo, lo + int(sizes[offset:offset + num_local].sum()))
      err, outside_zero, ok = against_own_quantization(got, want, local_rows)
      # What FP8 itself costs: against the unquantized product in float32.
      full = xla.gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs, group_offset=offset,
                              transpose_rhs=transpose, out_dtype=jnp.float32)
      fp8_err = rel_err(got, full)
      line = (f"{'PASS' if ok else 'FAIL'} fp8 {name:26s} {jnp.dtype(out_dtype).name:8s} vs own quantization "
              f"{err:.2e}  vs unquantized {fp8_err:.2e}  zeros outside {outside_zero}")
      print(line, flush=True)
      results.append(dict(kind="check", case=name, out_dtype=jnp.dtype(out_dtype).name, ok=ok, err=err,
                          fp8_err=fp8_err))
      for label, tiling in (tilings or {}).items():
        if not tiling.promote:  # the diagnostic's values are wrong by design: timed only
          continue
        check_tiling(results, name, label, tiling, got, want, local_rows, x, w, gs,
                     dict(group_offset=offset, transpose_rhs=transpose, out_dtype=out_dtype))
      if not transpose:
        check_tiles(results, name, x, w, gs, offset, out_dtype, got)
        check_dw(results, name, x, jax.random.normal(kw, (m, n), jnp.bfloat16), gs, offset, num_local, out_dtype)


def against_own_quantization(got, want, local_rows):
  """(error against the same quantization in float32, rows outside [lo, hi) exactly zero, PASS) of a
  forward/dlhs kernel output; the bound is its output dtype's."""
  lo, hi = local_rows
  got32 = np.asarray(got, np.float32)
  err = rel_err(got, want)
  outside_zero = bool((got32[:lo] == 0).all() and (got32[hi:] == 0).all())
  return err, outside_zero, err < TOL_SAME_QUANT[jnp.dtype(got.dtype).name] and outside_zero


def check_tiling(results, name, label, tiling, got_default, want, local_rows, x, w, gs, kw):
  """A variant tiling on the same case: within the same bound of its quantization, zeros outside the
  local rows, and how far from the default tiling (the same wgmma per 128 columns and the same
  promotion order: expected bit for bit)."""
  got = mgpu_fp8.gmm(x, w, gs, tiling=tiling, **kw)
  err, outside_zero, ok = against_own_quantization(got, want, local_rows)
  diff = float(np.nanmax(np.abs(np.asarray(got, np.float32) - np.asarray(got_default, np.float32))))
  dtype = jnp.dtype(kw["out_dtype"]).name
  print(f"{'PASS' if ok else 'FAIL'} fp8 {label} {name:22s} {dtype:8s} vs own quantization {err:.2e}  zeros outside "
        f"{outside_zero}  largest difference from the default tiling {diff:.2e}", flush=True)
  results.append(dict(kind="check", case=f"{label} {name}", out_dtype=dtype, ok=ok, err=err, fp8_err=None))


def check_row_quantize(results, name, x):
  """The one-pass 1x128 row-tile kernel against fp8_quant's (XLA's two passes): the same bytes and scales, NaN
  tiles included."""
  want_q, want_s = _quantize_x(x)
  got_q, got_s = _quantize_x_one_pass(x)
  ok = bool(np.array_equal(np.asarray(got_s), np.asarray(want_s), equal_nan=True)
            and np.array_equal(np.asarray(got_q).view(np.uint8), np.asarray(want_q).view(np.uint8)))
  print(f"{'PASS' if ok else 'FAIL'} fp8 quantize rows {name:22s} one-pass kernel bit-identical to fp8_quant: {ok}",
        flush=True)
  results.append(dict(kind="check", case=f"quantize rows {name}", out_dtype=None, ok=ok, err=None, fp8_err=None))


def check_tiles(results, name, x, w, gs, offset, out_dtype, got):
  """The FP8 dispatch's path (lhs quantized before the dispatch, `gmm(..., lhs_tiles=...)`): the same
  tiles, so the kernel's output must be bit for bit its own quantization's."""
  tiled = mgpu_fp8.gmm(x, w, gs, group_offset=offset, out_dtype=out_dtype, lhs_tiles=fp8_quant.quantize_rows(x))
  diff = float(np.max(np.abs(np.asarray(tiled, np.float32) - np.asarray(got, np.float32))))
  ok = diff == 0.0
  print(f"{'PASS' if ok else 'FAIL'} fp8 tiles {name:20s} {jnp.dtype(out_dtype).name:8s} lhs quantized before "
        f"the dispatch: largest difference {diff:.2e} (bit-identical: 0)", flush=True)
  results.append(dict(kind="check", case=f"tiles {name}", out_dtype=jnp.dtype(out_dtype).name, ok=ok, err=diff,
                      fp8_err=None))


def check_dw(results, name, x, dout, gs, offset, num_local, out_dtype):
  """The FP8 dW kernel on the same case: against its quantization in float32; empty groups exactly 0."""
  kw = dict(group_offset=offset, num_local_groups=num_local)
  got = mgpu_fp8_tgmm.tgmm(x, dout, gs, out_dtype=out_dtype, **kw)
  err = rel_err(got, xla_fp8.tgmm(x, dout, gs, out_dtype=jnp.float32, **kw))
  fp8_err = rel_err(got, xla.tgmm(jnp.nan_to_num(x.astype(jnp.float32)), dout.astype(jnp.float32), gs,
                                  out_dtype=jnp.float32, **kw))
  sizes = np.asarray(gs)[offset:offset + num_local]
  got32 = np.asarray(got, np.float32)
  empty_zero = bool(all((got32[g] == 0).all() for g in range(num_local) if sizes[g] == 0))
  ok = err < TOL_SAME_QUANT[jnp.dtype(out_dtype).name] and empty_zero and not np.isnan(got32).any()
  print(f"{'PASS' if ok else 'FAIL'} fp8 dW {name:23s} {jnp.dtype(out_dtype).name:8s} vs own quantization "
        f"{err:.2e}  vs unquantized {fp8_err:.2e}  empty groups zero {empty_zero}", flush=True)
  results.append(dict(kind="check", case=f"dW {name}", out_dtype=jnp.dtype(out_dtype).name, ok=ok, err=err,
                      fp8_err=fp8_err))
  if out_dtype == jnp.float32:  # the operands' quantization does not depend on the output dtype
    check_dw_quantize(results, name, x, dout, gs, offset, num_local)


def check_dw_quantize(results, name, x, dout, gs, offset, num_local):
  """dW's one-pass quantization kernels against fp8_quant's (XLA's two passes): the same bytes and scales."""
  layout = fp8_quant.group_blocks(gs, offset, num_local, x.shape[0])
  for what, a in (("x", x), ("dout", dout)):
    _same_bytes(results, f"dW quantize {name} {what}", f"fp8 dW quantize {name:23s} {what:4s} one-pass kernel",
                jax.jit(mgpu_fp8_quant.quantize_group_row_blocks)(a, layout),
                jax.jit(fp8_quant.quantize_group_row_blocks)(a, layout))
  # dW's x as the step gives it: the FP8 dispatch's tiles, requantized in one pass
  tiles = fp8_quant.quantize_rows(x)
  values = fp8_quant.dequantize_rows(tiles, tiles.q_MK.shape[1], x.dtype)
  _same_bytes(results, f"dW requantize {name} x tiles", f"fp8 dW requantize {name:21s} x's tiles, one-pass kernel",
              mgpu_fp8_quant.requantize_group_row_blocks(tiles, layout, x.dtype),
              jax.jit(fp8_quant.quantize_group_row_blocks)(values, layout))


def _same_bytes(results, case, label, got, want):
  """One check: a kernel's (e4m3 bytes, f32 scales) equal to fp8_quant's."""
  (got_q, got_s), (want_q, want_s) = got, want
  ok = bool(np.array_equal(np.asarray(got_s), np.asarray(want_s))
            and np.array_equal(np.asarray(got_q).view(np.uint8), np.asarray(want_q).view(np.uint8)))
  print(f"{'PASS' if ok else 'FAIL'} {label} bit-identical to fp8_quant: {ok}", flush=True)
  results.append(dict(kind="check", case=case, out_dtype=None, ok=ok, err=None, fp8_err=None))


def _dense_fp8(x_q, wT_q):
  """cuBLASLt FP8 (XLA's __cublas$lt$matmul$f8): [M, K] e4m3 x [N, K] e4m3 -> bf16, both K-major."""
  return jax.lax.dot_general(x_q, wT_q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def parse_tilings(spec: str | None) -> dict[str, "mgpu_fp8.Fp8Tiling"]:
  """'stages=6,grid_block_n=16;grid_block_n=8' -> {label: Fp8Tiling}: variants timed beside the default."""
  out = {}
  for item in filter(None, (spec or "").split(";")):
    fields = {}
    for pair in item.split(","):
      key, _, value = pair.partition("=")
      if key not in {f.name for f in dataclasses.fields(mgpu_fp8.Fp8Tiling)} or not value.isdigit():
        raise SystemExit(f"--tilings: {pair!r} is not an Fp8Tiling field=integer")
      fields[key] = int(value)
    out[f"mgpu_fp8 [{item}]"] = mgpu_fp8.Fp8Tiling(**fields)
  return out


class Timer:
  """bench_gmm's time_ms, keeping the SM clock and power each timing ran at (`tools/gpu_clock.py`), by label."""

  def __init__(self, clock: gpu_clock.ClockSampler):
    self.clock, self.clocks = clock, {}

  def __call__(self, label, fn, args) -> float:
    jax.block_until_ready(fn(*args))  # the compile outside the window: it runs at the idle clock
    t0 = time.monotonic()
    ms = time_ms(fn, args)[0]
    self.clocks[label] = self.clock.window(t0, time.monotonic())
    return ms


def run_speed(results, dists, tilings):
  with gpu_clock.ClockSampler() as clock:
    _run_speed(results, dists, tilings, Timer(clock))


def _run_speed(results, dists, tilings, timer):
  m, g = 65536, 32
  dense_bf16 = jax.jit(lambda x, w: x @ w)
  dense_fp8 = jax.jit(_dense_fp8)
  mgpu_fwd = jax.jit(lambda x, w, gs: mgpu.gmm(x, w, gs))

  for shape in ("up", "down"):
    k, n = SHAPES[shape]
    x, w, x_q, x_s, w_q, w_s = _operands(m, g, k, n)
    flops = 2.0 * m * k * n
    ref = {"dense bf16": timer("dense bf16", dense_bf16, (x, w[0])),
           "dense fp8": timer("dense fp8", dense_fp8, (x_q, w_q[0]))}
    for dist in dists:
      gs = jnp.asarray(group_sizes(dist, m, g, np.random.default_rng(3)))
      times = dict(ref)
      times["mgpu bf16"] = timer("mgpu bf16", mgpu_fwd, (x, w, gs))
      times["mgpu_fp8"] = timer("mgpu_fp8", _fp8_kernel, (x_q, x_s, w_q, w_s, gs))
      for label, tiling in tilings.items():
        times[label] = timer(label, functools.partial(_fp8_kernel, tiling=tiling), (x_q, x_s, w_q, w_s, gs))
      for label, fn, args in (("quantize x (1x128)", _quantize_x, (x,)),
                              ("quantize x (1x128, one-pass kernel)", _quantize_x_one_pass, (x,)),
                              ("quantize w (128x128, N-major copy)", _quantize_w, (w,))):
        times[label] = timer(label, fn, args)
      err = rel_err(_fp8_kernel(x_q, x_s, w_q, w_s, gs),
                    xla.gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs, group_offset=0,
                                     transpose_rhs=False, out_dtype=jnp.float32))
      times.update(dw_times(x, w, gs, timer))
      for what, ms in times.items():
        clock = timer.clocks.get(what) or {}
        row = dict(kind="speed", case=f"{shape} M={m} G={g} {dist}", what=what, ms=ms,
                   tflops=flops / ms / 1e9 if not what.startswith("quantize") else None,
                   fp8_err=err if what == "mgpu_fp8" else None, sm_mhz=clock.get("sm_mhz"), watts=clock.get("watts"))
        results.append(row)
        print(json.dumps(row), flush=True)


@functools.partial(jax.jit, static_argnames=("tiling", "profile_dir"))
def _fp8_kernel(x_q, x_s, w_q, w_s, gs, tiling=mgpu_fp8.Fp8Tiling(), profile_dir=None):
  """The forward kernel on operands quantized beforehand."""
  table = mgpu_schedule.work_table(gs, 0, w_q.shape[0], x_q.shape[0], tiling.block_m, window_align=8)
  return mgpu_fp8.grouped_matmul_fp8(x_q, x_s, w_q, w_s, table, tiling=tiling, profile_dir=profile_dir)


_quantize_x = jax.jit(fp8_quant.quantize_row_tiles)
_quantize_x_one_pass = jax.jit(mgpu_fp8_quant.quantize_row_tiles)


@jax.jit
def _quantize_w(w):
  q, s = fp8_quant.quantize_blocks(w)
  return q.swapaxes(1, 2), s.swapaxes(1, 2)  # the forward's [G, N, K] copy


def _operands(m, g, k, n):
  """(x, w, x_q, x_s, w_q, w_s): bf16 operands of one expert shape and their quantization, the forward's
  N-major weight copy."""
  kx, kw = jax.random.split(jax.random.key(2))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  return (x, w, *_quantize_x(x), *_quantize_w(w))


# Dense FP8 wgmma on Hopper: 8192 FLOP per cycle per SM (twice bf16's), the kernel's ceiling inside a tile.
FP8_FLOP_PER_CYCLE_SM = 8192


def run_profiles(profile_dir, dists, tilings):
  """The forward and dW kernels once per shape and distribution under Mosaic GPU's on-device profiler: their tile
  scopes (`full_tile`, its `epilogue`, `zero_tile`; dW's `dw_tile`) in thousands of SM cycles (kc;
  tools/kernel_timeline.py), against a tile's MMAs at the tensor cores' FP8 peak (dW's for a group of the mean
  size), and the forward for each --tilings variant. A profiled kernel is slower than the timed one: the shares
  matter, not the total."""
  m, g = 65536, 32
  for shape in ("up", "down"):
    k, n = SHAPES[shape]
    x, _, x_q, x_s, w_q, w_s = _operands(m, g, k, n)
    dout = jax.random.normal(jax.random.key(4), (m, n), jnp.bfloat16)
    for dist in dists:
      gs = jnp.asarray(group_sizes(dist, m, g, np.random.default_rng(3)))
      layout = fp8_quant.group_blocks(gs, 0, g, m)
      dw_operands = (*fp8_quant.quantize_group_row_blocks(x, layout), *fp8_quant.quantize_group_row_blocks(dout, layout),
                     layout.block0_L, layout.blocks_L)
      kernels = {}  # label: (scope, run(profile_dir), a tile's FLOPs)
      for label, tiling in {"full_tile": mgpu_fp8.Fp8Tiling(), **tilings}.items():
        kernels[label] = ("full_tile", functools.partial(
            lambda d, tiling: _fp8_kernel(x_q, x_s, w_q, w_s, gs, tiling=tiling, profile_dir=d), tiling=tiling),
            2 * tiling.block_m * tiling.cta_n * k)
      kernels["dw_tile"] = ("dw_tile", lambda d: jax.jit(functools.partial(
          mgpu_fp8_tgmm.transposed_grouped_matmul_fp8, profile_dir=d))(*dw_operands),
                            2 * mgpu_fp8_tgmm.TILE_M * mgpu_fp8.BLOCK * (m // g))
      for label, (scope, run, tile_flops) in kernels.items():
        slug = "".join(c if c.isalnum() else "_" for c in label)
        summary = _profile(run, os.path.join(profile_dir, f"{shape}_{dist}_{slug}"), f"{shape} {dist} {label}")
        if summary and (tile := summary["scopes"].get(scope)):
          peak_kc = tile_flops / FP8_FLOP_PER_CYCLE_SM / 1000
          print(f"# {shape} {dist}: a {label}'s MMAs at the FP8 peak take {peak_kc:.1f} kc; the median took "
                f"{tile['median_kc']:.1f} kc ({peak_kc / tile['median_kc']:.2f} of peak inside the tile)", flush=True)


def _profile(run, out_dir, label):
  """run(out_dir) once with the profiler on: its trace's summary (printed), or None if none was written."""
  profiled = kernel_timeline.profile_once(run, out_dir)
  if profiled is None:
    print(f"# {label}: no trace written to {out_dir}", flush=True)
    return None
  path, ranges = profiled
  summary = kernel_timeline.summarize(ranges)
  print(kernel_timeline.format_summary(f"{label}: {path}", summary), flush=True)
  return summary


def dw_times(x, w, gs, timer):
  """dW of this case (x^T @ dout per group, the forward's FLOPs): our bf16 kernel, the FP8 kernel on
  operands quantized beforehand, and the two group-aligned 128-row quantization passes. timer: `Timer`."""
  m, n = x.shape[0], w.shape[2]
  dout = jax.random.normal(jax.random.key(4), (m, n), jnp.bfloat16)
  g = w.shape[0]
  bf16 = jax.jit(lambda x, d, gs: mgpu.tgmm(x, d, gs, num_local_groups=g))

  def quantizer(quantize_group_row_blocks):
    """x and dout quantized over the same group-aligned 128-row blocks, in the kernel's argument order."""
    @jax.jit
    def quantize(x, d, gs):
      layout = fp8_quant.group_blocks(gs, 0, g, m)
      return (*quantize_group_row_blocks(x, layout), *quantize_group_row_blocks(d, layout),
              layout.block0_L, layout.blocks_L)
    return quantize

  quantize = quantizer(fp8_quant.quantize_group_row_blocks)
  quantize_one_pass = quantizer(mgpu_fp8_quant.quantize_group_row_blocks)
  kernel = jax.jit(mgpu_fp8_tgmm.transposed_grouped_matmul_fp8)
  quantized = quantize(x, dout, gs)
  tiles = jax.jit(fp8_quant.quantize_rows)(x)
  requantize = jax.jit(lambda tiles, gs: mgpu_fp8_quant.requantize_group_row_blocks(
      tiles, fp8_quant.group_blocks(gs, 0, g, m), x.dtype))
  runs = {"dW mgpu bf16": (bf16, (x, dout, gs)), "dW mgpu_fp8": (kernel, quantized),
          "dW quantize x and dout (128x1)": (quantize, (x, dout, gs)),
          "dW quantize x and dout (one-pass kernel)": (quantize_one_pass, (x, dout, gs)),
          "dW requantize x from its tiles (one-pass kernel)": (requantize, (tiles, gs))}
  return {label: timer(label, fn, args) for label, (fn, args) in runs.items()}


def print_table(results):
  print(f"\n[bench_fp8] {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
  checks = [r for r in results if r["kind"] == "check"]
  if checks:
    print(f"checks: {sum(r['ok'] for r in checks)} PASS, {sum(not r['ok'] for r in checks)} FAIL")
  cases = dict.fromkeys(r["case"] for r in results if r["kind"] == "speed")
  for case in cases:
    rows = {r["what"]: r for r in results if r["kind"] == "speed" and r["case"] == case}
    d16, d8, ours16 = (rows[k]["ms"] for k in ("dense bf16", "dense fp8", "mgpu bf16"))
    f8 = rows["mgpu_fp8"]
    print(f"{case:28s} dense bf16 {d16:.3f} ms | dense fp8 {d8:.3f} ms ({d16 / d8:.2f}x bf16) | "
          f"mgpu bf16 {ours16:.3f} ms | mgpu_fp8 {f8['ms']:.3f} ms {f8['tflops']:.0f} TF/s = "
          f"{d8 / f8['ms']:.2f} of dense fp8, {ours16 / f8['ms']:.2f}x mgpu bf16 | quantize x "
          f"{rows['quantize x (1x128)']['ms']:.3f} ms"
          + (f" (one-pass kernel {one_pass_x['ms']:.3f})"
             if (one_pass_x := rows.get("quantize x (1x128, one-pass kernel)")) else "")
          + f", w {rows['quantize w (128x128, N-major copy)']['ms']:.3f} ms | "
          f"err vs unquantized {f8['fp8_err']:.2e}")
    if clocks := [f"{what} {r['sm_mhz']:.0f}" for what, r in rows.items()
                  if r.get("sm_mhz") and "quantize" not in what]:
      print(f"{'':28s} SM clock while timed, MHz: {', '.join(clocks)}")
    for label in (w for w in rows if w.startswith("mgpu_fp8 [")):
      print(f"{'':28s} {label}: {rows[label]['ms']:.3f} ms = {d8 / rows[label]['ms']:.2f} of dense fp8")
    dw16, dw8 = rows["dW mgpu bf16"]["ms"], rows["dW mgpu_fp8"]["ms"]
    print(f"{'':28s} dW: mgpu bf16 {dw16:.3f} ms | mgpu_fp8 {dw8:.3f} ms = {d8 / dw8:.2f} of dense fp8, "
          f"{dw16 / dw8:.2f}x mgpu bf16 | quantize x and dout: XLA {rows['dW quantize x and dout (128x1)']['ms']:.3f} ms"
          + (f", one-pass kernel {one_pass['ms']:.3f} ms"
             if (one_pass := rows.get("dW quantize x and dout (one-pass kernel)")) else "")
          + (f"; x from its tiles {requant['ms']:.3f} ms"
             if (requant := rows.get("dW requantize x from its tiles (one-pass kernel)")) else ""))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--check-only", action="store_true")
  ap.add_argument("--checks", default=None, help="only these edge cases, ','-separated (default: all)")
  ap.add_argument("--dists", default="balanced,zipf1.2")
  ap.add_argument("--out", default=None)
  ap.add_argument("--profile-dir", default=None,
                  help="last, the forward and dW kernels once per shape and distribution under Mosaic GPU's "
                       "on-device profiler (its traces there, a summary per tile scope printed)")
  ap.add_argument("--profile-dists", default="balanced", help="the distributions --profile-dir profiles")
  ap.add_argument("--tilings", default=None,
                  help="forward-kernel tilings checked and timed beside the default, ';'-separated, e.g. "
                       "'grid_block_n=16;stages=6,grid_block_n=16'")
  args = ap.parse_args()
  results = []
  tilings = parse_tilings(args.tilings)
  names = args.checks.split(",") if args.checks else None
  if unknown := sorted(set(names or ()) - set(edge_cases())):
    raise SystemExit(f"--checks: no edge case {', '.join(unknown)} (cases: {', '.join(edge_cases())})")
  run_checks(results, tilings, names)
  if not args.check_only:
    run_speed(results, args.dists.split(","), tilings)
  print_table(results)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "bench_fp8.json").write_text(json.dumps(results, indent=1))
  if args.profile_dir:  # last: a profiled kernel compiles separately, and a failure there must lose nothing
    run_profiles(args.profile_dir, args.profile_dists.split(","), tilings)
  return 0 if all(r["ok"] for r in results if r["kind"] == "check") else 1


if __name__ == "__main__":
  sys.exit(main())
