"""Varying-manual-axes typing (MaxText/moe/vma.py) and the grouped GEMM's custom VJP under shard_map.

Meshes of several devices are checked in subprocesses (tests/test_ep.py: every mesh against one
device, and the mgpu kernels' typing traced on each). Here, in one process: the two rules on a
one-device mesh, whose axis is still a manual axis with check_vma on, and the mgpu kernels run by
Pallas' Mosaic-GPU interpreter inside shard_map, forward and gradients against a float32 reference.
"""

from __future__ import annotations

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gmm_reference import dense_gmm, rel_err
from MaxText.moe import gmm as gmm_lib
from MaxText.moe import vma
from MaxText.moe.gmm.mgpu import bf16 as mgpu

MESH = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))


def _in_shard_map(f, *args, in_specs, out_specs=P()):
  return jax.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs)(*args)


def test_like_operands_types_a_result_as_a_lax_op_would():
  def body(x_varying, w_invariant):
    seen = {}
    seen["x"], seen["w"] = vma.axes(x_varying), vma.axes(w_invariant)
    seen["out"] = vma.axes(vma.like_operands(jnp.zeros(3), x_varying, w_invariant))
    seen["out_of_w"] = vma.axes(vma.like_operands(jnp.zeros(3), w_invariant))
    assert seen == {"x": {"fsdp"}, "w": set(), "out": {"fsdp"}, "out_of_w": set()}, seen
    return x_varying

  _in_shard_map(body, jnp.ones(4), jnp.ones(4), in_specs=(P("fsdp"), P()), out_specs=P("fsdp"))


def test_like_primal_sums_over_axes_the_primal_does_not_vary_over():
  def body(ct_varying, w_invariant):
    summed = vma.like_primal(ct_varying, w_invariant)  # w shared by the shards: the partials' sum
    cast = vma.like_primal(w_invariant * 2, vma.stamp(ct_varying))  # same value on every shard: a cast
    assert vma.axes(summed) == set() and vma.axes(cast) == {"fsdp"}
    assert vma.like_primal(None, w_invariant) is None
    return summed, cast

  summed, cast = _in_shard_map(body, jnp.arange(4.0), jnp.ones(4), in_specs=(P("fsdp"), P()),
                               out_specs=(P(), P("fsdp")))
  np.testing.assert_array_equal(summed, np.arange(4.0))  # one shard: psum is the identity
  np.testing.assert_array_equal(cast, 2 * np.ones(4))


@pytest.mark.slow  # 50 s of interpreted Mosaic kernels on CPU: the slow tier (scripts/test.sh --all, CI) runs it
def test_mgpu_kernels_in_shard_map_interpreted_match_float32_reference(monkeypatch):
  """The crash's own setting: rows split over a mesh axis, weights shared, Pallas kernel outputs.
  Fails without vma typing ("manual axis types do not match"); with it, forward, dlhs and dW
  match the dense float32 reference, rows past the groups included."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(mgpu, "unavailable_reason", lambda: None)
  gmm_lib._resolve.cache_clear()  # pylint: disable=protected-access
  m, k, n = 32, 64, 128
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((4, k, n)) / 8, jnp.bfloat16)
  sizes = jnp.array([10, 0, 12, 6], jnp.int32)  # an empty group; 4 rows past the groups
  probe = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def loss(backend, l, r):
    body = lambda l, r: gmm_lib.gmm(l, r, sizes, backend=backend)  # noqa: E731
    out = _in_shard_map(body, l, r, in_specs=(P("fsdp"), P()), out_specs=P("fsdp"))
    return jnp.sum(out.astype(jnp.float32) * probe)

  try:
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
      got = jax.jit(jax.value_and_grad(lambda l, r: loss("mgpu", l, r), argnums=(0, 1)))(lhs, rhs)
      got = jax.block_until_ready(got)
  finally:
    gmm_lib._resolve.cache_clear()  # pylint: disable=protected-access
  f32 = lambda l, r: jnp.sum(dense_gmm(l, r, sizes, 0) * probe)  # noqa: E731
  want = jax.value_and_grad(f32, argnums=(0, 1))(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  for name, g, w in zip(("loss", "dlhs", "drhs"), jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(np.asarray(g, np.float32), np.asarray(w)) < 1e-2, name
