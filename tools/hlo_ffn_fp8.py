"""The expert FFN's forward and backward with FP8 experts (the block's gmm and its custom VJP, backend mgpu_fp8),
compiled for one H200 on this machine without a GPU (MaxText/plan/gpu_target.py: needs scripts/bootstrap.sh --gpu-plan),
its optimized HLO written to a file: where the weights are quantized and transposed (the grep below lists each
weight's amax, quantize and transpose fusions).

  python tools/hlo_ffn_fp8.py OUT.hlo [--m 65536] [--g 32]
  grep -E "^  %[a-z_.0-9]+ = [^ ]+ fusion\\(.*%w(01|2)\\.1[,)]|^  %input_transpose_fusion[.0-9]* = f8e4m3fn" OUT.hlo

Shapes are bench_gmm's FFN case (d = 7,168, f = 2,048, w0|w1 fused); its times are in BENCHMARKS.md "FP8 end to end".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from MaxText.plan import gpu_target  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--m", type=int, default=65536)
  ap.add_argument("--g", type=int, default=32)
  args = ap.parse_args()
  if reason := gpu_target.unavailable_reason("h200"):
    raise SystemExit(f"hlo_ffn_fp8: cannot compile for an H200 here: {reason}")
  devices = gpu_target.enter("h200", 1, 8)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  m, g, d, f = args.m, args.g, 7168, 2048

  def run(x, w01, w2, gs, dy):
    def ffn(a, b, c):
      h = gmm_lib.gmm(a, b, gs, backend="mgpu_fp8")
      return gmm_lib.gmm(jax.nn.silu(h[:, :f]) * h[:, f:], c, gs, backend="mgpu_fp8")
    y, vjp = jax.vjp(ffn, x, w01, w2)
    return (y,) + vjp(dy)

  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  shapes = (((m, d), jnp.bfloat16), ((g, d, 2 * f), jnp.bfloat16), ((g, f, d), jnp.bfloat16), ((g,), jnp.int32),
            ((m, d), jnp.bfloat16))
  specs = [jax.ShapeDtypeStruct(s, t, sharding=sharding) for s, t in shapes]
  Path(args.out).write_text(jax.jit(run).trace(*specs).lower().compile().as_text())
  print(f"hlo_ffn_fp8: {args.out}")


if __name__ == "__main__":
  main()
