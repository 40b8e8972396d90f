"""Route: the router's scores -> each token's top-k experts and combine weights.

Mirrors upstream MaxText 0.2.5's `RoutedMoE` routing (`GateLogit.__call__` ~675,
`get_topk` ~1277, `deepseek_routing` ~1406, `deepseek_scale_weights` ~1361) for
the configs we ship, so that swapping our block in leaves the numbers alone:

  scores = score_func(x @ w_router); selection = top-k of scores + bias.
  bias_selects_only (upstream: model_name deepseek3*/deepseek4*/kimi-k2*; ours:
    moe_router=deepseek_v3, patches/deepseek_v3_router.py): DeepSeek-V3's
    aux-loss-free balancing (arXiv 2412.19437 §2.1.2, `noaux_tc`). The bias, a
    non-trained variable moved by the sign rule (bias_update_E), only selects;
    the weights are the chosen experts' pre-bias scores, and group-limited
    routing may apply (only experts of the best `topk_groups` groups compete).
    A group is scored by the sum of its two best biased scores, as DeepSeek's
    inference code (inference/model.py, Gate) and upstream do. Node-limited
    routing (§2.1.2 and §3.2.2: each token on at most M nodes, chosen by the sum
    of the highest K/M affinities of the experts on each node) is the same with
    one group per node, M groups kept and the top K/M summed (`node_limited`;
    at V3's K = 8, M = 4 that is the top 2). Otherwise (other model names) the
    weights are the biased scores.
  deepseek_weights (upstream: decoder_block deepseek/deepseek4): weights are
    normalized to sum 1 for sigmoid/sqrtsoftplus, then times
    routed_scaling_factor. Otherwise (Mixtral, Qwen3...): a softmax over the k
    weights, optionally renormalized (norm_topk_prob).
  weigh_input (upstream: decoder_block llama4, `permute` ~1545): the weight is
    the sigmoid of the chosen logit, and it scales the token going into its one
    expert (top-1), not the expert's output; the block combines with 1.

Also the two side outputs upstream's block returns: the Switch-style load
balance loss (`load_balance_loss` ~3857) and the expert counts that drive the
routing-bias update (`calculate_expert_counts` ~351).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

ScoreFunc = Literal["sigmoid", "softmax", "sqrtsoftplus", ""]


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """Routing hyper-parameters (static).

  Attributes:
    num_experts: E.
    top_k: K, experts per token.
    score_func: applied to the gate logits before bias and top-k ("" = none).
    bias_selects_only: the bias picks experts but does not weigh them.
    deepseek_weights: DeepSeek normalization and scaling of the top-k weights.
    routed_scaling_factor: DeepSeek's multiplier on the normalized weights.
    n_groups: expert groups for group-limited routing (-1 = off).
    topk_groups: groups kept per token when n_groups > 0.
    group_score_top: a group's score is the sum of its this many best biased scores (upstream and DeepSeek's
      inference code: 2; node-limited routing: top_k / topk_groups, `node_limited`).
    norm_topk_prob: renormalize the softmax top-k weights (Qwen3).
    weigh_input: Llama 4's weights: sigmoid of the chosen logit, applied to the
      token before its expert (needs top_k 1; MaxText/moe/block.py applies it).
  """

  num_experts: int
  top_k: int
  score_func: ScoreFunc = "sigmoid"
  bias_selects_only: bool = True
  deepseek_weights: bool = True
  routed_scaling_factor: float = 1.0
  n_groups: int = -1
  topk_groups: int = -1
  group_score_top: int = 2
  norm_topk_prob: bool = False
  weigh_input: bool = False

  def __post_init__(self):
    if self.weigh_input and self.top_k != 1:
      raise ValueError(f"weigh_input (Llama 4's router) scales a token by its one expert's score: needs top_k 1, "
                       f"got {self.top_k}")


@dataclasses.dataclass(frozen=True)
class Routing:
  """What route() decided, per token.

  Attributes:
    weights_TK: combine weight of each chosen expert (router dtype).
    ids_TK: int32 global ids of the chosen experts.
    scores_TE: the scores the load-balance loss sees (pre-bias if the bias
      only selects, as upstream).
  """

  weights_TK: jax.Array
  ids_TK: jax.Array
  scores_TE: jax.Array


def _score(logits, score_func: ScoreFunc):
  if score_func == "sigmoid":
    return jax.nn.sigmoid(logits)
  if score_func == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  if score_func == "sqrtsoftplus":
    return jnp.sqrt(jax.nn.softplus(logits))
  return logits


def _top_sum(x_TGN, n: int):
  """Sum of the n largest of each group's N scores (f32), as `top_k(x, n)[0].sum(-1)`.

  n = 2 (V3's groups): max, then max with the first argmax masked out, element-wise work that fuses into one
  kernel, where `lax.top_k` on a 4- or 32-wide axis is a sort.
  """
  x = x_TGN.astype(jnp.float32)
  if n != 2:
    return jnp.sum(jax.lax.top_k(x, n)[0], axis=-1)
  first_TG = jnp.argmax(x, axis=-1)
  rest = jnp.where(jnp.arange(x.shape[-1]) == first_TG[..., None], -jnp.inf, x)
  return jnp.max(x, axis=-1) + jnp.max(rest, axis=-1)


def node_limited(cfg: RouterConfig) -> RouterConfig:
  """DeepSeek-V3's node-limited routing on a config whose groups are the EP nodes (MaxText/config/moe_keys.py checks that
  n_groups is the nodes): each node scored by the sum of its top_k / topk_groups best biased scores."""
  if cfg.n_groups < 1 or cfg.topk_groups < 1 or cfg.top_k % cfg.topk_groups:
    raise ValueError(f"node-limited routing needs groups (n_groups={cfg.n_groups}) and a node limit M "
                     f"(topk_groups={cfg.topk_groups}) dividing top_k={cfg.top_k}")
  return dataclasses.replace(cfg, group_score_top=cfg.top_k // cfg.topk_groups)


def _group_mask_TE(scores_TE, cfg: RouterConfig):
  """True for experts in each token's best `topk_groups` groups (scored by their top-`group_score_top` sum).

  A group is kept when fewer than `topk_groups` groups beat it, ties going to
  the lower index, which is `lax.top_k`'s order. Counting over [T, G, G]
  (G = 8 for V3) replaces two small top-k sorts per routing call with
  element-wise work. On the H200 proxy all of routing measured 1.4 ms, 0.2% of
  the step, after this change (tools/bench_train.py --profile; BENCHMARKS.md "End to end on one H200").
  """
  g = cfg.n_groups
  score_TG = _top_sum(scores_TE.reshape(*scores_TE.shape[:-1], g, -1), cfg.group_score_top)
  mine, other = score_TG[..., :, None], score_TG[..., None, :]
  lower = jnp.arange(g)[None, :] < jnp.arange(g)[:, None]  # [g, h]: h has the lower index
  beaten_by_TG = jnp.sum((other > mine) | ((other == mine) & lower), axis=-1)
  keep_TG = beaten_by_TG < cfg.topk_groups
  return jnp.repeat(keep_TG, cfg.num_experts // g, axis=-1)


def route(x_TD, w_router_DE, bias_E, cfg: RouterConfig, *, dtype=None) -> Routing:
  """Gate matmul, scores, top-k and weights for T tokens.

  Args:
    x_TD: tokens.
    w_router_DE: router kernel.
    bias_E: routing bias (selection only under deepseek), or None.
    cfg: routing hyper-parameters.
    dtype: dtype of the gate computation (upstream: float32 if
      float32_gate_logits, else the activation dtype); default x's.
  """
  dtype = dtype or x_TD.dtype
  logits_TE = jnp.dot(x_TD.astype(dtype), w_router_DE.astype(dtype))
  scores_TE = _score(logits_TE, cfg.score_func)
  if bias_E is not None and cfg.bias_selects_only:
    bias_E = jax.lax.stop_gradient(bias_E)  # selection only: no gradient (the sign rule moves it)
  select_TE = scores_TE if bias_E is None else scores_TE + bias_E.astype(dtype)
  aux_scores_TE = scores_TE if cfg.bias_selects_only else select_TE  # upstream's probs for the aux loss
  if cfg.bias_selects_only and cfg.n_groups > 0:
    select_TE = jnp.where(_group_mask_TE(select_TE, cfg), select_TE, -jnp.inf)
  _, ids_TK = jax.lax.top_k(select_TE, cfg.top_k)
  weights_TK = jnp.take_along_axis(scores_TE if cfg.bias_selects_only else select_TE, ids_TK, axis=-1)
  if cfg.weigh_input:
    weights_TK = jax.nn.sigmoid(weights_TK.astype(jnp.float32))  # upstream's sigmoid of the raw top-1 logit
  elif cfg.deepseek_weights:
    if cfg.score_func in ("sigmoid", "sqrtsoftplus"):
      weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
    weights_TK = weights_TK * cfg.routed_scaling_factor
  else:
    weights_TK = jax.nn.softmax(weights_TK.astype(jnp.float32), axis=-1).astype(dtype)
    if cfg.norm_topk_prob:
      weights_TK = weights_TK / weights_TK.sum(-1, keepdims=True)
  return Routing(weights_TK=weights_TK, ids_TK=ids_TK.astype(jnp.int32), scores_TE=aux_scores_TE)


def probs_TE(scores_TE, score_func: ScoreFunc):
  """The router's scores as a distribution over the E experts, float32 (its entropy, MaxText/moe/stats.py).

  Raw logits (score_func "": Qwen3, Mixtral, GPT-OSS and Llama 4 take their softmax after the top-k) go through
  a softmax over every expert, the distribution whose top-k they pick: its renormalized top-k are Qwen3's and
  Mixtral's weights. Scores already through a score function (sigmoid, sqrtsoftplus, softmax) are non-negative
  and are divided by their sum.
  """
  s_TE = scores_TE.astype(jnp.float32)
  if score_func == "":
    return jax.nn.softmax(s_TE, axis=-1)
  return s_TE / (jnp.sum(s_TE, axis=-1, keepdims=True) + 1e-20)


def expert_counts_E(ids_TK, num_experts: int):
  """Assignments per expert (int32). Feeds the aux-loss-free bias update and the MoE statistics.

  A one-hot sum (iota compares fused into one reduction) rather than a
  scatter-add of T*K ones into E bins, which serializes on atomics on a GPU.
  Ids outside [0, E) count nowhere, as the scatter's mode="drop" did.
  """
  hits = ids_TK.reshape(-1, 1) == jnp.arange(num_experts, dtype=ids_TK.dtype)
  return jnp.sum(hits, axis=0, dtype=jnp.int32)


def bias_update_E(counts_E, rate: float):
  """DeepSeek-V3's bias step: +rate for under-loaded experts, -rate for over-loaded."""
  mean = counts_E.sum(-1, keepdims=True) / counts_E.shape[-1]
  return jnp.sign(mean - counts_E) * rate


def load_balance_loss(ids_BSK, probs_BSE, weight: float):
  """Upstream's per-sequence Switch loss (~3857): E^2 * mean_b(density . mean prob) * weight.

  probs_BSE: router probabilities (upstream: softmax of the scores, or the
  normalized sigmoid scores for Megatron's seq_aux_loss).
  """
  num_experts, top_k = probs_BSE.shape[-1], ids_BSK.shape[-1]
  # Hits per (sequence, expert) as one fused one-hot reduction over S and K, not a [B, S, E] scatter.
  hits_BSKE = ids_BSK[..., None] == jnp.arange(num_experts, dtype=ids_BSK.dtype)
  density_BE = jnp.sum(hits_BSKE, axis=(1, 2), dtype=jnp.float32) / (ids_BSK.shape[1] * top_k)
  return jnp.mean(density_BE * jnp.mean(probs_BSE, axis=1)) * num_experts**2 * weight


def megatron_aux_inputs(scores_BSE, top_k: int):
  """Megatron-LM's sigmoid-router aux inputs (upstream ~453): normalized f32 scores, unbiased top-k."""
  scores = scores_BSE.astype(jnp.float32)
  probs = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
  return probs, jax.lax.top_k(scores, top_k)[1]
