"""Dense float32 reference for the grouped GEMM, and random grouped-GEMM problems.

Shared by tests/test_gmm*.py (tools/gpu_selftest.py keeps its own copy: it
runs where tests/ is not importable).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


def row_groups(group_sizes_G, num_rows: int) -> jax.Array:
  """Global group of each row; G_total for rows past sum(group_sizes) (padding)."""
  ends_G = jnp.cumsum(jnp.asarray(group_sizes_G))
  return jnp.searchsorted(ends_G, jnp.arange(num_rows), side="right")


def dense_gmm(lhs_MK, rhs_GKN, group_sizes_G, group_offset=0, transpose_rhs=False):
  """out[m] = lhs[m] @ rhs[g(m) - group_offset] via a one-hot [M, G_local] mask, in float32."""
  rhs_GKN = jnp.swapaxes(rhs_GKN, 1, 2) if transpose_rhs else rhs_GKN
  local_G = group_offset + jnp.arange(rhs_GKN.shape[0])
  onehot_MG = (row_groups(group_sizes_G, lhs_MK.shape[0])[:, None] == local_G[None, :]).astype(jnp.float32)
  return jnp.einsum(
      "mk,gkn,mg->mn",
      lhs_MK.astype(jnp.float32),
      rhs_GKN.astype(jnp.float32),
      onehot_MG,
      precision=jax.lax.Precision.HIGHEST,
  )


def rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


@dataclass(frozen=True)
class Case:
  """One grouped-GEMM problem: M rows, G_total groups of which G_local are local."""

  name: str
  group_sizes: tuple[int, ...]
  num_rows: int
  k: int = 8
  n: int = 6
  num_local: int | None = None  # None: every group is local
  group_offset: int = 0
  transpose_rhs: bool = False

  @property
  def local(self) -> int:
    return self.num_local or len(self.group_sizes)

  def arrays(self, dtype=jnp.float32, seed: int = 0):
    """(lhs_MK, rhs_GKN, group_sizes_G): random normal inputs, never zeros."""
    rng = np.random.default_rng(seed)
    rhs_shape = (self.local, self.n, self.k) if self.transpose_rhs else (self.local, self.k, self.n)
    lhs = jnp.asarray(rng.standard_normal((self.num_rows, self.k)), dtype)
    rhs = jnp.asarray(rng.standard_normal(rhs_shape), dtype)
    return lhs, rhs, jnp.asarray(self.group_sizes, jnp.int32)


CASES = (
    Case("balanced", (4, 4, 4, 4), 16),
    Case("empty_groups", (5, 0, 0, 6), 11),
    Case("all_rows_one_group", (0, 0, 12, 0), 12),
    Case("padding_rows", (3, 2, 4, 1), 16),  # sum(group_sizes) < rows
    Case("m37_untiled", (10, 0, 20, 5), 37),  # rows a multiple of no tile size
    Case("ring_offset_2_of_4", (5, 3, 6, 2), 20, num_local=2, group_offset=2),
    Case("ring_offset_0_of_4", (5, 3, 6, 2), 20, num_local=2, group_offset=0),
    Case("ring_local_all_empty", (7, 0, 0, 5), 14, num_local=2, group_offset=1),
    Case("transpose_rhs", (3, 0, 7, 4), 16, transpose_rhs=True),
)
