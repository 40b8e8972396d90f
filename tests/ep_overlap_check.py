"""The MoE block compiled for compile-only H200s (XLA's GPU compiler, no GPU): what runs beside its all-to-alls.

Run by tests/test_ep_nodes.py in a subprocess (the compile-only devices replace the backend before JAX starts):
`python tests/ep_overlap_check.py BACKEND CHUNKS...` prints, per chunk count, MaxText/plan/overlap.py's summary of
the scheduled forward + backward of our block (grouped GEMMs: the mgpu Mosaic kernels) at EP 8 = 2 nodes x 4,
compiled with the XLA flags of the EP recipes' preset (deepseek_v3_reference: latency-hiding scheduler,
multi-stream collectives).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from MaxText.config import xla_presets  # noqa: E402
from MaxText.plan import gpu_target  # noqa: E402

PRESET = "deepseek_v3_reference"


def main(backend: str, chunks: list[int]) -> None:
  flags = {k: v for p in xla_presets.expand([PRESET]) for k, v in p.flags.items()}
  os.environ["XLA_FLAGS"] = xla_presets.format_xla_flags({**flags, "xla_gpu_shard_autotuning": "false"})
  devices = gpu_target.enter("h200", 8, 4)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from MaxText.moe import block, dispatch, routing  # pylint: disable=import-outside-toplevel
  from MaxText.plan import overlap  # pylint: disable=import-outside-toplevel

  experts, top_k, hidden, mlp, tokens = 32, 8, 1024, 512, 2048 * len(devices)  # 4 experts and 2,048 tokens per GPU
  mesh = jax.sharding.Mesh(np.array(devices), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
  options = {"nodes": 2} if backend == "hierarchical" else {}
  disp = dispatch.make(backend, num_experts=experts, axis_name="expert", ep_size=len(devices), **options)
  sharding = block.Sharding(mesh=mesh, token_axes=("expert",), expert_axis="expert")
  spec = lambda *shape, s=P(): jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, s))  # noqa: E731
  args = (spec(tokens, hidden, s=P("expert")), spec(hidden, experts), spec(experts, hidden, mlp, s=P("expert")),
          spec(experts, hidden, mlp, s=P("expert")), spec(experts, mlp, hidden, s=P("expert")))
  for n in chunks:
    cfg = block.BlockConfig(router=routing.RouterConfig(num_experts=experts, top_k=top_k), gmm_backend="mgpu",
                            dtype=jnp.bfloat16, overlap_chunks=n)

    def loss(x, kernel, w0, w1, wo, cfg=cfg):  # the output feeds on (squared): its backward waits for the forward
      y = block.moe_block(x, block.Router(kernel, None), block.Experts(w0, w1, wo), cfg, disp, sharding)[0]
      return jnp.sum(jnp.square(y.astype(jnp.float32)))

    with jax.set_mesh(mesh):
      text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile().as_text()
    print(json.dumps({"backend": backend, "chunks": n, "mosaic": text.count("mosaic_gpu"),
                      **overlap.summary(text)}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], [int(c) for c in sys.argv[2:]])
