"""Dispatch/combine on their own: the registry, and the fused local backend.

With identity "experts" (y = x), combine(dispatch(x)) must equal sum_k w[t,k]
x[t] exactly, with gradients; with a per-row tag we check every row lands in
its expert's group. The backward must reuse the forward's permutation: one
sort in the whole forward+backward program, and no [tokens x experts] array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.moe import dispatch
from MaxText.moe.dispatch import local

from moe_reference import assert_close


def _inputs(tokens=11, top_k=3, experts=8, hidden=8, seed=0):
  kx, ki, kw = jax.random.split(jax.random.key(seed), 3)
  x_TD = jax.random.normal(kx, (tokens, hidden))
  ids_TK = jnp.argsort(jax.random.uniform(ki, (tokens, experts)), axis=-1)[:, :top_k].astype(jnp.int32)
  w_TK = jax.random.uniform(kw, (tokens, top_k))
  return x_TD, ids_TK, w_TK


def test_registry_lists_valid_names_on_unknown():
  with pytest.raises(ValueError, match="valid: local, ring, ragged_a2a, a2a_padded, hierarchical, te_ncclep"):
    dispatch.resolve("deepep", ep_size=1)


def test_auto_resolution_and_refusals():
  assert dispatch.resolve("auto", ep_size=1, platform="cpu") == "local"
  assert dispatch.resolve("auto", ep_size=4, platform="cpu") == "ring"
  with pytest.raises(ValueError, match="cannot run with expert parallelism 4"):
    dispatch.resolve("local", ep_size=4)
  with pytest.raises(RuntimeError, match="ragged-all-to-all"):
    dispatch.resolve("ragged_a2a", ep_size=2)  # XLA:CPU lacks it


def test_te_ncclep_says_what_is_missing():
  reason = dispatch.unavailable_reason("te_ncclep")
  assert "transformer_engine" in reason and "pip install" in reason
  with pytest.raises(RuntimeError, match="te_ncclep"):
    dispatch.make("te_ncclep", num_experts=8)


@pytest.mark.parametrize("tokens,top_k", [(11, 3), (5, 1), (7, 8)])
def test_local_round_trip_is_the_weighted_sum(tokens, top_k):
  x, ids, w = _inputs(tokens, top_k)
  d = dispatch.make("local", num_experts=8)

  def f(x, w):
    x_MD, meta = d.dispatch(x, ids)
    return d.combine(x_MD * 1.0, w, meta)

  want = lambda x, w: x * w.sum(-1, keepdims=True)  # noqa: E731
  assert_close(jax.jit(f)(x, w), want(x, w), 1e-6)  # jitted: one compile, not one per eager op
  probe = jax.random.normal(jax.random.key(3), x.shape)
  g = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * probe), argnums=(0, 1)))(x, w)
  g_ref = jax.grad(lambda x, w: jnp.sum(want(x, w) * probe), argnums=(0, 1))(x, w)
  for a, b in zip(g, g_ref):
    assert_close(a, b, 1e-5)


def test_rows_are_grouped_by_expert_with_empty_groups():
  ids = jnp.array([[6, 2], [2, 6], [6, 0]], jnp.int32)  # experts 1,3,4,5,7 empty
  x = jnp.arange(3.0)[:, None] * jnp.ones((1, 4))
  x_MD, meta = dispatch.make("local", num_experts=8).dispatch(x, ids)
  np.testing.assert_array_equal(np.asarray(meta.group_sizes_G), [1, 0, 2, 0, 0, 0, 3, 0])
  np.testing.assert_array_equal(np.asarray(x_MD[:, 0]), [2, 0, 1, 0, 1, 2])  # tokens, stable within a group


def test_backward_reuses_the_forward_permutation():
  x, ids, w = _inputs(13, 4, hidden=5)
  d = dispatch.make("local", num_experts=8)

  def loss(x, w):
    x_MD, meta = d.dispatch(x, ids)
    return jnp.sum(d.combine(jnp.sin(x_MD), w, meta))

  jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
  assert jaxpr.count(" sort[") == 1, "the backward must not sort again"
  float_scatter_adds = [l for l in jaxpr.splitlines() if "scatter-add" in l and "f32[" in l.split("=")[0]]
  assert not float_scatter_adds, "the backward gathers; only the integer group counts scatter-add"
  assert "[13,8]" not in jaxpr  # no [tokens, experts] one-hot (13 tokens, 8 experts)


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_custom_vjps_match_plain_autodiff(out_dtype):
  """permute_rows and combine_rows against autodiff of plain gathers, with padding rows past the T*K slots."""
  x, ids, w = _inputs(9, 2)
  meta = local.sort_by_expert(ids, 8)
  probe = jax.random.normal(jax.random.key(4), (9, 8))
  pad = 3  # rows no slot points at (a2a_padded's capacity padding): they must get exactly zero gradient

  def fused(x, w):
    rows = jnp.pad(jnp.cos(local.permute_rows(x, meta.order_M, meta.slot_row_TK)), ((0, pad), (0, 0)), constant_values=7.0)
    return jnp.sum(local.combine_rows(rows, w, meta.order_M, meta.slot_row_TK, out_dtype) * probe)

  def plain(x, w):
    rows = jnp.pad(jnp.cos(x[meta.order_M // 2]), ((0, pad), (0, 0)), constant_values=7.0)
    return jnp.sum(jnp.einsum("tkd,tk->td", rows[meta.slot_row_TK], w) * probe)

  for a, b in zip(jax.grad(fused, argnums=(0, 1))(x, w), jax.grad(plain, argnums=(0, 1))(x, w)):
    assert_close(a, b, 1e-6)
  rows = jnp.ones((18 + pad, 8))
  g_rows = jax.grad(lambda y: jnp.sum(local.combine_rows(y, w, meta.order_M, meta.slot_row_TK)))(rows)
  assert float(jnp.abs(g_rows[18:]).max()) == 0.0


def test_combine_backward_gathers_the_row_cotangent_from_g_TD():
  """No [T, K, D] cotangent scattered into rows: each row's gradient is one scaled gather of g_TD
  (plain autodiff scatter-adds a [T, K, D] array, 3.8 GB more traffic per layer on the proxy)."""
  x, ids, w = _inputs(13, 4, hidden=5)
  meta = local.sort_by_expert(ids, 8)
  _, vjp = jax.vjp(lambda y: local.combine_rows(y, w, meta.order_M, meta.slot_row_TK), jnp.sin(x[meta.order_M // 4]))
  into_rows = [(e.primitive.name, [str(v.aval) for v in e.invars]) for e in jax.make_jaxpr(vjp)(jnp.ones((13, 5))).eqns
               if any(str(v.aval) == "float32[52,5]" for v in e.outvars)]
  assert into_rows == [("gather", ["float32[13,5]", "int32[52,1]"]), ("mul", ["float32[52,5]", "float32[52,1]"])]


def _fill_gather(x, idx):
  return x.at[idx].get(mode="fill", fill_value=0)


def _inverse(idx_R, rows_N):
  return jnp.full((rows_N,), idx_R.shape[0], jnp.int32).at[idx_R].set(jnp.arange(idx_R.shape[0], dtype=jnp.int32),
                                                                      mode="drop")


@pytest.mark.parametrize("idx_R", [
    [3, 6, 0, 6, 6, 1],  # empty slots (the fill value N = 6), rows 2, 4, 5 never taken
    [6, 6, 6, 6],  # every slot empty: x gets zero gradient
    [4, 0, 5, 2, 1, 3],  # a full permutation
    [2, 9, 0],  # an index past N (any out-of-range index is an empty slot)
], ids=["empty_slots", "all_empty", "permutation", "past_n"])
def test_take_rows_matches_the_fill_gather_forward_and_gradient(idx_R):
  """local.take_rows (backward: the gather by the inverse) against autodiff of `.at[].get(mode="fill")`."""
  x_ND = jax.random.normal(jax.random.key(0), (6, 5))
  idx_R = jnp.asarray(idx_R, jnp.int32)
  inv_N = _inverse(idx_R, 6)
  g_RD = jax.random.normal(jax.random.key(1), (idx_R.shape[0], 5))
  got, vjp_got = jax.vjp(lambda x: local.take_rows(x, idx_R, inv_N), x_ND)
  want, vjp_want = jax.vjp(lambda x: _fill_gather(x, idx_R), x_ND)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(vjp_got(g_RD)[0], vjp_want(g_RD)[0])
  probe = lambda f: lambda x: jnp.sum(jnp.sin(f(x)) * g_RD)  # noqa: E731
  np.testing.assert_allclose(jax.grad(probe(lambda x: local.take_rows(x, idx_R, inv_N)))(x_ND),
                             jax.grad(probe(lambda x: _fill_gather(x, idx_R)))(x_ND), rtol=1e-6, atol=1e-7)


def test_take_rows_backward_is_a_gather_not_a_scatter():
  """Autodiff would transpose the fill gather into a scatter-add of rows into a zeroed buffer."""
  x_ND = jnp.ones((6, 5))
  idx_R = jnp.asarray([3, 6, 0, 1], jnp.int32)
  _, vjp = jax.vjp(lambda x: local.take_rows(x, idx_R, _inverse(idx_R, 6)), x_ND)
  jaxpr = str(jax.make_jaxpr(vjp)(jnp.ones((4, 5))))
  assert "scatter" not in jaxpr and "gather" in jaxpr, jaxpr

