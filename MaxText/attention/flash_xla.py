"""Kernel "xla": flash attention's two halves with cuDNN's contract, in plain XLA ops (float32 math).

The CPU stand-in for flash_cudnn.py, so that sinks.py's custom VJP runs the same code on CPU as on the GPU:

  forward(q_BTNH, k_BSKH, v_BSKH)                           -> out_BTNH (q's dtype), lse_BNT (float32)
  backward(q_BTNH, k_BSKH, v_BSKH, lse_BNT, out_BTNH, dout_BTNH) -> dq_BTNH, dk_BSKH, dv_BSKH

Causal, optionally within a sliding window: query t sees keys s with t - window < s <= t. GQA: N query heads,
K key/value heads, query head n reads key head n // (N // K). The backward is flash attention's: the
probabilities from the saved statistics, P = exp(scale * q k - lse), and D = rowsum(dout * out) from the saved
output, so it returns the gradient of whatever softmax those statistics and that output describe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NAME = "xla"
_MASKED = -1e30  # large and finite: a fully masked row never occurs (causal rows see their own key)


def _scores_BKGTS(q_BTNH, k_BSKH, scale: float, window: int | None):
  b, t, n, h = q_BTNH.shape
  kv_heads = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.astype(jnp.float32).reshape(b, t, kv_heads, n // kv_heads, h)
  s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH.astype(jnp.float32)) * scale
  t_pos, s_pos = jnp.arange(t)[:, None], jnp.arange(k_BSKH.shape[1])[None, :]
  visible_TS = s_pos <= t_pos
  if window is not None:
    visible_TS &= s_pos > t_pos - window
  return jnp.where(visible_TS, s_BKGTS, _MASKED), q_BTKGH


def forward(q_BTNH, k_BSKH, v_BSKH, *, scale: float, window: int | None):
  b, t, n, _ = q_BTNH.shape
  s_BKGTS, _ = _scores_BKGTS(q_BTNH, k_BSKH, scale, window)
  lse_BKGT = jax.nn.logsumexp(s_BKGTS, axis=-1)
  p_BKGTS = jnp.exp(s_BKGTS - lse_BKGT[..., None])
  out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", p_BKGTS, v_BSKH.astype(jnp.float32))
  return out_BTKGH.reshape(b, t, n, -1).astype(q_BTNH.dtype), lse_BKGT.reshape(b, n, t)


def backward(q_BTNH, k_BSKH, v_BSKH, lse_BNT, out_BTNH, dout_BTNH, *, scale: float, window: int | None):
  b, t, n, h = q_BTNH.shape
  kv_heads = k_BSKH.shape[2]
  g = n // kv_heads
  s_BKGTS, q_BTKGH = _scores_BKGTS(q_BTNH, k_BSKH, scale, window)
  p_BKGTS = jnp.exp(s_BKGTS - lse_BNT.reshape(b, kv_heads, g, t)[..., None])
  dout_BTKGH = dout_BTNH.astype(jnp.float32).reshape(b, t, kv_heads, g, -1)
  out_BTKGH = out_BTNH.astype(jnp.float32).reshape(b, t, kv_heads, g, -1)
  v_BSKH32 = v_BSKH.astype(jnp.float32)
  dv_BSKH = jnp.einsum("bkgts,btkgh->bskh", p_BKGTS, dout_BTKGH)
  dp_BKGTS = jnp.einsum("btkgh,bskh->bkgts", dout_BTKGH, v_BSKH32)
  d_BKGT = jnp.einsum("btkgh,btkgh->bkgt", dout_BTKGH, out_BTKGH)
  ds_BKGTS = p_BKGTS * (dp_BKGTS - d_BKGT[..., None]) * scale
  dq_BTNH = jnp.einsum("bkgts,bskh->btkgh", ds_BKGTS, k_BSKH.astype(jnp.float32)).reshape(b, t, n, h)
  dk_BSKH = jnp.einsum("bkgts,btkgh->bskh", ds_BKGTS, q_BTKGH)
  return dq_BTNH.astype(q_BTNH.dtype), dk_BSKH.astype(k_BSKH.dtype), dv_BSKH.astype(v_BSKH.dtype)
