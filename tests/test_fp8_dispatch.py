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
from MaxText.moe import gmm as gmm_lib
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
  packed = fp8_dispatch.pack(moved, jnp.uint8)
  assert packed.dtype == jnp.uint8 and packed.shape == (40, 256 + 4 * 2)
  got = fp8_dispatch.unpack(packed[rows], 256)
  want_q, want_scale_KbM = fp8_quant.quantize_row_tiles(jnp.pad(x[rows], ((0, 0), (0, 56))))
  assert (_bits(got.q_MK) == _bits(want_q)).all() and (_bits(got.scale_MKb) == _bits(want_scale_KbM.T)).all()
  assert fp8_dispatch.pack(moved).dtype == fp8_dispatch.WORD == jnp.uint32  # what an exchange moves
  for word in (jnp.uint16, jnp.uint32):  # wider words carry the same bytes
    wide = fp8_dispatch.pack(moved, word)
    assert wide.dtype == word and wide.shape == (40, packed.shape[1] // jnp.dtype(word).itemsize)
    again = fp8_dispatch.unpack(wide[rows], 256)
    assert (_bits(again.q_MK) == _bits(got.q_MK)).all() and (_bits(again.scale_MKb) == _bits(got.scale_MKb)).all()
  q, scale = fp8_quant.rows_for_kernel(got, 100)  # rows past the tiles: zeros with scale 1
  assert q.shape == (100, 256) and (_bits(q[97:]) == 0).all() and (np.asarray(scale[:, 97:]) == 1).all()


def test_local_dispatch_moves_the_same_tiles_as_the_packed_exchange():
  """The local dispatcher's two gathers (uint32 e4m3 words, the scales apart) give the tiles the packed uint8
  rows an exchanging dispatcher moves, bit for bit, with and without the backward's select of kept rows."""
  t, k_top, experts = 24, 3, 6
  x = jax.random.normal(jax.random.key(1), (t, 300), jnp.bfloat16) * jnp.logspace(-2, 2, t)[:, None]
  ids = jnp.asarray(np.random.default_rng(1).integers(0, experts, (t, k_top)), jnp.int32)
  local = dispatch.make("local", num_experts=experts)

  @dataclasses.dataclass(frozen=True)
  class Packed:  # the same rows through the packed path (not a LocalDispatcher instance)
    def dispatch(self, x_TD, ids_TK):
      return local.dispatch(x_TD, ids_TK)

  keep = jnp.asarray(np.random.default_rng(2).random((t * k_top, 1)) < 0.7)
  for keep_M1 in (None, keep):
    got, _ = fp8_dispatch._moved_tiles(local, x, ids, keep_M1)  # pylint: disable=protected-access
    want, _ = fp8_dispatch._moved_tiles(Packed(), x, ids, keep_M1)  # pylint: disable=protected-access
    assert got.q_MK.dtype == fp8_quant.E4M3 and got.q_MK.shape == (t * k_top, 384)
    assert (_bits(got.q_MK) == _bits(want.q_MK)).all() and (_bits(got.scale_MKb) == _bits(want.scale_MKb)).all()
  assert (_bits(got.q_MK)[~np.asarray(keep[:, 0])] == 0).all()


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


@pytest.mark.parametrize("bias", ["balanced", pytest.param("one_hot_expert", marks=pytest.mark.slow)])
def test_fp8_dispatch_is_the_fp8_block_with_dw_from_the_moved_tiles(bias):
  """Against the FP8 block that quantizes after the dispatch, its combine's cotangent quantized where it is
  (QuantizedCotangentCombine): the same loss and router gradient, exactly, and the same token gradient to
  float32's rounding. The forward kernels get the same tiles. wo's dlhs multiplies the moved cotangent tiles,
  each row's scales times its weight, where the reference requantizes the weighted rows: the same e4m3 bytes
  (test_a_row_scaled_by_its_weight_requantizes_to_the_tiles_that_crossed) and scales equal to an ulp. dW
  quantizes the moved tiles' values (DeepSeek-V3's cached FP8 activations), so it is another FP8 rounding of
  the same sum, and both stay within the 5% per-product bound of the float32 dense reference.
  one_hot_expert: a bias that sends every token to expert 5 first, leaving other experts empty."""
  bias_E = jnp.zeros((8,)) if bias == "balanced" else jnp.zeros((8,)).at[5].set(100.0)
  after_val, after = _loss_and_grads(_cfg(False), bias_E,
                                     dispatcher=QuantizedCotangentCombine(dispatch.make("local", num_experts=8)))
  val, grads = _loss_and_grads(_cfg(True), bias_E)
  ref_val, ref = _loss_and_grads(_cfg(False, "xla"), bias_E, reference=True)
  assert float(val) == float(after_val)
  assert _rel(grads[0], after[0]) < 1e-6  # measured 1.1e-7 and 1.2e-7
  np.testing.assert_array_equal(np.asarray(grads[1]), np.asarray(after[1]))
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


@pytest.mark.slow  # 35 s on two cores: the slow tier (scripts/test.sh --all, CI) runs it
def test_the_output_combines_backward_hands_wo_fp8_tiles_and_keeps_the_weights_gradient():
  """fp8_dispatch.expert_output_combine alone: the forward is wo's grouped GEMM and the bf16 combine, bit for
  bit; the weights' gradient is the bf16 combine's, from the cotangent unquantized; wo's dlhs and dW are its
  FP8 VJP's from each row's token cotangent through 1x128 e4m3 tiles times the row's weight (to float32's
  rounding of the scales: the tiles are taken as they crossed, not requantized). D = 200 pads to 256."""
  disp = dispatch.make("local", num_experts=8)
  kx, kh, kw, kc, ko = jax.random.split(jax.random.key(9), 5)
  ids_TK = jax.random.randint(kx, (20, 3), 0, 8)
  ids_TK = jnp.stack([ids_TK[:, 0], (ids_TK[:, 0] + 1) % 8, (ids_TK[:, 0] + 5) % 8], axis=1)  # distinct experts
  _, meta = disp.dispatch(jnp.zeros((20, 128)), ids_TK)
  h_MF = jax.random.normal(kh, (meta.order_M.shape[0], 128))
  wo_EFD = jax.random.normal(ko, (8, 128, 200)) / 10
  w_TK = jax.random.uniform(kw, (20, 3))
  ct_TD = jax.random.normal(kc, (20, 200)) * jnp.logspace(-2, 2, 20)[:, None]
  gmm = functools.partial(gmm_lib.gmm, group_sizes_G=meta.group_sizes_G, backend="xla_fp8")
  got, pull = jax.vjp(lambda h, wo, w: fp8_dispatch.expert_output_combine(
      disp, h, wo, meta, w, ids_TK, backend="xla_fp8", dtype=jnp.float32, tag=lambda y: y), h_MF, wo_EFD, w_TK)
  want, want_pull = jax.vjp(lambda h, wo, w: disp.combine(gmm(h, wo), w, meta), h_MF, wo_EFD, w_TK)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  ct_h, ct_wo, ct_w = pull(ct_TD)
  np.testing.assert_array_equal(np.asarray(ct_w), np.asarray(want_pull(ct_TD)[2]))
  # The reference's FP8 VJP requantizes the weighted rows of the quantized cotangent: the same tiles.
  ct_q_TD = fp8_quant.dequantize_rows(fp8_quant.quantize_rows(ct_TD), 200, jnp.float32)
  want_h, want_wo, _ = want_pull(ct_q_TD)
  assert _rel(ct_h, want_h) < 1e-6 and _rel(ct_wo, want_wo) < 1e-6
  _, float32_pull = jax.vjp(lambda h, wo: disp.combine(gmm(h, wo, backend="xla"), w_TK, meta), h_MF, wo_EFD)
  exact_h, exact_wo = float32_pull(ct_TD)
  assert 0.01 < _rel(ct_h, exact_h) < 0.1 and 0.01 < _rel(ct_wo, exact_wo) < 0.1  # FP8's rounding


def test_a_row_scaled_by_its_weight_requantizes_to_the_tiles_that_crossed():
  """Why wo's dlhs may take the combine's cotangent tiles as they crossed, each row's scales times its weight
  (fp8_dispatch): quantizing the weighted rows again (bf16: the moved tiles' values times the row's weight)
  gives the same e4m3 bytes, since scaling a row scales its tiles' amax. Only the scales' rounding differs.
  (29,360,128 bytes at [4096, 7168] also all equal; shape cut.)"""
  ct = (jax.random.normal(jax.random.key(0), (512, 1024)) * jnp.logspace(-4, 3, 512)[:, None]).astype(jnp.bfloat16)
  w = jax.random.uniform(jax.random.key(1), (512, 1), minval=0.01, maxval=2.5)
  tiles = fp8_quant.quantize_rows(ct)
  rows = (fp8_quant.dequantize_rows(tiles, 1024, jnp.float32) * w).astype(jnp.bfloat16)
  q_again, _ = fp8_quant.quantize_row_tiles(rows)
  assert (_bits(q_again) == _bits(tiles.q_MK)).all()
