"""Backend "tokamax": tokamax 0.0.17's ragged_dot_general, mosaic implementation (NVIDIA GPU).

On Hopper tokamax runs its Pallas Mosaic GPU kernels: the plain layout for the
forward, the transposed-rhs layout for dlhs (tokamax transposes the weights
itself) and its ragged-contracting kernel for dW. Measured on H200 at
DeepSeek-V3 expert shapes: 272-281 TF/s up-proj, 293-307 down-proj (tools/bench_gmm.py, 2026-11-30;
BENCHMARKS.md "Grouped GEMM (bf16)" has it against ours).
tokamax has no group_offset on GPU, so ring EP goes through _rows's row window.
Shapes the kernels cannot take (K=8, N=6, M=37...) are zero-padded by _pad (see _align).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.moe.gmm import _pad, _rows, xla

NAME = "tokamax"
INSTALL = "pip install tokamax==0.0.17"
# tokamax's Pallas Mosaic GPU kernels. (Its "xla" implementation is ragged_dot
# again; tests use it to run this adapter on CPU.)
_IMPLEMENTATION = "mosaic"

# tokamax takes jax's ragged_dot dimension layouts, defined once in xla.py.
_GMM_DIMS, _GMM_TRANSPOSED_DIMS, _TGMM_DIMS = xla.GMM_DIMS, xla.GMM_TRANSPOSED_DIMS, xla.TGMM_DIMS


def _tokamax():
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"grouped-GEMM backend 'tokamax' needs tokamax: {INSTALL} ({e})") from e
  return tokamax


def unavailable_reason() -> str | None:
  try:
    _tokamax()
  except ImportError as e:
    return str(e)
  if jax.default_backend() != "gpu":
    return f"tokamax's mosaic ragged_dot needs an NVIDIA GPU; JAX's backend here is {jax.default_backend()}"
  kind = jax.devices()[0].device_kind
  if "NVIDIA" not in kind:
    return f"tokamax's mosaic ragged_dot needs an NVIDIA GPU; the device here is {kind}"
  if str(getattr(jax.devices()[0], "compute_capability", "")).startswith("10."):
    # Its sm100 kernel takes only the default dimension numbers (pallas_mosaic_gpu.py): no dW, and Pallas's
    # mpmd_map refuses shard_map-varying operands (seen compiling for a compile-only B200).
    return "tokamax 0.0.17's Blackwell kernel has no dW form (a ragged contraction); moe_gmm_backend=te runs there"
  return None


def _align(dtype, *, rows: int) -> _pad.Align:
  """Multiples tokamax 0.0.17's sm90 kernels need (pallas_mosaic_gpu_kernel_sm90.py).

  Every operand moves by TMA with tiling (8, 128 bytes) (tiled_swizzled_block_spec: block_k
  128-512 and block_n 64 in bf16 all pick the 128-byte swizzle), and TMA takes a dimension
  only if it is shorter than its tile or a multiple of it, with row strides a multiple of 16
  bytes. So K and N go to multiples of 128 bytes (64 bf16 elements; tokamax's own test
  expects K % 64 == 0). Rows: the forward's lhs [M, K] is tiled by 8 along M (`rows=8`);
  the dW kernel transposes lhs to [K, M], where M is the 128-byte dimension (`rows=64`).
  Seen on the H200 before this padding: "dimension 0 must have size smaller or a multiple
  of its tiling 8, but got 37", "... dimension 2 ... tiling 64, but got 200", and "async_copy
  requires all GMEM strides except the last one to be a multiple of 16 bytes" (N=6).
  """
  width = 128 // jnp.dtype(dtype).itemsize
  return _pad.Align(m=rows, k=width, n=width)


def _ragged_dot(lhs, rhs, sizes_L, dims, out_dtype):
  tokamax = _tokamax()
  # A representative (uniform) distribution of the M rows lets tokamax's
  # heuristics pick a tiling without seeing the runtime sizes, as upstream does.
  group_sizes = tokamax.RaggedDotGroupSizes(sizes_L, lhs.shape[0])
  return tokamax.ragged_dot_general(
      lhs,
      rhs,
      group_sizes=group_sizes,
      ragged_dot_dimension_numbers=dims,
      precision=jax.lax.Precision.DEFAULT,
      preferred_element_type=out_dtype,
      implementation=_IMPLEMENTATION,
  )


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset, transpose_rhs, out_dtype):
  rows = _rows.local_rows(group_sizes_G, group_offset, rhs_GKN.shape[0])
  dims = _GMM_TRANSPOSED_DIMS if transpose_rhs else _GMM_DIMS
  kernel = lambda lhs, rhs: _ragged_dot(lhs, rhs, rows.sizes_L, dims, out_dtype)
  # Rows are padded after the roll: added rows lie past the local groups. Aligned shapes
  # (DeepSeek-V3's) reach tokamax unpadded: no copy.
  out_MN = _pad.gmm(kernel, _rows.to_local(lhs_MK, rows), rhs_GKN, transpose_rhs=transpose_rhs,
                    align=_align(lhs_MK.dtype, rows=8))
  # The kernel need not write rows past the local groups: from_local zeroes them.
  return _rows.from_local(out_MN, rows)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset, num_local_groups, out_dtype):
  rows = _rows.local_rows(group_sizes_G, group_offset, num_local_groups)
  # tokamax 0.0.17's dW kernel masks rows outside a group by multiplying, so a NaN there (the
  # GPU self-test puts NaN in them) reached dW; zero lhs's foreign rows first (dout's rows are
  # the finite cotangent of our zero-written output rows).
  lhs_MK = _rows.zero_outside_local(_rows.to_local(lhs_MK, rows), rows)
  dout_MN = _rows.to_local(dout_MN, rows)
  kernel = lambda lhs, dout: _ragged_dot(lhs, dout, rows.sizes_L, _TGMM_DIMS, out_dtype)
  return _pad.tgmm(kernel, lhs_MK, dout_MN, align=_align(lhs_MK.dtype, rows=64))
