"""Varying-manual-axes typing for what JAX cannot type itself: kernel outputs and custom-VJP cotangents.

Inside `jax.shard_map` (check_vma on, the default) every value carries the set of
mesh axes it varies over. `jax.lax` ops type their results as the union of their
operands' sets; Pallas/Mosaic kernels and foreign calls (Transformer Engine, tokamax)
type theirs as varying over nothing, and a custom VJP's cotangent must carry exactly
its primal's set. Left alone, a grouped GEMM whose rows are split over `fsdp`
returns dW typed invariant while its weights are `{fsdp}`-varying, and the whole
train step fails with "manual axis types do not match" on every multi-device mesh
(seen on 2xH200; CPU never saw it because the `xla` backend is made of lax ops).

Two rules, applied where kernels are called and where cotangents leave a custom VJP:

  like_operands(out, *operands)   kernel output -> varying like a lax op's result
  like_primal(ct, primal)         cotangent -> the primal's (or its `stamp`'s) set: summed over axes the
                                  primal does not vary over (the transpose of the
                                  implicit broadcast autodiff would have inserted),
                                  broadcast over axes it lacks

Outside shard_map every set is empty and both are the identity.
"""

from __future__ import annotations

import jax


def axes(x) -> frozenset[str]:
  """The mesh axes x (an array, or a pytree of them) varies over."""
  leaves = [leaf for leaf in jax.tree.leaves(x) if hasattr(leaf, "dtype")]
  return frozenset().union(*(jax.typeof(leaf).manual_axis_type.varying for leaf in leaves))


def vary(x, over):
  """x typed as varying over the axes `over` too (a cast, no data movement; its transpose is a psum over them)."""
  missing = tuple(sorted(frozenset(over) - axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def like_operands(out, *operands):
  """`out` (a pytree) typed as varying over every axis any operand varies over, as a lax op's result is.

  For kernel outputs: the kernel's result depends on all its operands, so it varies
  wherever they do, whatever type the kernel's primitive gave it.
  """
  over = axes(operands)
  return jax.tree.map(lambda leaf: vary(leaf, over), out)


def stamp(x):
  """A zero-size residual that remembers x's type: `like_primal(ct, stamp(x))` without keeping x alive."""
  return jax.tree.map(lambda leaf: vary(jax.numpy.zeros((0,), leaf.dtype), axes(leaf)), x)


def like_primal(ct, primal):
  """Cotangent `ct` typed like `primal` (same structure; None cotangents stay None).

  Axes the cotangent varies over but the primal does not: the primal was used
  identically by every shard, so its cotangent is the sum of the shards' partials
  (psum). Axes the primal varies over but the cotangent does not: every shard gets
  the same cotangent (a type cast, no data movement).
  """
  def one(c, p):
    if c is None:
      return None
    want = axes(p)
    extra = tuple(sorted(axes(c) - want))
    if extra:
      c = jax.lax.psum(c, extra)
    return vary(c, want)

  return jax.tree.map(one, ct, primal, is_leaf=lambda x: x is None)
