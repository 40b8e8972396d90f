"""The EP exchange is not recomputed under remat when the dispatched rows are kept (`moe_x_sorted`), on simulated
CPU devices: the block under jax.checkpoint, full remat against a policy that saves (or offloads) the rows.

Run by tests/test_ep_remat.py in a subprocess (the device count is fixed before JAX starts):
`python tests/ep_remat_check.py` prints one JSON line per (dispatcher, mesh, policy): the loss and gradients'
largest difference from the block without remat (float32), and the compiled gradient's all-to-all count and
bytes, against full remat's.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.moe import block, dispatch, routing  # noqa: E402
from moe_reference import make_params  # noqa: E402

TOKENS = 64  # 8 per device
# (dispatcher, mesh axes, mesh shape, dispatcher options): FSDP 2 x EP 4, EP 8 as 2 nodes x 4, and FSDP 2 x EP 4
# with the FP8 dispatch.
CASES = (
    ("a2a_padded", ("fsdp", "expert"), (2, 4), {"capacity_factor": 4.0}),
    ("hierarchical", ("expert",), (8,), {"nodes": 2, "capacity_factor": 4.0}),
    ("a2a_padded+fp8", ("fsdp", "expert"), (2, 4), {"capacity_factor": 4.0}),  # FP8 dispatch (moe_fp8: blockwise)
)
# The names a policy keeps: upstream's custom remat policy builds save_and_offload_only_these_names from its
# tensors_on_device / tensors_to_offload lists, which hold moe_x_sorted when its key is device / offload.
POLICIES = {
    "full": None,
    "moe_x_sorted_device": jax.checkpoint_policies.save_only_these_names(block.DISPATCHED_ROWS),
    "moe_x_sorted_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[block.DISPATCHED_ROWS],
        offload_src="device", offload_dst="pinned_host"),
}


def _a2a_rows(hlo: str) -> list[int]:
  """Each all-to-all's result elements, in the compiled module (async starts counted once)."""
  sizes = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) all-to-all(?:-start)?\(", line)
    if m:  # a tuple's elements (one per peer on CPU) summed
      sizes.append(sum(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", m.group(1))))
  return sizes


def run_case(backend, axes, shape, options, policy_names, top_k=8):
  mesh = jax.make_mesh(shape, axes, devices=jax.devices()[: int(np.prod(shape))],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  ep, fp8 = mesh.shape["expert"], backend.endswith("+fp8")
  disp = dispatch.make(backend.removesuffix("+fp8"), num_experts=16, axis_name="expert", ep_size=ep, **options)
  sharding = block.Sharding(mesh=mesh, token_axes=axes, expert_axis="expert")
  # With the FP8 dispatch the reference is its own quantization without remat (the same FP8 values).
  cfg = block.BlockConfig(router=routing.RouterConfig(num_experts=16, top_k=top_k, routed_scaling_factor=2.5),
                          dtype=jnp.float32, fp8_dispatch=fp8, gmm_backend="xla_fp8" if fp8 else "xla")
  x, router, ex = make_params(jax.random.key(0), tokens=TOKENS, hidden=128 if fp8 else 8, experts=16)
  probe = jax.random.normal(jax.random.key(5), x.shape)

  def loss(x, kernel, ex):
    y = block.moe_block(x, block.Router(kernel, None), ex, cfg, disp, sharding)[0]
    return jnp.sum(jnp.square(y) * probe)  # squared: the backward needs the forward's output

  def grads(remat: bool, policy=None):
    f = jax.checkpoint(loss, policy=policy) if remat else loss
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

  with jax.set_mesh(mesh):
    want = grads(False)(x, router.kernel_DE, ex)
    for policy_name in policy_names:
      fn = grads(True, POLICIES[policy_name])
      got = fn(x, router.kernel_DE, ex)
      rows = _a2a_rows(fn.lower(x, router.kernel_DE, ex).compile().as_text())
      err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
      yield {"backend": backend, "mesh": dict(zip(axes, shape)), "policy": policy_name, "err": err,
             "all_to_alls": len(rows), "all_to_all_elements": sum(rows)}


def main():
  jax.config.update("jax_default_matmul_precision", "highest")
  for i, (backend, axes, shape, options) in enumerate(CASES):
    policies = list(POLICIES) if i == 0 else ["full", "moe_x_sorted_device"]  # offloading: the first case's
    for row in run_case(backend, axes, shape, options, policies):
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
