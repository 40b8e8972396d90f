"""DeepSeek-V3's router on our block and on upstream's, against an independent float64 NumPy router.

The NumPy router is written from DeepSeek's published inference code (inference/model.py, Gate):
sigmoid scores; the bias added for selection only; each group scored by the sum of its top-2
biased scores; the best `topk_groups` groups kept; top-k of the kept biased scores; weights =
the original scores of the chosen experts, normalized, times route_scale (2.5). The bias update
is arXiv 2412.19437 §2.1.2: bias_i += gamma * sign(mean load - load_i).

Layers are built the way a moe_router=deepseek_v3 run builds them: through the patched
RoutedAndSharedMoE at upstream's model_name "default".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import patches
from MaxText import config as fork_config
from MaxText.moe import routing


def np_v3_route(x_TD, w_DE, bias_E, *, top_k, n_groups, topk_groups, scale):
  """float64 group-limited noaux_tc routing: (ids_TK sorted per token, weights_TK in that order)."""
  s = 1.0 / (1.0 + np.exp(-(x_TD.astype(np.float64) @ w_DE.astype(np.float64))))
  biased = s + bias_E.astype(np.float64)
  tokens, experts = biased.shape
  grouped = biased.reshape(tokens, n_groups, experts // n_groups)
  group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
  kept = np.argsort(-group_score, axis=-1)[:, :topk_groups]
  mask = np.zeros((tokens, n_groups), bool)
  np.put_along_axis(mask, kept, True, axis=-1)
  masked = np.where(np.repeat(mask, experts // n_groups, axis=-1), biased, -np.inf)
  ids = np.sort(np.argsort(-masked, axis=-1)[:, :top_k], axis=-1)
  w = np.take_along_axis(s, ids, -1)
  return ids, w / w.sum(-1, keepdims=True) * scale


def np_bias_update(ids, experts, gamma):
  load = np.bincount(ids.reshape(-1), minlength=experts).astype(np.float64)
  return gamma * np.sign(load.mean() - load)


def _sorted(ids_TK, weights_TK):
  ids, w = np.asarray(ids_TK).reshape(-1, ids_TK.shape[-1]), np.asarray(weights_TK, np.float64)
  order = np.argsort(ids, axis=-1)
  return np.take_along_axis(ids, order, -1), np.take_along_axis(w.reshape(ids.shape), order, -1)


def _inputs(tokens=48, hidden=8, experts=8):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(tokens, hidden)).astype(np.float32), (rng.normal(size=(hidden, experts)) * 0.7).astype(
      np.float32), (rng.normal(size=experts) * 0.1).astype(np.float32))


@pytest.mark.parametrize("groups", [(4, 2), (4, 3), (2, 1)])
def test_our_route_matches_numpy_v3_router(groups):
  x, w, b = _inputs()
  n_groups, topk_groups = groups
  cfg = routing.RouterConfig(num_experts=8, top_k=4 if topk_groups > 1 else 2, routed_scaling_factor=2.5,
                             n_groups=n_groups, topk_groups=topk_groups)
  want_ids, want_w = np_v3_route(x, w, b, top_k=cfg.top_k, n_groups=n_groups, topk_groups=topk_groups, scale=2.5)
  assert not np.array_equal(want_ids, np_v3_route(x, w, 0 * b, top_k=cfg.top_k, n_groups=n_groups,
                                                  topk_groups=topk_groups, scale=2.5)[0])  # the bias matters
  ungrouped = np_v3_route(x, w, b, top_k=cfg.top_k, n_groups=1, topk_groups=1, scale=2.5)[0]
  assert not np.array_equal(want_ids, ungrouped)  # the group limit matters
  r = routing.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), cfg)
  ids, weights = _sorted(r.ids_TK, r.weights_TK)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(weights, want_w, rtol=2e-6)
  update = routing.bias_update_E(routing.expert_counts_E(r.ids_TK, 8), 0.001)
  np.testing.assert_array_equal(np.asarray(update), np_bias_update(want_ids, 8, 0.001).astype(np.float32))

  # No gradient reaches the bias through the weights (it only selects).
  probe = jnp.asarray(np.random.default_rng(1).normal(size=r.weights_TK.shape), jnp.float32)
  dbias = jax.grad(lambda bias: jnp.sum(routing.route(jnp.asarray(x), jnp.asarray(w), bias, cfg).weights_TK * probe))(
      jnp.asarray(b))
  np.testing.assert_array_equal(np.asarray(dbias), 0)


# --- the layers a moe_router=deepseek_v3 run builds, upstream's block and ours ---


@pytest.fixture(scope="module")
def v3_config():
  import os  # pylint: disable=import-outside-toplevel

  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  os.environ.setdefault("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")  # keeps upstream from adding an HLO dump
  run = fork_config.load(["steps=1", "enable_checkpointing=false", "dtype=float32", "float32_gate_logits=true"])
  assert run.fork.moe_router == "deepseek_v3" and run.upstream.get("model_name", "default") == "default"
  return run, pyconfig.initialize(run.upstream_argv())


def _routed_layer(run, cfg, block: str):
  """The routed block of a MoE layer as the patched RoutedAndSharedMoE builds it."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.layers import initializers, moe  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  from patches import deepseek_v3_router, routed_moe  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
  # Validated again (not model_copy): the grouped-GEMM backend follows the block.
  fork = fork_config.ForkConfig(**{**run.fork.model_dump(), "moe_block": block, "moe_gmm_backend": None})
  try:
    deepseek_v3_router.apply(fork)
    if block == "ours":
      routed_moe.apply(fork)
    with jax.set_mesh(mesh):
      layer = moe.RoutedAndSharedMoE(config=cfg, mesh=mesh, kernel_axes=("embed", None), rngs=nnx.Rngs(0),
                                     kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
                                     dtype=jnp.float32, weight_dtype=jnp.float32).MoeBlock_0
  finally:
    routed_moe.undo()
    patches.undo_module(deepseek_v3_router)
  b = np.asarray(np.random.default_rng(2).normal(size=cfg.num_experts) * 0.1, np.float32)
  layer.gate.bias.set_value(jnp.asarray(b))
  return layer, mesh


@pytest.mark.parametrize("block", ["upstream", "ours"])
def test_layer_routes_bias_and_gradients_as_v3(v3_config, block):  # pylint: disable=redefined-outer-name
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  from patches import routed_moe  # pylint: disable=import-outside-toplevel

  run, cfg = v3_config
  layer, mesh = _routed_layer(run, cfg, block)
  # The bias is a non-trained variable: upstream's train step differentiates and decays nnx.Param only.
  assert isinstance(layer.gate.bias, moe.MoEBiasVar) and not isinstance(layer.gate.bias, nnx.Param)
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.emb_dim))
  x_TD = np.asarray(x).reshape(-1, cfg.emb_dim)
  w, b = np.asarray(layer.gate.kernel.get_value()), np.asarray(layer.gate.bias.get_value())
  want_ids, want_w = np_v3_route(x_TD, w, b, top_k=cfg.num_experts_per_tok, n_groups=cfg.n_routing_groups,
                                 topk_groups=cfg.topk_routing_group, scale=cfg.routed_scaling_factor)
  unbiased_ids, _ = np_v3_route(x_TD, w, 0 * b, top_k=cfg.num_experts_per_tok, n_groups=cfg.n_routing_groups,
                                topk_groups=cfg.topk_routing_group, scale=cfg.routed_scaling_factor)
  assert not np.array_equal(want_ids, unbiased_ids)  # the bias matters
  with jax.set_mesh(mesh):
    if block == "upstream":  # upstream's own routing, as its sparse path calls it
      logits, pre_bias = layer.gate(x)
      got_w, got_ids = layer.get_topk(logits, pre_bias)
    else:  # what our block routes with (patches/routed_moe.py -> MaxText/moe/routing.py)
      r = routing.route(jnp.asarray(x_TD), layer.gate.kernel.get_value(), layer.gate.bias.get_value(),
                        routed_moe._router_config(layer), dtype=jnp.float32)  # pylint: disable=protected-access
      got_w, got_ids = r.weights_TK, r.ids_TK
    ids, weights = _sorted(got_ids, got_w)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6)

    graphdef, bias, rest = nnx.split(layer, moe.MoEBiasVar, ...)

    def loss(bias):
      y, lb_loss, update = nnx.merge(graphdef, bias, rest)(x)
      return jnp.sum(y * jnp.cos(y)) + lb_loss, update

    (_, update), dbias = jax.value_and_grad(loss, has_aux=True)(bias)
  np.testing.assert_array_equal(np.asarray(update), np_bias_update(want_ids, cfg.num_experts, 0.001).astype(np.float32))
  for leaf in jax.tree.leaves(dbias):
    np.testing.assert_array_equal(np.asarray(leaf), 0)  # no gradient into the bias


def test_both_blocks_give_the_same_v3_layer_output(v3_config):  # pylint: disable=redefined-outer-name
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  run, cfg = v3_config
  up, mesh = _routed_layer(run, cfg, "upstream")
  ours, _ = _routed_layer(run, cfg, "ours")
  nnx.update(ours, nnx.state(up, nnx.Any(nnx.Param, moe.MoEBiasVar)))
  x = jax.random.normal(jax.random.key(3), (2, 16, cfg.emb_dim))
  with jax.set_mesh(mesh):
    want, got = up(x), ours(x)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("groups", [(8, 4), (4, 1), (2, 1)])
def test_group_mask_equals_top_k_order_with_ties(groups):
  """The sort-free group mask keeps exactly the groups `lax.top_k` keeps, ties included (lower index first)."""
  n_groups, topk_groups = groups
  rng = np.random.default_rng(1)
  scores = rng.integers(0, 3, size=(256, 32)).astype(np.float32)  # small integers: many tied groups and experts
  cfg = routing.RouterConfig(num_experts=32, top_k=4, n_groups=n_groups, topk_groups=topk_groups)
  grouped = jnp.asarray(scores).reshape(256, n_groups, -1)
  top2 = jax.lax.top_k(grouped, 2)[0].sum(-1)
  kept = jax.lax.top_k(top2, topk_groups)[1]
  want = np.repeat(np.asarray(jax.nn.one_hot(kept, n_groups).sum(-2) > 0), 32 // n_groups, axis=-1)
  np.testing.assert_array_equal(np.asarray(routing._group_mask_TE(jnp.asarray(scores), cfg)), want)


def test_expert_counts_match_bincount():
  ids = np.random.default_rng(2).integers(0, 16, size=(100, 6)).astype(np.int32)
  counts = routing.expert_counts_E(jnp.asarray(ids), 16)
  np.testing.assert_array_equal(np.asarray(counts), np.bincount(ids.reshape(-1), minlength=16))
  assert counts.dtype == jnp.int32


# --- node-limited routing (arXiv 2412.19437, §2.1.2 and §3.2.2) ---


def np_node_limited_route(x_TD, w_DE, bias_E, *, top_k, nodes, max_nodes, scale):
  """float64, the published rule: each token's experts on at most M = max_nodes nodes, "selected according to the
  sum of the highest K/M affinity scores of the experts distributed on each node" (affinities: the sigmoid scores
  plus the selection-only bias, as every selection is); then top-K of the experts on those nodes. Experts sit on
  the nodes in order, E/N each. Returns (ids_TK sorted per token, weights_TK in that order)."""
  s = 1.0 / (1.0 + np.exp(-(x_TD.astype(np.float64) @ w_DE.astype(np.float64))))
  affinity = s + bias_E.astype(np.float64)
  tokens, experts = affinity.shape
  per_node = affinity.reshape(tokens, nodes, experts // nodes)
  node_score = np.sort(per_node, axis=-1)[..., -(top_k // max_nodes):].sum(-1)
  chosen = np.argsort(-node_score, axis=-1, kind="stable")[:, :max_nodes]
  on_chosen = np.zeros((tokens, nodes), bool)
  np.put_along_axis(on_chosen, chosen, True, axis=-1)
  masked = np.where(np.repeat(on_chosen, experts // nodes, axis=-1), affinity, -np.inf)
  ids = np.sort(np.argsort(-masked, axis=-1, kind="stable")[:, :top_k], axis=-1)
  w = np.take_along_axis(s, ids, -1)
  return ids, w / w.sum(-1, keepdims=True) * scale


@pytest.mark.parametrize("top_k,nodes,max_nodes", [(6, 4, 2), (8, 2, 1), (8, 8, 4), (4, 4, 1)])
def test_node_limited_routing_matches_the_published_rule(top_k, nodes, max_nodes):
  """routing.node_limited: each node (a routing group) scored by its top K/M, the best M kept. K/M = 3, 8 and 4
  differ from the top 2 that group-limited routing sums (V3's K = 8, M = 4 is K/M = 2: the same rule)."""
  x, w, b = _inputs(tokens=512, experts=32)
  cfg = routing.node_limited(routing.RouterConfig(num_experts=32, top_k=top_k, routed_scaling_factor=2.5,
                                                  n_groups=nodes, topk_groups=max_nodes))
  want_ids, want_w = np_node_limited_route(x, w, b, top_k=top_k, nodes=nodes, max_nodes=max_nodes, scale=2.5)
  r = routing.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), cfg, dtype=jnp.float32)
  ids, weights = _sorted(r.ids_TK, r.weights_TK)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(weights, want_w, rtol=2e-6)
  nodes_per_token = [len(set(row)) for row in ids // (32 // nodes)]
  assert max(nodes_per_token) == max_nodes
  top2 = np_v3_route(x, w, b, top_k=top_k, n_groups=nodes, topk_groups=max_nodes, scale=2.5)[0]
  assert (top2 != want_ids).any(axis=-1).sum() >= (0 if top_k == 2 * max_nodes else 5)  # the K/M matters


def test_node_limited_routing_reaches_our_block_from_the_config():
  """moe_node_limited_routing=true gives our block's router the nodes as groups, each scored by its top K/M."""
  import types  # pylint: disable=import-outside-toplevel

  from patches import routed_moe  # pylint: disable=import-outside-toplevel

  two_nodes = ("configs/deepseek3-tiny.yml", "moe_block=ours", "num_slices=2", "dcn_expert_parallelism=2",
               "ici_expert_parallelism=4", "ici_fsdp_parallelism=1", "n_routing_groups=-1", "topk_routing_group=1")
  for limited in (True, False):
    run = fork_config.load([*two_nodes, f"moe_node_limited_routing={str(limited).lower()}"]
                           + ([] if limited else ["n_routing_groups=2"]))
    up = run.upstream
    defaults = {k: f.default for k, f in fork_config.upstream_fields().items() if f.default is not None}
    layer = types.SimpleNamespace(config={**defaults, **up}, num_experts=up["num_experts"],
                                  num_experts_per_tok=up["num_experts_per_tok"])
    cfg = routed_moe._router_config(layer, routed_moe.settings_from(run.fork))  # pylint: disable=protected-access
    want_top = up["num_experts_per_tok"] if limited else 2  # K / M with M = 1; else upstream's top 2
    assert (cfg.n_groups, cfg.topk_groups, cfg.group_score_top) == (2, 1, want_top)
  assert up["num_experts_per_tok"] > 2  # the two differ
