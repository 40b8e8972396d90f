"""Grouped GEMM: `gmm(lhs_MK, rhs_GKN, group_sizes_G)`, differentiable, one backend per file.

    out_MN[m] = lhs_MK[m] @ rhs_GKN[g(m)]    for the rows of the local groups, else 0

Rows of lhs_MK are sorted by group: global group g owns rows
[sum(gs[:g]), sum(gs[:g+1])). rhs_GKN holds the weights of the LOCAL groups,
global ids [group_offset, group_offset + G_local) (ring-of-experts EP), while
group_sizes_G has one entry per GLOBAL group. Rows of other groups and rows past
sum(group_sizes_G) (padding) come out as zeros. Every backend module has NAME,
unavailable_reason(), gmm(lhs_MK, rhs, group_sizes_G, *, group_offset, transpose_rhs,
out_dtype) and tgmm(lhs_MK, dout_MN, group_sizes_G, *, group_offset, num_local_groups,
out_dtype) with this contract (`xla.py` is the reference). The FP8 backends' gmm also takes
lhs_tiles, the rows already quantized (the FP8 dispatch, MaxText/moe/fp8_dispatch.py), and
lhs_gathered; their tgmm takes gathered, lhs_tiles and dout_tiles: which operands are gathers of token
rows (quantized by XLA through the gather) and the tiles an operand was dequantized from (requantized in
one pass; `backward`'s dout_tiles, the FP8 combine's cotangent, reach dlhs as its lhs_tiles too). None of
these changes a value.

The backward pass is a custom VJP built from each backend's two primitives:

    dlhs_MK  = gmm(dout_MN, rhs_GKN, transpose_rhs=True)    grouped GEMM, transposed weights
    drhs_GKN = tgmm(lhs_MK, dout_MN)                         per group: lhs_g.T @ dout_g

so no backend's backward ever builds per-group dense copies of the activations
(upstream's ragged_dot autodiff does: bf16[32,131072,7168] operands in an H200
backward HLO, 47 TFLOP/s/device against tokamax's 296-315 on the same proxy).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.moe import vma
from MaxText.moe.gmm import fp8_quant

BackendName = Literal[
    "xla",  # jax.lax.ragged_dot_general: portable float32 reference, the CPU path
    "tokamax",  # tokamax 0.0.17's ragged_dot, mosaic implementation (NVIDIA GPU)
    "mgpu",  # JAX Pallas Mosaic GPU Hopper kernels with a per-shape tiling table (mgpu/bf16.py)
    "te",  # Transformer Engine's cuBLAS grouped GEMM (needs transformer_engine.jax)
    "mgpu_fp8",  # blockwise FP8 (DeepSeek-V3's tiles and blocks) Hopper kernels (mgpu/fp8.py)
    "xla_fp8",  # the same FP8 quantization emulated in float32: the CPU path and mgpu_fp8's reference
    "te_mxfp8",  # Transformer Engine's grouped GEMM with MXFP8 block scaling (Blackwell)
    "xla_mxfp8",  # MXFP8 emulated by quantize-dequantize in float32: the CPU path and te_mxfp8's reference
]
BACKENDS: tuple[str, ...] = typing.get_args(BackendName)
# Backends that take lhs already quantized (gmm's lhs_tiles: the FP8 dispatch moved it in e4m3).
FP8_BACKENDS = ("mgpu_fp8", "xla_fp8")
# "auto" picks per platform: GPU -> mgpu (Hopper), else tokamax, else te (Blackwell: tokamax 0.0.17 has no dW
# there), else xla; CPU/TPU -> xla.
Choice = BackendName | Literal["auto"]
CHOICES: tuple[str, ...] = ("auto", *BACKENDS)
# Backend name -> its module under this package, where the two differ (our kernels live in the mgpu package).
_MODULES = {"mgpu": "mgpu.bf16", "mgpu_fp8": "mgpu.fp8"}
_GPU_PREFERENCE = ("mgpu", "tokamax", "te", "xla")


class BackendUnavailable(RuntimeError):
  """A known backend cannot run here; the message says why and what to install."""


def _log(msg: str) -> None:
  # The run log (stdout, as the run's own lines) must say what ran.
  print(f"[maxtext-moe] {msg}", flush=True)


@functools.cache
def _import_backend(name: str):
  """The backend module, or BackendUnavailable if it does not import."""
  if name not in BACKENDS:
    raise ValueError(f"unknown grouped-GEMM backend {name!r}; valid: {', '.join(CHOICES)}")
  try:
    module_name = f"{__name__}.{_MODULES.get(name, name)}"
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise BackendUnavailable(f"grouped-GEMM backend {name!r}: {module_name} does not import: {e}") from e
  missing = [a for a in ("NAME", "unavailable_reason", "gmm", "tgmm") if not hasattr(module, a)]
  if missing:
    raise BackendUnavailable(f"grouped-GEMM backend {name!r} lacks {', '.join(missing)} (see this module's doc)")
  return module


def unavailable_reason(name: str) -> str | None:
  """None if backend `name` can run here; else why, and what to install."""
  try:
    return _import_backend(name).unavailable_reason()
  except BackendUnavailable as e:
    return str(e)


def _auto(platform: str) -> tuple[str, str]:
  """(backend, why) for "auto" on `platform`."""
  if platform != "gpu":
    return "xla", f"platform {platform}: the GPU kernels do not apply"
  skipped = []
  for name in _GPU_PREFERENCE:
    reason = unavailable_reason(name)
    if reason is None:
      return name, "; ".join(skipped) or "first choice on GPU"
    skipped.append(f"{name} unavailable: {reason}")
  raise AssertionError("xla is always available")


# (backend, platform) pairs the log has named: the block calls gmm with auto's pick by name, said once already.
_named: set[tuple[str, str]] = set()


@functools.cache
def _resolve(name: str, platform: str):
  if name not in CHOICES:
    raise ValueError(f"unknown grouped-GEMM backend {name!r}; valid: {', '.join(CHOICES)}")
  if name == "auto":
    picked, why = _auto(platform)
    _log(f"grouped-GEMM backend auto -> {picked} ({why})")
    _named.add((picked, platform))
    return _import_backend(picked)
  reason = unavailable_reason(name)
  if reason is not None:
    raise BackendUnavailable(f"grouped-GEMM backend {name!r} is unavailable here: {reason}")
  if (name, platform) not in _named:
    _log(f"grouped-GEMM backend {name}")
    _named.add((name, platform))
  return _import_backend(name)


def resolve_backend(name: str):
  """'auto' or a backend name -> the backend module (NAME, gmm, tgmm, unavailable_reason).

  Resolved once per (name, platform), and the pick is logged then. An unknown
  name raises ValueError listing the valid ones; a known one that cannot run
  here raises BackendUnavailable saying why.
  """
  return _resolve(name, jax.default_backend())


@dataclasses.dataclass(frozen=True)
class _Static:
  """What the custom VJP needs besides arrays (hashable: a nondiff argument)."""

  backend: str
  transpose_rhs: bool
  out_dtype: np.dtype
  gathered: tuple[bool, bool] = (False, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gmm(lhs_MK, lhs_tiles, rhs_GKN, group_sizes_G, group_offset, static: _Static):
  return _gmm_fwd(lhs_MK, lhs_tiles, rhs_GKN, group_sizes_G, group_offset, static)[0]


def _fp8_lhs_kw(static: _Static, lhs_gathered: bool) -> dict:
  """FP8 backends quantize a product's lhs: by XLA through the gather where it is a gather of token rows."""
  return {"lhs_gathered": lhs_gathered} if static.backend in FP8_BACKENDS else {}


def _fp8_rhs_kw(rhs_blocks) -> dict:
  return {} if rhs_blocks is None else {"rhs_blocks": rhs_blocks}


def _gmm_fwd(lhs_MK, lhs_tiles, rhs_GKN, group_sizes_G, group_offset, static: _Static):
  # FP8 backends: the weight's blocks, quantized once for the forward and kept for dlhs, which multiplies the
  # same 128x128 blocks transposed and had quantized the bf16 weight again (the expert FFN 24.70 -> 24.01 ms on
  # the H200, tools/bench_gmm.py --ffn-only, 2026-12-04). The residual is the e4m3 copy dlhs reads, half the
  # weight's bytes: not the forward's transposed one, which `quantize_weight` may have written beside it.
  backend = _import_backend(static.backend)
  rhs_blocks = backend.quantize_weight(rhs_GKN) if static.backend in FP8_BACKENDS else None
  out_MN = backend.gmm(
      lhs_MK,
      rhs_GKN,
      group_sizes_G,
      group_offset=group_offset,
      transpose_rhs=static.transpose_rhs,
      out_dtype=static.out_dtype,
      **({} if lhs_tiles is None else {"lhs_tiles": lhs_tiles}),
      **_fp8_lhs_kw(static, static.gathered[0]),
      **_fp8_rhs_kw(rhs_blocks),
  )
  # Kernel outputs (Pallas, TE, tokamax) carry no varying manual axes: type them as a lax op would.
  out_MN = vma.like_operands(out_MN, lhs_MK, rhs_GKN, group_sizes_G, group_offset)
  kept_blocks = None if rhs_blocks is None else rhs_blocks._replace(q_GNK=None)
  return out_MN, (lhs_MK, lhs_tiles, rhs_GKN, group_sizes_G, group_offset, kept_blocks)


def backward(static: _Static, residuals, dout_MN, dout_tiles: fp8_quant.RowTiles | None = None):
  """The cotangents of `_gmm`'s operands from the output's. dout_tiles (FP8 backends): dout_MN's rows as the
  1x128 tiles they are the values of (dout_MN = dequantize_rows(dout_tiles) in lhs's dtype), which dlhs
  multiplies and dW requantizes in one pass: the FP8 combine's backward moved them (fp8_dispatch)."""
  lhs_MK, lhs_tiles, rhs_GKN, group_sizes_G, group_offset, rhs_blocks = residuals
  backend = _import_backend(static.backend)
  # The kernels take equal-dtype operands: dout is rounded to the compute dtype
  # as the forward's inputs were (a float32 out_dtype still accumulates in f32).
  dout_MN = dout_MN.astype(lhs_MK.dtype)
  with jax.named_scope("gmm_dlhs"):
    # rhs_GKN read transposed; with transpose_rhs the forward's rhs is [G, N, K]
    # and the plain product gives dlhs.
    dlhs_MK = backend.gmm(
        dout_MN,
        rhs_GKN,
        group_sizes_G,
        group_offset=group_offset,
        transpose_rhs=not static.transpose_rhs,
        out_dtype=lhs_MK.dtype,
        **({} if dout_tiles is None else {"lhs_tiles": dout_tiles}),
        **_fp8_lhs_kw(static, static.gathered[1]),
        **_fp8_rhs_kw(rhs_blocks),
    )
    dlhs_MK = vma.like_operands(dlhs_MK, dout_MN, rhs_GKN, group_sizes_G, group_offset)
  with jax.named_scope("gmm_drhs"):
    # drhs[g] = lhs_g.T @ dout_g, or dout_g.T @ lhs_g for a [G, N, K] rhs.
    swap = static.transpose_rhs
    a_MX, b_MY = (dout_MN, lhs_MK) if swap else (lhs_MK, dout_MN)
    fp8_kw = {}
    if static.backend in FP8_BACKENDS:  # which operand XLA should quantize, fusing its gather
      fp8_kw["gathered"] = static.gathered[::-1] if swap else static.gathered
      # Operands that are tiles' values are requantized from the tiles, not gathered.
      a_tiles, b_tiles = (dout_tiles, lhs_tiles) if swap else (lhs_tiles, dout_tiles)
      fp8_kw.update({k: t for k, t in (("lhs_tiles", a_tiles), ("dout_tiles", b_tiles)) if t is not None})
    drhs_GXY = backend.tgmm(
        a_MX,
        b_MY,
        group_sizes_G,
        group_offset=group_offset,
        num_local_groups=rhs_GKN.shape[0],
        out_dtype=rhs_GKN.dtype,
        **fp8_kw,
    )
    drhs_GXY = vma.like_operands(drhs_GXY, a_MX, b_MY, group_sizes_G, group_offset)
  # Each cotangent typed like its primal: dW of weights shared by every row shard is
  # summed over the shards here (MaxText/moe/vma.py). group_sizes and group_offset are
  # int32 here (see gmm): no cotangent.
  # lhs_tiles are lhs_MK's quantization, moved (the FP8 dispatch): lhs_MK carries the gradient.
  no_tiles = None if lhs_tiles is None else jax.tree.map(jnp.zeros_like, lhs_tiles)
  return vma.like_primal(dlhs_MK, lhs_MK), no_tiles, vma.like_primal(drhs_GXY, rhs_GKN), None, None


_gmm.defvjp(_gmm_fwd, backward)


def _check_offset(group_offset, num_groups: int, num_local: int) -> None:
  if isinstance(group_offset, jax.core.Tracer):
    return
  value = int(np.asarray(group_offset))
  if not 0 <= value <= num_groups - num_local:
    raise ValueError(
        f"group_offset={value} with {num_local} local groups of {num_groups}: the local groups "
        f"[{value}, {value + num_local}) must lie inside [0, {num_groups})"
    )


def gmm(
    lhs_MK: jax.Array,
    rhs_GKN: jax.Array,
    group_sizes_G: jax.Array,
    *,
    backend: str = "xla",
    group_offset: int | jax.Array = 0,
    preferred_element_type: jnp.dtype | None = None,
    transpose_rhs: bool = False,
    lhs_tiles: fp8_quant.RowTiles | None = None,
    gathered: tuple[bool, bool] = (False, False),
) -> jax.Array:
  """Grouped GEMM of row-sorted lhs_MK with the local groups' weights; see the module doc.

  Args:
    lhs_MK: [M, K] rows sorted by group; M may exceed sum(group_sizes_G).
    rhs_GKN: [G_local, K, N] weights of groups [group_offset, group_offset + G_local);
      [G_local, N, K] with transpose_rhs=True (used transposed).
    group_sizes_G: [G_total] rows per global group (integer; any float is cast and
      gets a zero gradient).
    backend: a name in CHOICES ("auto" picks per platform).
    group_offset: first local group's global id (int or int32 scalar / [1]).
    preferred_element_type: dtype of the result; default the promoted input dtype.
      Backends accumulate in float32 whatever this is.
    transpose_rhs: rhs given as [G_local, N, K] (as upstream megablox's flag).
    lhs_tiles: lhs_MK's rows already quantized to 1x128 tiles (FP8 backends only): the forward multiplies
      these, and lhs_MK (their values) is what dW quantizes and the gradient flows to.
    gathered: (lhs, the output's cotangent): which operands are gathers of token rows (the dispatch's
      output; the combine's cotangent). FP8 backends leave those to XLA's quantization, which fuses the
      gather and reads the compact token rows (each routed k times), wherever they are quantized (the
      forward's lhs, dlhs's dout, dW's operands), and quantize the others, materialized rows, in one pass
      (`mgpu/fp8_quant_kernels.py`). dW requantizes lhs from lhs_tiles where given, in one pass. No effect on the values.

  Returns:
    out_MN: [M, N]; zero in rows outside the local groups.
  """
  operands, static = prepare(lhs_MK, rhs_GKN, group_sizes_G, backend=backend, group_offset=group_offset,
                             preferred_element_type=preferred_element_type, transpose_rhs=transpose_rhs,
                             lhs_tiles=lhs_tiles, gathered=gathered)
  with jax.named_scope("gmm"):
    return _gmm(*operands, static)


def prepare(lhs_MK, rhs_GKN, group_sizes_G, *, backend="xla", group_offset=0, preferred_element_type=None,
            transpose_rhs=False, lhs_tiles=None, gathered=(False, False)):
  """gmm's arguments checked -> (operands, static): `forward(operands, static)` is gmm's forward with the
  residuals `backward` takes. For a custom VJP around gmm and the op its output feeds (fp8_dispatch's
  combine, whose backward hands dlhs and dW the cotangent as FP8 tiles)."""
  if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3 or group_sizes_G.ndim != 1:
    raise ValueError(
        f"gmm wants lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs_MK.shape}, {rhs_GKN.shape}, "
        f"{group_sizes_G.shape}"
    )
  k_rhs = rhs_GKN.shape[2] if transpose_rhs else rhs_GKN.shape[1]
  if lhs_MK.shape[1] != k_rhs:
    raise ValueError(f"gmm contraction mismatch: lhs {lhs_MK.shape}, rhs {rhs_GKN.shape}, {transpose_rhs=}")
  if group_sizes_G.shape[0] < rhs_GKN.shape[0]:
    raise ValueError(f"group_sizes has {group_sizes_G.shape[0]} groups, fewer than rhs's {rhs_GKN.shape[0]}")
  _check_offset(group_offset, group_sizes_G.shape[0], rhs_GKN.shape[0])
  compute_dtype = jnp.promote_types(lhs_MK.dtype, rhs_GKN.dtype)
  name = resolve_backend(backend).NAME
  if lhs_tiles is not None and name not in FP8_BACKENDS:
    raise ValueError(f"gmm: lhs_tiles (rows quantized before the dispatch) need an FP8 backend "
                     f"({', '.join(FP8_BACKENDS)}), not {name!r}")
  static = _Static(
      backend=name,
      transpose_rhs=bool(transpose_rhs),
      out_dtype=np.dtype(preferred_element_type or compute_dtype),
      gathered=(bool(gathered[0]), bool(gathered[1])),
  )
  operands = (
      lhs_MK.astype(compute_dtype),
      None if lhs_tiles is None else jax.lax.stop_gradient(lhs_tiles),
      rhs_GKN.astype(compute_dtype),
      group_sizes_G.astype(jnp.int32),
      jnp.asarray(group_offset, jnp.int32).reshape(()),
  )
  return operands, static


def forward(operands, static: _Static):
  """(out_MN, residuals) of `prepare`'s operands."""
  return _gmm_fwd(*operands, static)


__all__ = [
    "BACKENDS",
    "CHOICES",
    "BackendName",
    "BackendUnavailable",
    "Choice",
    "backward",
    "forward",
    "gmm",
    "prepare",
    "resolve_backend",
    "unavailable_reason",
]
