"""Kernel "cudnn": jax's cuDNN flash attention, its forward and backward called separately.

jax 0.11.2's private jax._src.cudnn.fused_attention_stablehlo (upstream MaxText's `cudnn_flash_jax` imports
the same module) wraps cuDNN's fused attention in a custom VJP whose backward drops the log-sum-exp's
cotangent (`if return_residual: grad_output = grad_output[0]`): a function of the returned LSE gets wrong
dq and dk, without an error. sinks.py needs the two halves on their own instead, so this module binds jax's
two wrapper primitives (which carry jax's batching and partitioning rules) with flash_xla.py's contract:

  forward(q_BTNH, k_BSKH, v_BSKH)                           -> out_BTNH, lse_BNT (float32)
  backward(q_BTNH, k_BSKH, v_BSKH, lse_BNT, out_BTNH, dout_BTNH) -> dq_BTNH, dk_BSKH, dv_BSKH

The backward recomputes P = exp(scale * q k - lse) from the statistics it is given and D = rowsum(dout * out)
from the output it is given (flash attention's backward), which is what sinks.py relies on. Causal
(MaskType.CAUSAL), optionally in a sliding window: cuDNN's `sliding_window_length` w keeps keys in
(t - w, t], MaxText's LOCAL_SLIDING mask. bf16/fp16 operands, head size <= 256 on Hopper.
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp

NAME = "cudnn"
MODULE = "jax._src.cudnn.fused_attention_stablehlo"


def _fa():
  return importlib.import_module(MODULE)


def _unused_operands(q_BTNH):
  """bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v: empty (none used)."""
  empty = jnp.zeros(0, q_BTNH.dtype)
  return (empty,) * 7


def _params(scale: float, window: int | None) -> dict:
  fa = _fa()
  return dict(scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=fa.MaskType.CAUSAL,
              layout=fa.AttentionLayout.BTNH.value, sliding_window_length=window)


def forward(q_BTNH, k_BSKH, v_BSKH, *, scale: float, window: int | None):
  fa = _fa()
  # jax's own checks, as its dot_product_attention makes them: dtypes, head sizes, cuDNN and GPU generation.
  fa.check_layout(q_BTNH, k_BSKH, v_BSKH, None, None, None, None, None, None, None, fa.AttentionLayout.BTNH)
  fa.check_is_flash_attention(q_BTNH, k_BSKH, v_BSKH, fa.AttentionLayout.BTNH.value, fa.check_cudnn_version(),
                              False, True)
  out_BTNH, lse_BNT = fa._dot_product_attention_fwd_p_wrapper.bind(  # pylint: disable=protected-access
      q_BTNH, k_BSKH, v_BSKH, *_unused_operands(q_BTNH), **_params(scale, window), is_training=True)
  return out_BTNH, lse_BNT


def backward(q_BTNH, k_BSKH, v_BSKH, lse_BNT, out_BTNH, dout_BTNH, *, scale: float, window: int | None):
  fa = _fa()
  dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(  # pylint: disable=protected-access
      q_BTNH, k_BSKH, v_BSKH, *_unused_operands(q_BTNH), lse_BNT, out_BTNH, dout_BTNH, **_params(scale, window))
  return dq, dk, dv
