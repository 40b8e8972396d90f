"""Where XLA's GPU scheduler puts the EP exchange under the plain accumulation loop and under combined 1F1B
(MaxText/accumulate/combined_1f1b.py), on a compiled schedule for compile-only GPUs: no GPU used.

  python tools/overlap_probe.py [--gpu h200] [--devices 16] [--backend hierarchical] [--microbatches 4]

The model: L layers of [an attention stand-in (x @ W_up @ W_down, 4D wide, about MLA's FLOPs a token), then our
routed-MoE block (MaxText/moe/block.py: DeepSeek-V3's router, the dispatch backend, Mosaic GPU grouped GEMMs)],
full remat, V3's widths (D 7168, F 2048, 256 experts, top-8), 4,096 tokens a GPU a microbatch, EP over every
device, 8 a node. Both loops compile from the same Stages; the table is the planner's walk of each schedule
(MaxText/plan/schedule.py: exposed = transfer time no compute covers, with its SM charge) and MaxText/plan/
overlap.py's count of the all-to-alls with a GEMM issued beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--gpu", default="h200", choices=["h100", "h200"])
  ap.add_argument("--devices", type=int, default=16)
  ap.add_argument("--backend", default="hierarchical", choices=["a2a_padded", "hierarchical"])
  ap.add_argument("--gmm", default="mgpu", help="grouped GEMM backend (MaxText/moe/gmm)")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--microbatches", type=int, default=4)
  ap.add_argument("--tokens", type=int, default=4096, help="tokens a GPU a microbatch")
  ap.add_argument("--capacity-factor", type=float, default=1.5)
  ap.add_argument("--loops", default="plain,combined")
  ap.add_argument("--xla-presets", default="deepseek_v3_reference",
                  help="MaxText/config/xla_presets.py names, comma-separated (the 671B recipes'); '' for XLA's defaults")
  ap.add_argument("--pgle", action="store_true",
                  help="compile with the planner's costs as XLA's scheduling profile (MaxText/plan/pgle.py)")
  ap.add_argument("--json", help="write the rows here too")
  ap.add_argument("--hlo-dir", help="write each loop's compiled module here (LOOP.hlo)")
  return ap.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from MaxText.config import xla_presets  # pylint: disable=import-outside-toplevel
  from MaxText.plan import aot  # pylint: disable=import-outside-toplevel

  flags = {}
  for preset in xla_presets.expand([n for n in args.xla_presets.split(",") if n]):
    flags.update(preset.flags)
  flags.update(xla_presets.parse_xla_flags(os.environ.get("XLA_FLAGS", "")))  # the user's own win, as in a run
  os.environ["XLA_FLAGS"] = xla_presets.format_xla_flags(flags)

  aot.configure_backend(aot.choose_topology(num_devices=args.devices, gpus_per_node=8, local_gpus=0,
                                            target_gpu=args.gpu))
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from MaxText import hardware  # pylint: disable=import-outside-toplevel
  from MaxText.accumulate import combined_1f1b  # pylint: disable=import-outside-toplevel
  from MaxText.moe import block, dispatch, routing  # pylint: disable=import-outside-toplevel
  from MaxText.plan import overlap, pgle, schedule  # pylint: disable=import-outside-toplevel

  n, d_model, d_ff, experts, top_k = args.devices, 7168, 2048, 256, 8
  nodes = max(1, n // 8)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("expert",))
  options = {"nodes": nodes} if args.backend == "hierarchical" else {}
  disp = dispatch.make(args.backend, num_experts=experts, axis_name="expert", ep_size=n,
                       capacity_factor=args.capacity_factor, **options)
  cfg = block.BlockConfig(router=routing.RouterConfig(num_experts=experts, top_k=top_k, routed_scaling_factor=2.5),
                          gmm_backend=args.gmm, dtype=jnp.bfloat16)
  sharding = block.Sharding(mesh=mesh, token_axes=("expert",), expert_axis="expert")

  def layer(w, x_TD):
    x_TD = x_TD + (jax.nn.gelu(x_TD @ w["up"]) @ w["down"]).astype(x_TD.dtype)  # the attention stand-in
    y_TD, r, _ = block.moe_block(x_TD, block.Router(w["router"], w["bias"]), w["experts"], cfg, disp, sharding)
    return x_TD + y_TD.astype(x_TD.dtype), jnp.mean(r.weights_TK.astype(jnp.float32) ** 2) * 1e-4

  stages = combined_1f1b.Stages(pre=lambda p, mb: mb.astype(jnp.bfloat16) * p, layer=jax.checkpoint(layer),
                                post=lambda p, y, mb: (jnp.mean((y.astype(jnp.float32) * p) ** 2), ()))
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
  L = args.layers
  ws = {"up": bf16(L, d_model, 4 * d_model), "down": bf16(L, 4 * d_model, d_model),
        "router": jax.ShapeDtypeStruct((L, d_model, experts), jnp.float32),
        "bias": jax.ShapeDtypeStruct((L, experts), jnp.float32),
        "experts": block.Experts(w0_EDF=bf16(L, experts, d_model, d_ff), w1_EDF=bf16(L, experts, d_model, d_ff),
                                 wo_EFD=bf16(L, experts, d_ff, d_model))}
  rep = NamedSharding(mesh, P())
  w_sh = {"up": rep, "down": rep, "router": rep, "bias": rep,
          "experts": jax.tree.map(lambda _: NamedSharding(mesh, P(None, "expert")), ws["experts"])}
  params = (bf16(), ws, bf16())
  mbs = bf16(args.microbatches, args.tokens * n, d_model)
  shardings = ((rep, w_sh, rep), NamedSharding(mesh, P(None, "expert")))
  gpu = hardware.GPUS[args.gpu]
  nodes_of = [i // 8 for i in range(n)]
  rows = []
  for loop in args.loops.split(","):
    f = {"plain": combined_1f1b.accumulated, "combined": combined_1f1b.value_and_grad}[loop]
    start = time.time()
    lowered = jax.jit(lambda p, m, f=f: f(stages, p, m), in_shardings=shardings).lower(params, mbs)
    if args.pgle:
      with tempfile.TemporaryDirectory() as workdir:
        compiled, used = pgle.compile_with_profile(lowered, gpu, {"expert": n}, nodes_of, Path(workdir))
      print(f"{loop}: scheduled with a profile of {used['instructions']} ops' costs", flush=True)
    else:
      compiled = lowered.compile()
    text = compiled.as_text()
    if args.hlo_dir:
      with open(os.path.join(args.hlo_dir, f"{loop}.hlo"), "w", encoding="utf-8") as f:
        f.write(text)
    terms = schedule.estimate(text, gpu, {"expert": n}, nodes_of)
    a2a = overlap.summary(text, "all-to-all")
    rows.append({"loop": loop, "compile_s": round(time.time() - start, 1), "step_s": terms.step_s,
                 "compute_s": terms.compute_s, "memory_s": terms.memory_s, "collectives_s": terms.collectives_s,
                 "exposed_s": terms.exposed_s, "contention_s": terms.contention_s,
                 "a2a_bytes_beside_gemm": a2a["bytes_beside_gemm"] / max(a2a["bytes"], 1.0),
                 "a2a_async": a2a["async"], "a2a_sync": a2a["sync"]})
  print(f"{args.devices} x {args.gpu} compile-only, {args.backend} EP {n} ({nodes} nodes), gmm {args.gmm}, "
        f"{L} layers, {args.microbatches} microbatches of {args.tokens} tokens a GPU, full remat, presets "
        f"[{args.xla_presets}]{', PGLE (the planner costs)' if args.pgle else ''}, jax {jax.__version__}")
  print(f"{'loop':10} {'step s':>8} {'compute':>8} {'memory':>8} {'comms':>8} {'exposed':>8} {'SM charge':>9} "
        f"{'a2a beside GEMM':>15}")
  for r in rows:
    print(f"{r['loop']:10} {r['step_s']:8.4f} {r['compute_s']:8.4f} {r['memory_s']:8.4f} {r['collectives_s']:8.4f} "
          f"{r['exposed_s']:8.4f} {r['contention_s']:9.4f} {r['a2a_bytes_beside_gemm']:14.0%}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
