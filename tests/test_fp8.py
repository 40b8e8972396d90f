"""Blockwise FP8 (moe_fp8: blockwise; docs/fp8.md): the quantization against NumPy, and the Hopper kernel lowered for
CUDA and run in Pallas' Mosaic-GPU interpreter against the same quantization in float32.
The GPU checks (PASS/FAIL per case) and timings are tools/bench_fp8.py's."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import MANY_CPU_THREADS, in_own_process
from MaxText.moe.gmm import fp8_quant, xla, xla_fp8
from MaxText.moe.gmm.mgpu import fp8 as mgpu_fp8, tiling as mgpu_tiling

E4M3_NP = ml_dtypes.float8_e4m3fn


def _np_row_tiles(x):
  m, k = x.shape
  tiles = x.astype(np.float32).reshape(m, k // 128, 128)
  amax = np.abs(tiles).max(-1)
  scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
  q = (tiles * (np.float32(1) / scale)[..., None]).reshape(m, k).astype(E4M3_NP)
  return q, scale.T


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_row_tiles_match_numpy_and_use_the_whole_e4m3_range():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((40, 384)).astype(np.float32) * np.array([1e-3, 1.0, 300.0]).repeat(128)
  x[5, 128:256] = 0.0  # an all-zero tile
  q, scale_KbM = fp8_quant.quantize_row_tiles(jnp.asarray(x))
  _, scale_np = _np_row_tiles(x)
  assert q.dtype == jnp.float8_e4m3fn and scale_KbM.shape == (3, 40) and scale_KbM.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(scale_KbM), scale_np, rtol=2.5e-7)  # amax / 448, to an f32 ulp
  # Every value rounded to e4m3 as NumPy's ml_dtypes rounds x * (1 / scale) (with our scales: no ulp drift).
  ours = np.asarray(scale_KbM).T
  q_np = (x.reshape(40, 3, 128) * (np.float32(1) / ours)[..., None]).reshape(40, 384).astype(E4M3_NP)
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_np.view(np.uint8))
  # Each tile's largest magnitude lands on 448 (e4m3's largest finite value); the zero tile stays 0.
  tile_max = np.abs(np.asarray(q, np.float32)).reshape(40, 3, 128).max(-1)
  assert tile_max[5, 1] == 0 and scale_np[1, 5] == 1.0
  tile_max[5, 1] = 448
  np.testing.assert_array_equal(tile_max, 448)


def test_dequantized_tiles_are_within_e4m3_rounding():
  """Normal e4m3 numbers carry 3 mantissa bits: relative error <= 2^-4 after rounding; below
  2^-6 (subnormals) the error is absolute, <= 2^-10 times the tile's scale."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((64, 256)).astype(np.float32)
  q, s = fp8_quant.quantize_row_tiles(jnp.asarray(x))
  back = np.asarray(fp8_quant.dequantize_row_tiles(q, s))
  scale = np.repeat(np.asarray(s).T, 128, axis=1)
  bound = np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
  assert (np.abs(back - x) <= bound).all()


def test_weight_blocks_match_numpy_and_serve_the_transposed_copy():
  rng = np.random.default_rng(2)
  w = rng.standard_normal((3, 256, 384)).astype(np.float32)
  w[1, :128, 256:] *= 1000.0  # one block far larger than its neighbours: only it changes scale
  q, s = fp8_quant.quantize_blocks(jnp.asarray(w))
  assert s.shape == (3, 2, 3)
  blocks = w.reshape(3, 2, 128, 3, 128)
  want = np.abs(blocks).max(axis=(2, 4)) / 448.0
  np.testing.assert_allclose(np.asarray(s), want, rtol=2.5e-7)
  np.testing.assert_allclose(np.asarray(s)[1, 0, 2] / np.asarray(s)[1, 0, 1], 1000.0, rtol=0.5)
  back = np.asarray(fp8_quant.dequantize_blocks(q, s))
  assert _rel(back, w) < 0.03
  # The transposed copy with transposed scales is the same dequantized matrix, transposed.
  back_t = np.asarray(fp8_quant.dequantize_blocks(q.swapaxes(1, 2), s.swapaxes(1, 2)))
  np.testing.assert_array_equal(back_t, back.swapaxes(1, 2))


def test_shapes_off_the_block_are_refused_by_name():
  with pytest.raises(ValueError, match="K \\(the contraction\\) = 200 must be a multiple of 128"):
    fp8_quant.quantize_row_tiles(jnp.zeros((8, 200)))
  with pytest.raises(ValueError, match="N = 100 must be a multiple of 128"):
    fp8_quant.quantize_blocks(jnp.zeros((2, 128, 100)))


def test_fp8_error_of_a_product_is_the_stated_bound():
  """The accuracy bound per product (docs/fp8.md "Accuracy"; tools/bench_fp8.py's checks): both operands quantized
  (each about 2.5% rms relative for Gaussian values) give about 3.6% relative (Frobenius) error
  against the float32 product; measured 3.65e-2 on the H200 for every DeepSeek-V3 shape. Bound 5%."""
  kx, kw = jax.random.split(jax.random.key(3))
  x = jax.random.normal(kx, (512, 1024), jnp.bfloat16)
  w = (jax.random.normal(kw, (4, 1024, 256)) / 32).astype(jnp.bfloat16)
  gs = jnp.asarray([100, 200, 0, 212], jnp.int32)
  fp8 = xla_fp8.gmm(x, w, gs, group_offset=0, transpose_rhs=False, out_dtype=jnp.float32)
  full = xla.gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs, group_offset=0, transpose_rhs=False,
                 out_dtype=jnp.float32)
  assert 0.02 < _rel(fp8, full) < 0.05


def test_group_blocks_start_every_local_group_on_a_128_row_block():
  """dW's 128x1 tiles must not span two experts: ring EP with groups 1..3 local of sizes 130, 0, 3
  (group 0's 5 rows and the padding rows after row 138 are not local)."""
  layout = fp8_quant.group_blocks(jnp.asarray([5, 130, 0, 3, 9], jnp.int32), 1, 3, 150)
  np.testing.assert_array_equal(layout.block0_L, [0, 2, 2])
  np.testing.assert_array_equal(layout.blocks_L, [2, 0, 1])
  np.testing.assert_array_equal(layout.sizes_L, [256, 0, 128])
  src = np.asarray(layout.src_P)
  assert src.shape == (fp8_quant.num_padded_rows(150, 3),) == (640,)
  np.testing.assert_array_equal(src[:130], np.arange(5, 135))  # group 1 from block 0
  assert (src[130:256] == 150).all()  # its gap: zero rows
  np.testing.assert_array_equal(src[256:259], [135, 136, 137])  # group 3 from block 2
  assert (src[259:] == 150).all()


def test_group_row_blocks_quantize_each_column_per_128_rows():
  rng = np.random.default_rng(7)
  x = rng.standard_normal((150, 256)).astype(np.float32)
  x[:5] = np.nan  # a foreign group's rows: never read
  layout = fp8_quant.group_blocks(jnp.asarray([5, 130, 0, 3, 9], jnp.int32), 1, 3, 150)
  q_blocks, scale = fp8_quant.quantize_group_row_blocks(jnp.asarray(x), layout)
  assert q_blocks.shape == (5, 256, 128) and scale.shape == (5, 256) and not np.isnan(np.asarray(scale)).any()
  qT = fp8_quant.group_row_blocks_KP(q_blocks)  # block b's column k holds rows [128b, 128b + 128) of column k
  np.testing.assert_array_equal(np.asarray(qT[:, 128:256], np.float32), np.asarray(q_blocks[1], np.float32))
  rows = np.zeros((640, 256), np.float32)
  rows[:130], rows[256:259] = x[5:135], x[135:138]
  want = np.abs(rows.reshape(5, 128, 256)).max(1) / 448.0
  np.testing.assert_allclose(np.asarray(scale), np.where(want > 0, want, 1.0), rtol=2.5e-7)
  back = np.asarray(fp8_quant.dequantize_row_tiles(qT, scale)).T
  assert _rel(back, rows) < 0.03 and (back[130:256] == 0).all()


# ------------------------------------------------------------------ the kernel


def _lower(fn, *shapes):
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("transpose", [False, True])
def test_kernel_lowers_for_cuda_at_deepseek_shapes(transpose):
  """Shape plumbing, e4m3 wgmma's K-major operands and the shared-memory budget are checked at
  lowering (no GPU needed): the up-proj forward and its dlhs."""
  w = (32, 7168, 2048)
  lhs = (4096, 2048) if transpose else (4096, 7168)
  text = _lower(lambda x, w, gs: mgpu_fp8.gmm(x, w, gs, transpose_rhs=transpose),
                (lhs, jnp.bfloat16), (w, jnp.bfloat16), ((32,), jnp.int32))
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("gathered", [(False, False), (True, False), (False, True)])
def test_dw_kernel_lowers_for_cuda_at_deepseek_shapes(gathered):
  """Through the backend's protocol entry, as gmm's VJP calls it: one Mosaic kernel for the product and
  one per operand quantized in one pass (the gathered ones are XLA's)."""
  text = _lower(lambda x, d, gs: mgpu_fp8.tgmm(x, d, gs, num_local_groups=32, gathered=gathered),
                ((4096, 7168), jnp.bfloat16), ((4096, 2048), jnp.bfloat16), ((32,), jnp.int32))
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1 + gathered.count(False)


def test_every_fp8_backends_dw_takes_the_gathered_flags():
  import inspect  # pylint: disable=import-outside-toplevel

  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  for name in gmm_lib.FP8_BACKENDS:
    assert "gathered" in inspect.signature(gmm_lib._import_backend(name).tgmm).parameters, name  # pylint: disable=protected-access


def test_tiling_fits_an_f32_epilogue_by_dropping_stages_and_refuses_misaligned_rows():
  t = mgpu_fp8.Fp8Tiling()
  assert t.smem_bytes(2) <= mgpu_fp8.SMEM_LIMIT_BYTES
  f32 = mgpu_fp8.Fp8Tiling(stages=7).fit_output(4)
  assert f32.stages == 4 and f32.smem_bytes(4) <= mgpu_fp8.SMEM_LIMIT_BYTES
  with pytest.raises(ValueError, match="N = 200 must be a multiple of 128"):
    t.validate(64, 128, 200, 2)
  with pytest.raises(ValueError, match="epilogue rows of 32 x 2 B are not a multiple of 128 B"):
    mgpu_fp8.Fp8Tiling(epi_n=32).validate(64, 128, 128, 2)
  mgpu_fp8.Fp8Tiling(epi_n=32).validate(64, 128, 128, 4)
  with pytest.raises(ValueError, match="epilogue rows of 32 x 2 B"):  # the bf16 kernel's tiling: the same rule
    mgpu_tiling.FwdTiling(epi_n=32).validate(128, 256, 2)
  mgpu_tiling.FwdTiling(epi_n=32).validate(128, 256, 4)


def test_profile_traces_fit_beside_the_kernels_for_every_tile():
  """bench_fp8 --profile-dir: the forward's two ranges per tile (full_tile, epilogue) for every tile an SM takes at
  DeepSeek-V3's down-projection (the most tiles: N = 7168), balanced, in the shared memory the 4-stage tiling
  leaves; and dW's one per tile."""
  from MaxText.moe.gmm.mgpu import kernels as mgpu_kernels  # pylint: disable=import-outside-toplevel

  t = mgpu_fp8.Fp8Tiling()
  ranges = mgpu_kernels.profile_ranges(t.smem_bytes(2), t.num_warpgroups)
  windows = 32 * -(-2048 // t.block_m)  # 32 groups of 2,048 rows, each cut into 192-row windows from its first row
  tiles_per_sm = -(-windows * (7168 // t.cta_n) // 132)
  assert ranges >= 2 * tiles_per_sm + 1, (ranges, tiles_per_sm)
  assert mgpu_kernels.compiler_params("/tmp/p", t.smem_bytes(2), t.num_warpgroups).profile_space == ranges
  # dW: one range per 192x128 output tile of 32 experts' [7168, 2048] gradients (38 row tiles, the last shifted)
  from MaxText.moe.gmm.mgpu import fp8_tgmm as mgpu_fp8_tgmm  # pylint: disable=import-outside-toplevel

  dw_ranges = mgpu_kernels.profile_ranges(mgpu_fp8_tgmm.smem_bytes(2), mgpu_fp8_tgmm.COMPUTE_WGS + 1)
  assert dw_ranges >= -(-32 * 38 * 16 // 132) + 1, dw_ranges


def test_dw_tiles_fit_and_a_contraction_under_a_tile_is_refused_by_the_kernel_and_padded_by_the_backend():
  from MaxText.moe.gmm.mgpu import fp8_tgmm as mgpu_fp8_tgmm  # pylint: disable=import-outside-toplevel

  assert mgpu_fp8_tgmm.smem_bytes(2) <= mgpu_fp8.SMEM_LIMIT_BYTES  # four stages beside a bf16 epilogue
  operands = [jax.ShapeDtypeStruct(s, d) for s, d in (
      ((2, 128, 128), fp8_quant.E4M3), ((2, 128), jnp.float32), ((2, 256, 128), fp8_quant.E4M3),
      ((2, 256), jnp.float32), ((1,), jnp.int32), ((1,), jnp.int32))]
  with pytest.raises(ValueError, match="K = 128 is less than a tile's 192 rows"):
    jax.eval_shape(mgpu_fp8_tgmm.transposed_grouped_matmul_fp8, *operands)
  out = jax.eval_shape(functools.partial(mgpu_fp8_tgmm.tgmm, num_local_groups=2),
                       jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
                       jax.ShapeDtypeStruct((2,), jnp.int32))
  assert out.shape == (2, 128, 256)


KERNEL_CASES = {  # name: (sizes, group_offset, num_local, transpose, out_dtype, nan_foreign, tiling)
    "ring_2_of_6_f32_nan_foreign": ([70, 0, 130, 1, 0, 85], 2, 3, False, jnp.float32, True, None),
    "dlhs_all_local_f32": ([70, 0, 130, 1, 0, 85], 0, 6, True, jnp.float32, False, None),
    "one_hot_bf16_rows_past": ([3, 250, 0, 1], 0, 4, False, jnp.bfloat16, False, None),
    "three_stages_ring_f32": ([70, 0, 130, 1, 0, 85], 2, 3, False, jnp.float32, True, mgpu_fp8.Fp8Tiling(stages=3)),
}


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_kernel_interpreted_matches_its_quantization(request, name):
  """The kernel (threads, TMA, barriers and wgmma simulated on the CPU) against the same
  quantization dequantized through float32 ragged_dot: equal up to f32 summation order. On the
  GPU the FP8 MMA's own accumulation adds ~3e-4 (tools/bench_fp8.py).

  The interpreter runs the kernel's four warpgroups as threads, each inside an XLA CPU execution; on a
  2-core machine XLA's CPU client ran three at once and the fourth never started (a deadlock at the first
  barrier). 8 host devices give it the threads, in a process of its own (conftest.in_own_process)."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  sizes, offset, num_local, transpose, out_dtype, nan_foreign, tiling = KERNEL_CASES[name]
  m, k, n = 296, 512, 256  # rows past the groups: 296 - sum(sizes)
  kx, kw = jax.random.split(jax.random.key(4))
  contract, out_cols = (n, k) if transpose else (k, n)
  x = jax.random.normal(kx, (m, contract), jnp.bfloat16)
  if nan_foreign:
    x = x.at[:sum(sizes[:offset]) - 3].set(jnp.nan)
  w = (jax.random.normal(kw, (num_local, k, n)) / 16).astype(jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = mgpu_fp8.gmm(x, w, gs, group_offset=offset, transpose_rhs=transpose, out_dtype=out_dtype,
                       tiling=tiling or mgpu_fp8.Fp8Tiling())
    got = np.asarray(jax.block_until_ready(got), np.float32)
  want = np.asarray(xla_fp8.gmm(x, w, gs, group_offset=offset, transpose_rhs=transpose,
                                           out_dtype=jnp.float32))
  assert got.shape == (m, out_cols) and not np.isnan(got).any()
  lo, hi = sum(sizes[:offset]), sum(sizes[:offset + num_local])
  assert (got[:lo] == 0).all() and (got[hi:] == 0).all()
  tol = 1e-5 if out_dtype == jnp.float32 else 1e-2
  assert _rel(got, want) < tol
  if name == "ring_2_of_6_f32_nan_foreign" and plgpu:  # the FP8 dispatch's path: lhs quantized before the kernel
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
      tiled = mgpu_fp8.gmm(x, w, gs, group_offset=offset, transpose_rhs=transpose, out_dtype=out_dtype,
                           lhs_tiles=fp8_quant.quantize_rows(x))
      np.testing.assert_array_equal(np.asarray(jax.block_until_ready(tiled), np.float32), got)


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_the_unpromoted_diagnostic_is_the_unscaled_sum(request):
  """Fp8Tiling(promote=False), bench_fp8's timing diagnostic: one accumulator over the whole contraction, no scales.
  With every tile's and block's amax at 448 every scale is 1, so it must equal the promoted kernel exactly; it also
  lowers for CUDA at DeepSeek-V3's shapes."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  diagnostic = mgpu_fp8.Fp8Tiling(promote=False)
  assert "mosaic_gpu" in _lower(lambda x, w, gs: mgpu_fp8.gmm(x, w, gs, tiling=diagnostic),
                                ((4096, 7168), jnp.bfloat16), ((32, 7168, 2048), jnp.bfloat16), ((32,), jnp.int32))
  m, k, n = 296, 512, 256
  kx, kw = jax.random.split(jax.random.key(0))
  x = (448 * jnp.sign(jax.random.normal(kx, (m, k)))).astype(jnp.bfloat16)
  w = (448 * jnp.sign(jax.random.normal(kw, (3, k, n)))).astype(jnp.bfloat16)
  gs = jnp.asarray([100, 0, 150], jnp.int32)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = np.asarray(jax.block_until_ready(mgpu_fp8.gmm(x, w, gs, tiling=diagnostic, out_dtype=jnp.float32)))
    want = np.asarray(jax.block_until_ready(mgpu_fp8.gmm(x, w, gs, out_dtype=jnp.float32)))
  np.testing.assert_array_equal(got, want)
  assert (got[250:] == 0).all() and np.abs(got[:250]).max() > 1e6


# ------------------------------------------------------------------ the backends, the VJP, the key


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmms_vjp_tells_fp8_backends_which_dw_operand_is_gathered(monkeypatch, transpose_rhs):
  """gathered names (lhs, dout); dW's backend call takes (a, b) = (lhs, dout), or (dout, lhs) for a
  [G, N, K] rhs: the flags must follow their operands. The values do not depend on them."""
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  seen = []
  real = xla_fp8.tgmm
  monkeypatch.setattr(xla_fp8, "tgmm", lambda *a, **kw: (seen.append(kw["gathered"]), real(*a, **kw))[1])
  x = jax.random.normal(jax.random.key(1), (256, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (2, 256, 128) if transpose_rhs else (2, 128, 256), jnp.float32)
  gs = jnp.asarray([100, 156], jnp.int32)
  f = lambda x, w, flags: gmm_lib.gmm(x, w, gs, backend="xla_fp8", transpose_rhs=transpose_rhs, gathered=flags)
  grads = [jax.grad(lambda x, w: f(x, w, flags).sum(), argnums=(0, 1))(x, w) for flags in ((True, False), (False, False))]
  assert seen == [(False, True) if transpose_rhs else (True, False), (False, False)]
  for a, b in zip(*grads):
    np.testing.assert_array_equal(a, b)


def test_the_expert_ffn_marks_the_dispatched_rows_and_the_combines_cotangent_as_gathered(monkeypatch):
  """x_MD (wi_0, wi_1's lhs) and wo's output cotangent are gathers of token rows; h and its gradients
  are not. A bf16 backend ignores the flags."""
  from MaxText.moe import block  # pylint: disable=import-outside-toplevel

  seen = []
  real = block.gmm
  monkeypatch.setattr(block, "gmm", lambda *a, **kw: (seen.append(kw["gathered"]), real(*a, **kw))[1])
  d, f, e = 128, 128, 2
  experts = block.Experts(*(jax.random.normal(jax.random.key(i), s, jnp.float32) / 16
                            for i, s in enumerate(((e, d, f), (e, d, f), (e, f, d)))))
  meta = type("Meta", (), dict(group_sizes_G=jnp.asarray([60, 68], jnp.int32), group_offset=0))()
  cfg = block.BlockConfig(router=None, gmm_backend="xla")
  block.expert_ffn(jax.random.normal(jax.random.key(5), (128, d), jnp.float32), meta, experts, cfg)
  assert seen == [(True, False), (True, False), (False, True)]


def test_xla_fp8_through_gmms_vjp_quantizes_all_three_products():
  """gmm's custom VJP with the FP8 backend: the forward and dlhs are products of blockwise-quantized
  operands (dlhs quantizes dout's rows and the weights' blocks); dW of 128-row blocks of both."""
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  kx, kw, kd = jax.random.split(jax.random.key(6), 3)
  x = jax.random.normal(kx, (300, 256), jnp.float32)
  w = jax.random.normal(kw, (3, 256, 384), jnp.float32) / 16
  dout = jax.random.normal(kd, (300, 384), jnp.float32)
  gs = jnp.asarray([90, 0, 200, 7], jnp.int32)  # 3 rows past the groups; group 3 is not local
  out, pullback = jax.vjp(lambda x, w: gmm_lib.gmm(x, w, gs, backend="xla_fp8"), x, w)
  dx, dw = pullback(dout)
  q = lambda a: fp8_quant.dequantize_row_tiles(*fp8_quant.quantize_row_tiles(a))  # noqa: E731
  qw = fp8_quant.dequantize_blocks(*fp8_quant.quantize_blocks(w))
  kw_ = dict(group_offset=0, out_dtype=jnp.float32)
  np.testing.assert_allclose(out, xla.gmm(q(x), qw, gs, transpose_rhs=False, **kw_), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, xla.gmm(q(dout), qw, gs, transpose_rhs=True, **kw_), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, xla_fp8.tgmm(x, dout, gs, group_offset=0, num_local_groups=3, out_dtype=jnp.float32),
                             rtol=1e-5, atol=1e-5)
  assert 0.02 < _rel(dw, xla.tgmm(x, dout, gs, group_offset=0, num_local_groups=3, out_dtype=jnp.float32)) < 0.05
  assert (np.asarray(out)[297:] == 0).all() and 0.02 < _rel(dx, xla.gmm(dout, w, gs, transpose_rhs=True, **kw_)) < 0.05


@pytest.mark.parametrize("remat", [False, True], ids=["saved", "remat"])
def test_a_weight_is_quantized_once_per_step(remat):
  """The forward, dlhs (and a remat's forward again) quantize the same weight to the same blocks: the compiled
  step has one block-amax reduction per weight, so "weights once per step" holds for one microbatch
  (the compiled H200 step's HLO, tests/hlo_fp8_passes.py: the GPU pipeline then re-reads the bf16 weight per
  consumer fusion)."""
  import re  # pylint: disable=import-outside-toplevel

  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  x = jax.random.normal(jax.random.key(0), (512, 256), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (4, 256, 384), jnp.bfloat16)
  gs = jnp.full((4,), 128, jnp.int32)
  loss = lambda x, w: jnp.sum(gmm_lib.gmm(x, w, gs, backend="xla_fp8").astype(jnp.float32) ** 2)  # noqa: E731
  step = jax.jit(jax.grad(jax.checkpoint(loss) if remat else loss, argnums=(0, 1)))
  hlo = step.lower(x, w).compile().as_text()
  block_amax = re.findall(r"= f32\[4,(?:2,3|3,2)\]\{[\d,]*\} reduce\(", hlo)  # [G, K/128, N/128] or transposed
  assert len(block_amax) == 1, block_amax


@pytest.mark.parametrize("cc, want", [("9.0", None), ("8.0", "no FP8 tensor cores"), ("7.0", "no FP8 tensor cores"),
                                      ("8.9", "written for Hopper's wgmma"), ("10.0", "Transformer Engine's MXFP8"),
                                      ("12.0", "past Hopper"), ("", "no FP8 tensor cores")])
def test_fp8_refuses_gpus_its_kernel_cannot_run_on(cc, want):
  from MaxText.config import checks as config_checks  # pylint: disable=import-outside-toplevel

  why = config_checks.fp8_gpu_refusal(cc)
  assert why is None if want is None else (want in why and "moe_fp8=none" in why)


def test_the_key_picks_the_fp8_backend_and_refuses_what_it_does_not_support(tmp_path):
  from pathlib import Path  # pylint: disable=import-outside-toplevel

  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from patches import routed_moe  # pylint: disable=import-outside-toplevel

  tiny = str(Path(__file__).resolve().parent.parent / "configs/deepseek3-tiny.yml")
  run = fork_config.load([tiny, "moe_block=ours", "moe_fp8=blockwise"])
  assert routed_moe.settings_from(run.fork)["gmm"] == "xla_fp8"  # CPU: emulated; mgpu_fp8 on a GPU
  assert routed_moe.settings_from(fork_config.load([tiny, "moe_block=ours"]).fork)["gmm"] == "auto"
  with pytest.raises(fork_config.ConfigError, match="'moe_fp8' = 'blockwise' .* and 'moe_block' = 'upstream'"):
    fork_config.load([tiny, "moe_block=upstream", "moe_fp8=blockwise"])
  with pytest.raises(fork_config.ConfigError, match="'moe_fp8' = 'blockwise' .* and 'moe_gmm_backend' = 'mgpu'"):
    fork_config.load([tiny, "moe_block=ours", "moe_fp8=blockwise", "moe_gmm_backend=mgpu"])
  with pytest.raises(fork_config.ConfigError, match="moe_fp8"):
    fork_config.load([tiny, "moe_block=ours", "moe_fp8=nvfp4"])


DW_CASES = {  # name: (sizes, group_offset, num_local, out_dtype, K)
    # K = 512: tiles of 192 rows at 0 and 192, and the last shifted back to 320, whose first 64 rows it must not store
    "ring_2_of_6_f32_nan_foreign": ([70, 0, 130, 1, 0, 85], 2, 3, jnp.float32, 512),
    "all_local_bf16_empty_groups": ([70, 0, 130, 1, 0, 85], 0, 6, jnp.bfloat16, 384),  # two whole tiles
    "toy_width_f32": ([70, 0, 130, 1, 0, 85], 0, 6, jnp.float32, 128),  # under a tile: padded to 256
}


@pytest.mark.parametrize("name", sorted(DW_CASES))
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_dw_kernel_interpreted_matches_its_quantization(request, name):
  """As the forward's test: four warpgroup threads (three compute) need a process of their own."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  from MaxText.moe.gmm.mgpu import fp8_tgmm as mgpu_fp8_tgmm  # pylint: disable=import-outside-toplevel

  sizes, offset, num_local, out_dtype, k = DW_CASES[name]
  m, n = 296, 384
  kx, kd = jax.random.split(jax.random.key(8))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  if offset:
    x = x.at[:3].set(jnp.nan)  # rows of a group before the local ones
  d = jax.random.normal(kd, (m, n), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = mgpu_fp8_tgmm.tgmm(x, d, gs, group_offset=offset, num_local_groups=num_local, out_dtype=out_dtype)
    got = np.asarray(jax.block_until_ready(got), np.float32)
  want = np.asarray(xla_fp8.tgmm(x, d, gs, group_offset=offset, num_local_groups=num_local, out_dtype=jnp.float32))
  assert got.shape == (num_local, k, n) and not np.isnan(got).any()
  empty = [g for g in range(num_local) if sizes[offset + g] == 0]
  assert empty and all((got[g] == 0).all() for g in empty)
  assert _rel(got, want) < (1e-5 if out_dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("num_sms", [1, 2])
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_dw_ring_runs_through_an_sms_tiles_interpreted(request, monkeypatch, num_sms):
  """Few simulated SMs, so that each runs many tiles through one ring of 4 slots: groups of 1, 3, 6 and 0
  blocks wrap it mid-tile and across tiles, the memory warpgroup loading the next tile while the compute
  warpgroups finish this one. Against the same quantization through float32. Not under the interpreter's race
  detector: it reports the compute warpgroups' scale loads against the TMA that filled the slot (plain loads
  of TMA-written shared memory), for JAX's own emit_pipeline_warp_specialized (the kernel before 227d6f6)
  as for this ring, on any SM that runs two steps or more, though the slot's `full` barrier orders them."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  from MaxText.moe.gmm.mgpu import fp8_tgmm as mgpu_fp8_tgmm, kernels as mgpu_kernels  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(mgpu_kernels, "num_sms", lambda: num_sms)
  sizes, k, n = [100, 300, 0, 700, 0], 384, 256  # 1, 3, 0, 6, 0 blocks of 128 rows
  m = sum(sizes) + 20
  kx, kd = jax.random.split(jax.random.key(9))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  d = jax.random.normal(kd, (m, n), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = mgpu_fp8_tgmm.tgmm(x, d, gs, num_local_groups=len(sizes), out_dtype=jnp.float32)
    got = np.asarray(jax.block_until_ready(got), np.float32)
  want = np.asarray(xla_fp8.tgmm(x, d, gs, group_offset=0, num_local_groups=len(sizes), out_dtype=jnp.float32))
  assert (got[2] == 0).all() and (got[4] == 0).all()
  assert _rel(got, want) < 1e-5


@pytest.mark.slow  # two short training runs
def test_a_tiny_run_with_fp8_experts_trains_like_the_unquantized_one(tmp_path):
  """The entry point with moe_fp8=blockwise on CPU (xla_fp8: the kernel's quantization emulated) against
  the same run without it: the log names the FP8 backend, and the losses stay within the stated
  tolerance (0.5% relative over 8 steps of the tiny model; DeepSeek-V3 reports < 0.25% at scale)."""
  from conftest import run_train  # pylint: disable=import-outside-toplevel

  common = ("steps=8", "enable_checkpointing=false", "moe_block=ours", "base_num_decoder_layers=4",
            "max_target_length=64", "per_device_batch_size=8")
  fp8 = run_train(tmp_path, *common, "moe_fp8=blockwise", run_name="fp8")
  assert fp8.returncode == 0, fp8.stderr[-3000:]
  base = run_train(tmp_path, *common, run_name="base")
  assert base.returncode == 0, base.stderr[-3000:]
  assert "grouped-GEMM backend xla_fp8" in fp8.stdout
  assert "(dispatch local in fp8, gmm xla_fp8, EP 1)" in fp8.stdout  # tokens quantized before the dispatch
  a, b = fp8.losses(), base.losses()
  assert sorted(a) == sorted(b) and len(a) == 8
  worst = max(abs(a[s] - b[s]) / b[s] for s in a)
  print(f"fp8 vs unquantized, worst relative loss difference over 8 steps: {worst:.2e}")
  assert 0 < worst < 5e-3
