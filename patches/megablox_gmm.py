"""Seam: maxtext.kernels.megablox.gmm (maxtext 0.2.5) -> our grouped GEMM (MaxText/moe/gmm).

Upstream's `RoutedMoE.sparse_matmul` runs every grouped GEMM through its `gmm`
closure (layers/moe.py ~2236), which calls `mblx.gmm(...)` (~2319) when
megablox=true and use_tokamax_gmm=false, looking the attribute up on the
`maxtext.kernels.megablox` package at each call. Rebinding it sends the up,
gate and down projections, and their backward, to the backend moe_gmm_backend
names. MaxText/config/moe_keys.py (moe_gmm_upstream_keys) makes sure the config reaches
that call, turning a config file's megablox=false into true.

Off TPU, upstream passes interpret=True (~2291) so that its Pallas TPU kernel
runs in interpret mode (about 65x slower than ragged_dot on CPU). The
replacement never calls that kernel, so interpret mode never happens; tiling
(megablox's TPU tiles) is ignored too: our backends tile for themselves.

`call_counts()` counts the calls per backend (once per trace, not per step), so
that tests can prove the patched path ran.
"""

from __future__ import annotations

import collections

import jax

from patches._seam import Seam

SEAM = Seam(
    name="megablox_gmm",
    module="maxtext.kernels.megablox",
    attr="gmm",
    sha256="616e3ed848f91a02",
)

# Calls into our backends per backend name, across the process (instrumentation:
# the only state here, read by tests and never by the op itself).
_CALLS: collections.Counter[str] = collections.Counter()


def call_counts() -> dict[str, int]:
  return dict(_CALLS)


def _refuse(what: str) -> None:
  raise NotImplementedError(
      f"moe_gmm_backend: upstream asked the grouped GEMM for {what}, which our backends do not do; "
      "use moe_gmm_backend=upstream for it"
  )


def _make_gmm(choice: str, backend: str):
  """A drop-in for megablox's gmm (same keywords) that runs `choice`, resolved to `backend`."""

  def gmm(
      lhs,
      rhs,
      group_sizes,
      preferred_element_type=jax.numpy.float32,
      tiling=None,  # megablox's TPU tiles: our backends choose their own
      group_offset=None,
      existing_out=None,
      transpose_rhs=False,
      interpret=None,  # no Pallas TPU kernel runs, so nothing to interpret
      lhs_quantize_dtype=None,
      rhs_quantize_dtype=None,
      use_qwix_quantization=False,  # only meaningful with a quantization rule, refused below
      use_tokamax_backend=False,
      weight_gather_axes=None,  # quantized weight all-gather only
      lhs_vma_axes=(),  # our outputs vary over whatever their inputs vary over
      rhs_vma_axes=(),
      qwix_rule=None,
      use_manual_quantization=False,
      use_gmm_v2=False,
      use_gmm_v2_heuristic_tiling=False,
      partial_sum=None,
  ):
    del tiling, interpret, use_qwix_quantization, weight_gather_axes, lhs_vma_axes, rhs_vma_axes
    del use_gmm_v2_heuristic_tiling
    if lhs_quantize_dtype or rhs_quantize_dtype or qwix_rule is not None or use_manual_quantization:
      _refuse("quantization")
    if use_tokamax_backend or use_gmm_v2:
      _refuse("upstream's tokamax kernels (use_tokamax_gmm / use_gmm_v2)")
    if existing_out is not None:
      _refuse("accumulation into existing_out")
    if not (isinstance(lhs, jax.Array) and isinstance(rhs, jax.Array)):
      _refuse(f"quantized operands ({type(lhs).__name__}, {type(rhs).__name__})")
    from MaxText.moe import gmm as moe_gmm  # pylint: disable=import-outside-toplevel

    _CALLS[backend] += 1
    out_MN = moe_gmm.gmm(
        lhs,
        rhs,
        group_sizes,
        backend=choice,  # resolved (and logged) once, in apply
        group_offset=0 if group_offset is None else group_offset,
        preferred_element_type=preferred_element_type,
        transpose_rhs=transpose_rhs,
    )
    # Upstream's embedding-chunked path accumulates chunks through partial_sum.
    return out_MN if partial_sum is None else out_MN + partial_sum.astype(out_MN.dtype)

  return gmm


def wanted(fork) -> bool:
  # Our block (moe_block=ours) calls MaxText.moe.gmm itself; upstream's sparse_matmul never runs.
  return fork.moe_block == "upstream" and fork.moe_gmm_backend != "upstream"


def apply(fork, hooks=None) -> None:  # pylint: disable=unused-argument
  """Resolves the backend now (logs the pick; fails before any compile if it cannot run).

  MaxText/run/loop.py applies patches after launch.start, so jax.distributed is
  initialized before this first touches a JAX backend.
  """
  from MaxText.moe import gmm as moe_gmm  # pylint: disable=import-outside-toplevel

  backend = moe_gmm.resolve_backend(fork.moe_gmm_backend).NAME

  def replace(original):
    replacement = _make_gmm(fork.moe_gmm_backend, backend)
    replacement.__wrapped__ = original
    return replacement

  SEAM.apply(replace)
