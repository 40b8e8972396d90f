"""Zero padding to the GPU kernels' alignment (MaxText/moe/gmm/_pad.py) and its use by the
tokamax and mgpu backends on the shapes the H200 self-test failed before it.

What a CPU proves here: the helper pads with zeros and crops exactly; aligned (DeepSeek-V3)
shapes reach both kernels as the caller's own arrays; every operand tokamax receives meets
the TMA rules read in tokamax 0.0.17's sm90 kernels (with tokamax's "xla" implementation
computing in place of "mosaic"); the mgpu kernels themselves, run by Pallas' Mosaic-GPU
interpreter, give the right forward and gradients through the public `gmm`. What only the GPU
proves: that those rules are all tokamax's compiled kernels need, and the compiled mgpu
kernels' numbers (`bash tools/gpu_checks.sh selftest-small`).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_script
from gmm_reference import Case, dense_gmm, rel_err
from MaxText.moe import gmm as gmm_lib
from MaxText.moe.gmm import _pad
from MaxText.moe.gmm.mgpu import bf16 as mgpu, kernels as mgpu_kernels, tgmm as mgpu_tgmm, tiling as mgpu_tiling
from MaxText.moe.gmm import tokamax as tokamax_backend


def _selftest():
  return load_script("gpu_selftest", "tools/gpu_selftest.py")


_SELFTEST = _selftest()
SMALL_CASES = _SELFTEST.small_cases()  # the cases both GPU backends failed at 4725881


@pytest.fixture
def as_if_available(monkeypatch):
  """Lets the public gmm resolve a GPU backend on CPU (its kernels then run interpreted or
  through a stand-in); the resolution cache is cleared before and after."""

  def make(module):
    monkeypatch.setattr(module, "unavailable_reason", lambda: None)
    gmm_lib._resolve.cache_clear()  # pylint: disable=protected-access

  yield make
  gmm_lib._resolve.cache_clear()  # pylint: disable=protected-access


# ------------------------------------------------------------------ the helper
def test_aligned_operands_reach_the_kernel_untouched():
  lhs, rhs = jnp.ones((16, 64)), jnp.ones((2, 64, 128))
  seen = []

  def kernel(a, b):
    seen.append((a, b))
    return jnp.ones((16, 128))

  out = _pad.gmm(kernel, lhs, rhs, transpose_rhs=False, align=_pad.Align(8, 64, 64))
  assert seen[0][0] is lhs and seen[0][1] is rhs and out.shape == (16, 128)
  dw = _pad.tgmm(lambda a, b: jnp.ones((2, 64, 128)), lhs, jnp.ones((16, 128)), align=_pad.Align(8, 64, 64))
  assert dw.shape == (2, 64, 128)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_pads_with_zeros_and_crops(transpose_rhs):
  m, k, n, align = 37, 8, 6, _pad.Align(8, 64, 128)
  lhs = jnp.arange(m * k, dtype=jnp.float32).reshape(m, k) + 1
  rhs = jnp.ones((3, n, k) if transpose_rhs else (3, k, n))
  seen = {}

  def kernel(a, b):
    seen["lhs"], seen["rhs"] = a, b
    return jnp.full((a.shape[0], b.shape[1] if transpose_rhs else b.shape[2]), 7.0)

  out = _pad.gmm(kernel, lhs, rhs, transpose_rhs=transpose_rhs, align=align)
  assert seen["lhs"].shape == (40, 64)
  assert seen["rhs"].shape == ((3, 128, 64) if transpose_rhs else (3, 64, 128))
  np.testing.assert_array_equal(seen["lhs"][:m, :k], lhs)
  assert not np.any(seen["lhs"][m:]) and not np.any(seen["lhs"][:, k:])
  assert int(np.count_nonzero(seen["rhs"])) == rhs.size  # only the original entries
  assert out.shape == (m, n) and np.all(out == 7.0)


def test_tgmm_pads_rows_and_crops_k_n():
  seen = {}

  def kernel(a, b):
    seen["lhs"], seen["dout"] = a, b
    return jnp.zeros((2, a.shape[1], b.shape[1]))

  out = _pad.tgmm(kernel, jnp.ones((11, 8)), jnp.ones((11, 6)), align=_pad.Align(64, 64, 64))
  assert seen["lhs"].shape == (64, 64) and seen["dout"].shape == (64, 64)
  assert not np.any(seen["lhs"][11:]) and not np.any(seen["dout"][11:])
  assert out.shape == (2, 8, 6)


# ------------------------------------------------------------------ the fast path
# DeepSeek-V3 expert shapes (hidden 7168, expert width 2048): every product of the forward and
# backward must reach the kernel with the caller's arrays (no pad, no copy) and return as is.
_DSV3 = [(8192, 7168, 2048, False), (8192, 2048, 7168, False), (8192, 2048, 7168, True)]


def _trace_passthrough(backend_gmm, backend_tgmm, record, gmm_returns_kernel_out=True, tgmm_selects_lhs=False):
  for m, k, n, transpose in _DSV3:
    def fwd(x, w, gs, transpose=transpose):
      out = backend_gmm(x, w, gs, group_offset=jnp.int32(0), transpose_rhs=transpose, out_dtype=jnp.bfloat16)
      a, b = record.pop("args")[:2]
      kernel_out = record.pop("out")
      assert a is x and b is w and kernel_out.shape == out.shape
      assert out is kernel_out or not gmm_returns_kernel_out
      return out

    def dw(x, d, gs):
      out = backend_tgmm(x, d, gs, group_offset=jnp.int32(0), num_local_groups=32, out_dtype=jnp.bfloat16)
      a, b = record.pop("args")[:2]
      assert b is d and out is record.pop("out")
      # tokamax's dW gets lhs through one row select (foreign rows to exact zero), same shape.
      assert a.shape == x.shape if tgmm_selects_lhs else a is x
      return out

    w = (32, n, k) if transpose else (32, k, n)
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    jax.eval_shape(fwd, spec(m, k), spec(*w), jax.ShapeDtypeStruct((32,), jnp.int32))
    jax.eval_shape(dw, spec(m, k), spec(m, n), jax.ShapeDtypeStruct((32,), jnp.int32))


def _recorder(record, shape_of):
  def kernel(*args, **kwargs):
    record["args"] = args
    record["out"] = jnp.zeros(shape_of(*args, **kwargs), jnp.bfloat16)
    return record["out"]

  return kernel


def test_mgpu_aligned_shapes_reach_its_kernels_unpadded(monkeypatch):
  record = {}

  def fwd_shape(lhs, rhs, table, *, transpose_rhs, **_):
    return lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]

  monkeypatch.setattr(mgpu_kernels, "grouped_matmul", _recorder(record, fwd_shape))
  monkeypatch.setattr(mgpu_tgmm, "transposed_grouped_matmul",
                      _recorder(record, lambda x, d, s, e, **_: (s.shape[0], x.shape[1], d.shape[1])))
  _trace_passthrough(mgpu.gmm, mgpu.tgmm, record)


def test_tokamax_aligned_shapes_reach_tokamax_unpadded(monkeypatch):
  record = {}

  def shape(lhs, rhs, sizes_L, dims, out_dtype):
    if dims is tokamax_backend._TGMM_DIMS:  # pylint: disable=protected-access
      return sizes_L.shape[0], lhs.shape[1], rhs.shape[1]
    contracting = dims.dot_dimension_numbers[0][1][0]
    return lhs.shape[0], rhs.shape[3 - contracting]

  monkeypatch.setattr(tokamax_backend, "_ragged_dot", _recorder(record, shape))
  # gmm's result then goes through _rows.from_local's row select (the protocol's zero rows,
  # there before padding was): the same [M, N], not a crop.
  _trace_passthrough(tokamax_backend.gmm, tokamax_backend.tgmm, record, gmm_returns_kernel_out=False,
                     tgmm_selects_lhs=True)


# ------------------------------------------------------------------ tokamax
def _tma_ok(shape, itemsize: int, tile) -> bool:
  """Mosaic GPU's TMA rules (jax 0.11.2 launch_context.py): every GMEM stride but the last a
  multiple of 16 bytes; each tiled trailing dimension shorter than its tile or a multiple."""
  strides_ok = all(int(np.prod(shape[d + 1:])) * itemsize % 16 == 0 for d in range(len(shape) - 1))
  tiles_ok = all(s <= t or s % t == 0 for s, t in zip(shape[-len(tile):], tile))
  return strides_ok and tiles_ok


def _tokamax_operands_ok(lhs, rhs, dims, out_dtype) -> list[str]:
  """The operands of tokamax 0.0.17's sm90 kernels as it builds them, checked against
  `_tma_ok`: bf16 blocks of block_k >= 128 and block_n = 64 take the (8, 64) tiling; the
  output tile is 128 bytes wide (pallas_mosaic_gpu_kernel_sm90.py, tokamax mosaic_gpu.py)."""
  size, out_size = lhs.dtype.itemsize, jnp.dtype(out_dtype).itemsize
  wide, out_wide = 128 // size, 128 // out_size
  if dims is tokamax_backend._TGMM_DIMS:  # pylint: disable=protected-access
    (m, k), n = lhs.shape, rhs.shape[1]
    checks = {"lhs.T [K, M]": ((k, m), size, (8, wide)), "dout [M, N]": (rhs.shape, size, (8, wide)),
              "out [G, K, N]": ((k, n), out_size, (8, out_wide))}
  else:
    rhs_gkn = rhs.shape if dims is tokamax_backend._GMM_DIMS else (  # pylint: disable=protected-access
        rhs.shape[0], rhs.shape[2], rhs.shape[1])  # tokamax transposes rhs itself
    checks = {"lhs [M, K]": (lhs.shape, size, (8, wide)), "rhs [G, K, N]": (rhs_gkn, size, (8, wide)),
              "out [M, N]": ((lhs.shape[0], rhs_gkn[2]), out_size, (1, out_wide))}
  return [name for name, (shape, itemsize, tile) in checks.items() if not _tma_ok(shape, itemsize, tile)]


def test_tma_rules_reject_what_the_h200_rejected():
  bf16 = jnp.dtype(jnp.bfloat16)
  fwd = tokamax_backend._GMM_DIMS  # pylint: disable=protected-access
  spec = lambda *s: jax.ShapeDtypeStruct(s, bf16)
  # "dimension 0 must have size smaller or a multiple of its tiling 8, but got 37"
  assert _tokamax_operands_ok(spec(37, 64), spec(4, 64, 64), fwd, bf16) == ["lhs [M, K]"]
  # "dimension 2 must have size smaller or a multiple of its tiling 64, but got 200"
  assert "rhs [G, K, N]" in _tokamax_operands_ok(spec(1000, 320), spec(8, 320, 200), fwd, bf16)
  # "async_copy requires all GMEM strides except the last one to be a multiple of 16 bytes" (N=6)
  assert "rhs [G, K, N]" in _tokamax_operands_ok(spec(16, 8), spec(4, 8, 6), fwd, bf16)
  assert _tokamax_operands_ok(spec(8192, 7168), spec(32, 7168, 2048), fwd, bf16) == []


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: c.name)
def test_tokamax_small_cases_meet_its_tma_rules_and_are_exact(monkeypatch, as_if_available, case):
  """The GPU self-test's own check (NaN-poisoned foreign rows, bf16, forward + dlhs + drhs
  through the public gmm) with tokamax's "xla" implementation computing, while every call
  into tokamax is checked against the rules its mosaic kernels enforce."""
  selftest = _SELFTEST
  monkeypatch.setattr(tokamax_backend, "_IMPLEMENTATION", "xla")
  as_if_available(tokamax_backend)
  ragged_dot, calls = tokamax_backend._ragged_dot, []  # pylint: disable=protected-access

  def checked(lhs, rhs, sizes_L, dims, out_dtype):
    bad = _tokamax_operands_ok(lhs, rhs, dims, out_dtype)
    assert not bad, f"{bad} of {lhs.shape} x {rhs.shape} break tokamax's TMA rules"
    calls.append(dims)
    return ragged_dot(lhs, rhs, sizes_L, dims, out_dtype)

  monkeypatch.setattr(tokamax_backend, "_ragged_dot", checked)
  errs = selftest.run_case(gmm_lib, "tokamax", case, seed=0)
  assert max(errs.values()) < selftest.TOLERANCE, errs
  assert len(calls) == 3  # forward, dlhs (transposed rhs), drhs


# ------------------------------------------------------------------ mgpu, interpreted
# One case per shape the kernels rejected (~15 s each under the interpreter): K=8/N=6 with rows
# past sum(group_sizes); M=37 with K=320 (not a multiple of tgmm's 128) and N=200. (Ring EP
# with padded rows: test_gmm_mgpu.py::test_gmm_kernel_interpreted; K/N padding is independent.)
# Inputs are finite everywhere: the tgmm kernel masks a boundary block's foreign rows by
# multiplying them by 0, which keeps a NaN there (the GPU self-test poisons them with NaN).
_MGPU_CASES = (
    Case("padding_rows_k8_n6", (3, 2, 4, 1), 16, k=8, n=6),
    Case("m37_k320_n200", (10, 0, 20, 5), 37, k=320, n=200),
)


@pytest.mark.parametrize("case", _MGPU_CASES, ids=lambda c: c.name)
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_mgpu_pads_odd_shapes_interpreted(as_if_available, case):
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  as_if_available(mgpu)
  lhs, rhs, gs = case.arrays(jnp.bfloat16)
  rhs = (rhs.astype(jnp.float32) / np.sqrt(case.k)).astype(jnp.bfloat16)
  dout = jnp.asarray(np.random.default_rng(1).standard_normal((case.num_rows, case.n)), jnp.bfloat16)

  def fwd_bwd(gmm, lhs, rhs):
    out, vjp = jax.vjp(lambda l, r: gmm(l, r), lhs, rhs)
    return (out, *vjp(dout.astype(out.dtype)))

  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = jax.jit(lambda l, r: fwd_bwd(
        lambda a, b: gmm_lib.gmm(a, b, gs, backend="mgpu", group_offset=case.group_offset), l, r))(lhs, rhs)
    got = jax.block_until_ready(got)
  want = fwd_bwd(lambda a, b: dense_gmm(a, b, gs, case.group_offset),
                 lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  assert [g.shape for g in got] == [(case.num_rows, case.n), lhs.shape, rhs.shape]
  local = np.asarray(jnp.any(dense_gmm(jnp.ones_like(lhs), jnp.ones_like(rhs), gs, case.group_offset) != 0, axis=1))
  for name, g, w in zip(("out", "dlhs", "drhs"), got, want):
    g = np.asarray(g.astype(jnp.float32))
    assert np.isfinite(g).all(), name
    assert rel_err(g, w) < 1e-2, (name, rel_err(g, w))
    if name != "drhs":
      assert not np.any(g[~local]), f"{name}: rows outside the local groups must be exactly zero"


def test_mgpu_padding_follows_the_tiling_it_runs():
  fwd = mgpu_tiling.lookup("fwd", 8, 6)
  assert mgpu._fwd_align(fwd) == _pad.Align(8, fwd.block_k, 2 * fwd.block_n)  # pylint: disable=protected-access
  tg = mgpu_tiling.lookup("tgmm", 320, 200)
  assert mgpu._tgmm_align(tg) == _pad.Align(8, tg.block_m, tg.cta_n)  # pylint: disable=protected-access
  for (op, k, n), tiling in mgpu_tiling.TABLE.items():  # the table's shapes need no padding
    if op in ("fwd", "tgmm"):
      align = mgpu._fwd_align(tiling) if op == "fwd" else mgpu._tgmm_align(tiling)  # pylint: disable=protected-access
      assert k % align.k == 0 and n % align.n == 0
