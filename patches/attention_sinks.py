"""Seam: maxtext.layers.attention_op.AttentionOp.apply_attention (maxtext 0.2.5) -> attention with sinks in jax's
cuDNN flash attention for `attention: cudnn_flash_jax` (MaxText/attention/sinks.py).

Upstream runs a layer's sinks (GPT-OSS: one learnable logit per query head) only in `dot_product`, which keeps
each layer's [batch, heads, T, T] scores in HBM, and in `cudnn_flash_te` (Transformer Engine's learnable
softmax); its `cudnn_flash_jax` raises "Attention sinks on GPU are only supported with attention=cudnn_flash_te"
(validate_gpu_flash_attention, attention_op.py ~147). Here a training or prefill call of `cudnn_flash_jax` that
carries sinks runs sinks.py's kernel "cudnn" instead: jax's cuDNN forward, out * sigmoid(lse - sink), and a
custom VJP whose backward is cuDNN's own with the sinks folded into its statistics. The window is the layer's:
LOCAL_SLIDING layers keep keys in (t - sliding_window_size, t], as upstream's dot_product mask does; global
layers are causal. The query arrives scaled (upstream's GPU kernels all take scale 1.0).

Every other call goes to upstream's method unchanged, and so does what it refuses for sinks (decode, attention
types other than global and sliding-window, dropout, a logit soft cap, QK-Clip's max logits, quantized KV). Like
upstream's `cudnn_flash_jax` (MaskType.CAUSAL, no segment ids), packed sequences' segment ids are not applied:
use synthetic data or packing=false with real data, as for the other families on cudnn_flash_jax.
"""

from __future__ import annotations

import functools
import importlib
import inspect

from patches._seam import Seam

SEAM = Seam(name="attention_sinks", module="maxtext.layers.attention_op", attr="AttentionOp.apply_attention",
            sha256="c1eadc2ee1a1d3ab")
KERNEL = "cudnn_flash_jax"  # the upstream `attention` value whose sinks this seam runs


def ours(op, args) -> int | None:
  """The sliding window (0 for a causal layer) when this call runs ours; None when it stays upstream's."""
  attention_op = importlib.import_module(SEAM.module)
  kind = op.attention_type
  if (op.attention_kernel != KERNEL or args.get("sinks") is None
      or args["model_mode"] == attention_op.MODEL_MODE_AUTOREGRESSIVE or args.get("record_max_logits")
      or kind not in (attention_op.AttentionType.GLOBAL, attention_op.AttentionType.LOCAL_SLIDING)
      or op.dropout_rate > 0 or op.attn_logits_soft_cap
      or any(isinstance(args[k], attention_op.KVTensor) for k in ("key", "value"))):
    return None
  return op.sliding_window_size if kind == attention_op.AttentionType.LOCAL_SLIDING else 0


def wrap(original):
  signature = inspect.signature(original)

  @functools.wraps(original)
  def apply_attention(self, *args, **kwargs):
    bound = signature.bind(self, *args, **kwargs)
    window = ours(self, bound.arguments)
    if window is None:
      return original(self, *args, **kwargs)
    from MaxText.attention import sinks  # pylint: disable=import-outside-toplevel

    a = bound.arguments
    out = sinks.attention_with_sinks(a["query"], a["key"], a["value"], a["sinks"], scale=1.0,
                                     window=window or None, kernel="cudnn")
    return out, None, None  # normalized already: AttentionOp.__call__ returns it as it is

  apply_attention.__wrapped__ = original
  return apply_attention


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True  # changes only calls that upstream refuses (cudnn_flash_jax with sinks)
