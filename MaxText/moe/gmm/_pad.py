"""Zero padding to a kernel's alignment, for the GPU backends (tokamax, mgpu).

The Mosaic GPU kernels move tiles with TMA, which wants every GMEM row stride a
multiple of 16 bytes and every tiled dimension either shorter than its tile or
a multiple of it; the kernels add their own block-multiple rules (see each
backend's `_align`). Rather than teach kernels odd shapes, a backend states the
multiples it needs per dimension and calls `gmm`/`tgmm` here, which pad, run the
kernel and slice the result back. The padding is exact:

  M (rows):         zero rows past the original M, hence past sum(group_sizes):
                    they belong to no group (the protocol writes such rows as
                    zeros, and the slice drops them; tgmm never reads them);
  K (contraction):  zero columns of lhs and zero rows of rhs add 0 to each dot;
  N (output width): zero columns of rhs (or dout) give output columns that the
                    slice drops.

A dimension that is already a multiple is left alone, and with all three
aligned the kernel gets the caller's arrays themselves and its result is
returned as is: no pad, no slice, no copy. That is the DeepSeek-V3 case
(M = tokens x top-k, K/N in {2048, 4096, 7168}) and every large shape we run.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Align(NamedTuple):
  """Multiples (in elements) a kernel needs along M (rows), K (contraction), N (output)."""

  m: int
  k: int
  n: int


def round_up(size: int, multiple: int) -> int:
  return -(-size // multiple) * multiple


def pad_axes(x: jax.Array, multiples: dict[int, int]) -> jax.Array:
  """x zero-padded at the end of each axis in `multiples` up to that multiple; x itself if
  no axis needs it."""
  widths = [(0, 0)] * x.ndim
  for axis, multiple in multiples.items():
    widths[axis] = (0, round_up(x.shape[axis], multiple) - x.shape[axis])
  if all(hi == 0 for _, hi in widths):
    return x
  return jnp.pad(x, widths)


def _crop(y: jax.Array, sizes: dict[int, int]) -> jax.Array:
  """y cut back to `sizes` along the given axes; y itself if nothing was padded."""
  if all(y.shape[axis] == size for axis, size in sizes.items()):
    return y
  index = [slice(None)] * y.ndim
  for axis, size in sizes.items():
    index[axis] = slice(0, size)
  return y[tuple(index)]


def gmm(
    kernel: Callable[[jax.Array, jax.Array], jax.Array],
    lhs_MK: jax.Array,
    rhs: jax.Array,
    *,
    transpose_rhs: bool,
    align: Align,
) -> jax.Array:
  """kernel(lhs, rhs) -> out [M', N'] run on operands padded to `align`; returns out_MN.

  rhs is [G, K, N], or [G, N, K] with transpose_rhs. Rows added past M belong to no
  group, so group sizes and offsets need no change.
  """
  m, _ = lhs_MK.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
  out = kernel(
      pad_axes(lhs_MK, {0: align.m, 1: align.k}),
      pad_axes(rhs, {k_axis: align.k, n_axis: align.n}),
  )
  return _crop(out, {0: m, 1: n})


def tgmm(
    kernel: Callable[[jax.Array, jax.Array], jax.Array],
    lhs_MK: jax.Array,
    dout_MN: jax.Array,
    *,
    align: Align,
) -> jax.Array:
  """kernel(lhs, dout) -> drhs [G, K', N'] run on operands padded to `align`; returns
  drhs_GKN. Added rows are zero and past every group: they contribute nothing."""
  k, n = lhs_MK.shape[1], dout_MN.shape[1]
  out = kernel(
      pad_axes(lhs_MK, {0: align.m, 1: align.k}),
      pad_axes(dout_MN, {0: align.m, 1: align.n}),
  )
  return _crop(out, {1: k, 2: n})
