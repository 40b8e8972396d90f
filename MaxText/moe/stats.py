"""Per-layer routing statistics, computed inside the jitted train step (no host callback).

Each MoE layer sows a few small arrays (patches/routed_moe.py, when
moe_metrics_every_n_steps > 0): its tokens per expert, the router entropy, the
routing bias' min/max/L2 norm and its dropped rows. The train step gathers
them over the layers (patches/moe_metrics.py) and `summarize` turns them into
the `moe/` scalars: a few dozen floats per step, not a device-to-host copy
per layer.
"""

from __future__ import annotations

import jax.numpy as jnp

from MaxText.moe import routing

# Names the layers sow under (suffixes of the intermediates' paths).
COUNTS = "moe_stats_counts_E"
ENTROPY = "moe_stats_entropy"
BIAS = "moe_stats_bias3"
OVERFLOW = "moe_stats_overflow"
BUFFER = "moe_stats_buffer2"


def layer_stats(ids_TK, scores_TE, bias_E, num_experts: int, overflow=None, buffer_2=None, *,
                score_func: routing.ScoreFunc) -> dict:
  """One MoE layer's statistics from its routing.

  scores_TE: the router's scores after `score_func` (raw logits when it is ""), as routing.Routing has them.
  counts_E: float32 assignments per expert (a token counts once per chosen expert).
  entropy: mean over tokens of the entropy (nats) of the router's distribution (routing.probs_TE: raw logits
    through a softmax, other scores divided by their sum): log(E) is uniform, 0 is one expert.
  bias3: the routing bias' [min, max, L2 norm] (zeros without a bias).
  overflow: 1.0 where a bounded dispatch buffer (a2a_padded) overflowed, i.e. rows were dropped (0 dropless).
  buffer2: [fullest per-peer buffer's fill (fraction of capacity), rows beyond capacity (dropped)] of a bounded
    dispatch (MaxText/moe/block.py moe_block_with_buffer); zeros on dispatchers without such a buffer.
  """
  # The bias update's own int32 reduction on the same ids: XLA's CSE keeps one (checked on XLA:CPU).
  counts_E = routing.expert_counts_E(ids_TK, num_experts).astype(jnp.float32)
  p_TE = routing.probs_TE(scores_TE, score_func)
  entropy = -jnp.mean(jnp.sum(p_TE * jnp.log(jnp.maximum(p_TE, 1e-20)), axis=-1))
  if bias_E is None:
    bias3 = jnp.zeros((3,), jnp.float32)
  else:
    b = bias_E.astype(jnp.float32)
    bias3 = jnp.stack([jnp.min(b), jnp.max(b), jnp.sqrt(jnp.sum(b * b))])
  overflow = jnp.zeros((), jnp.float32) if overflow is None else jnp.asarray(overflow, jnp.float32)
  buffer_2 = jnp.zeros((2,), jnp.float32) if buffer_2 is None else jnp.asarray(buffer_2, jnp.float32)
  return {COUNTS: counts_E, ENTROPY: entropy, BIAS: bias3, OVERFLOW: overflow, BUFFER: buffer_2}


def load_stats_L(counts_LE) -> dict:
  """Per-layer load statistics of tokens per expert counts_LE [layers, experts] (jnp or numpy)."""
  c = jnp.asarray(counts_LE, jnp.float32)
  mean_L = jnp.mean(c, axis=-1)
  safe_L = jnp.maximum(mean_L, 1e-20)
  return {
      "tokens_per_expert_min": jnp.min(c, axis=-1),
      "tokens_per_expert_mean": mean_L,
      "tokens_per_expert_max": jnp.max(c, axis=-1),
      "max_over_mean": jnp.max(c, axis=-1) / safe_L,
      "cv": jnp.std(c, axis=-1) / safe_L,  # coefficient of variation (population std / mean)
      "experts_without_tokens": jnp.sum(c == 0, axis=-1).astype(jnp.float32),
  }


def summarize(counts_LE, entropy_L, bias_L3, overflow_L, buffer_L2=None) -> dict:
  """The `moe/` scalars: per layer (moe/layer_NNN/...) and aggregated over the layers.

  Aggregates: min/max over layers of the extremes, the mean of the means, the worst (largest) max/mean
  and CV and the mean of each, the experts without tokens and the overflowed layers summed, the bias extremes.
  """
  per = load_stats_L(counts_LE)
  per["router_entropy"] = jnp.asarray(entropy_L, jnp.float32)
  bias = jnp.asarray(bias_L3, jnp.float32)
  per["bias_min"], per["bias_max"], per["bias_norm"] = bias[:, 0], bias[:, 1], bias[:, 2]
  per["overflow"] = jnp.asarray(overflow_L, jnp.float32)
  buffer = jnp.zeros((per["overflow"].shape[0], 2)) if buffer_L2 is None else jnp.asarray(buffer_L2, jnp.float32)
  per["capacity_used_pct"], per["dropped_tokens"] = 100 * buffer[:, 0], buffer[:, 1]
  out = {}
  for name, v_L in per.items():
    for layer in range(v_L.shape[0]):
      out[f"moe/layer_{layer:03d}/{name}"] = v_L[layer]
  out.update({
      "moe/tokens_per_expert_min": jnp.min(per["tokens_per_expert_min"]),
      "moe/tokens_per_expert_mean": jnp.mean(per["tokens_per_expert_mean"]),
      "moe/tokens_per_expert_max": jnp.max(per["tokens_per_expert_max"]),
      "moe/max_over_mean": jnp.max(per["max_over_mean"]),
      "moe/max_over_mean_avg": jnp.mean(per["max_over_mean"]),
      "moe/worst_layer": jnp.argmax(per["max_over_mean"]).astype(jnp.float32),
      "moe/cv": jnp.max(per["cv"]),
      "moe/cv_avg": jnp.mean(per["cv"]),
      "moe/experts_without_tokens": jnp.sum(per["experts_without_tokens"]),
      "moe/router_entropy": jnp.mean(per["router_entropy"]),
      "moe/bias_min": jnp.min(per["bias_min"]),
      "moe/bias_max": jnp.max(per["bias_max"]),
      "moe/bias_norm": jnp.max(per["bias_norm"]),
      "moe/overflow_layers": jnp.sum(per["overflow"]),  # > 0: rows were dropped (never on dropless)
      "moe/capacity_used_pct": jnp.max(per["capacity_used_pct"]),  # 0 without a bounded buffer
      "moe/dropped_tokens": jnp.sum(per["dropped_tokens"]),  # token-expert rows beyond capacity
  })
  return out
