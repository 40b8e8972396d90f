"""Attention with sinks as upstream MaxText's dot_product path computes it, in float32: the sink logit
concatenated to each row's scores, a softmax over both, the sink's column dropped. Shared by
tests/test_attention_sinks.py (tools/sinks_selftest.py keeps its own copy: it runs without tests/)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_attention_with_sinks(q_BTNH, k_BSKH, v_BSKH, sinks_N, *, scale=1.0, window=None):
  b, t, n, _ = q_BTNH.shape
  groups = n // k_BSKH.shape[2]
  k_BSNH = jnp.repeat(k_BSKH.astype(jnp.float32), groups, axis=2)
  v_BSNH = jnp.repeat(v_BSKH.astype(jnp.float32), groups, axis=2)
  s_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH.astype(jnp.float32), k_BSNH) * scale
  t_pos, s_pos = jnp.arange(t)[:, None], jnp.arange(k_BSKH.shape[1])[None, :]
  visible_TS = (s_pos <= t_pos) & (True if window is None else s_pos > t_pos - window)
  s_BNTS = jnp.where(visible_TS, s_BNTS, -jnp.inf)
  sink_BNT1 = jnp.broadcast_to(sinks_N.astype(jnp.float32)[None, :, None, None], (b, n, t, 1))
  p_BNTS = jax.nn.softmax(jnp.concatenate([s_BNTS, sink_BNT1], axis=-1), axis=-1)[..., :-1]
  return jnp.einsum("bnts,bsnh->btnh", p_BNTS, v_BSNH)
