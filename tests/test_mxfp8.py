"""moe_fp8=mxfp8: the MXFP8 format (fp8_quant.quantize_mx), its emulation (xla_mxfp8) against float32 references,
Transformer Engine's adapter (te_mxfp8) held to a stand-in of TE's grouped GEMM, and the refusals.

The references are numpy's, written from the OCP MX spec as Transformer Engine applies it (e4m3 values, one E8M0
power-of-two scale per 32 values along the contraction, the exponent rounded up so that amax / scale <= 448), not
from the code under test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from MaxText import config as fork_config
from MaxText.config import checks as config_checks
from MaxText.moe import gmm as gmm_lib
from MaxText.moe.gmm import fp8_quant
from MaxText.moe.gmm import te_mxfp8
import test_gmm_backends as te_fakes

TINY = "configs/deepseek3-tiny.yml"


def np_mx(x, axis):
  """x rounded to MXFP8 along `axis` in float64: blocks of 32 (zero-padded), scale 2^ceil(log2(amax / 448))."""
  x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  n = x.shape[-1]
  pad = -n % 32
  blocks = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, 32)
  amax = np.abs(blocks).max(-1, keepdims=True)
  with np.errstate(divide="ignore"):
    exponent = np.where(amax > 0, np.clip(np.ceil(np.log2(amax / 448.0)), -126, 127), 0)
  scale = 2.0**exponent
  q = np.clip(blocks / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  out = (q * scale).reshape(*x.shape[:-1], -1)[..., :n]
  return np.moveaxis(out, -1, axis)


def np_gmm(lhs, rhs, sizes, offset, transpose_rhs, quantize):
  """The grouped GEMM of the local groups, each operand MXFP8 along the contraction where `quantize`."""
  q = np_mx if quantize else (lambda a, axis: np.asarray(a, np.float64))
  w = np.swapaxes(np.asarray(rhs, np.float64), 1, 2) if transpose_rhs else np.asarray(rhs, np.float64)
  w = q(w, 1)
  x = q(lhs, 1)
  out = np.zeros((x.shape[0], w.shape[2]))
  ends = np.cumsum(sizes)
  for g in range(w.shape[0]):
    s, e = ends[offset + g] - sizes[offset + g], ends[offset + g]
    out[s:e] = x[s:e] @ w[g]
  return out


def np_tgmm(lhs, dout, sizes, offset, local, quantize):
  """dW of each local group: both operands MXFP8 in 32-row blocks from the group's first row."""
  q = np_mx if quantize else (lambda a, axis: np.asarray(a, np.float64))
  ends = np.cumsum(sizes)
  out = []
  for g in range(local):
    s, e = ends[offset + g] - sizes[offset + g], ends[offset + g]
    out.append(q(np.asarray(lhs, np.float64)[s:e], 0).T @ q(np.asarray(dout, np.float64)[s:e], 0))
  return np.stack(out)


def rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# --- the format ---


def test_scales_are_powers_of_two_rounded_up_and_nothing_saturates():
  amax = jnp.array([0.0, 448.0, 449.0, 224.0, 447.99, 896.0, 897.0, 1.0, 3e38, 1e-37, 1e-44])
  # 448 = 0.875 x 2^9: a power-of-two multiple of 448 keeps its exponent, anything above it rounds up
  want = [0, 0, 1, -1, 0, 1, 2, -8, 120, fp8_quant.MX_MIN_EXPONENT, fp8_quant.MX_MIN_EXPONENT]
  got = np.asarray(fp8_quant.mx_exponent(amax))
  assert list(got[:10]) == want[:10]
  assert got[10] in (0, fp8_quant.MX_MIN_EXPONENT)  # a subnormal amax: XLA may flush it to 0 (scale 1), never NaN
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)) * np.array([[1e-30], [1.0], [1e30], [3e38 / 5]]),
                  jnp.float32)
  q, scale = fp8_quant.quantize_mx(x, axis=1)
  assert scale.dtype == jnp.uint8 and scale.shape == (4, 2) and q.dtype == fp8_quant.E4M3
  qf = np.asarray(q.astype(jnp.float32))
  assert np.isfinite(qf).all() and np.abs(qf).max() <= 448
  # each block's largest value lands in (224, 448]: the scale uses the format's top binade
  assert (np.abs(qf).reshape(4, 2, 32).max(-1) > 224).all()


def test_zeros_keep_scale_one_and_dequantize_to_zero():
  q, scale = fp8_quant.quantize_mx(jnp.zeros((2, 64)), axis=1)
  assert (np.asarray(scale) == fp8_quant.E8M0_BIAS).all() and not np.asarray(q.astype(jnp.float32)).any()
  assert not np.asarray(fp8_quant.dequantize_mx(q, scale, axis=1)).any()


@pytest.mark.parametrize("axis", [0, 1])
def test_the_quantizer_is_the_formats_rounding_along_its_axis(axis):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((96, 64)) * np.exp(rng.uniform(-8, 8, (96, 1)))
  x[5, 7] = 1e4  # an outlier spoils only its own block of 32
  got = np.asarray(fp8_quant.mx_values(jnp.asarray(x, jnp.float32), axis))
  want = np_mx(np.asarray(jnp.asarray(x, jnp.float32)), axis)
  np.testing.assert_array_equal(got, want)
  assert rel(got, x) < 0.04  # e4m3: 3 mantissa bits, a relative rounding of at most 1/16
  other = np.asarray(fp8_quant.mx_values(jnp.asarray(x, jnp.float32), 1 - axis))
  assert not np.array_equal(got, other)
  with pytest.raises(ValueError, match="multiple of 32"):
    fp8_quant.quantize_mx(jnp.zeros((3, 40)), axis=1)


# --- the emulation against float32 references: forward, dlhs, dW, empty experts ---


def _spread(rng, shape):
  """Normal values scaled by row and by column by e^U(-3, 3): Gaussian blocks alone share one scale whichever way
  they are blocked (amax/448 of 32 samples lies in one binade), and power-of-two factors commute with the
  quantization: neither would tell a block's axis."""
  rows, cols = (np.exp(rng.uniform(-3, 3, (n, 1))) for n in shape[-2:])
  return jnp.asarray(rng.standard_normal(shape) * rows * cols.T, jnp.float32)


CASES = {  # name: (group sizes, group_offset, local groups, transpose_rhs); hidden 64, 4 experts
    "all_local_empty_experts": ((37, 0, 70, 0), 0, 4, False),
    "ring_2_of_4_one_empty": ((23, 41, 0, 33), 2, 2, False),
    "transposed_weights_empty_first": ((0, 50, 29, 21), 0, 4, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_xla_mxfp8_forward_and_gradients_against_float32(monkeypatch, name):
  sizes, offset, local, transpose = CASES[name]
  rng = np.random.default_rng(2)
  m, k, n = sum(sizes) + 5, 64, 96  # 5 padding rows past the groups
  lhs, dout = _spread(rng, (m, k)), _spread(rng, (m, n))
  rhs = _spread(rng, (local, n, k) if transpose else (local, k, n))
  gs = jnp.asarray(sizes, jnp.int32)

  quantized = []  # (shape, axis) of every operand quantized, in trace order
  real = fp8_quant.mx_values
  monkeypatch.setattr(fp8_quant, "mx_values", lambda x, axis: quantized.append((x.shape, axis)) or real(x, axis))

  def f(lhs, rhs):
    out = gmm_lib.gmm(lhs, rhs, gs, backend="xla_mxfp8", group_offset=offset, transpose_rhs=transpose,
                      preferred_element_type=jnp.float32)
    return jnp.sum(out * dout), out

  (_, out), (dlhs, drhs) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(lhs, rhs)
  # Each operand blocked along the dim its product contracts: the forward's K, dlhs's N (the weight a second time,
  # along its other dim), dW's rows. (The values below cannot tell: e4m3 rounds each value to 3 mantissa bits
  # whatever its block's power-of-two scale, which decides only what underflows.)
  p = fp8_quant.num_padded_rows(m, local)
  w_k, w_n = (2, 1) if transpose else (1, 2)
  dw_operands = [((p, n), 0), ((p, k), 0)] if transpose else [((p, k), 0), ((p, n), 0)]
  assert quantized == [((m, k), 1), (rhs.shape, w_k), ((m, n), 1), (rhs.shape, w_n), *dw_operands]
  # The format's products, from numpy: dlhs = Q_N(dout) Q_N(w)^T, each weight quantized along the dim it contracts.
  want_out = np_gmm(lhs, rhs, sizes, offset, transpose, quantize=True)
  w_nk = rhs if transpose else np.swapaxes(np.asarray(rhs), 1, 2)  # dlhs contracts over N
  want_dlhs = np_gmm(dout, w_nk, sizes, offset, False, quantize=True)
  want_dw = np_tgmm(lhs, dout, sizes, offset, local, quantize=True)
  want_dw = np.swapaxes(want_dw, 1, 2) if transpose else want_dw
  assert rel(out, want_out) < 1e-6 and rel(dlhs, want_dlhs) < 1e-6 and rel(drhs, want_dw) < 1e-6
  # Against the unquantized float32 products: MXFP8's own error, two e4m3 roundings of ~2-3% rms each.
  exact = (np_gmm(lhs, rhs, sizes, offset, transpose, False), np_gmm(dout, w_nk, sizes, offset, False, False),
           np_tgmm(lhs, dout, sizes, offset, local, False))
  exact = (*exact[:2], np.swapaxes(exact[2], 1, 2) if transpose else exact[2])
  for got, want in zip((out, dlhs, drhs), exact):
    assert 0.005 < rel(got, want) < 0.06
  # Rows of other shards' experts, padding rows and empty experts: exact zeros, as the bf16 backends give.
  ends = np.cumsum(sizes)
  local_rows = np.zeros(m, bool)
  local_rows[ends[offset] - sizes[offset]:ends[offset + local - 1]] = True
  assert not np.asarray(out)[~local_rows].any() and not np.asarray(dlhs)[~local_rows].any()
  for g in range(local):
    if sizes[offset + g] == 0:
      assert not np.asarray(drhs[g]).any()


# --- Transformer Engine's adapter, held to a stand-in of TE's MXFP8 grouped GEMM ---


class _ScalingMode:
  NO_SCALING, MXFP8_1D_SCALING = "NO_SCALING", "MXFP8_1D_SCALING"


class _QuantizerFactory:
  @staticmethod
  def create_set(scaling_mode=None, fwd_dtype=None, bwd_dtype=None, n_groups=None, **kw):
    assert not kw and fwd_dtype == bwd_dtype == jnp.float8_e4m3fn
    return {"scaling_mode": scaling_mode, "n_groups": n_groups}


def _fake_mxfp8_grouped_gemm(calls: list):
  """TE 2.20's grouped_gemm with an MXFP8 quantizer set, as its source reads: each operand quantized along the dim
  contracting_dims contract (rowwise where it is the last, else colwise); every group 128-aligned (its V2 MXFP8
  kernel's dynamic constraint; a dW block must not span two experts); one GroupedQuantizer per group."""
  bf16_gemm = te_fakes._fake_te_grouped_gemm([])  # pylint: disable=protected-access

  def grouped_gemm(lhs, rhs, contracting_dims=((1,), (2,)), preferred_element_type=None, quantizer_set=None,
                   **kw):
    assert quantizer_set["scaling_mode"] == _ScalingMode.MXFP8_1D_SCALING
    sizes = np.asarray(lhs.first_dims)
    assert (sizes % 128 == 0).all(), sizes
    calls.append((tuple(tuple(d) for d in contracting_dims), quantizer_set["n_groups"], len(sizes)))
    (lc,), (rc,) = contracting_dims
    lhs_q = te_fakes._FakeGroupedNoScaleTensor(jnp.asarray(np_mx(lhs.data, lc), jnp.float32), None, lhs.first_dims,  # pylint: disable=protected-access
                                               None, lhs.data.shape)
    rhs_q = te_fakes._FakeGroupedNoScaleTensor(jnp.asarray(np_mx(rhs.data, rc), jnp.float32), None, rhs.first_dims,  # pylint: disable=protected-access
                                               None, rhs.data.shape)
    if contracting_dims == ((0,), (0,)):  # dW: 32-row blocks, which the 128-aligned groups keep inside an expert
      assert rhs.first_dims is not None
    return bf16_gemm(lhs_q, rhs_q, contracting_dims, preferred_element_type=preferred_element_type, **kw)

  return grouped_gemm


@pytest.mark.parametrize("name", sorted(CASES))
def test_te_mxfp8_adapter_gives_the_emulations_products(monkeypatch, name):
  calls = []
  te_fakes._install_fake_te(monkeypatch, _fake_mxfp8_grouped_gemm(calls))  # pylint: disable=protected-access
  import sys  # pylint: disable=import-outside-toplevel
  quantize = sys.modules["transformer_engine.jax.quantize"]
  monkeypatch.setattr(quantize, "QuantizerFactory", _QuantizerFactory, raising=False)
  monkeypatch.setattr(quantize, "ScalingMode", _ScalingMode, raising=False)
  sizes, offset, local, transpose = CASES[name]
  rng = np.random.default_rng(4)
  m, k, n = sum(sizes) + 5, 64, 96
  lhs, dout = _spread(rng, (m, k)), _spread(rng, (m, n))
  rhs = _spread(rng, (local, n, k) if transpose else (local, k, n))
  gs, kw = jnp.asarray(sizes, jnp.int32), {"group_offset": jnp.int32(offset), "out_dtype": jnp.float32}
  want = np_gmm(lhs, rhs, sizes, offset, transpose, quantize=True)
  got = te_mxfp8.gmm(lhs, rhs, gs, transpose_rhs=transpose, **kw)
  assert rel(got, want) < 1e-6
  dw = te_mxfp8.tgmm(lhs, dout, gs, num_local_groups=local, **kw)
  assert rel(dw, np_tgmm(lhs, dout, sizes, offset, local, quantize=True)) < 1e-6
  fwd = ((1,), (2,)) if transpose else ((1,), (1,))
  assert calls == [(fwd, local + 1, local + 1), (((0,), (0,)), local + 1, local + 1)]  # the trailing group too


# --- refusals and wiring ---


def test_mxfp8_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
  hopper = config_checks.fp8_gpu_refusal("9.0", "mxfp8")
  assert "no MXFP8 tensor cores (Blackwell" in hopper and "moe_fp8=blockwise" in hopper
  no_te = config_checks.fp8_gpu_refusal("10.0", "mxfp8", te_missing="TE is not installed")
  assert "Transformer Engine's grouped GEMM: TE is not installed" in no_te and "\n" not in no_te
  assert config_checks.fp8_gpu_refusal("10.0", "mxfp8") is None
  assert "moe_fp8=mxfp8" in config_checks.fp8_gpu_refusal("10.0", "blockwise")
  monkeypatch.setitem(__import__("sys").modules, "transformer_engine", None)
  assert "needs Transformer Engine" in gmm_lib.unavailable_reason("te_mxfp8")


def test_the_key_picks_mxfp8s_backend():
  from patches import routed_moe  # pylint: disable=import-outside-toplevel

  run = fork_config.load([TINY, "moe_block=ours", "moe_fp8=mxfp8"])
  assert routed_moe.settings_from(run.fork)["gmm"] == "xla_mxfp8"  # CPU: emulated; te_mxfp8 on a Blackwell GPU
  fork_config.load([TINY, "moe_block=ours", "moe_fp8=mxfp8", "moe_gmm_backend=te"])  # TE is MXFP8's GEMM
  with pytest.raises(fork_config.ConfigError, match="'moe_fp8' = 'mxfp8' .* and 'moe_gmm_backend' = 'mgpu'"):
    fork_config.load([TINY, "moe_block=ours", "moe_fp8=mxfp8", "moe_gmm_backend=mgpu"])
  with pytest.raises(fork_config.ConfigError, match="'moe_fp8' = 'blockwise' .* and 'moe_gmm_backend' = 'te'"):
    fork_config.load([TINY, "moe_block=ours", "moe_fp8=blockwise", "moe_gmm_backend=te"])
