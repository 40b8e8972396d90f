"""GPU-only grouped-GEMM backends, exercised as far as a CPU allows.

tokamax, mgpu and te cannot run their kernels here: each must say so clearly.
The tokamax adapter still runs through tokamax's own (XLA) implementation, and
the te adapter's argument plumbing through a stand-in for TE's grouped_gemm
that enforces TE's documented contract (TE itself is not installed here).
tools/gpu_selftest.py checks the real kernels on a GPU.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gmm_reference import CASES, dense_gmm, rel_err
from MaxText.moe import gmm as gmm_lib
from MaxText.moe.gmm import te as te_backend
from MaxText.moe.gmm import tokamax as tokamax_backend


def test_gpu_only_backends_say_why_they_cannot_run_on_cpu():
  assert gmm_lib.unavailable_reason("xla") is None
  tokamax_reason = gmm_lib.unavailable_reason("tokamax")
  assert "needs an NVIDIA GPU" in tokamax_reason and "cpu" in tokamax_reason
  assert gmm_lib.unavailable_reason("mgpu")  # not importable yet, or needs a Hopper GPU
  for name in ("tokamax", "mgpu", "te"):
    gmm_lib._resolve.cache_clear()  # pylint: disable=protected-access
    with pytest.raises(gmm_lib.BackendUnavailable, match=f"backend '{name}' is unavailable here: .+"):
      gmm_lib.resolve_backend(name)


def test_mgpu_is_registered_lazily_and_reports_its_import_state():
  reason = gmm_lib.unavailable_reason("mgpu")
  if importlib.util.find_spec("MaxText.moe.gmm.mgpu.bf16") is None:
    assert "MaxText.moe.gmm.mgpu.bf16 does not import" in reason
  else:  # the kernel owner's module: on CPU it must refuse with its own reason
    assert "does not import" in reason or "GPU" in reason or "Hopper" in reason, reason


# --- te: the real missing-TE error, then the plumbing with a stand-in -----------------


def test_te_without_transformer_engine_says_how_to_install(monkeypatch):
  # TE is absent here; the None entries keep it so where TE is installed.
  monkeypatch.setitem(sys.modules, "transformer_engine", None)
  reason = gmm_lib.unavailable_reason("te")
  assert "pip install 'maxtext-moe[te]'" in reason and "NGC" in reason
  lhs, rhs, gs = CASES[0].arrays()
  with pytest.raises(ImportError, match=r"backend 'te' needs Transformer Engine for JAX: pip install"):
    te_backend.gmm(lhs, rhs, gs, group_offset=jnp.int32(0), transpose_rhs=False, out_dtype=jnp.float32)


class _FakeGroupedNoScaleTensor:
  """transformer_engine.jax.quantize.GroupedNoScaleTensor (2.20.2): the fields grouped_gemm reads."""

  def __init__(self, data, amax, first_dims, last_dims, original_shape):
    assert amax is None and last_dims is None and tuple(original_shape) == data.shape
    self.data, self.first_dims = data, first_dims


def _fake_te_grouped_gemm(calls: list):
  """TE 2.20.2's grouped_gemm contract as read in its source, computed group by group in numpy.

  Signature of the release: grouped_gemm(lhs, rhs, contracting_dims=((1,),(2,)), bias=None, precision=DEFAULT,
  preferred_element_type=None, group_offset=None, quantizer_set=noop, use_async_d2h_group_sizes=False), with
  GroupedNoScaleTensor operands whose first_dims carry the row-group sizes. contracting_dims ((1,),(1,)) =
  [M,K] x [G,K,N]; ((1,),(2,)) = [M,K] x [G,N,K]; ((0,),(0,)) = [M,K] x [M,N] -> [G,K,N] (wgrad, both ragged);
  its FFI requires sum(group sizes) == M and, outside wgrad, one group per rhs slice. group_offset raises.
  """

  def grouped_gemm(lhs, rhs, contracting_dims=((1,), (2,)), bias=None, precision=None,
                   preferred_element_type=None, group_offset=None, quantizer_set=None,
                   use_async_d2h_group_sizes=False):
    del precision, quantizer_set, use_async_d2h_group_sizes
    assert bias is None and group_offset is None
    assert isinstance(lhs, _FakeGroupedNoScaleTensor) and isinstance(rhs, _FakeGroupedNoScaleTensor)
    sizes = np.asarray(lhs.first_dims)
    lhs_np, rhs_np = np.asarray(lhs.data, np.float64), np.asarray(rhs.data, np.float64)
    assert sizes.sum() == lhs_np.shape[0], "TE: Unexpected group_sizes! M != sum(group_sizes)"
    calls.append(tuple(tuple(d) for d in contracting_dims))
    ends = np.cumsum(sizes)
    starts = ends - sizes
    if contracting_dims == ((0,), (0,)):
      np.testing.assert_array_equal(np.asarray(rhs.first_dims), sizes)
      out = np.stack([lhs_np[s:e].T @ rhs_np[s:e] for s, e in zip(starts, ends)])
    else:
      assert rhs.first_dims is None and rhs_np.shape[0] == len(sizes)
      weights = rhs_np if contracting_dims == ((1,), (1,)) else np.swapaxes(rhs_np, 1, 2)
      assert contracting_dims in (((1,), (1,)), ((1,), (2,)))
      out = np.concatenate([lhs_np[s:e] @ weights[g] for g, (s, e) in enumerate(zip(starts, ends))])
    return jnp.asarray(out, preferred_element_type or lhs.data.dtype)

  return grouped_gemm


def _install_fake_te(monkeypatch, grouped_gemm, version="2.20.2"):
  cpp = types.ModuleType("transformer_engine.jax.cpp_extensions")
  cpp.grouped_gemm = grouped_gemm
  quantize = types.ModuleType("transformer_engine.jax.quantize")
  quantize.GroupedNoScaleTensor = _FakeGroupedNoScaleTensor
  te_jax = types.ModuleType("transformer_engine.jax")
  te_jax.cpp_extensions, te_jax.quantize = cpp, quantize
  te = types.ModuleType("transformer_engine")
  te.jax, te.__version__ = te_jax, version
  for name, module in (("transformer_engine", te), ("transformer_engine.jax", te_jax),
                       ("transformer_engine.jax.cpp_extensions", cpp), ("transformer_engine.jax.quantize", quantize)):
    monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_te_adapter_plumbing_with_a_stand_in_grouped_gemm(monkeypatch, case):
  calls = []
  _install_fake_te(monkeypatch, _fake_te_grouped_gemm(calls))
  lhs, rhs, gs = case.arrays()
  off = jnp.int32(case.group_offset)
  out = te_backend.gmm(lhs, rhs, gs, group_offset=off, transpose_rhs=case.transpose_rhs, out_dtype=jnp.float32)
  assert rel_err(out, dense_gmm(lhs, rhs, gs, case.group_offset, case.transpose_rhs)) < 1e-5

  dout = jnp.asarray(np.random.default_rng(3).standard_normal(out.shape), jnp.float32)
  a, b = (dout, lhs) if case.transpose_rhs else (lhs, dout)
  drhs = te_backend.tgmm(a, b, gs, group_offset=off, num_local_groups=case.local, out_dtype=jnp.float32)
  _, want_drhs = jax.grad(
      lambda l, r: jnp.sum(dense_gmm(l, r, gs, case.group_offset, case.transpose_rhs) * dout), argnums=(0, 1)
  )(lhs, rhs)
  assert drhs.shape == rhs.shape
  assert rel_err(drhs, want_drhs) < 1e-5 if np.any(want_drhs) else not np.any(drhs)
  fwd = ((1,), (2,)) if case.transpose_rhs else ((1,), (1,))
  assert calls == [fwd, ((0,), (0,))]


@pytest.mark.parametrize("version", ["2.8.0", "2.21.0", "unknown"])
def test_te_refuses_a_transformer_engine_it_was_not_checked_against(monkeypatch, version):
  _install_fake_te(monkeypatch, _fake_te_grouped_gemm([]), version=version)
  assert f"supports Transformer Engine 2.20.x; {version} is installed" in te_backend.unavailable_reason()


# --- tokamax: the adapter through tokamax's own XLA implementation ---------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tokamax_adapter_runs_through_tokamax_on_cpu(monkeypatch, case):
  """Same code path as on GPU (tokamax.ragged_dot_general, RaggedDotGroupSizes, the
  row window), with tokamax's "xla" implementation standing in for "mosaic"."""
  monkeypatch.setattr(tokamax_backend, "_IMPLEMENTATION", "xla")
  lhs, rhs, gs = case.arrays()
  off = jnp.int32(case.group_offset)
  out = jax.jit(
      lambda l, r, g: tokamax_backend.gmm(l, r, g, group_offset=off, transpose_rhs=case.transpose_rhs,
                                          out_dtype=jnp.float32)
  )(lhs, rhs, gs)
  assert rel_err(out, dense_gmm(lhs, rhs, gs, case.group_offset, case.transpose_rhs)) < 1e-5
  drhs = tokamax_backend.tgmm(lhs, out, gs, group_offset=off, num_local_groups=case.local, out_dtype=jnp.float32)
  want = jax.grad(lambda r: 0.5 * jnp.sum(dense_gmm(lhs, r, gs, case.group_offset) ** 2))(
      jnp.swapaxes(rhs, 1, 2) if case.transpose_rhs else rhs
  )
  assert rel_err(drhs, want) < 1e-5 if np.any(want) else not np.any(drhs)


def test_tokamax_adapter_zeroes_foreign_rows_before_dw(monkeypatch):
  """tokamax 0.0.17's GPU dW masks rows outside a group by multiplying (the H200 self-test
  saw NaN rows reach dW). A stand-in kernel with that behaviour: the adapter must hand it
  exact zeros in every row outside the local groups, so dW stays finite and right."""

  def multiply_masked_tgmm(lhs_MK, dout_MN, group_sizes_L, dims, out_dtype):
    del dims
    ends_L = jnp.cumsum(group_sizes_L)
    row_M = jnp.arange(lhs_MK.shape[0])
    in_group_LM = (row_M >= (ends_L - group_sizes_L)[:, None]) & (row_M < ends_L[:, None])
    masked_LMK = lhs_MK[None] * in_group_LM[..., None].astype(lhs_MK.dtype)  # NaN * 0 = NaN
    return jnp.einsum("lmk,mn->lkn", masked_LMK, dout_MN).astype(out_dtype)

  monkeypatch.setattr(tokamax_backend, "_ragged_dot", multiply_masked_tgmm)
  m, k, n = 40, 64, 64
  gs = jnp.asarray([10, 0, 20, 5], jnp.int32)  # groups 1..3 local; 5 padding rows at the end
  lhs = jax.random.normal(jax.random.key(0), (m, k))
  dout = jax.random.normal(jax.random.key(1), (m, n))
  foreign_M = (jnp.arange(m) < 10) | (jnp.arange(m) >= 35)
  poisoned = jnp.where(foreign_M[:, None], jnp.nan, lhs)
  dw = tokamax_backend.tgmm(poisoned, dout, gs, group_offset=jnp.int32(1), num_local_groups=3,
                            out_dtype=jnp.float32)
  want = jnp.stack([lhs[10:10].T @ dout[10:10], lhs[10:30].T @ dout[10:30], lhs[30:35].T @ dout[30:35]])
  assert np.isfinite(np.asarray(dw)).all()
  assert rel_err(dw, want) < 1e-5


def test_auto_on_blackwell_passes_over_tokamax_for_te(monkeypatch):
  """tokamax 0.0.17's sm100 kernel has no dW form: on a B200 auto skips it for TE's grouped GEMM (then xla)."""
  b200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA B200", compute_capability="10.0")
  monkeypatch.setattr(jax, "devices", lambda *a, **k: [b200])
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert "no dW form" in tokamax_backend.unavailable_reason()
  _install_fake_te(monkeypatch, _fake_te_grouped_gemm([]))
  gmm_lib._import_backend.cache_clear()  # pylint: disable=protected-access
  assert gmm_lib._auto("gpu")[0] == "te"  # pylint: disable=protected-access
