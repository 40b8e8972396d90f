"""Upstream's other MoE families on our block (MaxText/moe/families.py, patches/routed_moe.py).

Fast: that every upstream import of RoutedMoE is rebound; that every upstream model file with experts either
runs on our block or is refused naming a key; each family's routing and GLU as read from upstream's file; the
configs a user starts from.
Slow: each family's new pieces (GPT-OSS's clamped GLU and expert biases, Llama 4's token weighting, the clamped
GLU) against a float32 dense reference, forward and gradients, on one device and on 4 simulated devices with
expert parallelism; per family, upstream's own RoutedMoE against our block on the same parameters in float32
(outputs, aux loss, bias update, every gradient); tiny models of each family trained on both blocks (loss and
gradient norm per step).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pydantic_core
import pytest
import yaml

import patches
from conftest import REPO, in_own_process
from moe_reference import assert_close, make_params
from MaxText import config as fork_config
from MaxText.moe import block, dispatch, families, routing

# Tiny run config (configs/<name>-tiny.yml) -> the upstream model file it shrinks.
FAMILIES = {
    "qwen3-moe": "qwen3-30b-a3b",
    "mixtral": "mixtral-8x7b",
    "gpt-oss": "gpt-oss-20b",
    "llama4": "llama4-17b-16e",
    "kimi-k2": "kimi-k2-1t",
    "deepseek2": "deepseek2-16b",
}
LIMIT = 0.6  # a clamp the tiny activations cross (GPT-OSS's is 7 at real scale)


# --- the new pieces of the block against a dense reference ---


def _reference_ffn(x_TD, ids_TK, weights_TK, ex: block.Experts, glu: str, act):
  """sum_k w[t,k] * FFN_{ids[t,k]}(x[t]), every expert computed densely (einsums), float32, biases included."""
  h0 = jnp.einsum("td,edf->tef", x_TD, ex.w0_EDF) + (0 if ex.b0_EF is None else ex.b0_EF[None])
  h1 = jnp.einsum("td,edf->tef", x_TD, ex.w1_EDF) + (0 if ex.b1_EF is None else ex.b1_EF[None])
  if glu == "gpt_oss":  # GPT-OSS's model card: clamp, x * sigmoid(1.702 x), (up + 1)
    g = jnp.minimum(h0, LIMIT)
    h = g * jax.nn.sigmoid(1.702 * g) * (jnp.clip(h1, -LIMIT, LIMIT) + 1)
  elif glu == "clamped_glu":
    h = act(jnp.minimum(h0, LIMIT)) * jnp.clip(h1, -LIMIT, LIMIT)
  else:
    h = act(h0) * h1
  y_TED = jnp.einsum("tef,efd->ted", h, ex.wo_EFD) + (0 if ex.bo_ED is None else ex.bo_ED[None])
  onehot_TKE = jax.nn.one_hot(ids_TK, ex.w0_EDF.shape[0])
  return jnp.einsum("tke,tk,ted->td", onehot_TKE, weights_TK, y_TED)


def _with_biases(ex: block.Experts, key) -> block.Experts:
  e, _, f = ex.w0_EDF.shape
  k0, k1, ko = jax.random.split(key, 3)
  return dataclasses.replace(ex, b0_EF=jax.random.normal(k0, (e, f)) * 0.3, b1_EF=jax.random.normal(k1, (e, f)) * 0.3,
                             bo_ED=jax.random.normal(ko, (e, ex.wo_EFD.shape[2])) * 0.3)


def _block_and_reference(cfg: block.BlockConfig, tokens=13, biases=True, bias_E=None, sharding=None, disp=None):
  """(loss, grads wrt x, router kernel and every expert tensor) of the block and of the dense reference."""
  x, router, ex = make_params(jax.random.key(0), tokens=tokens, experts=cfg.router.num_experts)
  ex = _with_biases(ex, jax.random.key(4)) if biases else ex
  probe = jax.random.normal(jax.random.key(7), x.shape)
  disp = disp or dispatch.make("local", num_experts=cfg.router.num_experts)
  act = block.ACTIVATIONS[cfg.activation]

  def ours(x, kernel, ex):
    y, _, _ = block.moe_block(x, block.Router(kernel, bias_E), ex, cfg, disp, sharding)
    return jnp.sum(y * probe)

  def reference(x, kernel, ex):
    logits = x @ kernel  # upstream's gate
    if cfg.router.weigh_input:  # Llama 4: top-1 logit; its sigmoid scales the token, combined with weight 1
      ids = jnp.argmax(logits, axis=-1)[:, None]
      scale = jax.nn.sigmoid(jnp.take_along_axis(logits, ids, axis=-1))
      y = _reference_ffn(x * scale, ids, jnp.ones_like(scale), ex, cfg.glu, act)
    else:  # softmax over the top-k (biased) logits, as Mixtral, Qwen3 and GPT-OSS
      select = logits if bias_E is None else logits + bias_E
      top, ids = jax.lax.top_k(select, cfg.router.top_k)
      y = _reference_ffn(x, ids, jax.nn.softmax(top, axis=-1), ex, cfg.glu, act)
    return jnp.sum(y * probe)

  got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(x, router.kernel_DE, ex)
  want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))(x, router.kernel_DE, ex)
  return got, want


def _assert_same(got, want, tol=1e-4):
  assert_close(got[0], want[0], tol, "loss")
  for name, g, w in zip(("dx", "drouter", "dexperts"), got[1], want[1]):
    for gl, wl in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      assert_close(gl, wl, tol, name)


def _softmax_router(top_k=2, experts=8):
  return routing.RouterConfig(num_experts=experts, top_k=top_k, score_func="", bias_selects_only=False,
                              deepseek_weights=False)


@pytest.mark.slow  # jit compiles of the block and its reference, value and gradients
@pytest.mark.parametrize("glu,activation", [("gpt_oss", "sigmoid"), ("clamped_glu", "silu"), ("glu", "silu")])
def test_glu_forms_with_expert_biases_match_the_dense_reference(glu, activation):
  cfg = block.BlockConfig(router=_softmax_router(), activation=activation, glu=glu, activation_limit=LIMIT)
  got, want = _block_and_reference(cfg, bias_E=jnp.linspace(-0.2, 0.2, 8))  # GPT-OSS's bias selects and weighs
  _assert_same(got, want)
  assert len(jax.tree.leaves(got[1][2])) == 6  # the three biases got gradients too


@pytest.mark.slow  # jit compiles of the block and its reference, value and gradients
def test_expert_biases_leave_empty_and_padding_rows_alone():
  """Two experts take every token: the other six get no rows, and their biases no gradient."""
  cfg = block.BlockConfig(router=_softmax_router(), activation="sigmoid", glu="gpt_oss", activation_limit=LIMIT)
  bias_E = jnp.zeros((8,)).at[jnp.array([2, 5])].set(50.0)
  got, want = _block_and_reference(cfg, tokens=7, bias_E=bias_E)
  _assert_same(got, want)
  dex = got[1][2]
  idle = np.array([e not in (2, 5) for e in range(8)])
  for name in ("b0_EF", "b1_EF", "bo_ED"):
    assert np.all(np.asarray(getattr(dex, name))[idle] == 0), name


def test_expert_bias_gradient_is_a_gemm_not_a_scatter_add():
  """A gathered bias_EN[expert of row m] has a scatter-add of every row into E rows as its gradient, serialized by
  its collisions on a GPU (the GPT-OSS proxy's step: 2.98 s on an H200, BENCHMARKS.md "Families on one H200");
  as a one-hot GEMM the gradient is onehot_ME^T @ dh_MN. The value: each held row gets its expert's bias, rows of
  experts held elsewhere and padding rows none."""
  import types as pytypes  # pylint: disable=import-outside-toplevel

  meta = pytypes.SimpleNamespace(group_sizes_G=jnp.array([3, 0, 2, 4]), group_offset=1)  # this shard: experts 1-2
  h_MN = jnp.zeros((10, 3))
  bias_EN = jnp.arange(6.0).reshape(2, 3) + 1
  plus = lambda b: block._plus_row_bias(h_MN, b, meta, jnp.float32)  # noqa: E731
  got = np.asarray(plus(bias_EN))
  want = np.zeros((10, 3))
  want[3:5] = np.asarray(bias_EN)[1]  # rows 3-4: expert 2 (local 1); expert 1 has none; rows 0-2 expert 0, 5-8 expert 3
  np.testing.assert_array_equal(got, want)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda b: jnp.sum(plus(b) * jnp.arange(30.0).reshape(10, 3))))(bias_EN))
  assert "scatter" not in jaxpr and "dot_general" in jaxpr


@pytest.mark.slow  # jit compiles of the block and its reference, value and gradients
def test_llama4_weighs_the_token_before_its_one_expert():
  router = routing.RouterConfig(num_experts=8, top_k=1, score_func="", bias_selects_only=False,
                                deepseek_weights=False, weigh_input=True)
  got, want = _block_and_reference(block.BlockConfig(router=router), biases=False)
  _assert_same(got, want)
  with pytest.raises(ValueError, match="needs top_k 1"):
    routing.RouterConfig(num_experts=8, top_k=2, weigh_input=True)


FOUR_CPUS = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


@pytest.mark.slow  # several simulated devices: a process of its own
@pytest.mark.parametrize("backend,axes,shape", [("ring", ("fsdp", "expert"), (2, 2)), ("ring", ("expert",), (4,)),
                                                ("a2a_padded", ("data", "expert"), (2, 2))])
def test_biases_and_token_weighting_under_expert_parallelism(backend, axes, shape, request):
  """GPT-OSS's expert biases (each shard adds only its own experts' rows) and Llama 4's token weighting inside
  shard_map on 4 simulated devices, against the dense reference: forward and every gradient."""
  if not in_own_process(request, FOUR_CPUS):
    return  # the process of its own passed
  assert jax.device_count() == 4
  mesh = jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  sharding = block.Sharding(mesh=mesh, token_axes=axes, expert_axis="expert")
  opts = {"capacity_factor": 4.0} if backend == "a2a_padded" else {}
  disp = dispatch.make(backend, num_experts=8, axis_name="expert", ep_size=mesh.shape["expert"], **opts)
  gpt_oss = block.BlockConfig(router=_softmax_router(), activation="sigmoid", glu="gpt_oss", activation_limit=LIMIT)
  _assert_same(*_block_and_reference(gpt_oss, tokens=24, bias_E=jnp.linspace(-0.2, 0.2, 8), sharding=sharding,
                                     disp=disp))
  llama4 = block.BlockConfig(router=dataclasses.replace(_softmax_router(top_k=1), weigh_input=True))
  _assert_same(*_block_and_reference(llama4, tokens=24, biases=False, sharding=sharding, disp=disp))


# --- the seam reaches every family ---


def _binds_routed_moe_at_import(path: Path) -> bool:
  text = path.read_text()
  if "RoutedMoE" not in text:  # most of upstream's files: no parse needed
    return False
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, ast.ImportFrom) and node.module == "maxtext.layers.moe" and any(
        a.name == "RoutedMoE" for a in node.names):
      return True
  return False


def test_every_upstream_import_of_routed_moe_is_rebound():
  """A module that bound upstream's class by name at import keeps it through our rebinding of
  maxtext.layers.moe.RoutedMoE: each one must be in IMPORTED_BY, and applying the seam must reach it."""
  import importlib  # pylint: disable=import-outside-toplevel

  from patches import routed_moe  # pylint: disable=import-outside-toplevel

  root = fork_config.upstream_configs_dir().parent
  binding = {".".join(("maxtext", *p.relative_to(root).with_suffix("").parts))
             for p in root.rglob("*.py") if _binds_routed_moe_at_import(p)}
  assert binding == {s.module for s in routed_moe.IMPORTED_BY} == {"maxtext.models.qwen3"}
  qwen3, moe = importlib.import_module("maxtext.models.qwen3"), importlib.import_module("maxtext.layers.moe")
  upstream = moe.RoutedMoE
  try:
    routed_moe.apply(fork_config.ForkConfig(moe_block="ours"))
    assert qwen3.RoutedMoE is moe.RoutedMoE is not upstream and issubclass(qwen3.RoutedMoE, upstream)
  finally:
    routed_moe.undo()
  assert qwen3.RoutedMoE is moe.RoutedMoE is upstream


# --- every upstream MoE model: runs on our block or is refused naming a key ---


@functools.cache
def _upstream_defaults() -> dict:
  """upstream's base.yml over its pydantic field defaults."""
  defaults = {}
  for key, info in fork_config.upstream_fields().items():
    if info.default is not pydantic_core.PydanticUndefined:
      defaults[key] = info.default
    elif info.default_factory is not None:
      defaults[key] = info.default_factory()
  return {**defaults, **yaml.safe_load((fork_config.upstream_configs_dir() / "base.yml").read_text())}


def _upstream_view(path: Path) -> dict:
  """An upstream model file over base.yml over upstream's field defaults: the keys our check reads, as upstream's
  pyconfig would resolve them for `model_name=<file>` (its derived keys aside), without its 1 s per model."""
  model = yaml.safe_load(path.read_text())
  model.pop("base_config", None)
  return {**_upstream_defaults(), **model, "model_name": path.stem}


# What our block refuses among upstream 0.2.5's MoE model files, and the key it names; every other one runs.
REFUSED = {
    "deepseek3-671b-batchsplit": "use_batch_split_schedule",
    "deepseek4-284b": "first_num_hash_layers",
    "deepseek4-tiny": "first_num_hash_layers",
    "gemma4-26b": "decoder_block",
    "qwen3.5-35b-a3b-fp8": "weight_dtype",
    "qwen3.5-397b-a17b-fp8": "weight_dtype",
}


def test_every_upstream_moe_model_runs_on_our_block_or_is_refused_naming_a_key():
  views = {p.stem: _upstream_view(p) for p in sorted((fork_config.upstream_configs_dir() / "models").glob("*.yml"))}
  moe = {name: v for name, v in views.items() if v["num_experts"] > 1}
  assert set(FAMILIES.values()) <= set(moe) and len(moe) >= 30  # the survey saw upstream's MoE models
  refused = {}
  for name, view in moe.items():
    reasons = families.refusals(view)
    if reasons:
      key, _, why = reasons[0]
      assert key in view and why, (name, reasons)
      refused[name] = key
    else:  # what our block would run it with builds (Llama 4's top-1 check included)
      cfg = block.BlockConfig(router=families.router_config(view, view["num_experts"], view["num_experts_per_tok"]),
                              **families.glu(view))
      assert cfg.activation in block.ACTIVATIONS and cfg.glu in block.GLUS, name
  assert refused == REFUSED


@pytest.mark.parametrize("family,want", [
    ("qwen3-30b-a3b", dict(score_func="", deepseek_weights=False, norm_topk_prob=True, glu="glu")),
    ("mixtral-8x7b", dict(score_func="", deepseek_weights=False, norm_topk_prob=False, glu="glu")),
    ("gpt-oss-20b", dict(score_func="", bias_selects_only=False, glu="gpt_oss", activation="sigmoid",
                         activation_limit=7.0)),
    ("llama4-17b-16e", dict(weigh_input=True, top_k=1, glu="glu")),
    ("kimi-k2-1t", dict(score_func="sigmoid", bias_selects_only=True, deepseek_weights=True,
                        routed_scaling_factor=2.827)),
    ("deepseek2-16b", dict(score_func="softmax", bias_selects_only=False, deepseek_weights=True, top_k=6)),
])
def test_each_family_reads_its_routing_and_glu_from_upstreams_file(family, want):
  view = _upstream_view(fork_config.upstream_configs_dir() / "models" / f"{family}.yml")
  got = {**dataclasses.asdict(families.router_config(view, view["num_experts"], view["num_experts_per_tok"])),
         **families.glu(view)}
  assert {k: got[k] for k in want} == want


def _np_router_stats(x_TD, w_DE, bias_E, view: dict, groups: tuple[int, int] | None):
  """float64 reference of a family's routing statistics, from its upstream model file's keys: (counts_E, entropy).

  Scores by routed_score_func ("": raw logits); the bias selects only at V3's model names, else it is part of the
  logits. The router's distribution: the softmax of raw logits over every expert (Qwen3, Mixtral, GPT-OSS and
  Llama 4 take their softmax after the top-k, of these same logits), other scores over their sum."""
  logits = np.asarray(x_TD, np.float64) @ np.asarray(w_DE, np.float64)
  func = view["routed_score_func"] or ""
  scores = {"": logits, "sigmoid": 1 / (1 + np.exp(-logits)), "softmax": np.exp(logits) / np.exp(logits).sum(-1)[:, None],
            "sqrtsoftplus": np.sqrt(np.log1p(np.exp(logits)))}[func]
  selects_only = str(view["model_name"]).startswith(families.V3_ROUTER_MODEL_PREFIXES)
  biased = scores if bias_E is None else scores + np.asarray(bias_E, np.float64)
  own = scores if selects_only else biased
  probs = np.exp(own - own.max(-1, keepdims=True)) if func == "" else own
  probs = probs / probs.sum(-1, keepdims=True)
  entropy = float(np.mean(-np.sum(probs * np.log(probs), axis=-1)))
  select = biased.copy()
  if groups:  # V3's group-limited routing: a group scored by its two best biased scores, the best kept
    n_groups, kept = groups
    per = select.reshape(len(select), n_groups, -1)
    best = np.argsort(-np.sort(per, axis=-1)[..., -2:].sum(-1), axis=-1, kind="stable")[:, :kept]
    mask = np.zeros(per.shape[:2], bool)
    np.put_along_axis(mask, best, True, axis=-1)
    select = np.where(np.repeat(mask, per.shape[-1], axis=-1), select, -np.inf)
  ids = np.argsort(-select, axis=-1, kind="stable")[:, :view["num_experts_per_tok"]]
  return np.bincount(ids.reshape(-1), minlength=view["num_experts"]), entropy


@pytest.mark.parametrize("model,groups", [("qwen3-30b-a3b", None), ("mixtral-8x7b", None), ("gpt-oss-20b", None),
                                          ("llama4-17b-16e", None), ("kimi-k2-1t", None), ("deepseek2-16b", None),
                                          ("deepseek3-671b", (8, 4))])
def test_each_family_routing_statistics_match_a_numpy_reference(model, groups):
  """Tokens per expert and router entropy, as our block sows them (routing.route -> stats.layer_stats with the
  family's score function), for each family's upstream model file against float64 NumPy. The entropy lies in
  [0, ln E]; Qwen3's and Mixtral's raw logits read as probabilities gave -4136 and -144."""
  from MaxText.moe import stats  # pylint: disable=import-outside-toplevel

  view = _upstream_view(fork_config.upstream_configs_dir() / "models" / f"{model}.yml")
  if groups:
    view = {**view, "n_routing_groups": groups[0], "topk_routing_group": groups[1]}
  num_experts, top_k = view["num_experts"], view["num_experts_per_tok"]
  cfg = families.router_config(view, num_experts, top_k)
  kx, kw, kb = jax.random.split(jax.random.key(0), 3)
  x_TD = jax.random.normal(kx, (64, 8), jnp.float32)
  w_DE = jax.random.normal(kw, (8, num_experts), jnp.float32)
  bias_E = jax.random.normal(kb, (num_experts,), jnp.float32) * 0.3 if view["routed_bias"] else None
  r = routing.route(x_TD, w_DE, bias_E, cfg, dtype=jnp.float32)
  got = stats.layer_stats(r.ids_TK, r.scores_TE, bias_E, num_experts, score_func=cfg.score_func)
  want_counts, want_entropy = _np_router_stats(x_TD, w_DE, bias_E, view, groups)
  np.testing.assert_array_equal(np.asarray(got[stats.COUNTS]), want_counts)
  assert float(got[stats.ENTROPY]) == pytest.approx(want_entropy, rel=1e-5)
  assert 0.1 < want_entropy < np.log(num_experts)


@pytest.mark.parametrize("model,key", [("gemma4-26b", "decoder_block"), ("qwen3.5-35b-a3b-fp8", "weight_dtype")])
def test_a_refused_model_is_one_config_error_naming_the_key(model, key, tmp_path, monkeypatch):
  from MaxText.config import environment  # pylint: disable=import-outside-toplevel
  from patches import config_errors  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv("XLA_FLAGS", environment.NEUTRAL_XLA_FLAGS)  # keeps upstream from adding an HLO dump
  run = fork_config.load([str(REPO / "configs/upstream-model.yml"), f"model_name={model}", "hardware=cpu",
                          f"base_output_directory={tmp_path}"])
  patches.apply_module(config_errors)
  try:
    with pytest.raises(fork_config.ConfigError) as err:
      environment.validate_with_upstream(run)
  finally:
    patches.undo_module(config_errors)
  message = str(err.value)
  assert "\n" not in message and message.startswith(f"config key '{key}'") and f"model_name {model}" in message
  assert "moe_block=ours cannot run it" in message and "moe_block=upstream" in message


# --- per family: upstream's RoutedMoE and ours on the same parameters (slow: a config and a compile each) ---


def _family_config(family: str, tmp_path, *overrides):
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  (tmp_path / "jax_cache").mkdir()  # upstream points jax's compile cache at it
  run = fork_config.load([str(REPO / f"configs/{family}-tiny.yml"), "dtype=float32", "load_balance_loss_weight=0.01",
                          f"base_output_directory={tmp_path}", f"jax_cache_dir={tmp_path / 'jax_cache'}", *overrides])
  return run, pyconfig.initialize(run.upstream_argv())


def _routed_layer(cls, cfg, mesh):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.layers import initializers  # pylint: disable=import-outside-toplevel

  return cls(config=cfg, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, mesh=mesh,
             kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"), kernel_axes=("embed", None),
             intermediate_dim=cfg.moe_mlp_dim, dtype=cfg.dtype, weight_dtype=cfg.weight_dtype, rngs=nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_layer_matches_upstreams_in_float32(family, tmp_path, monkeypatch):
  """The family's RoutedMoE as upstream builds it, run by upstream's sparse path and by our block on the same
  parameters (random routing and expert biases where the family has them): the same parameter tree, output,
  load-balance loss, routing-bias update and gradient of every parameter."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel
  from patches import routed_moe  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")  # keeps upstream from adding an HLO dump
  run, cfg = _family_config(family, tmp_path)
  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.emb_dim))
  state = lambda layer: nnx.state(layer, nnx.Any(nnx.Param, moe.MoEBiasVar))  # noqa: E731

  def loss_and_grads(layer):
    def loss(layer, x):
      y, lb_loss, bias_update = layer(x)
      return jnp.sum(y * jnp.cos(y)) + lb_loss, bias_update
    return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)

  with jax.set_mesh(mesh):
    upstream = _routed_layer(moe.RoutedMoE, cfg, mesh)
    for i, (path, var) in enumerate(nnx.to_flat_state(state(upstream))):
      if "bias" in "/".join(map(str, path)):  # the routing bias and GPT-OSS's expert biases start at zero
        var.set_value(jax.random.normal(jax.random.key(10 + i), var.get_value().shape) * 0.3)
    (want, want_update), (want_dlayer, want_dx) = loss_and_grads(upstream)
    try:
      routed_moe.apply(run.fork)
      ours = _routed_layer(moe.RoutedMoE, cfg, mesh)
    finally:
      routed_moe.undo()
    assert type(ours) is not type(upstream)
    assert jax.tree.map(jnp.shape, state(ours)) == jax.tree.map(jnp.shape, state(upstream))
    nnx.update(ours, state(upstream))
    calls = routed_moe.call_counts().get("local", 0)
    (got, got_update), (got_dlayer, got_dx) = loss_and_grads(ours)
    assert routed_moe.call_counts().get("local", 0) > calls  # our block ran
  assert_close(got, want, 1e-4, "loss (with the load-balance loss)")
  _assert_sown_stats_match_the_reference(run, cfg, mesh, ours, x)
  assert (got_update is None) == (want_update is None) == (family != "kimi-k2")
  if want_update is not None:
    assert_close(got_update, want_update, 0, "routing-bias update")
  assert_close(got_dx, want_dx, 1e-4, "dx")
  want_grads, got_grads = dict(nnx.to_flat_state(want_dlayer)), dict(nnx.to_flat_state(got_dlayer))
  assert sorted(got_grads) == sorted(want_grads) and len(want_grads) >= 4
  if family == "gpt-oss":
    assert {("wi_0_bias",), ("wi_1_bias",), ("wo_bias",), ("gate", "bias")} <= set(want_grads)
  for path, want_g in want_grads.items():
    assert_close(got_grads[path].get_value(), want_g.get_value(), 1e-4, "/".join(map(str, path)))


def _assert_sown_stats_match_the_reference(run, cfg, mesh, ours, x):
  """What each block sows for the `moe/` statistics (ours, and upstream's with the statistics on: patches/
  routed_moe.py's global-view copy of its routing) on the same parameters, against the float64 reference."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  from MaxText.moe import stats  # pylint: disable=import-outside-toplevel
  from patches import routed_moe  # pylint: disable=import-outside-toplevel

  try:
    routed_moe.apply(run.fork.model_copy(update={"moe_block": "upstream"}))
    theirs = _routed_layer(moe.RoutedMoE, cfg, mesh)
  finally:
    routed_moe.undo()
  nnx.update(theirs, nnx.state(ours, nnx.Param))
  nnx.update(theirs, nnx.state(ours, moe.MoEBiasVar))
  bias = None if ours.gate.bias is None else np.asarray(ours.gate.bias[...])
  want_counts, want_entropy = _np_router_stats(np.asarray(x).reshape(-1, x.shape[-1]), np.asarray(ours.gate.kernel[...]),
                                               bias, cfg.get_keys(), (cfg.n_routing_groups, cfg.topk_routing_group)
                                               if cfg.n_routing_groups > 0 else None)
  for layer in (ours, theirs):
    nnx.pop(layer, nnx.Intermediate)
    with jax.set_mesh(mesh):
      layer(x)
    sown = {str(path[-1]): v.get_value() for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Intermediate))}
    np.testing.assert_array_equal(np.asarray(sown[stats.COUNTS][0]), want_counts)
    assert float(np.asarray(sown[stats.ENTROPY][0])) == pytest.approx(want_entropy, rel=1e-4)


def _grad_norms(run_dir: Path) -> dict[int, float]:
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # pylint: disable=import-outside-toplevel

  (events,) = glob.glob(str(run_dir / "tensorboard" / "**" / "events.out.tfevents.*"), recursive=True)
  acc = EventAccumulator(events, size_guidance={"scalars": 0})
  acc.Reload()
  return {e.step: e.value for e in acc.Scalars("learning/raw_grad_norm")}


# Relative difference allowed between the two blocks' losses and gradient norms, per step, in float32: the same
# routing and math in another order (XLA fuses and sums the expert rows differently). Measured: <= 2e-6.
TRAIN_RTOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_trains_on_our_block_as_on_upstreams(family, train):
  """configs/<family>-tiny.yml, 4 steps in float32 on each block: every step's loss and gradient norm agree."""
  common = (f"configs/{family}-tiny.yml", "steps=4", "dtype=float32", "load_balance_loss_weight=0.01")
  ours = train(*common, run_name="ours")
  assert ours.returncode == 0, ours.stderr[-3000:]
  assert "routed MoE layer -> our block (dispatch local, gmm xla, EP 1)" in ours.stdout
  upstream = train(*common, "moe_block=upstream", run_name="upstream")
  assert upstream.returncode == 0, upstream.stderr[-3000:]
  assert "our block" not in upstream.stdout
  a, b = ours.losses(), upstream.losses()
  assert sorted(a) == sorted(b) == [0, 1, 2, 3]
  ga, gb = _grad_norms(ours.run_dir), _grad_norms(upstream.run_dir)
  assert sorted(ga) == sorted(gb) and len(gb) == 4
  for step in b:
    assert abs(a[step] - b[step]) <= TRAIN_RTOL * abs(b[step]), (family, a, b)
    assert abs(ga[step] - gb[step]) <= TRAIN_RTOL * abs(gb[step]), (family, ga, gb)
  assert b[3] < b[0]  # it trains


# --- configs a user starts from, and the benchmark's variants of them ---


def _bench_train(monkeypatch):
  from conftest import load_script  # pylint: disable=import-outside-toplevel

  monkeypatch.syspath_prepend(str(REPO / "tools"))  # bench_train imports its sibling profile_breakdown
  return load_script("bench_train", "tools/bench_train.py")


def test_dense_equivalent_of_the_deepseek_proxy_is_the_measured_one(monkeypatch):
  bench_train = _bench_train(monkeypatch)
  got = bench_train.variant_overrides("dense_equivalent", str(REPO / bench_train.DEFAULT_CONFIG))
  assert got == ["moe_block=upstream", *bench_train.VARIANTS["dense_equivalent"][0]]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_proxy_runs_on_our_block_and_its_bench_variants_load(family, monkeypatch):
  """The proxy's run config shows our path; upstream's best path, ours and the dense equivalent (computed from
  the family's model: (K + shared) x F wide) are configs we accept."""
  bench_train = _bench_train(monkeypatch)
  proxy = str(REPO / f"configs/bench/{family}-proxy-1xh200.yml")
  run = fork_config.load([proxy])
  assert run.fork.moe_block == "ours" and run.fork.recipe_num_gpus == 1
  assert run.upstream["model_name"] == FAMILIES[family]
  for name in ("upstream_tokamax", "upstream_ragged", "ours", "dense_equivalent"):
    loaded = fork_config.load([proxy, *bench_train.variant_overrides(name, proxy)])
    assert loaded.fork.moe_block == ("ours" if name == "ours" else "upstream"), name
    # GPT-OSS's sinks run in our fused kernel on cudnn_flash_jax (patches/attention_sinks.py); upstream's own path
    # for them is dot_product, so its variants take that
    upstream_sinks = family == "gpt-oss" and name.startswith("upstream")
    assert loaded.upstream["attention"] == ("dot_product" if upstream_sinks else "cudnn_flash_jax"), name
  view = bench_train.model_view(proxy)
  dense = dict(o.split("=", 1) for o in bench_train.dense_equivalent(view))
  assert int(dense["base_mlp_dim"]) == (view["num_experts_per_tok"] + view.get("shared_experts", 0)) * view[
      "base_moe_mlp_dim"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_dense_equivalent_keeps_every_layer(family, monkeypatch):
  """Upstream scans num_decoder_layers / inhomogeneous_layer_cycle_interval blocks (nnx_decoders.py's
  _init_scanned_generic), each holding a cycle of layers only in the blocks built so (Llama 4's, GPT-OSS's). A dense
  equivalent on a one-layer block must set the interval to 1: Llama 4's (interval 4) on Llama 2's block ran one
  layer of four on the H200, 1,024 TFLOP/s/device by MaxText's count."""
  bench_train = _bench_train(monkeypatch)
  view = bench_train.model_view(str(REPO / f"configs/bench/{family}-proxy-1xh200.yml"))
  dense = {**view, **dict(o.split("=", 1) for o in bench_train.dense_equivalent(view))}

  def layers_built(c: dict) -> int:
    interval = int(c.get("inhomogeneous_layer_cycle_interval", 1))
    per_block = interval if c.get("decoder_block") in ("llama4", "gpt_oss") else 1
    return int(c["base_num_decoder_layers"]) // interval * per_block

  assert layers_built(dense) == layers_built(view) == int(view["base_num_decoder_layers"])


RECIPES = sorted((REPO / "configs/recipes").glob("*-8xh100.yml"))


def test_every_family_has_a_one_node_recipe():
  names = {p.name for p in RECIPES}
  assert len(RECIPES) == len(FAMILIES)
  for family, model in FAMILIES.items():
    assert f"{model}-8xh100.yml" in names or f"{family}-proxy-8xh100.yml" in names or (
        f"{model}-proxy-8xh100.yml" in names), family


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_one_node_recipe_fits_its_8_gpus_and_its_plan(path):
  """The mesh fits 8 GPUs and splits the experts; the header records the compiled plan that fits (or says why
  none ran here)."""
  from MaxText.config import parallelism  # pylint: disable=import-outside-toplevel

  run = fork_config.load([str(path)])
  assert run.fork.recipe_num_gpus == 8 and run.fork.target_gpu == "h100" and run.fork.moe_block == "ours"
  parallelism.check_topology(run.upstream, 8, 8, 1)
  planned = re.search(r"^# Memory: ([\d.]+) GiB a GPU of ([\d.]+) usable: fits", path.read_text(), re.M)
  assert planned and float(planned[1]) <= float(planned[2]), path.name  # its summary's: tests/test_recipe_plans.py


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "llama4", "gpt-oss"])
def test_dense_equivalent_of_each_tiny_family_trains(family, train, monkeypatch):
  """bench_train's dense_equivalent overrides build and train the family's model (the tiny one, 2 steps). Kimi-K2
  and DeepSeek-V2 take DeepSeek-V3's form (all layers in first_num_dense_layers), measured on the H200."""
  bench_train = _bench_train(monkeypatch)
  config = f"configs/{family}-tiny.yml"
  run = train(config, "steps=2", *bench_train.variant_overrides("dense_equivalent", str(REPO / config)))
  assert run.returncode == 0, run.stderr[-3000:]
  assert "our block" not in run.stdout and len(run.losses()) == 2


def test_bench_gmm_families_are_the_proxies_expert_shapes(monkeypatch):
  """tools/bench_gmm.py --family: each family's (D, F, G, K) is its proxy's hidden, expert width, experts and top-k
  (Kimi-K2: 48 experts, a GPU's share of 384 under its one-node recipe's EP 8)."""
  from conftest import load_script  # pylint: disable=import-outside-toplevel

  bench_gmm = load_script("bench_gmm", "tools/bench_gmm.py")
  bench_train = _bench_train(monkeypatch)
  for family in FAMILIES:
    c = bench_train.model_view(str(REPO / f"configs/bench/{family}-proxy-1xh200.yml"))
    experts = 384 // 8 if family == "kimi-k2" else c["num_experts"]
    assert bench_gmm.FAMILIES[family] == (c["base_emb_dim"], c["base_moe_mlp_dim"], experts,
                                          c["num_experts_per_tok"]), family
    tokens = c["per_device_batch_size"] * c["max_target_length"]
    assert bench_gmm.proxy_rows(family) == tokens * c["num_experts_per_tok"], family
