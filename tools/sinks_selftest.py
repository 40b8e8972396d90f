#!/usr/bin/env python3
"""GPU self-test of attention with sinks (MaxText/attention/sinks.py) against a float32 reference.

    PYTHONPATH=. python3 tools/sinks_selftest.py                 # kernel cudnn (jax's cuDNN + our custom VJP)
    python3 tools/sinks_selftest.py --kernels cudnn,te           # and Transformer Engine's learnable softmax
    python3 tools/sinks_selftest.py --cpu-smoke                  # kernel xla, small cases, on CPU

Each case runs the kernel under jit in bf16, forward and backward, and compares the output and dq, dk, dv and
the sinks' gradient with upstream's dot_product formulation (the sink logit concatenated to the scores) in
float32 on the same bf16-rounded inputs: a case passes when each is finite and within relative error 2e-2
(max |err| / max |ref|). Cases: GPT-OSS's heads (64 query and 8 KV heads of 64), causal and with its window
of 128, sinks drawn N(0, 1), -inf (plain attention) and 10 (a sink that takes most of each row). Each PASS/FAIL
line also gives the kernel's forward + backward time next to the dense reference's in bf16 (upstream's
dot_product, which keeps the [B, N, T, T] scores). Exit 0 when every case passes, 1 if one fails, 2 when the
kernels cannot run here (no GPU, or TE asked for and missing): one line says why.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 2e-2  # bf16 inputs, outputs and cotangents; float32 statistics
N, K, H = 64, 8, 64  # GPT-OSS-20B: query heads, KV heads, head size
GPT_OSS_WINDOW = 128


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  batch: int
  seq: int
  window: int | None
  sink: str  # random | minus_inf | dominant
  heads: tuple[int, int, int] = (N, K, H)


def gpu_cases() -> list[Case]:
  return [Case(f"T{t}_{'w' + str(GPT_OSS_WINDOW) if w else 'causal'}_{s}", b, t, w, s)
          for b, t in ((2, 1024), (1, 4096)) for w in (None, GPT_OSS_WINDOW) for s in ("random",)] + [
      Case("T1024_w128_minus_inf", 2, 1024, GPT_OSS_WINDOW, "minus_inf"),
      Case("T1024_causal_dominant", 2, 1024, None, "dominant")]


def smoke_cases() -> list[Case]:
  return [Case("smoke_causal_random", 2, 16, None, "random", (4, 2, 8)),
          Case("smoke_w5_dominant", 1, 16, 5, "dominant", (4, 1, 8))]


def dense_attention_with_sinks(q_BTNH, k_BSKH, v_BSKH, sinks_N, *, scale, window):
  """Upstream's dot_product formulation (tests/sinks_reference.py's copy: this script runs without tests/)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  b, t, n, _ = q_BTNH.shape
  groups = n // k_BSKH.shape[2]
  dtype = q_BTNH.dtype
  k_BSNH, v_BSNH = jnp.repeat(k_BSKH, groups, axis=2), jnp.repeat(v_BSKH, groups, axis=2)
  s_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH, preferred_element_type=jnp.float32) * scale
  t_pos, s_pos = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  visible_TS = (s_pos <= t_pos) & (True if window is None else s_pos > t_pos - window)
  s_BNTS = jnp.where(visible_TS, s_BNTS, -jnp.inf)
  sink_BNT1 = jnp.broadcast_to(sinks_N.astype(jnp.float32)[None, :, None, None], (b, n, t, 1))
  p_BNTS = jax.nn.softmax(jnp.concatenate([s_BNTS, sink_BNT1], axis=-1), axis=-1)[..., :-1]
  return jnp.einsum("bnts,bsnh->btnh", p_BNTS.astype(dtype), v_BSNH, preferred_element_type=jnp.float32).astype(dtype)


def _operands(case: Case, seed: int):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  n, k, h = case.heads
  rng = np.random.default_rng(seed)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)  # noqa: E731
  sinks_N = {"random": rng.standard_normal(n).astype(np.float32), "minus_inf": np.full(n, -np.inf, np.float32),
             "dominant": np.full(n, 10.0, np.float32)}[case.sink]
  b, t = case.batch, case.seq
  return draw(b, t, n, h), draw(b, t, k, h), draw(b, t, k, h), jnp.asarray(sinks_N), draw(b, t, n, h)


def _fwd_bwd(attention):
  import jax  # pylint: disable=import-outside-toplevel

  def value_and_grads(q, k, v, sinks_N, ct):
    out, vjp = jax.vjp(attention, q, k, v, sinks_N)
    return (out, *vjp(ct))

  return jax.jit(value_and_grads)


def _median_ms(fn, args, reps: int = 5) -> float:
  import jax  # pylint: disable=import-outside-toplevel

  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * sorted(times)[len(times) // 2]


def run_case(kernel: str, case: Case, seed: int) -> tuple[dict[str, float], float, float]:
  """(relative errors by name, kernel's fwd+bwd ms, bf16 dense reference's fwd+bwd ms)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from MaxText.attention import sinks  # pylint: disable=import-outside-toplevel

  scale = case.heads[2] ** -0.5
  args = _operands(case, seed)
  ours = _fwd_bwd(lambda *a: sinks.attention_with_sinks(*a, scale=scale, window=case.window, kernel=kernel))
  dense = _fwd_bwd(lambda *a: dense_attention_with_sinks(*a, scale=scale, window=case.window))
  got = ours(*args)
  f32 = [a.astype(jnp.float32) for a in args]
  want = dense(*f32)
  errors = {}
  for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    errors[name] = float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)) if np.isfinite(g).all() else float("inf")
  return errors, _median_ms(ours, args), _median_ms(dense, args)


def main(argv=None) -> int:
  sys.stdout.reconfigure(line_buffering=True)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", default="cudnn", help="comma-separated: cudnn, te (default: cudnn)")
  parser.add_argument("--cpu-smoke", action="store_true", help="kernel xla only, small cases, on CPU")
  parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000, help="inputs' seed (default: fresh)")
  args = parser.parse_args(argv)
  if args.cpu_smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"  # before jax initializes its backends
  sys.path.insert(0, REPO)
  import jax  # pylint: disable=import-outside-toplevel
  from MaxText.attention import sinks, sinks_te  # pylint: disable=import-outside-toplevel

  kernels = ["xla"] if args.cpu_smoke else [k.strip() for k in args.kernels.split(",") if k.strip()]
  unknown = [k for k in kernels if k not in sinks.KERNELS]
  if unknown:
    parser.error(f"unknown kernel(s) {unknown}; valid: {', '.join(sinks.KERNELS)}")
  if not args.cpu_smoke and jax.default_backend() != "gpu":
    print(f"sinks_selftest: no GPU here (JAX's backend is {jax.default_backend()}); run it on an NVIDIA GPU, "
          "or --cpu-smoke for the XLA kernel on CPU")
    return 2
  if "te" in kernels and sinks_te.unavailable_reason():
    print(f"sinks_selftest: {sinks_te.unavailable_reason()}")
    return 2
  cudnn = "n/a"
  if not args.cpu_smoke:
    from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=import-outside-toplevel
    cudnn = fa.check_cudnn_version()
  print(f"jax {jax.__version__}, cuDNN {cudnn}, devices: {[d.device_kind for d in jax.devices()]}, seed {args.seed}")

  cases = smoke_cases() if args.cpu_smoke else gpu_cases()
  failed = 0
  for kernel in kernels:
    for i, case in enumerate(cases):
      start = time.perf_counter()
      try:
        errors, ms, dense_ms = run_case(kernel, case, args.seed + i)
        ok = all(e <= TOLERANCE for e in errors.values())
        detail = " ".join(f"{k}={v:.2e}" for k, v in errors.items()) + f"  fwd+bwd {ms:.2f} ms, dense {dense_ms:.2f} ms"
      except Exception as e:  # pylint: disable=broad-exception-caught
        ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
      failed += not ok
      print(f"{'PASS' if ok else 'FAIL'} {kernel:6s} {case.name:24s} {detail} ({time.perf_counter() - start:.1f} s)")
  total = len(kernels) * len(cases)
  print(f"\n{'ALL PASS' if not failed else f'{failed} FAILED'} ({total - failed} pass, {failed} fail)")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
