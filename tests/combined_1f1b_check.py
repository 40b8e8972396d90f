"""Combined 1F1B (MaxText/accumulate/combined_1f1b.py) against the plain accumulation loop on simulated CPU devices.

Run by tests/test_combined_1f1b.py in a subprocess (the device count is fixed before JAX starts):
`python tests/combined_1f1b_check.py` prints one JSON line per case. The layer is a residual MoE block (DeepSeek-V3's
router with its aux-free bias, our dispatch backend, the XLA grouped GEMM) after a dense stand-in for attention, float32,
its router's mean squared weight as the layer's aux loss; three microbatches of two layers. Last, hierarchical with
FP8 experts and the FP8 dispatch against the plain loop's own FP8 numbers.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from ep_nodes_check import EXPERTS, layout, on_mesh, router_cfg  # noqa: E402
from MaxText.accumulate import combined_1f1b  # noqa: E402
from MaxText.moe import block  # noqa: E402

LAYERS, MICROBATCHES, TOKENS_PER_DEVICE, HIDDEN, MLP, VOCAB = 2, 3, 4, 8, 6, 11
POLICIES = {
    "full_remat": jax.checkpoint_policies.nothing_saveable,
    # the recipes' kind: the layer's dispatched rows kept, so its backward does not exchange them again
    "dispatched_rows_saved": jax.checkpoint_policies.save_only_these_names(block.DISPATCHED_ROWS),
}


def stages(backend, name, policy, fp8=False):
  mesh, nodes, _ = layout(name)
  disp, sharding, _ = on_mesh(backend, name, capacity_factor=float(mesh.shape["expert"]))
  cfg = block.BlockConfig(router=router_cfg(nodes, None), dtype=jnp.float32,
                          **({"gmm_backend": "xla_fp8", "fp8_dispatch": True} if fp8 else {}))

  def layer(w, x_TD):
    x_TD = x_TD + jnp.tanh(x_TD @ w["attn"])
    y_TD, r, _ = block.moe_block(x_TD, block.Router(w["router"], w["bias"]), w["experts"], cfg, disp, sharding)
    return x_TD + y_TD, jnp.mean(r.weights_TK ** 2) * 0.01

  def post(p, y_TD, mb):
    logp = jax.nn.log_softmax(y_TD @ p)
    return -jnp.sum(jnp.take_along_axis(logp, mb["targets"][:, None], axis=1)), {"tokens": jnp.float32(y_TD.shape[0])}

  return mesh, combined_1f1b.Stages(pre=lambda p, mb: p[mb["ids"]], layer=jax.checkpoint(layer, policy=policy),
                                    post=post)


def params(tokens):
  k = jax.random.split(jax.random.key(0), 9)
  normal = lambda i, *shape, s=0.4: jax.random.normal(k[i], shape) * s  # noqa: E731
  ws = {"attn": normal(0, LAYERS, HIDDEN, HIDDEN), "router": normal(1, LAYERS, HIDDEN, EXPERTS, s=0.5),
        "bias": normal(2, LAYERS, EXPERTS, s=0.3),
        "experts": block.Experts(w0_EDF=normal(3, LAYERS, EXPERTS, HIDDEN, MLP),
                                 w1_EDF=normal(4, LAYERS, EXPERTS, HIDDEN, MLP),
                                 wo_EFD=normal(5, LAYERS, EXPERTS, MLP, HIDDEN))}
  mbs = {"ids": jax.random.randint(k[6], (MICROBATCHES, tokens), 0, VOCAB),
         "targets": jax.random.randint(k[7], (MICROBATCHES, tokens), 0, VOCAB)}
  return (normal(8, VOCAB, HIDDEN, s=1.0), ws, jax.random.normal(k[8], (HIDDEN, VOCAB))), mbs


def case(backend, name, policy_name, fp8=False):
  mesh, st = stages(backend, name, POLICIES[policy_name], fp8)
  tokens = TOKENS_PER_DEVICE * mesh.size
  p, mbs = params(tokens)
  mbs = jax.device_put(mbs, NamedSharding(mesh, P(None, tuple(mesh.axis_names))))
  plain = jax.jit(lambda p, m: combined_1f1b.accumulated(st, p, m))(p, mbs)
  combined = jax.jit(lambda p, m: combined_1f1b.value_and_grad(st, p, m))(p, mbs)
  ((t0, aux0), g0), ((t1, aux1), g1) = plain, combined
  rel = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1.0, float(np.max(np.abs(np.asarray(b))))))
            for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)))
  return {"backend": backend, "fp8": fp8, "layout": name, "policy": policy_name, "loss_err": abs(float(t1) - float(t0)) / abs(float(t0)),
          "grad_err": rel, "aux_equal": bool(jax.tree.all(jax.tree.map(lambda a, b: bool(np.allclose(a, b, rtol=1e-5)),
                                                                          aux1, aux0))),
          "grad_norm": float(np.sqrt(sum(np.sum(np.square(np.asarray(a))) for a in jax.tree.leaves(g0))))}


def main():
  for backend, name in (("a2a_padded", "expert2x4"), ("hierarchical", "expert2x4")):
    for policy_name in POLICIES:
      print(json.dumps(case(backend, name, policy_name)), flush=True)
  # FP8 experts with the FP8 dispatch (tokens and the combine's cotangent cross as e4m3 tiles): the combined loop
  # quantizes what the plain loop does, so it is held to the plain loop's FP8 numbers, not to bf16's
  print(json.dumps(case("hierarchical", "expert2x4", "full_remat", fp8=True)), flush=True)


if __name__ == "__main__":
  main()
