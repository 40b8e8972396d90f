"""Where the local groups' rows are, for backends whose kernel has no group_offset.

Rows are sorted by global group. This shard holds the weights of groups
[group_offset, group_offset + G_local) (ring-of-experts EP), whose rows are one
contiguous window [start, end) of the M rows; rows before it belong to other
shards' groups and rows after it to later groups or to padding. No kernel we
call (ragged_dot, tokamax, TE) takes a group offset, so a backend rolls the
window to row 0, runs the kernel on the local group sizes (which leave the
tail rows out of every group), rolls the result back and zeroes every row
outside the window. Without EP (G_total == G_local) the window starts at row 0
and no roll is traced.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LocalRows(NamedTuple):
  """The local groups' row window.

  Attributes:
    start: int32 []: first row of local group 0.
    end: int32 []: one past the last row of the last local group.
    sizes_L: int32 [G_local]: the local groups' sizes.
    shifted: static: whether the window may start past row 0 (G_total > G_local).
  """

  start: jax.Array
  end: jax.Array
  sizes_L: jax.Array
  shifted: bool


def local_rows(group_sizes_G: jax.Array, group_offset: jax.Array, num_local_groups: int) -> LocalRows:
  """The row window of groups [group_offset, group_offset + num_local_groups)."""
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  if group_sizes_G.shape[0] == num_local_groups:
    return LocalRows(jnp.int32(0), jnp.sum(group_sizes_G), group_sizes_G, shifted=False)
  before_G = jnp.arange(group_sizes_G.shape[0]) < group_offset
  start = jnp.sum(jnp.where(before_G, group_sizes_G, 0))
  sizes_L = jax.lax.dynamic_slice_in_dim(group_sizes_G, group_offset, num_local_groups)
  return LocalRows(start, start + jnp.sum(sizes_L), sizes_L, shifted=True)


def to_local(x_M: jax.Array, rows: LocalRows) -> jax.Array:
  """Rows rolled so that local group 0 starts at row 0."""
  return jnp.roll(x_M, -rows.start, axis=0) if rows.shifted else x_M


def zero_outside_local(x_M: jax.Array, rows: LocalRows) -> jax.Array:
  """`x_M` (already `to_local`) with every row past the local groups set to exact zero.

  For kernels that mask rows by multiplying (tokamax's dW): NaN or inf in a padding row or
  another shard's row would otherwise survive as NaN * 0. A select, fused by XLA into the
  roll or pad when there is one; otherwise one pass over x_M.
  """
  return _keep_rows(x_M, jnp.arange(x_M.shape[0]) < rows.end - rows.start)


def from_local(y_M: jax.Array, rows: LocalRows) -> jax.Array:
  """Undoes `to_local`, then zeroes every row outside the window.

  The select (not a multiply) keeps whatever a kernel left in rows it did not
  own, NaN included, out of the result.
  """
  if rows.shifted:
    y_M = jnp.roll(y_M, rows.start, axis=0)
  row_M = jnp.arange(y_M.shape[0])
  return _keep_rows(y_M, (row_M >= rows.start) & (row_M < rows.end))


def _keep_rows(x_M: jax.Array, inside_M: jax.Array) -> jax.Array:
  """x_M with every row where inside_M is False set to exact zero (a select: NaN does not survive)."""
  return jnp.where(inside_M.reshape((-1,) + (1,) * (x_M.ndim - 1)), x_M, jnp.zeros((), x_M.dtype))
