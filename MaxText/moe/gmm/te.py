"""Backend "te": Transformer Engine for JAX's grouped GEMM (cuBLAS grouped GEMM, NVIDIA GPU).

Adapter for `transformer_engine.jax.cpp_extensions.grouped_gemm(lhs, rhs,
group_sizes, contracting_dims, ..., preferred_element_type, group_offset)`, the
form of TE's grouped GEMM that takes a group_sizes array (older TEs took lists
of per-group operands and are refused). Its contracting_dims pick the layout:

    ((1,), (1,))  lhs [M, K] x rhs [G, K, N] -> [M, N]        forward
    ((1,), (2,))  lhs [M, K] x rhs [G, N, K] -> [M, N]        transposed weights (dlhs)
    ((0,), (0,))  lhs [M, K] x rhs [M, N]    -> [G, K, N]     per-group lhs_g.T @ rhs_g (dW)

TE's grouped GEMM wants sum(group_sizes) == M (its FFI checks it) and has no
group_offset yet, so rows go through _rows's window (ring EP) and the rows past
the local groups form one extra trailing group: multiplied by zero weights in
the forward, and its dW dropped. That costs FLOPs on padding rows.

Never run against a real TE here (TE is not installed where CI runs); the tests
cover the missing-TE error and, with a stand-in module, the argument plumbing.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from MaxText.moe.gmm import _rows

NAME = "te"
INSTALL = "pip install 'maxtext-moe[te]' (transformer-engine[jax]) or use an NGC JAX container, which ships TE"

_FWD_DIMS = ((1,), (1,))
_TRANSPOSED_RHS_DIMS = ((1,), (2,))
_WGRAD_DIMS = ((0,), (0,))


def _grouped_gemm():
  """TE's grouped_gemm, or ImportError saying how to install TE."""
  try:
    from transformer_engine.jax import cpp_extensions  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"grouped-GEMM backend 'te' needs Transformer Engine for JAX: {INSTALL} ({e})") from e
  grouped_gemm = getattr(cpp_extensions, "grouped_gemm", None)
  if grouped_gemm is None or "group_sizes" not in inspect.signature(grouped_gemm).parameters:
    raise ImportError(
        "grouped-GEMM backend 'te' needs a Transformer Engine whose "
        "transformer_engine.jax.cpp_extensions.grouped_gemm takes group_sizes; this one does not: "
        f"upgrade, {INSTALL}"
    )
  return grouped_gemm


def unavailable_reason() -> str | None:
  try:
    _grouped_gemm()
  except ImportError as e:
    return str(e)
  if jax.default_backend() != "gpu":
    return f"Transformer Engine's grouped GEMM needs an NVIDIA GPU; JAX's backend here is {jax.default_backend()}"
  return None


def _with_tail_group(sizes_L: jax.Array, num_rows: int) -> jax.Array:
  """[G_local + 1] sizes whose last group takes every row past the local ones."""
  sizes_L = sizes_L.astype(jnp.int32)
  return jnp.concatenate([sizes_L, (num_rows - jnp.sum(sizes_L)).reshape(1)])


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset, transpose_rhs, out_dtype):
  grouped_gemm = _grouped_gemm()
  rows = _rows.local_rows(group_sizes_G, group_offset, rhs_GKN.shape[0])
  zeros_1KN = jnp.zeros((1,) + rhs_GKN.shape[1:], rhs_GKN.dtype)  # the tail group's weights
  out_MN = grouped_gemm(
      _rows.to_local(lhs_MK, rows),
      jnp.concatenate([rhs_GKN, zeros_1KN]),
      _with_tail_group(rows.sizes_L, lhs_MK.shape[0]),
      contracting_dims=_TRANSPOSED_RHS_DIMS if transpose_rhs else _FWD_DIMS,
      preferred_element_type=out_dtype,
  )
  return _rows.from_local(out_MN, rows).astype(out_dtype)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset, num_local_groups, out_dtype):
  grouped_gemm = _grouped_gemm()
  rows = _rows.local_rows(group_sizes_G, group_offset, num_local_groups)
  drhs_GKN = grouped_gemm(
      _rows.to_local(lhs_MK, rows),
      _rows.to_local(dout_MN, rows),
      _with_tail_group(rows.sizes_L, lhs_MK.shape[0]),
      contracting_dims=_WGRAD_DIMS,
      preferred_element_type=out_dtype,
  )
  return drhs_GKN[:num_local_groups].astype(out_dtype)
