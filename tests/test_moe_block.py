"""The whole block (route -> dispatch -> gmm -> combine) against a float32 dense reference.

Forward and gradients with respect to the tokens, the router kernel and every
expert weight, on the `local` backend; the EP backends are checked against
the same block in tests/test_ep.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.moe import block, dispatch, routing
from moe_reference import assert_close, dense_ffn, make_params


def _cfg(top_k, experts=8, **router):
  return block.BlockConfig(router=routing.RouterConfig(num_experts=experts, top_k=top_k, routed_scaling_factor=2.5,
                                                       **router), gmm_backend="xla", dtype=jnp.float32)


def _losses(cfg, bias_E):
  """(block loss, reference loss) as functions of (x, router kernel, experts)."""
  disp = dispatch.make("local", num_experts=cfg.router.num_experts)
  probe = jax.random.normal(jax.random.key(7), (64, 64))

  def block_loss(x, kernel, ex):
    y, _, _ = block.moe_block(x, block.Router(kernel, bias_E), ex, cfg, disp)
    return jnp.sum(y * probe[: y.shape[0], : y.shape[1]])

  def ref_loss(x, kernel, ex):
    r = routing.route(x, kernel, bias_E, cfg.router)  # ids are discrete; weights carry the router gradient
    y = dense_ffn(x, r.ids_TK, r.weights_TK, ex)
    return jnp.sum(y * probe[: y.shape[0], : y.shape[1]])

  return block_loss, ref_loss


def _check(cfg, bias_E, tokens=13):
  x, router, ex = make_params(jax.random.key(0), tokens=tokens, experts=cfg.router.num_experts)
  block_loss, ref_loss = _losses(cfg, bias_E)
  got, got_g = jax.value_and_grad(block_loss, argnums=(0, 1, 2))(x, router.kernel_DE, ex)
  want, want_g = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(x, router.kernel_DE, ex)
  assert_close(got, want, 1e-4, "loss")
  for name, g, w in zip(("dx", "drouter", "dexperts"), got_g, want_g):
    for gl, wl in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      assert_close(gl, wl, 1e-4, name)
  return x, router


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_block_matches_dense_reference(top_k):
  _check(_cfg(top_k), jnp.zeros((8,)))


def test_all_tokens_to_one_expert_leaves_others_empty():
  bias = jnp.zeros((8,)).at[3].set(100.0)  # selection only: every token picks expert 3 first
  cfg = _cfg(1)
  x, router = _check(cfg, bias)
  r = routing.route(x, router.kernel_DE, bias, cfg.router)
  assert np.all(np.asarray(r.ids_TK) == 3)


def test_empty_experts_with_top2_and_odd_token_count():
  bias = jnp.zeros((8,)).at[jnp.array([1, 6])].set(100.0)  # experts 0,2,3,4,5,7 get nothing
  _check(_cfg(2), bias, tokens=7)


def test_softmax_routing_with_bias_in_weights():
  cfg = _cfg(2, score_func="softmax", bias_selects_only=False, deepseek_weights=False, norm_topk_prob=True)
  _check(cfg, jnp.linspace(-0.1, 0.1, 8))


def test_bfloat16_block_stays_close_to_float32_reference():
  cfg = block.BlockConfig(router=routing.RouterConfig(num_experts=8, top_k=4, routed_scaling_factor=2.5),
                          dtype=jnp.bfloat16, gate_dtype=jnp.float32)
  x, router, ex = make_params(jax.random.key(1), tokens=11)
  y, r, _ = block.moe_block(x, router, ex, cfg, dispatch.make("local", num_experts=8))
  assert y.dtype == jnp.bfloat16
  assert_close(y, dense_ffn(x, r.ids_TK, r.weights_TK, ex), 5e-2, "bf16 forward")


def test_route_matches_deepseek_v3_formula():
  """Selection by sigmoid + bias; weights = pre-bias sigmoid of the chosen, normalized, x scale."""
  x, router, _ = make_params(jax.random.key(2), tokens=5)
  bias = jnp.linspace(-0.3, 0.3, 8)
  cfg = routing.RouterConfig(num_experts=8, top_k=3, routed_scaling_factor=2.5)
  r = routing.route(x, router.kernel_DE, bias, cfg)
  s = 1 / (1 + np.exp(-np.asarray(x) @ np.asarray(router.kernel_DE)))
  ids = np.argsort(-(s + np.asarray(bias)), axis=-1)[:, :3]
  w = np.take_along_axis(s, ids, -1)
  np.testing.assert_array_equal(np.sort(np.asarray(r.ids_TK), -1), np.sort(ids, -1))
  np.testing.assert_allclose(np.asarray(r.weights_TK), w / w.sum(-1, keepdims=True) * 2.5, rtol=1e-5)


def test_group_limited_routing_only_picks_from_best_groups():
  x, router, _ = make_params(jax.random.key(3), tokens=9)
  cfg = routing.RouterConfig(num_experts=8, top_k=2, n_groups=4, topk_groups=1)
  r = routing.route(x, router.kernel_DE, None, cfg)
  groups = np.asarray(r.ids_TK) // 2
  assert np.all(groups[:, 0] == groups[:, 1])  # both experts from the single kept group


def test_named_scopes_mark_the_four_stages():
  cfg = _cfg(2)
  x, router, ex = make_params(jax.random.key(0))
  disp = dispatch.make("local", num_experts=8)
  hlo = jax.jit(lambda x: block.moe_block(x, router, ex, cfg, disp)[0]).lower(x).as_text(debug_info=True)
  for scope in ("route", "dispatch", "gmm", "combine"):
    assert f"{scope}/" in hlo, scope


# --- the whole-block patch (patches/routed_moe.py) ---


def test_patch_refuses_a_different_upstream_naming_both_versions(monkeypatch):
  import dataclasses as dc

  from MaxText.config import ForkConfig
  from maxtext.layers import moe
  from patches import routed_moe
  from patches._seam import UpstreamMismatch

  with pytest.raises(UpstreamMismatch, match=r"targets maxtext 0\.2\.5 .* but maxtext 0\.3\.0 is installed"):
    routed_moe.SEAM.check(installed_version="0.3.0")
  moved = dc.replace(routed_moe.SEAM, sha256="0123456789abcdef")  # upstream's RoutedMoE source changed
  monkeypatch.setattr(routed_moe, "SEAM", moved)
  before = moe.RoutedMoE
  with pytest.raises(UpstreamMismatch, match=r"expected 0123456789abcdef\) in the installed maxtext 0\.2\.5"):
    routed_moe.apply(ForkConfig(moe_block="ours"))
  assert moe.RoutedMoE is before  # refused before touching anything


def test_patch_applies_once_and_undoes():
  from MaxText.config import ForkConfig
  from maxtext.layers import moe
  from patches import routed_moe

  upstream = moe.RoutedMoE
  try:
    routed_moe.apply(ForkConfig(moe_block="ours"))
    patched = moe.RoutedMoE
    routed_moe.apply(ForkConfig(moe_block="ours"))
    assert moe.RoutedMoE is patched and issubclass(patched, upstream) and patched is not upstream
    assert "__init__" not in vars(patched)  # same constructor, same parameter tree
  finally:
    routed_moe.undo()
  assert moe.RoutedMoE is upstream


@pytest.mark.slow
def test_patched_training_matches_upstream_ragged_path(train):
  """Tiny DeepSeek-V3, 5 steps: our block vs upstream's sparse_matmul (ragged_dot) path."""
  common = ("steps=5", "enable_checkpointing=false", "sparse_matmul=true", "megablox=false")
  ours = train(*common, "moe_block=ours", run_name="ours")
  assert ours.returncode == 0, ours.stderr[-3000:]
  assert ours.stdout.count("routed MoE layer -> our block (dispatch local, gmm xla, EP 1)") >= 1
  upstream = train(*common, "moe_block=upstream", run_name="upstream")  # the tiny config runs ours by default
  assert upstream.returncode == 0, upstream.stderr[-3000:]
  assert "our block" not in upstream.stdout
  a, b = ours.losses(), upstream.losses()
  assert sorted(a) == sorted(b) and len(a) == 5
  for step in b:
    assert abs(a[step] - b[step]) < 1e-2 * abs(b[step]), (a, b)  # bf16 activations


def _upstream_layer(cls, cfg, mesh):
  from flax import nnx

  return cls(config=cfg, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, mesh=mesh,
             kernel_init=__import__("maxtext.layers.initializers", fromlist=["x"]).nd_dense_init(
                 1.0, "fan_in", "truncated_normal"),
             kernel_axes=("embed_router", None), intermediate_dim=cfg.moe_mlp_dim, dtype=cfg.dtype,
             weight_dtype=cfg.weight_dtype, rngs=nnx.Rngs(0))


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_patched_layer_keeps_upstream_params_and_matches_it_in_float32(monkeypatch):
  """Same parameter tree (paths, shapes, dtypes, sharding); same output, aux loss, bias update and grads
  as upstream's sparse path, with a nonzero routing bias."""
  from flax import nnx
  from maxtext.configs import pyconfig
  from maxtext.layers import moe
  from maxtext.utils import maxtext_utils

  from MaxText import config as fork_config
  from patches import routed_moe

  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")  # keeps upstream from adding an HLO dump
  run = fork_config.load(["steps=1", "enable_checkpointing=false", "dtype=float32", "moe_block=ours",
                          "load_balance_loss_weight=0.01", "routed_bias_update_rate=0.001"])
  cfg = pyconfig.initialize(run.upstream_argv())
  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.emb_dim))

  def describe(layer):
    flat = nnx.to_flat_state(nnx.state(layer, nnx.Any(nnx.Param, moe.MoEBiasVar)))
    return {path: (v.get_value().shape, v.get_value().dtype, type(v).__name__, v.get_metadata().get("out_sharding"))
            for path, v in flat}

  def loss_and_grads(layer):
    def loss(layer, x):
      y, lb_loss, bias_update = layer(x)
      return jnp.sum(y * jnp.cos(y)) + lb_loss, bias_update
    return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)

  with jax.set_mesh(mesh):
    upstream = _upstream_layer(moe.RoutedMoE, cfg, mesh)
    upstream.gate.bias.set_value(jax.random.normal(jax.random.key(2), upstream.gate.bias.get_value().shape) * 0.3)
    (want, want_bias_update), (want_dlayer, want_dx) = loss_and_grads(upstream)
    try:
      routed_moe.apply(run.fork)
      ours = _upstream_layer(moe.RoutedMoE, cfg, mesh)
    finally:
      routed_moe.undo()
    assert describe(ours) == describe(upstream)
    nnx.update(ours, nnx.state(upstream, nnx.Any(nnx.Param, moe.MoEBiasVar)))
    calls = dict(routed_moe.call_counts())
    (got, got_bias_update), (got_dlayer, got_dx) = loss_and_grads(ours)
    assert routed_moe.call_counts().get("local", 0) > calls.get("local", 0)  # our block ran
  assert_close(got, want, 1e-4, "loss (with the load-balance loss)")
  assert_close(got_bias_update, want_bias_update, 0, "routing-bias update")
  assert_close(got_dx, want_dx, 1e-4, "dx")
  for name in ("wi_0", "wi_1", "wo"):
    assert_close(getattr(got_dlayer, name).get_value(), getattr(want_dlayer, name).get_value(), 1e-4, name)
  assert_close(got_dlayer.gate.kernel.get_value(), want_dlayer.gate.kernel.get_value(), 1e-4, "router")


def test_te_block_without_te_says_what_to_install():
  """Refused by the check the trainer and the planner both run before any patch (config_checks.check_fork)."""
  from MaxText import config as fork_config
  from MaxText.config import checks as config_checks

  run = fork_config.load(["moe_block=te"])
  with pytest.raises(fork_config.ConfigError, match=r"pip install 'maxtext-moe\[te\]'"):
    config_checks.check_fork(run)
