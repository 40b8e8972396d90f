"""Seam: jax 0.11.2's batching rules for cuDNN attention (jax/_src/cudnn/fused_attention_stablehlo.py ~809, ~867)
-> right for MLA, whose values' head size differs from the keys' (DeepSeek-V3: d_qk 192, d_v 128).

Upstream MaxText's pipeline vmaps its stages (layers/pipeline.py), so `attention: cudnn_flash_jax` reaches jax's
cuDNN primitives under vmap. jax's rule folds the vmap axis into the batch (stages x batch sequences in one cuDNN
call: no extra work), but it reshapes the values with the keys' head size, and the output, the forward output and
its cotangent with the query's. With d_v != d_qk the first reshape fails: "cannot reshape array of shape
(2, 16, 4096, 128, 128) ... into shape (32, 4096, 128, 192)". The rule here folds the same way, each operand with
its own trailing shape; cuDNN itself takes d_qk=192 with d_v=128 (sm90+, cuDNN >= 9.10: jax's `is_mla` path), so
the folded call is the one an unpipelined MLA layer makes, with a batch `stages` times larger.

Every other call goes to jax's rule unchanged: equal head sizes, a bias, packed (offsets) or paged sequences, an
unused operand that carries the vmap axis. The rules live in jax's batching registry keyed by the wrapper
primitives, not on a module attribute: the seam checks jax's version, the hash of both rules' source, and that
the registry still holds them.
"""

from __future__ import annotations

import importlib

from patches._seam import Seam, UpstreamMismatch

SEAM = Seam(name="cudnn_mla_vmap", module="jax._src.cudnn.fused_attention_stablehlo",
            attr="_dot_product_attention_fwd_batcher", sha256="7ffbed744673fcf8", version="0.11.2", package="jax")
BWD_SEAM = Seam(name="cudnn_mla_vmap", module="jax._src.cudnn.fused_attention_stablehlo",
                attr="_dot_product_attention_bwd_batcher", sha256="6182bc4733f3203c", version="0.11.2", package="jax")
# The wrapper primitive each rule batches (fused_attention_stablehlo.py ~1191).
_RULES = ((SEAM, "_dot_product_attention_fwd_p_wrapper"), (BWD_SEAM, "_dot_product_attention_bwd_p_wrapper"))

# Operand positions in the primitives' argument lists (fused_attention_stablehlo.py ~424 and ~464): query
# [B, T, N, Hqk] (BTNH; BNTH swaps T and N), key [B, S, N, Hqk], value [B, S, N, Hv], bias, q_seqlen [B],
# kv_seqlen [B], q_offsets, kv_offsets, page_table_k, page_table_v; the backward's also the softmax statistics
# [B, N, T] and the forward output and its cotangent [B, T, N, Hv]. Each leads with the batch B.
QUERY_KEY_VALUE = (0, 1, 2)
SEQLENS = (4, 5)
BACKWARD_ONLY = (10, 11, 12)
_saved: dict = {}  # wrapper primitive -> jax's registry entry, while ours is registered


def _folded_operands(backward: bool, mask_type) -> tuple[int, ...]:
  """The operands that carry the batch: folded with the vmap axis; the rest must be unused (empty, unbatched)."""
  fa = importlib.import_module(SEAM.module)
  return QUERY_KEY_VALUE + (SEQLENS if fa.has_padding(mask_type) else ()) + (BACKWARD_ONLY if backward else ())


def _fold(x, bdim, size: int):
  """[size, B, ...] (the vmap axis moved first, or broadcast where x lacks it) -> [size * B, ...]."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  x = jnp.broadcast_to(x, (size, *x.shape)) if bdim is None else jnp.moveaxis(x, bdim, 0)
  return x.reshape((size * x.shape[1], *x.shape[2:]))


def _folding_rule(primitive, jax_rule, backward: bool):
  def rule(batched_args, batch_dims, **params):
    key, value = batched_args[1:3]
    folded = _folded_operands(backward, params["mask_type"])
    unused = [i for i in range(len(batched_args)) if i not in folded]
    if (value.shape[-1] == key.shape[-1] or params["variadic_args"][0]
        or any(batch_dims[i] is not None or batched_args[i].size for i in unused)):
      return jax_rule(batched_args, batch_dims, **params)
    size = next(a.shape[d] for a, d in zip(batched_args, batch_dims) if d is not None)
    args = [_fold(a, d, size) if i in folded else a for i, (a, d) in enumerate(zip(batched_args, batch_dims))]
    outs = primitive.bind(*args, **params)  # one cuDNN call over size x B sequences
    return [o.reshape((size, o.shape[0] // size, *o.shape[1:])) for o in outs], [0] * len(outs)

  rule.__wrapped__ = jax_rule
  return rule


def _registered_rule(batching, primitive):
  """The rule jax registered for `primitive`: `primitive_batchers[p] = rule` stores it in a closure
  (jax/_src/interpreters/batching.py ~597)."""
  wrapped = batching.fancy_primitive_batchers.get(primitive)
  code = getattr(wrapped, "__code__", None)
  cells = dict(zip(code.co_freevars, wrapped.__closure__ or ())) if code else {}
  return cells["batcher"].cell_contents if "batcher" in cells else None


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  if _saved:
    return
  from jax._src.interpreters import batching  # pylint: disable=import-outside-toplevel

  fa = importlib.import_module(SEAM.module)
  for seam, name in _RULES:
    seam.check()
    if _registered_rule(batching, getattr(fa, name)) is not seam.target():
      raise UpstreamMismatch(f"patch '{seam.name}': jax's batching rule for {name} is no longer {seam.attr} "
                             f"(jax {seam.version}); re-read the seam before patching")
  for seam, name in _RULES:
    primitive = getattr(fa, name)
    _saved[primitive] = batching.fancy_primitive_batchers[primitive]
    batching.primitive_batchers[primitive] = _folding_rule(primitive, seam.target(), backward=seam is BWD_SEAM)


def undo() -> None:
  from jax._src.interpreters import batching  # pylint: disable=import-outside-toplevel

  batching.fancy_primitive_batchers.update(_saved)
  _saved.clear()


def applied() -> bool:
  return bool(_saved)


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True  # changes only calls with unequal head sizes under vmap, which jax's rule cannot batch
