"""Backend "tokamax": tokamax 0.0.17's ragged_dot_general, mosaic implementation (NVIDIA GPU).

On Hopper tokamax runs its Pallas Mosaic GPU kernels: the plain layout for the
forward, the transposed-rhs layout for dlhs (tokamax transposes the weights
itself) and its ragged-contracting kernel for dW. Measured on H200 at
DeepSeek-V3 expert shapes: 272-281 TF/s up-proj, 293-307 down-proj (issue 6).
tokamax has no group_offset on GPU, so ring EP goes through _rows's row window.
"""

from __future__ import annotations

import jax

from MaxText.moe.gmm import _rows

NAME = "tokamax"
INSTALL = "pip install tokamax==0.0.17"
# tokamax's Pallas Mosaic GPU kernels. (Its "xla" implementation is ragged_dot
# again; tests use it to run this adapter on CPU.)
_IMPLEMENTATION = "mosaic"

_GMM_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
_GMM_TRANSPOSED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
_TGMM_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


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
  return None


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
  out_MN = _ragged_dot(_rows.to_local(lhs_MK, rows), rhs_GKN, rows.sizes_L, dims, out_dtype)
  # The kernel need not write rows past the local groups: from_local zeroes them.
  return _rows.from_local(out_MN, rows)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset, num_local_groups, out_dtype):
  rows = _rows.local_rows(group_sizes_G, group_offset, num_local_groups)
  lhs_MK, dout_MN = _rows.to_local(lhs_MK, rows), _rows.to_local(dout_MN, rows)
  return _ragged_dot(lhs_MK, dout_MN, rows.sizes_L, _TGMM_DIMS, out_dtype)
