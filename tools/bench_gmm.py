"""Grouped-GEMM benchmark: every available backend against a dense GEMM of equal FLOPs,
measured in the same run, after a correctness check against a float32 reference.

  python tools/bench_gmm.py --quick --out /tmp/gmm        # the recorded DeepSeek-V3 set
  python tools/bench_gmm.py --shapes up,down --m 16384,131072 --g 8,64 --dists all
  python tools/bench_gmm.py --family all --out /tmp/gmm  # each MoE family's expert shapes (FAMILIES)

Rows per case: backend, pass (fwd = out = x @ w[g]; bwd = dlhs + dW; ffn = up(w0|w1 fused),
SwiGLU, down, forward + backward), median ms, TF/s, ratio to dense. Correctness: fresh
random inputs per case (never zeros), output memory poisoned with NaN just before the call
(a freed buffer of the same size is what the allocator hands out next), relative Frobenius
error vs a per-group float32 reference < 1e-2 and no NaN anywhere (every row written).
Backends: dense (reference), xla (lax.ragged_dot), tokamax (ragged_dot, mosaic), mgpu_jax
(JAX's ragged_dot_mgpu/transposed_ragged_dot_mgpu with our tiling table), mgpu (ours), and the
blockwise-FP8 ones: mgpu_fp8 (our Hopper kernels, with the quantization of both operands inside
the timed call, as a training step pays it) and xla_fp8 (the same quantization emulated in
float32). FP8 rows are held to FP8_TOL, not TOL: their error against the unquantized product is
FP8's own. The expert FFN, FP8 against bf16 (BENCHMARKS.md "FP8 end to end"): `--quick --ffn-only
--backends mgpu,mgpu_fp8` (the ffn rows of both; `tools/gpu_checks.sh fp8-gmm`).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.moe import gmm as gmm_lib  # noqa: E402

SHAPES = {  # name -> (K, N) of one expert's product
    "up_fused": (7168, 4096),  # w0|w1 fused
    "up": (7168, 2048),
    "down": (2048, 7168),
    "tiny": (256, 512),  # CPU smoke test of the script itself
}
# Each MoE family's experts as its one-GPU proxy runs them (configs/bench/<family>-proxy-1xh200.yml): hidden D,
# expert width F, experts G on the GPU, top-k K. --family benchmarks up (D -> F) and down (F -> D) at
# M = proxy_rows (its tokens x K), and the whole expert FFN. Kimi-K2's G is 48, what a GPU holds of its 384 experts
# under the one-node recipe's EP 8 (its 1-GPU proxy keeps 32, DeepSeek-V3's shape).
FAMILIES = {
    "deepseek3": (7168, 2048, 32, 8),
    "qwen3-moe": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
    "gpt-oss": (2880, 2880, 32, 4),
    "llama4": (5120, 8192, 16, 1),
    "kimi-k2": (7168, 2048, 48, 8),
    "deepseek2": (2048, 1408, 64, 6),
}
PROXY_TOKENS = 4 * 4096  # the proxies' batch: 4 sequences of 4,096 tokens
# Proxies that run fewer: GPT-OSS's dot_product attention (its sinks and window) holds 2 sequences.
PROXY_TOKENS_OF = {"gpt-oss": 2 * 4096}


def proxy_rows(family: str) -> int:
  """The routed rows a family's proxy feeds its grouped GEMMs a step: its tokens x top-k."""
  return PROXY_TOKENS_OF.get(family, PROXY_TOKENS) * FAMILIES[family][3]
for _family, (_d, _f, _, _) in FAMILIES.items():
  SHAPES[f"{_family}_up"], SHAPES[f"{_family}_down"] = (_d, _f), (_f, _d)
DISTS = ("balanced", "zipf1.2", "one90", "some_empty")
TOL = 1e-2
# Two e4m3 roundings of ~2.5% rms each: 3.6-3.7% Frobenius per product on Gaussian operands, bound 5%
# as tests/test_fp8.py's. Each FFN output passes through two quantized products and the SwiGLU's
# product rule: 6.3-6.5% measured (xla_fp8 on CPU, three seeds), bound 10%.
FP8_TOL = {"gemm": 5e-2, "ffn": 1e-1}
FP8_BACKENDS = ("mgpu_fp8", "xla_fp8")


def tolerance(backend: str, kind: str = "gemm") -> float:
  return FP8_TOL[kind] if backend in FP8_BACKENDS else TOL


# ------------------------------------------------------------------ group sizes
def group_sizes(dist: str, m: int, g: int, rng: np.random.Generator) -> np.ndarray:
  if dist == "balanced":
    p = np.ones(g)
  elif dist == "zipf1.2":
    p = 1.0 / np.arange(1, g + 1) ** 1.2
    rng.shuffle(p)
  elif dist == "one90":
    p = np.full(g, 0.1 / (g - 1))
    p[rng.integers(g)] = 0.9
  elif dist == "some_empty":
    p = rng.uniform(0.5, 1.5, g)
    p[rng.choice(g, g // 4, replace=False)] = 0.0
  else:
    raise ValueError(f"unknown dist {dist!r}; valid: {DISTS}")
  sizes = np.floor(p / p.sum() * m).astype(np.int64)
  sizes[np.argmax(p)] += m - sizes.sum()
  return sizes.astype(np.int32)


# ------------------------------------------------------------------ backends
# Jitted once per backend and reused by every case: group sizes are traced values, so cases
# of one shape share the compiled kernels (a fresh jit per case recompiled every Mosaic-GPU
# kernel, ~25 s each, and made each case cost 70-140 s on the H200).
def _vjp_pair(gmm_fn, tgmm_fn):
  """Jitted fwd and bwd (dlhs, dW) from a backend's gmm/tgmm primitives."""
  def fwd(x, w, gs):
    return gmm_fn(x, w, gs, transpose_rhs=False)

  def bwd(x, w, gs, dout):
    return gmm_fn(dout, w, gs, transpose_rhs=True), tgmm_fn(x, dout, gs, w.shape[0])
  return jax.jit(fwd), jax.jit(bwd)


def _autodiff_pair(ragged):
  def bwd(x, w, gs, dout):
    _, vjp = jax.vjp(lambda a, b: ragged(a, b, gs), x, w)
    return vjp(dout)
  return jax.jit(ragged), jax.jit(bwd)


_DENSE = {"fwd": jax.jit(lambda a, b: a @ b),
          "bwd": jax.jit(lambda a, b, d: (d @ b.T, a.T @ d))}


def backends(names):
  out = {}
  for name in names:
    if name == "xla":
      out[name] = _autodiff_pair(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs))
    elif name == "xla_vjp":  # ragged_dot composed through the gmm/tgmm VJP (CPU smoke test)
      from MaxText.moe.gmm import xla
      out[name] = _vjp_pair(
          lambda a, w, gs, transpose_rhs: jax.lax.ragged_dot(
              a, jnp.swapaxes(w, 1, 2) if transpose_rhs else w, gs),
          lambda x, d, gs, nl: jax.lax.ragged_dot_general(x, d, gs, xla.TGMM_DIMS))
    elif name == "tokamax":
      try:
        import tokamax
      except ImportError as e:
        print(f"[skip] tokamax: {e} (pip install tokamax==0.0.17)")
        continue
      out[name] = _autodiff_pair(
          lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation="mosaic"))
    elif name in ("mgpu", "mgpu_jax"):
      from MaxText.moe.gmm.mgpu import bf16 as mgpu
      reason = mgpu.unavailable_reason()
      if reason:
        print(f"[skip] {name}: {reason}")
        continue
      if name == "mgpu":
        out[name] = _vjp_pair(
            lambda a, w, gs, transpose_rhs: mgpu.gmm(a, w, gs, transpose_rhs=transpose_rhs),
            lambda x, d, gs, nl: mgpu.tgmm(x, d, gs, num_local_groups=nl))
      else:
        out[name] = _vjp_pair(
            lambda a, w, gs, transpose_rhs: mgpu.jax_ragged_dot(a, w, gs, transpose_rhs=transpose_rhs),
            lambda x, d, gs, nl: mgpu.jax_transposed_ragged_dot(x, d, gs))
    elif name in FP8_BACKENDS:  # blockwise FP8: each call quantizes its operands (MaxText/moe/gmm/fp8_quant.py)
      reason = gmm_lib.unavailable_reason(name)
      if reason:
        print(f"[skip] {name}: {reason}")
        continue
      mod = gmm_lib.resolve_backend(name)
      zero = jnp.int32(0)
      out[name] = _vjp_pair(
          lambda a, w, gs, transpose_rhs, mod=mod: mod.gmm(a, w, gs, group_offset=zero, transpose_rhs=transpose_rhs,
                                                          out_dtype=a.dtype),
          lambda x, d, gs, nl, mod=mod: mod.tgmm(x, d, gs, group_offset=zero, num_local_groups=nl,
                                                 out_dtype=x.dtype))
    elif name == "te":  # Transformer Engine's cuBLAS grouped GEMM through our adapter (MaxText/moe/gmm/te.py)
      from MaxText.moe.gmm import te
      reason = te.unavailable_reason()
      if reason:
        print(f"[skip] te: {reason}")
        continue
      zero = jnp.int32(0)
      out[name] = _vjp_pair(
          lambda a, w, gs, transpose_rhs: te.gmm(a, w, gs, group_offset=zero, transpose_rhs=transpose_rhs,
                                                 out_dtype=a.dtype),
          lambda x, d, gs, nl: te.tgmm(x, d, gs, group_offset=zero, num_local_groups=nl, out_dtype=x.dtype))
    else:
      raise ValueError(f"unknown backend {name!r}")
  return out


# ------------------------------------------------------------------ timing / checking
def time_ms(fn, args, reps=7, target_s=0.05):
  """Median per-call device time: batches of async calls, one sync per batch."""
  out = fn(*args)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  est = time.perf_counter() - t0
  n = max(1, min(50, int(target_s / max(est, 1e-6))))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(n):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / n * 1e3)
  return statistics.median(samples), samples


def poison(shapes_dtypes):
  bufs = [jnp.full(s, jnp.nan, d) for s, d in shapes_dtypes]
  jax.block_until_ready(bufs)
  del bufs


def rel_err(out, ref):
  out = jnp.asarray(out, jnp.float32)
  if bool(jnp.isnan(out).any()):
    return float("nan")
  return float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def _bound(sizes) -> int:
  """Rows each group's product is computed over: the largest group, rounded up to 1024 rows."""
  return max(1024, -(-int(max(sizes)) // 1024) * 1024)


def ref_fwd(x, w, sizes, transpose=False):
  """Per-group float32 products: out[rows of group g] = x[those rows] @ w[g] (w[g].T with transpose), zero rows
  past sum(sizes)."""
  return _ref_fwd(x, w, jnp.asarray(sizes, jnp.int32), _bound(sizes), transpose)


def ref_tgmm(x, dout, sizes):
  """Per-group float32 x[rows of g].T @ dout[rows of g], [G, K, N]."""
  return _ref_tgmm(x, dout, jnp.asarray(sizes, jnp.int32), _bound(sizes))


# One product shape per program: each group's rows are a slice of `rows` rows, masked past the group's size, in a
# loop over the groups. A static slice per group gave XLA a distinct dot shape per group (Zipf sizes: 32 shapes per
# product, each compiled and autotuned) and the expert-FFN case printed no row in 530 s on the H200 (2026-12-03).
@functools.partial(jax.jit, static_argnums=(3, 4))
def _ref_fwd(x, w, sizes_G, rows, transpose):
  hi = jax.lax.Precision.HIGHEST
  starts_G = jnp.cumsum(sizes_G) - sizes_G
  x_pad = jnp.pad(x.astype(jnp.float32), ((0, rows), (0, 0)))
  n = w.shape[1] if transpose else w.shape[2]

  def group(g, out):
    keep = (jnp.arange(rows) < sizes_G[g])[:, None]
    w_g = w[g].astype(jnp.float32)
    prod = jnp.dot(jnp.where(keep, jax.lax.dynamic_slice_in_dim(x_pad, starts_G[g], rows), 0.0),
                   w_g.T if transpose else w_g, precision=hi)
    # Rows past the group's size add zeros to the next group's rows.
    return jax.lax.dynamic_update_slice_in_dim(out, jax.lax.dynamic_slice_in_dim(out, starts_G[g], rows) + prod,
                                               starts_G[g], 0)
  out = jax.lax.fori_loop(0, w.shape[0], group, jnp.zeros((x.shape[0] + rows, n), jnp.float32))
  return out[:x.shape[0]]


@functools.partial(jax.jit, static_argnums=(3,))
def _ref_tgmm(x, dout, sizes_G, rows):
  hi = jax.lax.Precision.HIGHEST
  starts_G = jnp.cumsum(sizes_G) - sizes_G
  x_pad = jnp.pad(x.astype(jnp.float32), ((0, rows), (0, 0)))
  dout_pad = jnp.pad(dout.astype(jnp.float32), ((0, rows), (0, 0)))

  def group(g):
    keep = (jnp.arange(rows) < sizes_G[g])[:, None]
    x_g = jnp.where(keep, jax.lax.dynamic_slice_in_dim(x_pad, starts_G[g], rows), 0.0)
    return jnp.dot(x_g.T, jax.lax.dynamic_slice_in_dim(dout_pad, starts_G[g], rows), precision=hi)
  return jax.lax.map(group, jnp.arange(sizes_G.shape[0]))


# ------------------------------------------------------------------ cases
def run_gemm_case(shape, m, g, dist, bks, passes, seed, rows, check=True):
  k, n = SHAPES[shape]
  rng = np.random.default_rng(seed)
  sizes = group_sizes(dist, m, g, rng)
  key = jax.random.key(seed)
  kx, kw, kd, kdw = jax.random.split(key, 4)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  dout = jax.random.normal(kd, (m, n), jnp.bfloat16)
  gs = jnp.asarray(sizes)
  w_dense = (jax.random.normal(kdw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  label = f"{shape} M={m} G={g} {dist}"
  refs = {}
  if check and "fwd" in passes:
    refs["fwd"] = ref_fwd(x, w, sizes)
  if check and "bwd" in passes:
    refs["dlhs"] = ref_fwd(dout, w, sizes, transpose=True)
    refs["dw"] = ref_tgmm(x, dout, sizes)
  flops = 2.0 * m * k * n
  dense_args = {"fwd": (x, w_dense), "bwd": (x, w_dense, dout)}
  dense_ms = {}
  for p in passes:
    dense_ms[p], _ = time_ms(_DENSE[p], dense_args[p])
    mult = 1 if p == "fwd" else 2
    rows.append(dict(case=label, backend="dense", pass_=p, ms=dense_ms[p],
                     tflops=mult * flops / dense_ms[p] / 1e9, ratio=1.0, err=""))
  for name, (fwd, bwd) in bks.items():
    for p in passes:
      if name == "xla" and p == "bwd" and not ARGS.xla_bwd:
        continue
      if name == "xla" and m * g * k > 2**36:
        continue  # ragged_dot's dense expansion would not fit / takes minutes
      fn = fwd if p == "fwd" else bwd
      args = (x, w, gs) if p == "fwd" else (x, w, gs, dout)
      row = dict(case=label, backend=name, pass_=p)
      try:
        err = ""
        if check:
          poison([((m, n), jnp.bfloat16)] if p == "fwd" else
                 [((m, k), jnp.bfloat16), ((g, k, n), jnp.bfloat16)])
          out = fn(*args)
          if p == "fwd":
            e = rel_err(out, refs["fwd"])
          else:
            e = max(rel_err(out[0], refs["dlhs"]), rel_err(out[1], refs["dw"]))
          err = f"{e:.2e}"
          if not e < tolerance(name):
            err = f"FAIL {err}"
            print(f"[FAIL] {label} {name} {p}: rel err {e} (timed anyway, marked FAIL)")
          del out
        ms, _ = time_ms(fn, args)
        mult = 1 if p == "fwd" else 2
        row.update(ms=ms, tflops=mult * flops / ms / 1e9, ratio=dense_ms[p] / ms, err=err)
      except Exception as e:  # a failing backend must not end the sweep
        traceback.print_exc()
        row.update(ms=float("nan"), tflops=0.0, ratio=0.0, err=f"ERROR {type(e).__name__}")
      rows.append(row)
      print(f"  {label:32s} {name:9s} {p}: {row['ms']:.3f} ms {row['tflops']:.0f} TF/s "
            f"x{row['ratio']:.2f} err {row['err']}", flush=True)


def run_ffn_case(m, g, dist, bks, seed, rows, dims=None):
  """Expert FFN: y = (silu(x@w0) * (x@w1)) @ w2, w0|w1 fused, forward + backward. dims: (model dim, expert dim),
  named in the row (a family's); default --ffn-dims."""
  d, f = dims or map(int, ARGS.ffn_dims.split(","))
  rng = np.random.default_rng(seed)
  sizes = group_sizes(dist, m, g, rng)
  kx, k1, k2, kd = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (m, d), jnp.bfloat16)
  w01 = (jax.random.normal(k1, (g, d, 2 * f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(k2, (g, f, d), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (m, d), jnp.bfloat16)
  gs = jnp.asarray(sizes)
  flops = 3 * 2.0 * m * d * 3 * f
  label = f"ffn{f' {d}->{f}' if dims else ''} M={m} G={g} {dist}"

  def swiglu(h):
    return jax.nn.silu(h[:, :f]) * h[:, f:]

  def ffn_dense(x, w01, w2):
    return swiglu(x @ w01) @ w2

  def make_ffn(fwd, bwd):
    @jax.custom_vjp
    def gmm(a, w, gs):
      return fwd(a, w, gs)

    def gmm_fwd(a, w, gs):
      return fwd(a, w, gs), (a, w, gs)

    def gmm_bwd(res, dout):
      a, w, gs = res
      da, dw = bwd(a, w, gs, dout)
      return da, dw, None
    gmm.defvjp(gmm_fwd, gmm_bwd)
    return lambda x, w01, w2, gs: gmm(swiglu(gmm(x, w01, gs)), w2, gs)

  def fwd_bwd(ffn):
    def run(x, w01, w2, gs, dy):
      y, vjp = jax.vjp(lambda a, b, c: ffn(a, b, c, gs), x, w01, w2)
      return (y,) + vjp(dy)
    return jax.jit(run)

  dense_fn = jax.jit(lambda x, a, b, dy: (lambda y_vjp: (y_vjp[0],) + y_vjp[1](dy))(
      jax.vjp(ffn_dense, x, a, b)))
  wd01, wd2 = w01[0], w2[0]
  t0 = time.perf_counter()
  dense_ms, _ = time_ms(dense_fn, (x, wd01, wd2, dy))
  rows.append(dict(case=label, backend="dense", pass_="ffn", ms=dense_ms,
                   tflops=flops / dense_ms / 1e9, ratio=1.0, err=""))
  print(f"  {label:32s} dense     ffn: {dense_ms:.3f} ms (compiled and timed in {time.perf_counter() - t0:.0f} s)",
        flush=True)
  ref = None
  for name, (fwd, bwd) in bks.items():
    if name == "xla":
      continue
    if name == "tokamax":
      ffn = fwd  # tokamax.ragged_dot is differentiable: use its own VJP
      fn = fwd_bwd(lambda x, a, b, gs: ffn(swiglu(ffn(x, a, gs)), b, gs))
    elif name in gmm_lib.BACKENDS:  # our backends through the block's own custom VJP, as the step runs them (FP8:
      # each weight quantized once, in the forward, and its blocks kept for dlhs)
      fn = fwd_bwd(lambda x, a, b, gs, name=name: gmm_lib.gmm(swiglu(gmm_lib.gmm(x, a, gs, backend=name)), b, gs,
                                                              backend=name))
    else:
      fn = fwd_bwd(make_ffn(fwd, bwd))
    row = dict(case=label, backend=name, pass_="ffn")
    try:
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(x, w01, w2, gs, dy))
      t_first = time.perf_counter() - t0
      if ref is None:
        t0 = time.perf_counter()
        ref = jax.block_until_ready(ffn_reference(x, w01, w2, dy, sizes))
        print(f"  {label:32s} float32 reference in {time.perf_counter() - t0:.0f} s", flush=True)
      e = max(rel_err(o, r) for o, r in zip(out, ref))
      del out
      err = f"{e:.2e}" if e < tolerance(name, "ffn") else f"FAIL {e:.2e}"
      ms, _ = time_ms(fn, (x, w01, w2, gs, dy))
      row.update(ms=ms, tflops=flops / ms / 1e9, ratio=dense_ms / ms, err=err, first_call_s=round(t_first, 1))
    except Exception as e:
      traceback.print_exc()
      row.update(ms=float("nan"), tflops=0.0, ratio=0.0, err=f"ERROR {type(e).__name__}")
    rows.append(row)
    print(f"  {label:32s} {name:9s} ffn: {row['ms']:.3f} ms x{row['ratio']:.2f} {row['err']} "
          f"(first call, its compile included: {row.get('first_call_s', float('nan')):.0f} s)", flush=True)


def ffn_reference(x, w01, w2, dy, sizes):
  """(y, dx, dw01, dw2) of y = (silu(x@w0) * (x@w1)) @ w2 per group in float32, its backward by hand: a few
  products of one shape each (ref_fwd/ref_tgmm), not autodiff through them."""
  f = w2.shape[1]
  x, w01, w2, dy = (a.astype(jnp.float32) for a in (x, w01, w2, dy))
  h = ref_fwd(x, w01, sizes)
  a, b = h[:, :f], h[:, f:]
  s = jax.nn.silu(a) * b
  y = ref_fwd(s, w2, sizes)
  ds = ref_fwd(dy, w2, sizes, transpose=True)
  sig = jax.nn.sigmoid(a)
  dh = jnp.concatenate([ds * b * sig * (1 + a * (1 - sig)), ds * jax.nn.silu(a)], axis=1)
  return y, ref_fwd(dh, w01, sizes, transpose=True), ref_tgmm(x, dh, sizes), ref_tgmm(s, dy, sizes)


def check_edges():
  """mgpu semantics the timed cases don't reach: group_offset (ring EP), rows past
  sum(group_sizes), M not a multiple of the tile, empty groups, transposed rhs, f32 out.
  Prints PASS/FAIL per case; returns the number of failures."""
  from MaxText.moe.gmm.mgpu import bf16 as mgpu
  k, n, fails = 512, 768, 0
  cases = [  # (M, global sizes, group_offset, num_local, transpose, out_dtype)
      (3001, [700, 0, 1300, 1, 0, 999], 0, 6, False, jnp.bfloat16),
      (3001, [700, 0, 1300, 1, 0, 900], 0, 6, False, jnp.bfloat16),  # 101 padding rows
      (3001, [700, 0, 1300, 1, 0, 900], 2, 3, False, jnp.bfloat16),  # ring EP: groups 2..4
      (4096, [0, 0, 4096, 0], 1, 2, True, jnp.bfloat16),
      (2500, [128, 256, 0, 2000], 1, 3, True, jnp.float32),
      (200, [0, 0, 0, 0], 0, 4, False, jnp.bfloat16),  # nothing routed: all zeros
  ]
  for i, (m, sizes, off, nl, transpose, odt) in enumerate(cases):
    key = jax.random.key(1000 + i)
    kx, kw, kd = jax.random.split(key, 3)
    kdim, ndim = (n, k) if transpose else (k, n)  # lhs width, out width
    x = jax.random.normal(kx, (m, kdim), jnp.bfloat16)
    wshape = (nl, ndim, kdim) if transpose else (nl, kdim, ndim)
    w = (jax.random.normal(kw, wshape, jnp.float32) / 16).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    # reference: local groups' rows, zeros elsewhere
    wl = jnp.swapaxes(w, 1, 2) if transpose else w
    pre = sum(sizes[:off])
    full = [pre] + sizes[off:off + nl]
    wref = jnp.concatenate([jnp.zeros((1,) + wl.shape[1:], wl.dtype), wl])
    ref = ref_fwd(x, wref, full)
    d = jax.random.normal(kd, (m, ndim), jnp.bfloat16)
    try:
      poison([((m, ndim), odt)])
      out = jax.jit(lambda x, w, gs: mgpu.gmm(x, w, gs, group_offset=off, transpose_rhs=transpose,
                                               out_dtype=odt))(x, w, gs)
      e = rel_err(out, ref)
      outside = (jnp.arange(m) < pre) | (jnp.arange(m) >= pre + sum(sizes[off:off + nl]))
      zero_ok = bool((jnp.where(outside[:, None], out, 0) == 0).all())
      poison([((nl, kdim, ndim), jnp.bfloat16)])
      dw = jax.jit(lambda x, d, gs: mgpu.tgmm(x, d, gs, group_offset=off, num_local_groups=nl))(x, d, gs)
      dref = ref_tgmm(x, d, full)[1:]
      e2 = rel_err(dw, dref) if float(jnp.linalg.norm(dref)) > 0 else (
          0.0 if bool((dw == 0).all()) else float("inf"))
      ok = (e < TOL or (float(jnp.linalg.norm(ref)) == 0 and bool((out == 0).all()))) \
          and zero_ok and e2 < TOL
      print(f"[{'PASS' if ok else 'FAIL'}] edge{i} M={m} sizes={sizes} off={off} local={nl} "
            f"T={transpose} out={jnp.dtype(odt).name}: gmm err {e:.2e} zeros_ok {zero_ok} "
            f"tgmm err {e2:.2e}", flush=True)
      fails += not ok
    except Exception:
      traceback.print_exc()
      print(f"[FAIL] edge{i}: exception", flush=True)
      fails += 1
  return fails


def save(rows, meta):
  if not ARGS.out or not rows:
    return
  os.makedirs(ARGS.out, exist_ok=True)
  with open(os.path.join(ARGS.out, "results.json"), "w") as fh:
    json.dump(dict(meta=meta, rows=rows), fh, indent=1)
  with open(os.path.join(ARGS.out, "results.csv"), "w", newline="") as fh:
    wr = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))  # rows' keys differ
    wr.writeheader()
    wr.writerows(rows)


def print_table(rows):
  hdr = f"{'case':34s} {'backend':9s} {'pass':4s} {'ms':>9s} {'TF/s':>6s} {'/dense':>6s}  err"
  print(hdr)
  print("-" * len(hdr))
  for r in rows:
    print(f"{r['case']:34s} {r['backend']:9s} {r['pass_']:4s} {r['ms']:9.3f} "
          f"{r['tflops']:6.0f} {r['ratio']:6.2f}  {r['err']}")


def main():
  global ARGS
  # Lines reach a redirected log even when a time limit kills the run.
  sys.stdout.reconfigure(line_buffering=True)
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--quick", action="store_true",
                  help="DeepSeek-V3: up, down at M=65536 G=32 balanced+zipf1.2, fwd+bwd; FFN zipf1.2")
  ap.add_argument("--family", default=None,
                  help=f"comma-separated, or all: each family's up and down at its proxy's M and G, balanced+zipf1.2, "
                       f"fwd+bwd, and its FFN ({', '.join(FAMILIES)}); replaces --shapes/--m/--g/--ffn-dims")
  ap.add_argument("--shapes", default="up_fused,up,down")
  ap.add_argument("--m", default="16384,65536,131072")
  ap.add_argument("--g", default="8,32,64")
  ap.add_argument("--dists", default="all")
  ap.add_argument("--passes", default="fwd,bwd")
  ap.add_argument("--backends", default="xla,tokamax,mgpu_jax,mgpu")
  ap.add_argument("--ffn", action="store_true", help="also the expert FFN fwd+bwd")
  ap.add_argument("--ffn-first", action="store_true", help="run the FFN cases before the GEMMs")
  ap.add_argument("--ffn-only", action="store_true",
                  help="the FFN cases alone (--quick's FFN case for mgpu and mgpu_fp8 had printed nothing after "
                       "330 s on the H200, each backend's six or more Mosaic kernels compiling for it)")
  ap.add_argument("--ffn-dists", default=None, help="FFN distributions (default: --dists)")
  ap.add_argument("--ffn-dims", default="7168,2048", help="model dim, expert dim")
  ap.add_argument("--xla-bwd", action="store_true", help="time ragged_dot autodiff (huge)")
  ap.add_argument("--edge", action="store_true", help="first check mgpu edge semantics")
  ap.add_argument("--deadline-s", type=float, default=None,
                  help="start no new case after this many seconds (each new kernel shape costs "
                       "~25 s of Mosaic-GPU compile on an H200; a fresh --quick case ~200 s)")
  ap.add_argument("--cache-dir", default=None,
                  help="JAX persistent compilation cache (carry it between device calls)")
  ap.add_argument("--no-check", action="store_true")
  ap.add_argument("--out", default=None, help="directory for results.csv / results.json")
  ARGS = ap.parse_args()
  if ARGS.quick:
    ARGS.shapes, ARGS.m, ARGS.g, ARGS.dists = "up,down", "65536", "32", "balanced,zipf1.2"
    ARGS.ffn, ARGS.ffn_dists = True, "zipf1.2"
  gemm_list = [(shape, m, g) for shape in ARGS.shapes.split(",") for m in map(int, ARGS.m.split(","))
               for g in map(int, ARGS.g.split(","))]
  ffn_list = [(m, g, None) for m in map(int, ARGS.m.split(",")) for g in map(int, ARGS.g.split(","))]
  if ARGS.family:
    names = list(FAMILIES) if ARGS.family == "all" else ARGS.family.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
      ap.error(f"unknown family {unknown}; valid: all, {', '.join(FAMILIES)}")
    rows_of = {n: (proxy_rows(n), FAMILIES[n][2]) for n in names}
    gemm_list = [(f"{n}_{side}", *rows_of[n]) for n in names for side in ("up", "down")]
    ffn_list = [(*rows_of[n], FAMILIES[n][:2]) for n in names]
    ARGS.dists, ARGS.ffn = ("balanced,zipf1.2" if ARGS.dists == "all" else ARGS.dists), True
  dists = DISTS if ARGS.dists == "all" else ARGS.dists.split(",")
  if ARGS.cache_dir:
    jax.config.update("jax_compilation_cache_dir", ARGS.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  t_start = time.monotonic()

  def out_of_time():
    over = ARGS.deadline_s is not None and time.monotonic() - t_start > ARGS.deadline_s
    if over:
      print(f"[deadline] {ARGS.deadline_s:.0f} s passed: no further cases", flush=True)
    return over
  bks = backends(ARGS.backends.split(","))
  dev = jax.devices()[0]
  meta = dict(device=dev.device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              argv=sys.argv, backends=list(bks))
  print(meta, flush=True)
  if ARGS.edge:
    print(f"edge failures: {check_edges()}", flush=True)
  rows, seed = [], 0
  def gemm_cases():
    nonlocal seed
    for shape, m, g in gemm_list:
      for dist in dists:
        seed += 1
        if out_of_time():
          raise KeyboardInterrupt
        run_gemm_case(shape, m, g, dist, bks, ARGS.passes.split(","), seed, rows,
                      check=not ARGS.no_check)
        save(rows, meta)

  def ffn_cases():
    nonlocal seed
    ffn_dists = dists if ARGS.ffn_dists is None else ARGS.ffn_dists.split(",")
    for m, g, dims in ffn_list:
      for dist in ffn_dists:
        seed += 1
        if out_of_time():
          raise KeyboardInterrupt
        run_ffn_case(m, g, dist, bks, seed, rows, dims)
        save(rows, meta)

  order = [gemm_cases] + ([ffn_cases] if ARGS.ffn else [])
  if ARGS.ffn_first:
    order.reverse()
  if ARGS.ffn_only:
    order = [ffn_cases]
  try:  # `timeout -s INT` ends a long sweep but still saves and prints what was measured
    for cases in order:
      cases()
  except KeyboardInterrupt:  # deadline, or Ctrl-C / `timeout -s INT` between compiles
    print("[stopped] the table below holds the cases finished so far", flush=True)
  save(rows, meta)
  print_table(rows)


ARGS = None
if __name__ == "__main__":
  main()
