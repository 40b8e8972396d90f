"""Kernel "te": Transformer Engine's JAX fused attention with its learnable softmax (softmax_type learnable).

TE's cuDNN graph takes the sink itself (`softmax_offset`, float32 [1, N, 1, 1]) and returns its gradient: no
rescaling outside the kernel. TE-JAX has it since 2.11; its cuDNN backend enables it from cuDNN 9.13.1 (older
cuDNN: TE has no fused kernel for it). Used here through `transformer_engine.jax.attention.fused_attn` with
separate q, k, v (BSHD_BSHD_BSHD, not the packed THD layouts, whose learnable softmax TE has known bugs in),
a causal mask and TE's window (left, right) = (window - 1, 0), which keeps keys in (t - window, t].
Checked against TE's 2.20 source (MaxText/moe/te_release.py's series); other releases are refused by name.
"""

from __future__ import annotations

import jax.numpy as jnp

from MaxText.moe import te_release

NAME = "te"
INSTALL = "pip install 'maxtext-moe[te]' (transformer-engine[jax]) or use an NGC JAX container, which ships TE"
MIN_CUDNN = (9, 13, 1)  # TE's fused_attn.cpp: learnable softmax on cuDNN 9.13.1 and later


def _te():
  """TE's attention module, or ImportError saying what to install."""
  try:
    from transformer_engine.jax import attention  # pylint: disable=import-outside-toplevel
    from transformer_engine.jax.cpp_extensions.misc import get_cudnn_version  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"attention-with-sinks kernel 'te' needs Transformer Engine for JAX: {INSTALL} ({e})") from e
  why = te_release.unsupported(te_release.installed_version())
  if why:
    raise ImportError(f"attention-with-sinks kernel 'te' {why}: {INSTALL}")
  if tuple(get_cudnn_version()) < MIN_CUDNN:
    raise ImportError(f"attention-with-sinks kernel 'te': TE's learnable softmax needs cuDNN >= "
                      f"{'.'.join(map(str, MIN_CUDNN))}, this process loads {'.'.join(map(str, get_cudnn_version()))}")
  return attention


def unavailable_reason() -> str | None:
  try:
    _te()
  except ImportError as e:
    return str(e)
  return None


def attention_with_sinks(q_BTNH, k_BSKH, v_BSKH, sinks_N, *, scale: float, window: int | None):
  te = _te()
  batch, t = q_BTNH.shape[:2]
  full = jnp.full((batch,), t, jnp.int32)  # every position valid: the causal mask does the rest
  return te.fused_attn(
      (q_BTNH, k_BSKH, v_BSKH), None, te.SequenceDescriptor.from_seqlens((full, full)), None,
      attn_bias_type=te.AttnBiasType.NO_BIAS, attn_mask_type=te.AttnMaskType.CAUSAL_MASK,
      qkv_layout=te.QKVLayout.BSHD_BSHD_BSHD, softmax_type=te.AttnSoftmaxType.LEARNABLE_SOFTMAX,
      scaling_factor=scale, dropout_probability=0.0, is_training=True,
      window_size=None if window is None else (window - 1, 0),
      softmax_offset=sinks_N.astype(jnp.float32).reshape(1, -1, 1, 1))
