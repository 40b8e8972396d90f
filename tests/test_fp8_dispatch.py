"""The FP8 dispatch (MaxText/moe/fp8_dispatch.py): tokens quantized before they move to the experts, and
the combine's cotangent before it moves back to them in the backward.

Meshes and EP dispatchers: tests/test_ep.py (ep_check's meshes_fp8_dispatch). GPU kernel typing on
every mesh: ep_check's kernel_typing (mgpu_fp8 runs with the FP8 dispatch, as moe_fp8 configures it)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class QuantizedCotangentCombine:
  """`local` whose combine's backward quantizes its cotangent to 1x128 tiles and dequantizes it before the
  usual transpose (the weights' gradient from the cotangent as it is): what the FP8 combine's backward
  sends to the experts, computed in place. The reference for the block with fp8_dispatch."""

  inner: Any
  name = "local"

  def dispatch(self, x_TD, ids_TK):
    return self.inner.dispatch(x_TD, ids_TK)

  def combine(self, y_MD, weights_TK, meta):
    return _quantized_cotangent_combine(self.inner, y_MD, weights_TK, meta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _quantized_cotangent_combine(inner, y_MD, weights_TK, meta):
  return inner.combine(y_MD, weights_TK, meta)


def _qcc_fwd(inner, y_MD, weights_TK, meta):
  y_TD, pull = jax.vjp(lambda y, w: inner.combine(y, w, meta), y_MD, weights_TK)
  return y_TD, pull


def _qcc_bwd(inner, pull, ct_TD):
  del inner
  ct_q_TD = fp8_quant.dequantize_rows(fp8_quant.quantize_rows(ct_TD), ct_TD.shape[1], ct_TD.dtype)
  return pull(ct_q_TD)[0], pull(ct_TD)[1], None


_quantized_cotangent_combine.defvjp(_qcc_fwd, _qcc_bwd)


def _loss_and_grads(cfg, bias, reference=False, dispatcher=None):
  x, router, ex = make_params(jax.random.key(3), tokens=48, hidden=256, mlp=128)
  probe = jax.random.normal(jax.random.key(4), x.shape)
  dispatcher = dispatcher or dispatch.make("local", num_experts=8)

  def loss(x, kernel, ex):
    if reference:  # the float32 dense reference, routed as the block routes
      r = routing.route(x, kernel, bias, cfg.router)
      return jnp.sum(dense_ffn(x, r.ids_TK, r.weights_TK, ex) * probe)
    y, _, _ = block.moe_block(x, block.Router(kernel, bias), ex, cfg, dispatcher)
    return jnp.sum(y * probe)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, router.kernel_DE, ex)


def _rel(a, b):
  flat = lambda t: np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(t)])  # noqa: E731
  return float(np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b)))


@pytest.mark.parametrize("bias", ["balanced", "one_hot_expert"])
def test_fp8_dispatch_is_the_fp8_block_with_dw_from_the_moved_tiles(bias):
  """Against the FP8 block that quantizes after the dispatch, its combine's cotangent quantized where it is
  (QuantizedCotangentCombine): the same loss and token/router gradients, exactly (the kernels get the same
  tiles, and each expert row the same cotangent: its token's dequantized tiles times its weight). dW
  quantizes the moved tiles' values (DeepSeek-V3's cached FP8 activations), so it is another FP8 rounding of
  the same sum, and both stay within the 5% per-product bound of the float32 dense reference.
  one_hot_expert: a bias that sends every token to expert 5 first, leaving other experts empty."""
  bias_E = jnp.zeros((8,)) if bias == "balanced" else jnp.zeros((8,)).at[5].set(100.0)
  after_val, after = _loss_and_grads(_cfg(False), bias_E,
                                     dispatcher=QuantizedCotangentCombine(dispatch.make("local", num_experts=8)))
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


def test_the_combines_backward_sends_fp8_tiles_and_keeps_the_weights_gradient():
  """fp8_dispatch.combine alone: the forward is the bf16 combine's, bit for bit; y's cotangent is each
  row's token cotangent through 1x128 e4m3 tiles, times the row's weight; the weights' gradient is the bf16
  combine's, from the cotangent unquantized."""
  disp = dispatch.make("local", num_experts=8)
  kx, ky, kw, kc = jax.random.split(jax.random.key(9), 4)
  ids_TK = jax.random.randint(kx, (20, 3), 0, 8)
  ids_TK = jnp.stack([ids_TK[:, 0], (ids_TK[:, 0] + 1) % 8, (ids_TK[:, 0] + 5) % 8], axis=1)  # distinct experts
  _, meta = disp.dispatch(jnp.zeros((20, 200)), ids_TK)
  y_MD = jax.random.normal(ky, (meta.order_M.shape[0], 200))
  w_TK = jax.random.uniform(kw, (20, 3))
  ct_TD = jax.random.normal(kc, (20, 200)) * jnp.logspace(-2, 2, 20)[:, None]
  got, pull = jax.vjp(lambda y, w: fp8_dispatch.combine(disp, y, w, meta, ids_TK), y_MD, w_TK)
  want, want_pull = jax.vjp(lambda y, w: disp.combine(y, w, meta), y_MD, w_TK)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  ct_y, ct_w = pull(ct_TD)
  np.testing.assert_array_equal(np.asarray(ct_w), np.asarray(want_pull(ct_TD)[1]))
  ct_q_TD = fp8_quant.dequantize_rows(fp8_quant.quantize_rows(ct_TD), 200, jnp.float32)
  np.testing.assert_array_equal(np.asarray(ct_y), np.asarray(want_pull(ct_q_TD)[0]))
  assert 0.01 < _rel(ct_y, want_pull(ct_TD)[0]) < 0.05  # FP8's rounding: the cotangent was quantized


def test_a_row_scaled_by_its_weight_requantizes_to_the_tiles_that_crossed():
  """wo's dlhs quantizes the combine's cotangent rows again (bf16: the moved tiles' values times the row's
  weight). Scaling a row scales its tiles' amax, so the e4m3 bytes come back unchanged: the dlhs multiplies
  what crossed, not a second rounding of it. (29,360,128 bytes at [4096, 7168] also all equal; shape cut.)"""
  ct = (jax.random.normal(jax.random.key(0), (512, 1024)) * jnp.logspace(-4, 3, 512)[:, None]).astype(jnp.bfloat16)
  w = jax.random.uniform(jax.random.key(1), (512, 1), minval=0.01, maxval=2.5)
  tiles = fp8_quant.quantize_rows(ct)
  rows = (fp8_quant.dequantize_rows(tiles, 1024, jnp.float32) * w).astype(jnp.bfloat16)
  q_again, _ = fp8_quant.quantize_row_tiles(rows)
  assert (_bits(q_again) == _bits(tiles.q_MK)).all()
