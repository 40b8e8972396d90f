"""The FP8 dispatch (MaxText/moe/fp8_dispatch.py): tokens quantized before they move.

Meshes and EP dispatchers: tests/test_ep.py (ep_check's meshes_fp8_dispatch). GPU kernel typing on
every mesh: ep_check's kernel_typing (mgpu_fp8 runs with the FP8 dispatch, as moe_fp8 configures it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.moe import block, dispatch, fp8_dispatch, routing
from MaxText.moe.gmm import fp8_quant
from moe_reference import dense_ffn, make_params


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype == fp8_quant.E4M3 else a).view(np.uint8)


def test_quantizing_commutes_with_moving_rows_bit_for_bit():
  """A 1x128 tile is one row's: quantize-then-gather is gather-then-quantize, scales included; packing
  the e4m3 bytes and f32 scales side by side loses nothing; K pads to 128 with zero columns."""
  x = jax.random.normal(jax.random.key(0), (40, 200), jnp.bfloat16) * jnp.logspace(-3, 3, 40)[:, None]
  rows = jnp.asarray(np.random.default_rng(0).integers(0, 40, 97))
  moved = fp8_quant.quantize_rows(x)
  packed = fp8_dispatch.pack(moved)
  assert packed.dtype == jnp.uint8 and packed.shape == (40, 256 + 4 * 2)
  got = fp8_dispatch.unpack(packed[rows], 256)
  want_q, want_scale_KbM = fp8_quant.quantize_row_tiles(jnp.pad(x[rows], ((0, 0), (0, 56))))
  assert (_bits(got.q_MK) == _bits(want_q)).all() and (_bits(got.scale_MKb) == _bits(want_scale_KbM.T)).all()
  q, scale = fp8_quant.rows_for_kernel(got, 100)  # rows past the tiles: zeros with scale 1
  assert q.shape == (100, 256) and (_bits(q[97:]) == 0).all() and (np.asarray(scale[:, 97:]) == 1).all()


def _cfg(fp8: bool, gmm_backend="xla_fp8"):
  return block.BlockConfig(router=routing.RouterConfig(num_experts=8, top_k=4), gmm_backend=gmm_backend,
                           dtype=jnp.float32, fp8_dispatch=fp8)


def _loss_and_grads(cfg, bias, reference=False):
  x, router, ex = make_params(jax.random.key(3), tokens=48, hidden=256, mlp=128)
  probe = jax.random.normal(jax.random.key(4), x.shape)

  def loss(x, kernel, ex):
    if reference:  # the float32 dense reference, routed as the block routes
      r = routing.route(x, kernel, bias, cfg.router)
      return jnp.sum(dense_ffn(x, r.ids_TK, r.weights_TK, ex) * probe)
    y, _, _ = block.moe_block(x, block.Router(kernel, bias), ex, cfg, dispatch.make("local", num_experts=8))
    return jnp.sum(y * probe)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, router.kernel_DE, ex)


def _rel(a, b):
  flat = lambda t: np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(t)])  # noqa: E731
  return float(np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b)))


@pytest.mark.parametrize("bias", ["balanced", "one_hot_expert"])
def test_fp8_dispatch_is_the_fp8_block_with_dw_from_the_moved_tiles(bias):
  """Against the FP8 block that quantizes after the dispatch: the same loss and token/router gradients,
  exactly (the kernels get the same tiles; dlhs never reads them). dW quantizes the moved tiles' values
  (DeepSeek-V3's cached FP8 activations), so it is another FP8 rounding of the same sum, and both stay
  within the 5% per-product bound of the float32 dense reference. one_hot_expert: a bias that sends
  every token to expert 5 first, leaving other experts empty."""
  bias_E = jnp.zeros((8,)) if bias == "balanced" else jnp.zeros((8,)).at[5].set(100.0)
  after_val, after = _loss_and_grads(_cfg(False), bias_E)
  val, grads = _loss_and_grads(_cfg(True), bias_E)
  ref_val, ref = _loss_and_grads(_cfg(False, "xla"), bias_E, reference=True)
  assert float(val) == float(after_val)
  for i in (0, 1):
    np.testing.assert_array_equal(np.asarray(grads[i]), np.asarray(after[i]))
  assert 0 < _rel(grads[2], after[2]) < 0.05
  def errors(v, g):
    return [abs(float(v) - float(ref_val)) / abs(float(ref_val)), *(_rel(g[i], ref[i]) for i in range(3))]

  ours, theirs = errors(val, grads), errors(after_val, after)
  print("relative to float32 dense (loss, dx, d router, dW): fp8 dispatch", ours, "quantized after", theirs)
  # The gradients run through two FP8 products in a row (e.g. wo's dlhs, then wi_0/wi_1's), each within the
  # 5% bound: 10% for them, and the FP8 dispatch within a point of quantizing after the dispatch.
  assert ours[0] < 0.05 and max(ours[1:]) < 0.10, ours
  assert ours[3] < theirs[3] + 0.01, (ours, theirs)


def test_fp8_dispatch_needs_an_fp8_grouped_gemm():
  with pytest.raises(ValueError, match="lhs_tiles .* need an FP8 backend"):
    _loss_and_grads(dataclasses.replace(_cfg(True), gmm_backend="xla"), jnp.zeros((8,)))
