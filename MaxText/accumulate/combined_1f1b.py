"""Megatron's combined 1F1B in the gradient-accumulation loop: layer l's forward of microbatch i+1 runs in the same
loop body as layer L-1-l's backward of microbatch i, so that one microbatch's EP exchange can run while the other's
GEMMs do. Megatron-Core calls it "combined 1F1B" (EP all-to-all overlap, DeepSeek-V3 on H100: 30-40% of the step
exposed -> under 5%); DeepSeek's DualPipe pairs a forward and a backward chunk the same way.

  (total, aux), grads = combined_1f1b.value_and_grad(stages, params, microbatches)

stages: `Stages(pre, layer, post)`; params: (params_pre, params_layers, params_post), params_layers stacked on a
leading L axis; microbatches: a pytree whose leaves lead with M >= 1. total: the sum over microbatches of post's
loss plus every layer's aux loss; aux: (post's aux summed, the layers' aux losses summed); grads: like params.
`accumulated` is the plain loop (one microbatch's forward, then its backward) it equals.

What runs, M microbatches of L layers:
  prologue  pre and the L layer forwards of microbatch 0
  body i    (i = 0 .. M-2) post's forward and backward of microbatch i, pre of i+1, then one scan over l of
            [forward of layer l of microbatch i+1 | backward of layer L-1-l of microbatch i], pre's backward of i
  epilogue  post, the L layer backwards and pre's backward of microbatch M-1
The two halves of the scan body share no value, so XLA's scheduler may put either one's collectives beside the
other's GEMMs (tools/overlap_probe.py reads where it did, from a compiled schedule).

What the backward keeps is what jax.vjp of the layer keeps: with the layer wrapped in jax.checkpoint, its remat
policy decides, as in the plain loop. Residuals that are the layer's own weights are not stored again (they are
the scan's input). Peak: two microbatches' residuals (one going backward, one coming forward), where the plain
loop holds one; pre's residuals are not kept (its forward runs again in its backward: an embedding lookup).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Stages:
  """The model cut where its scanned layers start and end.

  Attributes:
    pre: (params_pre, microbatch) -> x_0, the first layer's input (embedding, dense layers).
    layer: (params_l, x) -> (x, aux_loss): one of the L identical layers; aux_loss a scalar added to the loss
      (a load-balance loss), its cotangent 1.
    post: (params_post, x_L, microbatch) -> (loss, aux): the scalar differentiated, and what is summed beside it.
  """

  pre: Callable[[Any, Any], jax.Array]
  layer: Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]]
  post: Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]


class _VjpShape:
  """A layer VJP's pytree structure, found while tracing the first forward: which of its leaves are the layer's
  weights (re-supplied in the backward) and which are residuals the forward must store."""

  def __init__(self):
    self.treedef = None
    self.weight_leaf = None  # per VJP leaf: index of the weight leaf it is, or None (a stored residual)

  def split(self, vjp, w) -> list[jax.Array]:
    leaves, treedef = jax.tree.flatten(vjp)
    index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(w))}
    weight_leaf = tuple(index.get(id(leaf)) for leaf in leaves)
    if self.treedef is None:
      self.treedef, self.weight_leaf = treedef, weight_leaf
    elif weight_leaf != self.weight_leaf:
      raise ValueError("combined_1f1b: the layer's VJP keeps different residuals on different calls")
    return [leaf for leaf, i in zip(leaves, weight_leaf) if i is None]

  def join(self, stored: list[jax.Array], w):
    w_leaves, stored = jax.tree.leaves(w), iter(stored)
    leaves = [next(stored) if i is None else w_leaves[i] for i in self.weight_leaf]
    return jax.tree.unflatten(self.treedef, leaves)


def _index(tree, l):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, l, keepdims=False), tree)


def _add_at(acc, tree, l):
  return jax.tree.map(lambda a, g: jax.lax.dynamic_update_index_in_dim(a, a[l] + g.astype(a.dtype), l, 0), acc, tree)


def _layer_forward(stages, shape, w, x):
  (y, aux_loss), vjp = jax.vjp(stages.layer, w, x)
  return y, aux_loss, shape.split(vjp, w)


def _layer_backward(shape, w, stored, g_y, aux_loss):
  return shape.join(stored, w)((g_y, jnp.ones_like(aux_loss)))  # (g_w, g_x)


def _forward(stages, shape, ws, x0):
  """The L layer forwards of one microbatch: (x_L, stored residuals [L, ...], aux losses [L])."""
  def body(x, w):
    y, aux_loss, stored = _layer_forward(stages, shape, w, x)
    return y, (stored, aux_loss)

  y, (stored, aux_L) = jax.lax.scan(body, x0, ws)
  return y, stored, aux_L


def _backward(shape, ws, stored, aux_L, g_y, g_ws):
  """The L layer backwards of one microbatch, adding into g_ws: (g_x0, g_ws)."""
  num_layers = aux_L.shape[0]

  def body(carry, l):
    g, acc = carry
    g_w, g = _layer_backward(shape, _index(ws, l), _index(stored, l), g, aux_L[l])
    return (g, _add_at(acc, g_w, l)), None

  (g_x0, g_ws), _ = jax.lax.scan(body, (g_y, g_ws), jnp.arange(num_layers - 1, -1, -1))
  return g_x0, g_ws


def _combined(stages, shape, ws, x0_next, stored, aux_L, g_y, g_ws):
  """Layer l's forward of the next microbatch beside layer L-1-l's backward of this one, for l = 0 .. L-1."""
  num_layers = aux_L.shape[0]

  def body(carry, w_and_l):
    x, g, acc = carry
    w, l = w_and_l
    y, aux_next, stored_next = _layer_forward(stages, shape, w, x)  # microbatch i+1, layer l
    back = num_layers - 1 - l
    g_w, g = _layer_backward(shape, _index(ws, back), _index(stored, back), g, aux_L[back])  # i, layer L-1-l
    return (y, g, _add_at(acc, g_w, back)), (stored_next, aux_next)

  (y_next, g_x0, g_ws), (stored_next, aux_next) = jax.lax.scan(body, (x0_next, g_y, g_ws),
                                                                (ws, jnp.arange(num_layers)))
  return y_next, stored_next, aux_next, g_x0, g_ws


def _post(stages, p_post, y, mb):
  """post's loss and aux, and its gradients (params_post, x_L)."""
  (loss, aux), (g_post, g_y) = jax.value_and_grad(lambda p, y: stages.post(p, y, mb), argnums=(0, 1),
                                                  has_aux=True)(p_post, y)
  return loss, aux, g_post, g_y.astype(y.dtype)


def _pre_backward(stages, p_pre, mb, g_x0):
  _, vjp = jax.vjp(lambda p: stages.pre(p, mb), p_pre)
  return vjp(g_x0)[0]


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def value_and_grad(stages: Stages, params, microbatches):
  """((total, (post aux, layers' aux loss)), grads): see the module docstring."""
  p_pre, ws, p_post = params
  shape = _VjpShape()
  num_mb = jax.tree.leaves(microbatches)[0].shape[0]
  mb_at = lambda i: jax.tree.map(lambda a: a[i], microbatches)  # noqa: E731

  def finish(acc, mb, y, aux_L):
    """post's forward and backward of one microbatch, its losses added: (acc, the cotangent of x_L)."""
    total, post_aux, layer_aux, g_pre, g_ws, g_post = acc
    loss, aux, g_post_i, g_y = _post(stages, p_post, y, mb)
    aux_loss = aux_L.sum(dtype=jnp.float32)
    return (total + loss + aux_loss, _tree_add(post_aux, aux), layer_aux + aux_loss, g_pre, g_ws,
            _tree_add(g_post, g_post_i)), g_y

  y0, stored0, aux0 = _forward(stages, shape, ws, stages.pre(p_pre, mb_at(0)))
  zeros = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
  _, aux_shape, _, _ = jax.eval_shape(lambda: _post(stages, p_post, y0, mb_at(0)))
  acc = (jnp.zeros((), jnp.float32), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape),
         jnp.zeros((), jnp.float32), zeros(p_pre), zeros(ws), zeros(p_post))

  def step(carry, mbs):
    acc, y, stored, aux_L = carry
    mb, mb_next = mbs
    acc, g_y = finish(acc, mb, y, aux_L)
    total, post_aux, layer_aux, g_pre, g_ws, g_post = acc
    y_next, stored_next, aux_next, g_x0, g_ws = _combined(stages, shape, ws, stages.pre(p_pre, mb_next), stored,
                                                          aux_L, g_y, g_ws)
    g_pre = _tree_add(g_pre, _pre_backward(stages, p_pre, mb, g_x0))
    return ((total, post_aux, layer_aux, g_pre, g_ws, g_post), y_next, stored_next, aux_next), None

  if num_mb > 1:
    pairs = (jax.tree.map(lambda a: a[:-1], microbatches), jax.tree.map(lambda a: a[1:], microbatches))
    (acc, y0, stored0, aux0), _ = jax.lax.scan(step, (acc, y0, stored0, aux0), pairs)
  last = mb_at(num_mb - 1)
  acc, g_y = finish(acc, last, y0, aux0)
  total, post_aux, layer_aux, g_pre, g_ws, g_post = acc
  g_x0, g_ws = _backward(shape, ws, stored0, aux0, g_y, g_ws)
  g_pre = _tree_add(g_pre, _pre_backward(stages, p_pre, last, g_x0))
  return (total, (post_aux, layer_aux)), (g_pre, g_ws, g_post)


def accumulated(stages: Stages, params, microbatches):
  """The plain loop value_and_grad equals: each microbatch's forward, then its backward, summed."""
  def loss(params, mb):
    p_pre, ws, p_post = params
    y, aux_L = jax.lax.scan(lambda x, w: stages.layer(w, x), stages.pre(p_pre, mb), ws)
    post_loss, aux = stages.post(p_post, y, mb)
    return post_loss + aux_L.sum(), (aux, aux_L.sum())

  def step(carry, mb):
    (total, aux), grads = carry
    (loss_i, aux_i), g = jax.value_and_grad(loss, has_aux=True)(params, mb)
    return ((total + loss_i, _tree_add(aux, aux_i)), _tree_add(grads, g)), None

  first = jax.tree.map(lambda a: a[0], microbatches)
  (loss0, aux0), g0 = jax.value_and_grad(loss, has_aux=True)(params, first)
  rest = jax.tree.map(lambda a: a[1:], microbatches)
  ((total, aux), grads), _ = jax.lax.scan(step, ((loss0.astype(jnp.float32), aux0), g0), rest)
  return (total, aux), grads
