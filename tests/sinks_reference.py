"""Shared by tests/test_attention_sinks*.py: attention with sinks as upstream MaxText's dot_product path computes
it, in float32 (the sink logit concatenated to each row's scores, a softmax over both, the sink's column dropped;
tools/sinks_selftest.py keeps its own copy: it runs without tests/), and `cpu_cudnn`, jax's cuDNN primitives
with a CPU kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src.cudnn import fused_attention_stablehlo as fa

import cpu_cudnn as cpu_cudnn_lib

from MaxText.attention import flash_xla


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


def _core_fwd(q, k, v, *unused, scale, mask_type, layout, sliding_window_length, is_training, **_):
  assert mask_type == fa.MaskType.CAUSAL and layout == fa.AttentionLayout.BTNH.value and is_training
  assert not any(u.size for u in unused)  # no bias, seqlens, offsets or page tables
  return flash_xla.forward(q, k, v, scale=scale, window=sliding_window_length)


def _core_bwd(q, k, v, *rest, scale, mask_type, layout, sliding_window_length, **_):
  *unused, lse, out, dout = rest
  assert mask_type == fa.MaskType.CAUSAL and layout == fa.AttentionLayout.BTNH.value
  assert not any(u.size for u in unused)
  return flash_xla.backward(q, k, v, lse, out, dout, scale=scale, window=sliding_window_length)


@pytest.fixture
def cpu_cudnn(monkeypatch):
  """jax's cuDNN primitives with flash_xla's kernels (tests/cpu_cudnn.py)."""
  with cpu_cudnn_lib.kernels(monkeypatch, _core_fwd, _core_bwd):
    yield
