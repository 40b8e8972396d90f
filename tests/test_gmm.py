"""The grouped GEMM interface (MaxText/moe/gmm) against a dense float32 reference, on CPU.

Forward and gradients of the public, differentiable `gmm` with the xla backend,
the structure of its custom VJP, and backend resolution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gmm_reference import CASES, Case, dense_gmm, rel_err
from MaxText.moe import gmm as gmm_lib


def _gmm(case: Case, backend="xla", **kw):
  return lambda lhs, rhs, gs: gmm_lib.gmm(
      lhs, rhs, gs, backend=backend, group_offset=case.group_offset, transpose_rhs=case.transpose_rhs, **kw
  )


def _ref(case: Case):
  return lambda lhs, rhs, gs: dense_gmm(lhs, rhs, gs, case.group_offset, case.transpose_rhs)


def _grads(fn, lhs, rhs, gs, cotangent_MN):
  """d/d(lhs, rhs) of sum(fn(...) * cotangent), cotangent fixed and random."""
  loss = lambda l, r: jnp.sum(fn(l, r, gs).astype(jnp.float32) * cotangent_MN)  # noqa: E731
  return jax.grad(loss, argnums=(0, 1))(lhs, rhs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_grads_match_dense_reference_f32(case):
  lhs, rhs, gs = case.arrays()
  cot_MN = jnp.asarray(np.random.default_rng(1).standard_normal((case.num_rows, case.n)), jnp.float32)

  out = jax.jit(_gmm(case))(lhs, rhs, gs)
  want = _ref(case)(lhs, rhs, gs)
  assert out.shape == want.shape and out.dtype == jnp.float32
  assert rel_err(out, want) < 1e-5

  dlhs, drhs = jax.jit(lambda l, r: _grads(_gmm(case), l, r, gs, cot_MN))(lhs, rhs)
  want_dlhs, want_drhs = _grads(_ref(case), lhs, rhs, gs, cot_MN)
  assert dlhs.shape == lhs.shape and drhs.shape == rhs.shape
  assert rel_err(dlhs, want_dlhs) < 1e-5
  assert rel_err(drhs, want_drhs) < 1e-5 if np.any(want_drhs) else not np.any(drhs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rows_outside_local_groups_are_exact_zeros_even_from_nan_rows(case):
  """Padding rows and other shards' rows hold NaN in lhs: they must not leak anywhere."""
  lhs, rhs, gs = case.arrays()
  from gmm_reference import row_groups  # pylint: disable=import-outside-toplevel

  group_M = row_groups(gs, case.num_rows)
  local_M = (group_M >= case.group_offset) & (group_M < case.group_offset + case.local)
  poisoned = jnp.where(local_M[:, None], lhs, jnp.nan)
  out = jax.jit(_gmm(case))(poisoned, rhs, gs)
  assert np.all(np.asarray(out)[~np.asarray(local_M)] == 0)
  assert np.all(np.isfinite(np.asarray(out)))
  cot_MN = jnp.ones((case.num_rows, case.n), jnp.float32)
  _, drhs = jax.jit(lambda l, r: _grads(_gmm(case), l, r, gs, cot_MN))(poisoned, rhs)
  assert np.all(np.isfinite(np.asarray(drhs)))


@pytest.mark.parametrize("case", [CASES[4], CASES[5]], ids=lambda c: c.name)
def test_bf16_inputs_accumulate_in_f32(case):
  lhs, rhs, gs = case.arrays(jnp.bfloat16)
  # Same bf16-rounded inputs, exact products summed in f32: a bf16 accumulator
  # would miss by ~1e-3; a float32 one agrees to float32 rounding.
  out_f32 = gmm_lib.gmm(lhs, rhs, gs, group_offset=case.group_offset, preferred_element_type=jnp.float32)
  assert out_f32.dtype == jnp.float32
  assert rel_err(out_f32, _ref(case)(lhs, rhs, gs)) < 1e-6

  out_bf16 = jax.jit(_gmm(case))(lhs, rhs, gs)
  assert out_bf16.dtype == jnp.bfloat16
  assert rel_err(out_bf16, _ref(case)(lhs, rhs, gs)) < 1e-2

  cot_MN = jnp.asarray(np.random.default_rng(2).standard_normal((case.num_rows, case.n)), jnp.bfloat16)
  dlhs, drhs = _grads(_gmm(case), lhs, rhs, gs, cot_MN.astype(jnp.float32))
  want_dlhs, want_drhs = _grads(_ref(case), lhs, rhs, gs, cot_MN.astype(jnp.float32))
  assert dlhs.dtype == jnp.bfloat16 and drhs.dtype == jnp.bfloat16
  assert rel_err(dlhs, want_dlhs) < 1e-2 and rel_err(drhs, want_drhs) < 1e-2


def test_group_sizes_get_no_gradient_whether_int_or_float():
  case = CASES[0]
  lhs, rhs, gs = case.arrays()
  out, vjp = jax.vjp(_gmm(case), lhs, rhs, gs)
  _, _, dgs = vjp(jnp.ones_like(out))
  assert dgs.dtype == jax.dtypes.float0 and dgs.shape == gs.shape  # integer input: symbolic zero

  gs_float = gs.astype(jnp.float32)
  dgs_float = jax.grad(lambda g: jnp.sum(gmm_lib.gmm(lhs, rhs, g)))(gs_float)
  assert dgs_float.dtype == jnp.float32 and not np.any(dgs_float)


def test_group_offset_traced_under_jit_matches_static():
  case = CASES[5]
  lhs, rhs, gs = case.arrays()
  traced = jax.jit(lambda off: gmm_lib.gmm(lhs, rhs, gs, group_offset=off))(jnp.int32(case.group_offset))
  assert rel_err(traced, _ref(case)(lhs, rhs, gs)) < 1e-5


def test_bad_shapes_and_offsets_raise_clear_errors():
  lhs, rhs, gs = CASES[5].arrays()
  with pytest.raises(ValueError, match=r"local groups \[3, 5\) must lie inside \[0, 4\)"):
    gmm_lib.gmm(lhs, rhs, gs, group_offset=3)
  with pytest.raises(ValueError, match="contraction mismatch"):
    gmm_lib.gmm(lhs[:, :5], rhs, gs)
  with pytest.raises(ValueError, match="fewer than rhs"):
    gmm_lib.gmm(lhs, rhs, gs[:1])


# --- the custom VJP's structure -------------------------------------------------------

# Distinct primes, so that a shape holding both G and M cannot be a coincidence.
_G, _M, _K, _N = 5, 37, 11, 13


def _avals(jaxpr):
  """Every value's abstract shape in a jaxpr, sub-jaxprs (jit, custom_vjp...) included."""
  for eqn in jaxpr.eqns:
    yield from (v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval"))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _avals(inner)


def _eqns(jaxpr, name):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner, name)


def _per_group_dense_shapes(fn) -> list[tuple[int, ...]]:
  """Shapes in fn's forward+backward jaxpr that hold the group dim and all M rows."""
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((_M, _K)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((_G, _K, _N)), jnp.float32)
  gs = jnp.asarray([7, 0, 15, 9, 3], jnp.int32)
  grad_fn = jax.value_and_grad(lambda l, r: jnp.sum(fn(l, r, gs) ** 2), argnums=(0, 1))
  jaxpr = jax.make_jaxpr(grad_fn)(lhs, rhs).jaxpr
  shapes = {tuple(a.shape) for a in _avals(jaxpr) if hasattr(a, "shape")}
  return sorted(s for s in shapes if len(s) >= 3 and _G in s and _M in s), jaxpr


def test_custom_vjp_builds_no_per_group_dense_copies():
  dense_shapes, jaxpr = _per_group_dense_shapes(lambda l, r, gs: gmm_lib.gmm(l, r, gs))
  assert dense_shapes == []
  # Forward, dlhs (transposed weights) and dW (ragged contraction): one backend call each.
  dims = [e.params["ragged_dot_dimension_numbers"] for e in _eqns(jaxpr, "ragged_dot_general")]
  assert [d.dot_dimension_numbers[0] for d in dims] == [((1,), (1,)), ((1,), (2,)), ((0,), (0,))]


def test_dense_copy_detector_flags_the_naive_per_group_expansion():
  """The detector above is not vacuous: masking lhs per group ([G, M, K]) is caught."""

  def per_group_copies(lhs, rhs, gs):
    onehot_GM = (jnp.arange(_G)[:, None] == jnp.searchsorted(jnp.cumsum(gs), jnp.arange(_M), side="right")[None])
    lhs_GMK = jnp.where(onehot_GM[..., None], lhs[None], 0.0)
    return jnp.einsum("gmk,gkn->mn", lhs_GMK, rhs)

  dense_shapes, _ = _per_group_dense_shapes(per_group_copies)
  assert (_G, _M, _K) in dense_shapes


# --- backend resolution -------------------------------------------------------------


def test_unknown_backend_raises_listing_valid_names():
  with pytest.raises(ValueError) as err:
    gmm_lib.resolve_backend("cublas")
  for name in ("auto", "xla", "tokamax", "mgpu", "te"):
    assert f"{name}" in str(err.value)
  with pytest.raises(ValueError, match="unknown grouped-GEMM backend 'cublas'"):
    gmm_lib.gmm(*CASES[0].arrays(), backend="cublas")


def test_auto_picks_xla_on_cpu_and_logs_the_pick_once(capsys):
  gmm_lib._resolve.cache_clear()  # pylint: disable=protected-access
  assert gmm_lib.resolve_backend("auto").NAME == "xla"
  assert gmm_lib.resolve_backend("auto").NAME == "xla"
  log = capsys.readouterr().out
  assert log.count("grouped-GEMM backend auto -> xla (platform cpu") == 1, log


def test_backend_literal_lists_every_backend_module():
  assert gmm_lib.BACKENDS == ("xla", "tokamax", "mgpu", "te", "mgpu_fp8", "xla_fp8", "te_mxfp8", "xla_mxfp8")
  assert gmm_lib.CHOICES[0] == "auto"
