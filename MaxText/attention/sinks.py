"""Attention with sinks (GPT-OSS) in a fused kernel: one learnable logit per query head that joins every
row's softmax and attends to nothing.

  out_t = sum_s exp(S_ts - lse'_t) v_s,   lse'_t = logaddexp(lse_t, sink),   lse_t = logsumexp_s S_ts

so out' = out * exp(lse - lse') = out * sigmoid(lse - sink): a flash-attention kernel's output and log-sum-exp,
rescaled. Upstream MaxText 0.2.5 computes this only in `dot_product` (the sink concatenated to the scores,
[B, N, T, S] in HBM) and in `cudnn_flash_te` (Transformer Engine); its `cudnn_flash_jax` refuses sinks.

The gradient, with P'_ts = exp(S_ts - lse'_t) (the sink's own probability exp(sink - lse'_t); its value is 0):

  dv = P'^T dout',   dS = P' * (dout' v^T - D'),   D'_t = rowsum(dout' * out')_t
  dsink = -sum_t exp(sink - lse'_t) * D'_t       (summed over batch and positions, per head)

which is flash attention's backward run with the statistics lse' in place of lse and out' in place of out:
the kernel's own backward, given (lse', out', dout'), returns the exact dq, dk, dv of attention with sinks.
Differentiating out * sigmoid(lse - sink) through jax's cuDNN VJP instead drops the LSE's cotangent (jax's
rule discards it) and gives wrong dq and dk silently.

Kernels (`KERNELS`), each a module with forward/backward on cuDNN's contract (flash_xla.py's docstring):
  cudnn  jax's cuDNN flash attention, no Transformer Engine (flash_cudnn.py)
  xla    the same contract in XLA ops, float32: CPU, and the tests' stand-in for cudnn (flash_xla.py)
and "te", Transformer Engine's fused attention with its learnable softmax (sinks_te.py: its own VJP).
"""

from __future__ import annotations

import functools
import importlib
from typing import Literal

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.moe import vma

Kernel = Literal["cudnn", "xla", "te"]
KERNELS = {
    "cudnn": "MaxText.attention.flash_cudnn",  # jax's cuDNN flash attention + this module's custom VJP
    "xla": "MaxText.attention.flash_xla",  # XLA ops (CPU, tests) + this module's custom VJP
    "te": "MaxText.attention.sinks_te",  # Transformer Engine's learnable-softmax fused attention (its own VJP)
}


def resolve(kernel: str):
  """The kernel's module; an unknown name raises, naming the valid ones."""
  if kernel not in KERNELS:
    raise ValueError(f"attention-with-sinks kernel {kernel!r}: not one of {', '.join(KERNELS)}")
  return importlib.import_module(KERNELS[kernel])


def attention_with_sinks(q_BTNH, k_BSKH, v_BSKH, sinks_N, *, scale: float = 1.0, window: int | None = None,
                         kernel: Kernel = "cudnn"):
  """Causal attention (keys in (t - window, t] when `window` is set) whose softmax also holds `sinks_N[n]`.

  q_BTNH: queries [batch, T, N query heads, H]; k_BSKH, v_BSKH: [batch, S = T, K kv heads, H], N % K == 0
  (query head n reads kv head n // (N // K)); sinks_N: [N] logits, compared with scale * q.k (float32 math).
  Returns out_BTNH in q's dtype.
  """
  if window is not None and window <= 0:
    raise ValueError(f"sliding window {window}: must be > 0 (None: no window)")
  module = resolve(kernel)
  if kernel == "te":
    return module.attention_with_sinks(q_BTNH, k_BSKH, v_BSKH, sinks_N, scale=scale, window=window)
  return _sink_attention(q_BTNH, k_BSKH, v_BSKH, sinks_N, (kernel, float(scale), window))


def _kernel(static):
  kernel, scale, window = static
  module = resolve(kernel)
  return (functools.partial(module.forward, scale=scale, window=window),
          functools.partial(module.backward, scale=scale, window=window))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sink_attention(q_BTNH, k_BSKH, v_BSKH, sinks_N, static):
  return _forward(q_BTNH, k_BSKH, v_BSKH, sinks_N, static)[0]


def _forward(q_BTNH, k_BSKH, v_BSKH, sinks_N, static):
  forward, _ = _kernel(static)
  out_BTNH, lse_BNT = forward(q_BTNH, k_BSKH, v_BSKH)
  lse_sink_BNT = jnp.logaddexp(lse_BNT, sinks_N.astype(jnp.float32)[None, :, None])
  keep_BTN1 = jnp.exp(lse_BNT - lse_sink_BNT).transpose(0, 2, 1)[..., None]  # sigmoid(lse - sink)
  out_sink_BTNH = (out_BTNH.astype(jnp.float32) * keep_BTN1).astype(out_BTNH.dtype)
  out_sink_BTNH = checkpoint_name(out_sink_BTNH, "context")  # the name upstream's cuDNN paths give their output
  return out_sink_BTNH, (q_BTNH, k_BSKH, v_BSKH, sinks_N, lse_sink_BNT, out_sink_BTNH)


def _backward(static, residuals, dout_sink_BTNH):
  q_BTNH, k_BSKH, v_BSKH, sinks_N, lse_sink_BNT, out_sink_BTNH = residuals
  _, backward = _kernel(static)
  dout_sink_BTNH = dout_sink_BTNH.astype(out_sink_BTNH.dtype)
  dq, dk, dv = backward(q_BTNH, k_BSKH, v_BSKH, lse_sink_BNT, out_sink_BTNH, dout_sink_BTNH)
  d_BNT = jnp.einsum("btnh,btnh->bnt", dout_sink_BTNH.astype(jnp.float32), out_sink_BTNH.astype(jnp.float32))
  p_sink_BNT = jnp.exp(sinks_N.astype(jnp.float32)[None, :, None] - lse_sink_BNT)
  dsinks_N = -jnp.einsum("bnt,bnt->n", p_sink_BNT, d_BNT).astype(sinks_N.dtype)
  primals = (q_BTNH, k_BSKH, v_BSKH, sinks_N)
  return vma.like_primal((dq, dk, dv, dsinks_N), primals)


_sink_attention.defvjp(_forward, _backward)
