"""Backend "xla": jax.lax.ragged_dot_general, the portable reference and the CPU path.

On CPU, JAX lowers ragged_dot by expanding the ragged operand to one masked
dense copy per group ([G, M, K]); that is fine at CI sizes and is why this is
not the GPU default (ragged_dot measured 23 TF/s on H200 against 272-281 for
tokamax: tools/bench_gmm.py; BENCHMARKS.md "Grouped GEMM (bf16)"). Accumulation is
always float32; the result is cast to out_dtype afterwards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.moe.gmm import _rows

NAME = "xla"

# out[m] = lhs[m] @ rhs[g(m)]: rhs_GKN contracts on its dim 1.
GMM_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
# out[m] = lhs[m] @ rhs[g(m)].T: rhs_GNK contracts on its dim 2 (the dlhs product).
GMM_TRANSPOSED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
# out[g] = lhs[rows of g].T @ dout[rows of g]: the ragged dim M is contracted.
TGMM_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def unavailable_reason() -> str | None:
  return None  # plain JAX: runs on every platform


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset, transpose_rhs, out_dtype):
  rows = _rows.local_rows(group_sizes_G, group_offset, rhs_GKN.shape[0])
  out_MN = jax.lax.ragged_dot_general(
      _rows.to_local(lhs_MK, rows),
      rhs_GKN,
      rows.sizes_L,
      GMM_TRANSPOSED_DIMS if transpose_rhs else GMM_DIMS,
      preferred_element_type=jnp.float32,
  )
  return _rows.from_local(out_MN, rows).astype(out_dtype)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset, num_local_groups, out_dtype):
  rows = _rows.local_rows(group_sizes_G, group_offset, num_local_groups)
  drhs_GKN = jax.lax.ragged_dot_general(
      _rows.to_local(lhs_MK, rows),
      _rows.to_local(dout_MN, rows),
      rows.sizes_L,
      TGMM_DIMS,
      preferred_element_type=jnp.float32,
  )
  return drhs_GKN.astype(out_dtype)
