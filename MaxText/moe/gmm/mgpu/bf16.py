"""Grouped-GEMM backend "mgpu": Pallas Mosaic-GPU kernels for Hopper (see GMM protocol in
`MaxText/moe/gmm/__init__.py`).

  gmm  -> `kernels.grouped_matmul` (warp-specialized, work-table scheduled, zero-fills
          rows outside the local groups, rhs optionally transposed for dlhs), or with
          `FwdTiling.pingpong` -> `pingpong.grouped_matmul_pingpong` (the same contract,
          compute warpgroups on alternate tiles; off: slower on the H200, docs/kernels.md, "Tried, and why it did not help")
  tgmm -> `tgmm.transposed_grouped_matmul` (dW over the local groups only)

Tilings come from `tiling.TABLE`, keyed by the per-group product's (K, N).
`jax_ragged_dot` / `jax_transposed_ragged_dot` expose JAX's own kernels with the same
tilings, as the baseline `tools/bench_gmm.py` measures ours against.

Requires a Hopper GPU (compute capability 9.x) and jax >= 0.11 with the CUDA plugin
(`pip install "jax[cuda13]"`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from MaxText.moe.gmm import _pad

NAME = "mgpu"
_DTYPES = (jnp.bfloat16, jnp.float16)
# TMA with the (8, 64) swizzle tiling rejects arrays whose row count is not a multiple of 8
# (seen on the H200: "dimension 0 must have size smaller or a multiple of its tiling 8").
_ROW_MULTIPLE = 8


def _fwd_align(tiling) -> _pad.Align:
  """What grouped_matmul needs (FwdTiling.validate): K a multiple of block_k, N of a tile's
  columns (FwdTiling.n_multiple); rows of 8 for TMA. The table's shapes need no padding; a
  small or odd shape (K=8, N=6) is padded up to one tile (wasteful but correct; such shapes
  are tests and toys, not training)."""
  return _pad.Align(m=_ROW_MULTIPLE, k=tiling.block_k, n=tiling.n_multiple)


def _tgmm_align(tiling) -> _pad.Align:
  """What transposed_grouped_matmul needs (TgmmTiling.validate): K (its output rows) a
  multiple of block_m, N of cta_n; rows of 8 for TMA."""
  return _pad.Align(m=_ROW_MULTIPLE, k=tiling.block_m, n=tiling.cta_n)


def unavailable_reason() -> str | None:
  """None if this backend can run here, else why not and what to install."""
  try:
    from jax.experimental.pallas import mosaic_gpu  # noqa: F401
  except ImportError as e:  # pragma: no cover - depends on the jax build
    return f"jax.experimental.pallas.mosaic_gpu is not importable ({e}); install jax>=0.11"
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not gpus:
    return "no GPU: the mgpu backend needs an NVIDIA Hopper GPU and jax[cuda13]"
  cc = getattr(gpus[0], "compute_capability", "")
  if not str(cc).startswith("9"):
    return f"GPU compute capability {cc!r}: the mgpu kernels use sm_90a wgmma (Hopper only)"
  return None


def _check_operands(lhs_MK, rhs, group_sizes_G, transpose_rhs):
  if lhs_MK.ndim != 2 or rhs.ndim != 3 or group_sizes_G.ndim != 1:
    raise ValueError(
        f"expected lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs_MK.shape}, "
        f"{rhs.shape}, {group_sizes_G.shape}")
  if lhs_MK.dtype != rhs.dtype or lhs_MK.dtype not in _DTYPES:
    raise ValueError(f"lhs/rhs must share a 16-bit float dtype, got {lhs_MK.dtype}/{rhs.dtype}")
  if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be integers, got {group_sizes_G.dtype}")
  k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
  if lhs_MK.shape[1] != k:
    raise ValueError(
        f"contraction mismatch: lhs {lhs_MK.shape}, rhs {rhs.shape} ({transpose_rhs=})")
  if rhs.shape[0] > group_sizes_G.shape[0]:
    raise ValueError(
        f"rhs has {rhs.shape[0]} local groups but group_sizes only {group_sizes_G.shape[0]}")


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset=0, transpose_rhs=False, out_dtype=None,
        tiling=None, profile_dir=None):
  """out_MN[rows of local group g] = lhs_MK[rows] @ rhs[g] (rhs[g].T with transpose_rhs);
  rows of non-local groups and rows past sum(group_sizes) are zeros. tiling: a FwdTiling to
  use instead of the table's (the tuner's and benchmarks' override). profile_dir: write the
  kernel's on-device trace there (`mgpu_kernels.compiler_params`)."""
  from MaxText.moe.gmm.mgpu import kernels as mgpu_kernels, schedule as mgpu_schedule, tiling as mgpu_tiling

  _check_operands(lhs_MK, rhs_GKN, group_sizes_G, transpose_rhs)
  out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
  k = lhs_MK.shape[1]
  n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
  explicit = tiling is not None
  tiling = (tiling or mgpu_tiling.lookup("fwd", k, n)).fit_output(out_dtype.itemsize)

  def kernel(lhs_PK, rhs):  # P >= M rows, K and N padded to the tiling
    t = tiling
    k_steps = lhs_PK.shape[1] // t.block_k
    if t.chain and k_steps % t.stages and not explicit:
      t = dataclasses.replace(t, chain=False)  # a fallback shape (toys, tests): unchained
    # Padded rows fall past sum(group_sizes) (or past the clipped local range) -> ZERO items.
    table = mgpu_schedule.work_table(
        group_sizes_G, group_offset, rhs.shape[0], lhs_PK.shape[0], t.block_m,
        window_align=t.window_align)
    if t.pingpong:
      from MaxText.moe.gmm.mgpu import pingpong as mgpu_pingpong
      kernel_fn = mgpu_pingpong.grouped_matmul_pingpong
    else:
      kernel_fn = mgpu_kernels.grouped_matmul
    return kernel_fn(lhs_PK, rhs, table, tiling=t, transpose_rhs=transpose_rhs,
                     out_dtype=out_dtype, profile_dir=profile_dir)

  # Aligned shapes (the table's, DeepSeek-V3's) reach the kernel unpadded: no copy.
  return _pad.gmm(kernel, lhs_MK, rhs_GKN, transpose_rhs=transpose_rhs, align=_fwd_align(tiling))


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset=0, num_local_groups, out_dtype=None,
         tiling=None, profile_dir=None):
  """drhs[g]_KN = lhs[rows of local group g]^T @ dout[same rows]; empty groups give zeros.
  tiling, profile_dir: as for `gmm`."""
  from MaxText.moe.gmm.mgpu import schedule as mgpu_schedule, tgmm as mgpu_tgmm, tiling as mgpu_tiling

  if lhs_MK.ndim != 2 or dout_MN.ndim != 2 or lhs_MK.shape[0] != dout_MN.shape[0]:
    raise ValueError(f"expected lhs [M, K] and dout [M, N], got {lhs_MK.shape}, {dout_MN.shape}")
  if lhs_MK.dtype != dout_MN.dtype or lhs_MK.dtype not in _DTYPES:
    raise ValueError(f"lhs/dout must share a 16-bit float dtype, got {lhs_MK.dtype}/{dout_MN.dtype}")
  if num_local_groups > group_sizes_G.shape[0]:
    raise ValueError(f"{num_local_groups=} > {group_sizes_G.shape[0]} groups")
  out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
  m, k = lhs_MK.shape
  n = dout_MN.shape[1]
  tiling = tiling or mgpu_tiling.lookup("tgmm", k, n)
  # Bounds clipped to the original M: padded rows are in no group.
  starts, ends = mgpu_schedule.local_group_bounds(group_sizes_G, group_offset, num_local_groups, m)

  def kernel(lhs_PK, dout_PN):
    return mgpu_tgmm.transposed_grouped_matmul(
        lhs_PK, dout_PN, starts, ends, tiling=tiling, out_dtype=out_dtype, profile_dir=profile_dir)

  # Aligned shapes (the table's, DeepSeek-V3's) reach the kernel unpadded: no copy.
  return _pad.tgmm(kernel, lhs_MK, dout_MN, align=_tgmm_align(tiling))


def jax_ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, *, transpose_rhs=False):
  """JAX's own ragged_dot_mgpu with our tiling table (baseline; all groups local, rows past
  sum(group_sizes) are left unwritten by that kernel)."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  from MaxText.moe.gmm.mgpu import tiling as mgpu_tiling

  _check_operands(lhs_MK, rhs_GKN, group_sizes_G, transpose_rhs)
  k = lhs_MK.shape[1]
  n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
  t = mgpu_tiling.lookup("jax_fwd", k, n)
  return ragged_dot_mgpu.ragged_dot(
      lhs_MK, rhs_GKN, group_sizes=group_sizes_G.astype(jnp.int32), block_m=t.block_m,
      block_n=t.block_n, block_k=t.block_k, max_concurrent_steps=t.max_concurrent_steps,
      grid_block_n=t.grid_block_n, transpose_rhs=transpose_rhs)


def jax_transposed_ragged_dot(lhs_MK, dout_MN, group_sizes_G):
  """JAX's own transposed_ragged_dot_mgpu (baseline dW over all groups)."""
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
  from MaxText.moe.gmm.mgpu import tiling as mgpu_tiling

  t = mgpu_tiling.lookup("tgmm", lhs_MK.shape[1], dout_MN.shape[1])
  return transposed_ragged_dot_mgpu.transposed_ragged_dot(
      lhs_MK, dout_MN, group_sizes=group_sizes_G.astype(jnp.int32), block_m=t.block_m,
      block_n=t.block_n, block_k=t.block_k, max_concurrent_steps=t.stages,
      grid_block_n=t.grid_block_n)
