"""Backend "te": Transformer Engine for JAX's grouped GEMM (cuBLAS grouped GEMM, NVIDIA GPU).

Adapter for TE 2.20's `transformer_engine.jax.cpp_extensions.grouped_gemm(lhs, rhs,
contracting_dims, ..., preferred_element_type)`, whose operands are
`transformer_engine.jax.quantize.GroupedNoScaleTensor`s: the row-group sizes ride on
the ragged operand as `first_dims` (there is no group_sizes argument; TE's own
`dense.grouped_dense` builds them the same way). Its contracting_dims pick the layout:

    ((1,), (1,))  lhs [M, K] x rhs [G, K, N] -> [M, N]        forward
    ((1,), (2,))  lhs [M, K] x rhs [G, N, K] -> [M, N]        transposed weights (dlhs)
    ((0,), (0,))  lhs [M, K] x rhs [M, N]    -> [G, K, N]     per-group lhs_g.T @ rhs_g (dW)

TE's grouped GEMM wants sum(group sizes) == M (its FFI checks it) and has no
group_offset yet, so rows go through _rows's window (ring EP) and the rows past
the local groups form one extra trailing group: multiplied by zero weights in
the forward, and its dW dropped. That costs FLOPs on padding rows.

Checked against the released TE 2.20.2 (te_release.SUPPORTED_TE); other versions are refused by
name, since the grouped GEMM's signature has changed between TE releases.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from MaxText.moe import te_release
from MaxText.moe.gmm import _rows

NAME = "te"
INSTALL = "pip install 'maxtext-moe[te]' (transformer-engine[jax]) or use an NGC JAX container, which ships TE"

_FWD_DIMS = ((1,), (1,))
_TRANSPOSED_RHS_DIMS = ((1,), (2,))
_WGRAD_DIMS = ((0,), (0,))


def _grouped_gemm():
  """(TE's grouped_gemm, GroupedNoScaleTensor), or ImportError saying how to install a supported TE."""
  try:
    from transformer_engine.jax import cpp_extensions  # pylint: disable=import-outside-toplevel
    from transformer_engine.jax.quantize import GroupedNoScaleTensor  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"grouped-GEMM backend 'te' needs Transformer Engine for JAX: {INSTALL} ({e})") from e
  why = te_release.unsupported(te_release.installed_version())
  if why:
    raise ImportError(f"grouped-GEMM backend 'te' {why}: {INSTALL}")
  _v1_below_cublas_13_3()
  return cpp_extensions.grouped_gemm, GroupedNoScaleTensor


# TE 2.20 runs bf16 on Hopper through nvte_grouped_gemm (its "V2"), which needs cuBLAS >= 13.3 at run time
# (its own check, cublaslt_grouped_gemm.cu) and otherwise fails at launch; the V1 path (one cuBLAS GEMM per
# group, group sizes copied to the host) runs on older cuBLAS, e.g. the 13.1 of the jax 0.11.2 CUDA-13 wheels.
_CUBLAS_FOR_V2 = 130300


def _v1_below_cublas_13_3() -> None:
  try:
    import transformer_engine_jax as ext  # pylint: disable=import-outside-toplevel
    # The submodule itself: `from ...cpp_extensions import gemm` is TE's gemm *function* (re-exported by name).
    gemm = importlib.import_module("transformer_engine.jax.cpp_extensions.gemm")
  except ImportError:  # no compiled extension (a stand-in): nothing to choose
    return
  if getattr(gemm, "_v2_grouped_gemm_available", False) and ext.get_cublasLt_version() < _CUBLAS_FOR_V2:
    gemm._v2_grouped_gemm_available = False  # pylint: disable=protected-access
    print(f"[maxtext-moe] te grouped GEMM: cuBLAS {ext.get_cublasLt_version()} < {_CUBLAS_FOR_V2}, TE's V1 path",
          flush=True)


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


def _ragged(tensor_cls, x, sizes=None):
  return tensor_cls(data=x, amax=None, first_dims=sizes, last_dims=None, original_shape=x.shape)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset, transpose_rhs, out_dtype):
  grouped_gemm, tensor_cls = _grouped_gemm()
  rows = _rows.local_rows(group_sizes_G, group_offset, rhs_GKN.shape[0])
  zeros_1KN = jnp.zeros((1,) + rhs_GKN.shape[1:], rhs_GKN.dtype)  # the tail group's weights
  out_MN = grouped_gemm(
      _ragged(tensor_cls, _rows.to_local(lhs_MK, rows), _with_tail_group(rows.sizes_L, lhs_MK.shape[0])),
      _ragged(tensor_cls, jnp.concatenate([rhs_GKN, zeros_1KN])),
      contracting_dims=_TRANSPOSED_RHS_DIMS if transpose_rhs else _FWD_DIMS,
      preferred_element_type=out_dtype,
  )
  return _rows.from_local(out_MN, rows).astype(out_dtype)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset, num_local_groups, out_dtype):
  grouped_gemm, tensor_cls = _grouped_gemm()
  rows = _rows.local_rows(group_sizes_G, group_offset, num_local_groups)
  sizes = _with_tail_group(rows.sizes_L, lhs_MK.shape[0])
  drhs_GKN = grouped_gemm(
      _ragged(tensor_cls, _rows.to_local(lhs_MK, rows), sizes),
      _ragged(tensor_cls, _rows.to_local(dout_MN, rows), sizes),
      contracting_dims=_WGRAD_DIMS,
      preferred_element_type=out_dtype,
  )
  return drhs_GKN[:num_local_groups].astype(out_dtype)
