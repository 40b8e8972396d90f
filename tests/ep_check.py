"""EP backends against the one-device block, on simulated CPU devices (or GPUs).

Run by tests/test_ep.py in a subprocess (the device count must be set before
JAX starts): `python tests/ep_check.py CASE` prints one JSON line per check.

On a machine with >= 2 GPUs, `python tests/ep_check.py gpu` checks every EP
backend that can run there (ring, a2a_padded, ragged_a2a) against the
one-device block and prints PASS/FAIL per case (float32, highest precision).
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.moe import block, dispatch, routing  # noqa: E402
from moe_reference import make_params  # noqa: E402

TOKENS = 24  # 6 per device


def _cfg(top_k):
  return block.BlockConfig(router=routing.RouterConfig(num_experts=8, top_k=top_k, routed_scaling_factor=2.5),
                           dtype=jnp.float32)


def _loss_and_grads(cfg, disp, sharding, bias):
  x, router, ex = make_params(jax.random.key(0), tokens=TOKENS)
  probe = jax.random.normal(jax.random.key(5), x.shape)

  def loss(x, kernel, ex):
    y, _, overflow = block.moe_block(x, block.Router(kernel, bias), ex, cfg, disp, sharding)
    return jnp.sum(y * probe), overflow

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (val, overflow), grads = grad_fn(x, router.kernel_DE, ex)
  return val, grads, overflow


def _max_err(a, b):
  return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compare(backend, mesh_shape, top_k, bias, **options):
  """EP backend on a (data, expert) mesh vs `local` on one device: loss and grads."""
  cfg = _cfg(top_k)
  want_val, want_grads, _ = _loss_and_grads(cfg, dispatch.make("local", num_experts=8), None, bias)
  mesh = jax.make_mesh(mesh_shape, ("data", "expert"), devices=jax.devices()[: mesh_shape[0] * mesh_shape[1]],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  disp = dispatch.make(backend, num_experts=8, axis_name="expert", ep_size=mesh_shape[1], **options)
  sharding = block.Sharding(mesh=mesh, token_axes=("data", "expert"), expert_axis="expert")
  val, grads, overflow = _loss_and_grads(cfg, disp, sharding, bias)
  return {"backend": backend, "mesh": list(mesh_shape), "top_k": top_k, "loss_err": abs(float(val - want_val)),
          "grad_err": _max_err(grads, want_grads), "overflow": bool(overflow)}


def main(case: str):
  balanced, skewed = jnp.zeros((8,)), jnp.zeros((8,)).at[5].set(100.0)  # skewed: every token picks expert 5
  if case == "match":
    for backend in ("ring", "a2a_padded"):
      for mesh_shape, top_k, bias in (((1, 4), 2, balanced), ((2, 2), 8, balanced), ((1, 4), 1, skewed)):
        opts = {"capacity_factor": 4.0} if backend == "a2a_padded" else {}
        print(json.dumps(compare(backend, mesh_shape, top_k, bias, **opts)), flush=True)
  elif case == "overflow_flag":
    print(json.dumps(compare("a2a_padded", (1, 4), 1, skewed, capacity_factor=1.0, on_overflow="flag")), flush=True)
  elif case == "overflow_error":
    compare("a2a_padded", (1, 4), 1, skewed, capacity_factor=1.0, on_overflow="error")
    print(json.dumps({"raised": False}), flush=True)
  elif case == "ragged_a2a_cpu":
    # XLA:CPU cannot run it: resolve() must say so; the whole forward+backward
    # must still trace and lower (shapes, offsets, transpose rules).
    out = {}
    try:
      dispatch.resolve("ragged_a2a", ep_size=4)
      out["resolve_raised"] = ""
    except RuntimeError as e:
      out["resolve_raised"] = str(e)
    cfg, (x, router, ex) = _cfg(2), make_params(jax.random.key(0), tokens=TOKENS)
    mesh = jax.make_mesh((1, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    disp = dispatch.make("ragged_a2a", num_experts=8, axis_name="expert", ep_size=4)
    sharding = block.Sharding(mesh=mesh, token_axes=("data", "expert"), expert_axis="expert")
    loss = lambda x, ex: jnp.sum(block.moe_block(x, router, ex, cfg, disp, sharding)[0])  # noqa: E731
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, ex).as_text()
    out["ragged_ops_in_hlo"] = hlo.count("ragged_all_to_all")
    print(json.dumps(out), flush=True)
  elif case == "gpu":
    jax.config.update("jax_default_matmul_precision", "highest")
    n = 4 if len(jax.devices()) >= 4 else 2
    print(f"devices: {jax.devices()}", flush=True)
    for backend in ("ring", "a2a_padded", "ragged_a2a"):
      for top_k, bias, name in ((2, balanced, "balanced"), (8, balanced, "top8"), (1, skewed, "one-expert")):
        try:
          r = compare(backend, (1, n), top_k, bias, capacity_factor=float(n)) if backend != "ring" else \
              compare(backend, (1, n), top_k, bias)
          ok = r["loss_err"] < 1e-3 and r["grad_err"] < 1e-3 and not r["overflow"]
          print(f"{'PASS' if ok else 'FAIL'} {backend} EP={n} {name} {json.dumps(r)}", flush=True)
        except Exception as e:  # pylint: disable=broad-exception-caught
          print(f"FAIL {backend} EP={n} {name} {type(e).__name__}: {str(e)[:300]}", flush=True)
  else:
    raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
  main(sys.argv[1])
