"""The one-pass quantization kernels of blockwise FP8 (`mgpu_fp8_quant`) and where gmm's VJP uses them: each
lowered for CUDA and interpreted bit for bit against `fp8_quant` (tests/test_fp8.py tests fp8_quant against NumPy)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MANY_CPU_THREADS, in_own_process
from MaxText.moe.gmm import fp8_quant, xla_fp8
from MaxText.moe.gmm.mgpu import fp8 as mgpu_fp8, fp8_quant_kernels as mgpu_fp8_quant


def _lower(fn, *shapes):
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_each_padded_block_is_one_run_of_source_rows():
  """The one-pass kernel's view of the layout: a block is `valid` consecutive source rows from `row0`
  (no block spans two groups), then the gap's zero rows; blocks of the bound's slack have none."""
  layout = fp8_quant.group_blocks(jnp.asarray([5, 130, 0, 3, 9], jnp.int32), 1, 3, 150)
  row0, valid = mgpu_fp8_quant.block_rows(layout, 150)
  np.testing.assert_array_equal(valid, [128, 2, 3, 0, 0])
  np.testing.assert_array_equal(row0[:3], [5, 133, 135])
  src = np.asarray(layout.src_P).reshape(5, 128)
  for b in range(5):
    np.testing.assert_array_equal(src[b, :valid[b]], row0[b] + np.arange(valid[b]))
    assert (src[b, valid[b]:] == 150).all()


def test_dw_quantize_kernel_lowers_for_cuda_at_deepseek_shapes():
  def quantize(x, gs):
    return mgpu_fp8_quant.quantize_group_row_blocks(x, fp8_quant.group_blocks(gs, 0, 32, x.shape[0]))

  for k in (7168, 2048):
    assert "mosaic_gpu" in _lower(quantize, ((4096, k), jnp.bfloat16), ((32,), jnp.int32))


def test_row_tile_quantize_kernel_lowers_for_cuda_at_deepseek_shapes():
  for k in (7168, 2048):
    assert "mosaic_gpu" in _lower(mgpu_fp8_quant.quantize_row_tiles, ((4096, k), jnp.bfloat16))
  with pytest.raises(ValueError, match="K = 200 must be a multiple of 128"):
    mgpu_fp8_quant.quantize_row_tiles(jnp.zeros((8, 200), jnp.bfloat16))


ROW_QUANT_CASES = {  # name: (m, k, dtype)
    "bf16_last_block_past_m": (296, 256, jnp.bfloat16),  # the last 128-row box runs 88 rows past M
    "f32_eight_tiles_per_block": (256, 1024, jnp.float32),
}


@pytest.mark.parametrize("name", sorted(ROW_QUANT_CASES))
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_row_tile_quantize_kernel_interpreted_is_bit_for_bit_fp8_quant(name):
  """The one-pass 1x128 kernel gives exactly fp8_quant.quantize_row_tiles's bytes and scales: a zero row (scale 1),
  a NaN tile (NaN stays in its own tile), a tile with a large row, and rows past M written nowhere."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  m, k, dtype = ROW_QUANT_CASES[name]
  x = (jax.random.normal(jax.random.key(1), (m, k)) * 4).astype(dtype)
  x = x.at[5].set(0).at[7, :128].set(jnp.nan).at[9, 200:].set(1e4)
  want_q, want_s = fp8_quant.quantize_row_tiles(x)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got_q, got_s = jax.block_until_ready(mgpu_fp8_quant.quantize_row_tiles(x))
  assert got_q.shape == (m, k) and got_s.shape == (k // 128, m)
  np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))
  np.testing.assert_array_equal(np.asarray(got_q).view(np.uint8), np.asarray(want_q).view(np.uint8))
  assert np.isnan(np.asarray(got_q[7, :128], np.float32)).all() and not np.isnan(np.asarray(got_q[7, 128:],
                                                                                          np.float32)).any()


DW_QUANT_CASES = {  # name: (m, k, sizes, group_offset, num_local)
    "ring_2_of_6_nan_foreign_past_m": (296, 256, [70, 0, 130, 1, 0, 85], 2, 3),  # the last block's box runs past M
    "one_hot_expert": (2048, 384, [8, 1900, 20, 120], 0, 4),
    "rows_past_groups_empty_group": (1024, 128, [100, 0, 300, 37], 0, 4),
}


@pytest.mark.parametrize("name", sorted(DW_QUANT_CASES))
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_dw_quantize_kernel_interpreted_is_bit_for_bit_fp8_quant(name):
  """The one-pass kernel (TMA, shared memory and the warpgroup's transposed store simulated on the CPU)
  gives exactly fp8_quant.quantize_group_row_blocks's bytes and scales: the same f32 amax and division.
  NaN in a foreign group's rows, and the next group's rows inside a block's TMA box, leak nowhere."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  m, k, sizes, offset, num_local = DW_QUANT_CASES[name]
  x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16) * 4
  if offset:
    x = x.at[:sum(sizes[:offset])].set(jnp.nan)
  layout = fp8_quant.group_blocks(jnp.asarray(sizes, jnp.int32), offset, num_local, m)
  want_q, want_s = fp8_quant.quantize_group_row_blocks(x, layout)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got_q, got_s = jax.block_until_ready(mgpu_fp8_quant.quantize_group_row_blocks(x, layout))
  np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))
  np.testing.assert_array_equal(np.asarray(got_q).view(np.uint8), np.asarray(want_q).view(np.uint8))
  assert not np.isnan(np.asarray(got_q, np.float32)).any()




# ------------------------------------------------------------------ dW's lhs from the FP8 dispatch's tiles


def test_requantize_kernel_lowers_for_cuda_at_deepseek_shapes():
  def requantize(q, s, gs):
    layout = fp8_quant.group_blocks(gs, 0, 32, q.shape[0])
    return mgpu_fp8_quant.requantize_group_row_blocks(fp8_quant.RowTiles(q, s), layout, jnp.bfloat16)

  for k in (7168, 2048):
    assert "mosaic_gpu" in _lower(requantize, ((4096, k), fp8_quant.E4M3), ((4096, k // 128), jnp.float32),
                                  ((32,), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", sorted(DW_QUANT_CASES))
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_requantize_kernel_interpreted_is_bit_for_bit_the_dequantized_rows_quantized(name, dtype):
  """From tiles, the bytes and scales fp8_quant gives the rows' values in dtype (what gmm's VJP holds): each
  value rounded to dtype before the amax. A NaN tile of a foreign group and the next group's rows inside a box
  leak nowhere, and groups start at rows that are no multiple of 4 (row 201: on the H200 a scale box that started
  there in its minor dimension stopped the kernel, 2026-12-03)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  m, k, sizes, offset, num_local = DW_QUANT_CASES[name]
  x = jax.random.normal(jax.random.key(9), (m, k), jnp.float32) * 4
  x = x.at[11, 100:].set(3e4)  # one row's tiles far from the others: its scale is not its block's
  if offset:
    x = x.at[:sum(sizes[:offset])].set(jnp.nan)
  tiles = fp8_quant.quantize_rows(x)
  layout = fp8_quant.group_blocks(jnp.asarray(sizes, jnp.int32), offset, num_local, m)
  want_q, want_s = fp8_quant.quantize_group_row_blocks(fp8_quant.dequantize_rows(tiles, k, dtype), layout)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got_q, got_s = jax.block_until_ready(mgpu_fp8_quant.requantize_group_row_blocks(tiles, layout, dtype))
  np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))
  np.testing.assert_array_equal(np.asarray(got_q).view(np.uint8), np.asarray(want_q).view(np.uint8))
  assert not np.isnan(np.asarray(got_q, np.float32)).any()


@pytest.mark.parametrize("k", [pytest.param(128, marks=pytest.mark.slow), 384], ids=["toy_width_padded", "three_blocks"])
def test_dw_given_the_tiles_multiplies_the_bytes_it_would_quantize_from_their_values(monkeypatch, k):
  """mgpu_fp8_tgmm.tgmm with lhs_tiles or dout_tiles hands the product kernel the same operands as with the
  operand = their values in bf16, also where K under a tile is padded to 256 (the tiles' columns too) and N
  (200) to 256. The product kernel is replaced by one that returns its operands; the quantization kernels run
  interpreted."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  from MaxText.moe.gmm.mgpu import fp8_tgmm as mgpu_fp8_tgmm  # pylint: disable=import-outside-toplevel

  seen = []

  def operands(*args, out_dtype):
    seen.append([np.asarray(a).view(np.uint8) if a.dtype == fp8_quant.E4M3 else np.asarray(a) for a in args])
    return jnp.zeros((len(args[4]), args[0].shape[1], args[2].shape[1]), out_dtype)

  monkeypatch.setattr(mgpu_fp8_tgmm, "transposed_grouped_matmul_fp8", operands)
  m, n, sizes = 296, 200, jnp.asarray([70, 0, 130, 1, 0, 85], jnp.int32)
  kx, kd = jax.random.split(jax.random.key(3))
  x_tiles = fp8_quant.quantize_rows(jax.random.normal(kx, (m, k), jnp.float32) * 3)
  d_tiles = fp8_quant.quantize_rows(jax.random.normal(kd, (m, n), jnp.float32) * jnp.logspace(-3, 2, m)[:, None])
  x, d = fp8_quant.dequantize_rows(x_tiles, k, jnp.bfloat16), fp8_quant.dequantize_rows(d_tiles, n, jnp.bfloat16)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    for tiles in ({}, {"lhs_tiles": x_tiles}, {"dout_tiles": d_tiles}, {"lhs_tiles": x_tiles, "dout_tiles": d_tiles}):
      mgpu_fp8_tgmm.tgmm(x, d, sizes, num_local_groups=6, **tiles)
  for got_operands in seen[1:]:
    for want, got in zip(seen[0], got_operands):
      np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ which pass each product's lhs takes


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["forward", "dlhs"])
def test_a_materialized_lhs_is_quantized_by_the_one_pass_kernel_and_a_gathered_one_by_xla(transpose_rhs):
  """One Mosaic kernel for the product, and one for the lhs unless it is a gather of token rows."""
  w, lhs = ((32, 7168, 2048), (4096, 2048)) if transpose_rhs else ((32, 7168, 2048), (4096, 7168))
  for gathered, kernels in ((False, 2), (True, 1)):
    text = _lower(lambda x, w, gs, g=gathered: mgpu_fp8.gmm(x, w, gs, transpose_rhs=transpose_rhs, lhs_gathered=g),
                  (lhs, jnp.bfloat16), (w, jnp.bfloat16), ((32,), jnp.int32))
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == kernels


def test_gmms_vjp_gives_each_product_its_operands_gathered_flag_and_dw_the_tiles(monkeypatch):
  """The forward's lhs is gathered[0], dlhs's lhs (the output's cotangent) gathered[1]; dW gets both, and the
  forward's lhs_tiles for its lhs. None of it changes a value."""
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  seen = []
  real_gmm, real_tgmm = xla_fp8.gmm, xla_fp8.tgmm
  monkeypatch.setattr(xla_fp8, "gmm", lambda *a, **kw: (seen.append(("gmm", kw["lhs_gathered"])), real_gmm(*a, **kw))[1])
  monkeypatch.setattr(xla_fp8, "tgmm", lambda *a, **kw: (seen.append(("tgmm", kw["gathered"], kw.get("lhs_tiles") is not None)),
                                                         real_tgmm(*a, **kw))[1])
  tiles = fp8_quant.quantize_rows(jax.random.normal(jax.random.key(1), (256, 128), jnp.float32))
  x = fp8_quant.dequantize_rows(tiles, 128, jnp.float32)
  w = jax.random.normal(jax.random.key(2), (2, 128, 256), jnp.float32)
  gs = jnp.asarray([100, 156], jnp.int32)

  def loss(x, w, flags, lhs_tiles):
    return gmm_lib.gmm(x, w, gs, backend="xla_fp8", gathered=flags, lhs_tiles=lhs_tiles).sum()

  grads = [jax.grad(loss, argnums=(0, 1))(x, w, flags, t) for flags, t in (((True, False), tiles), ((False, True), None))]
  assert seen == [("gmm", True), ("gmm", False), ("tgmm", (True, False), True),
                  ("gmm", False), ("gmm", True), ("tgmm", (False, True), False)]
  for a, b in zip(*grads):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_backward_hands_the_cotangents_tiles_to_dlhs_and_dw(monkeypatch, transpose_rhs):
  """gmm.backward's dout_tiles (the FP8 combine's cotangent, fp8_dispatch): dlhs multiplies them as its lhs, dW
  requantizes them for its dout (its lhs where transpose_rhs swaps dW's operands); without them, nothing is
  passed. Values as with the tiles' values alone: xla_fp8 requantizes those."""
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  seen = []
  real_gmm, real_tgmm = xla_fp8.gmm, xla_fp8.tgmm
  monkeypatch.setattr(xla_fp8, "gmm", lambda *a, **kw: (seen.append(("gmm", "lhs_tiles" in kw)), real_gmm(*a, **kw))[1])
  monkeypatch.setattr(xla_fp8, "tgmm", lambda *a, **kw: (seen.append(("tgmm", "lhs_tiles" in kw, "dout_tiles" in kw)),
                                                         real_tgmm(*a, **kw))[1])
  x = jax.random.normal(jax.random.key(1), (256, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (2, 256, 128) if transpose_rhs else (2, 128, 256), jnp.float32)
  d_tiles = fp8_quant.quantize_rows(jax.random.normal(jax.random.key(3), (256, 256), jnp.float32))
  dout = fp8_quant.dequantize_rows(d_tiles, 256, jnp.float32)
  gs = jnp.asarray([100, 156], jnp.int32)
  operands, static = gmm_lib.prepare(x, w, gs, backend="xla_fp8", transpose_rhs=transpose_rhs)
  _, residuals = gmm_lib.forward(operands, static)
  seen.clear()
  with_tiles = gmm_lib.backward(static, residuals, dout, dout_tiles=d_tiles)
  without = gmm_lib.backward(static, residuals, dout)
  dw_tiles = ("tgmm", True, False) if transpose_rhs else ("tgmm", False, True)
  assert seen == [("gmm", True), dw_tiles, ("gmm", False), ("tgmm", False, False)]
  for a, b in zip(with_tiles, without):
    if a is not None:
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_dlhs_multiplies_the_blocks_the_forward_quantized(monkeypatch, transpose_rhs):
  """FP8 gmm quantizes its weight once, in the forward (zero-padded to whole blocks: K = 136 and N = 200 here), and
  hands the blocks to dlhs through the VJP's residuals: both products get rhs_blocks, and the gradients are, bit for
  bit, those of each product quantizing the weight itself (an empty group and rows past the groups included)."""
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  seen = []
  real_gmm = xla_fp8.gmm
  monkeypatch.setattr(xla_fp8, "gmm", lambda *a, **kw: (seen.append(kw.get("rhs_blocks") is not None),
                                                        real_gmm(*a, **kw))[1])
  x = jax.random.normal(jax.random.key(1), (200, 136), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (3, 200, 136) if transpose_rhs else (3, 136, 200), jnp.float32)
  ct = jax.random.normal(jax.random.key(3), (200, 200), jnp.float32)
  gs = jnp.asarray([50, 0, 120], jnp.int32)

  def loss(x, w):
    return (gmm_lib.gmm(x, w, gs, backend="xla_fp8", transpose_rhs=transpose_rhs) * ct).sum()

  got = jax.grad(loss, argnums=(0, 1))(x, w)
  assert seen == [True, True]  # the forward's product, then dlhs's
  monkeypatch.setattr(xla_fp8, "gmm", lambda *a, rhs_blocks=None, **kw: real_gmm(*a, **kw))
  want = jax.grad(loss, argnums=(0, 1))(x, w)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  assert float(jnp.abs(got[1]).max()) > 0 and float(jnp.abs(got[0][170:]).max()) == 0


def test_weight_block_kernel_lowers_for_cuda_at_deepseek_shapes():
  for shape in ((32, 7168, 4096), (32, 2048, 7168)):
    assert "mosaic_gpu" in _lower(mgpu_fp8_quant.quantize_weight_blocks_both, (shape, jnp.bfloat16))
  with pytest.raises(ValueError, match="K = 200 and N = 128 must be multiples of 128"):
    mgpu_fp8_quant.quantize_weight_blocks_both(jnp.zeros((2, 200, 128), jnp.bfloat16))


@pytest.mark.parametrize("chunk", [4, 1])
def test_weight_block_kernel_interpreted_is_bit_for_bit_fp8_quant(chunk):  # ~5 s interpreted: the fast tier
  """The one-pass 128x128 kernel gives exactly fp8_quant.quantize_weight_blocks's bytes and scales, and the same
  bytes transposed: a zero block (scale 1), a block with one large value, a block with a NaN; three column blocks
  per grid block (each store buffer reused) and one."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  w = (jax.random.normal(jax.random.key(1), (2, 256, 384)) * 4).astype(jnp.bfloat16)
  w = w.at[0, :128, :128].set(0).at[1, 130, 300].set(jnp.nan).at[1, 5, 5].set(1e4)
  want_q, want_s = fp8_quant.quantize_weight_blocks(w)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    q, q_t, s = jax.block_until_ready(mgpu_fp8_quant.quantize_weight_blocks_both(w, chunk=chunk))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
  assert float(s[0, 0, 0]) == 1.0
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(want_q).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(q_t).view(np.uint8), np.asarray(want_q.swapaxes(1, 2)).view(np.uint8))


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.slow  # long on CPU (interpreted kernels): --all only
def test_the_forward_multiplies_the_one_pass_kernels_blocks_exactly(request, transpose_rhs):
  """mgpu_fp8's forward with the blocks `quantize_weight` wrote in both layouts in one pass (the transposed copy
  read where the kernel wants [G, out, contraction]) gives, bit for bit, the forward that quantizes the weight
  itself: an empty group, rows past the groups, K and N not multiples of 128 (padded)."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  m, k, n = 296, 200, 136
  x = jax.random.normal(jax.random.key(1), (m, n if transpose_rhs else k), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(2), (3, k, n)) / 8).astype(jnp.bfloat16)
  w = w.swapaxes(1, 2) if transpose_rhs else w
  gs = jnp.asarray([100, 0, 150], jnp.int32)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    blocks = mgpu_fp8.quantize_weight(w)
    got = mgpu_fp8.gmm(x, w, gs, transpose_rhs=transpose_rhs, out_dtype=jnp.float32, rhs_blocks=blocks)
    want = mgpu_fp8.gmm(x, w, gs, transpose_rhs=transpose_rhs, out_dtype=jnp.float32)
    got, want = (np.asarray(jax.block_until_ready(a)) for a in (got, want))
  assert blocks.q_GNK is not None
  np.testing.assert_array_equal(got, want)
  assert np.abs(got[:250]).max() > 0 and (got[250:] == 0).all()


def test_the_vjp_keeps_only_the_blocks_dlhs_reads():
  """The forward's transposed copy of the weight's blocks is not a residual: dlhs reads the stored layout, and the
  copy would hold a second e4m3 weight per expert matrix from the forward to the backward."""
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  static = gmm_lib._Static(backend="mgpu_fp8", transpose_rhs=False, out_dtype=np.dtype(jnp.bfloat16))  # pylint: disable=protected-access
  operands = (jax.ShapeDtypeStruct((512, 256), jnp.bfloat16), None, jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16),
              jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
  _, residuals = jax.eval_shape(lambda *ops: gmm_lib.forward(ops, static), *operands)
  blocks = residuals[-1]
  assert isinstance(blocks, fp8_quant.WeightBlocks) and blocks.q_GNK is None
  assert blocks.q_GKN.shape == (4, 256, 384) and blocks.q_GKN.dtype == fp8_quant.E4M3
