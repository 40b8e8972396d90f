"""patches/attention_sinks.py: upstream's AttentionOp with attention=cudnn_flash_jax runs GPT-OSS's sinks through
MaxText/attention/sinks.py (jax's cuDNN primitives given a CPU kernel, tests/sinks_reference.py's
`cpu_cudnn`), equal to upstream's own dot_product on the same inputs, forward and gradients, for a sliding-window
layer and a global one; without the seam upstream refuses the sinks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO
from MaxText import config as fork_config
from patches import attention_sinks
from sinks_reference import cpu_cudnn  # noqa: F401  pylint: disable=unused-import

B, T = 2, 32  # the tiny GPT-OSS: 4 query heads, 2 KV heads of 16, window 16 (< T, so it masks)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  out = tmp_path_factory.mktemp("tiny")
  run = fork_config.load([str(REPO / "configs/gpt-oss-tiny.yml"), "dtype=float32", f"base_output_directory={out}",
                          f"jax_cache_dir={out / 'jax_cache'}"])
  cfg = pyconfig.initialize(run.upstream_argv())
  return cfg, jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)


def _op(tiny, kernel: str, attention_type):
  from maxtext.layers import attention_op  # pylint: disable=import-outside-toplevel

  cfg, mesh = tiny
  return attention_op.AttentionOp(config=cfg, mesh=mesh, attention_kernel=kernel, max_target_length=T,
                                  num_query_heads=cfg.num_query_heads, num_kv_heads=cfg.num_kv_heads,
                                  attention_type=attention_type, sliding_window_size=cfg.sliding_window_size)


def _operands(cfg):
  rng = np.random.default_rng(0)
  q = rng.standard_normal((B, T, cfg.num_query_heads, cfg.head_dim), np.float32) * 0.5
  k = rng.standard_normal((B, T, cfg.num_kv_heads, cfg.head_dim), np.float32)
  v = rng.standard_normal((B, T, cfg.num_kv_heads, cfg.head_dim), np.float32)
  sinks_N = rng.standard_normal(cfg.num_query_heads).astype(np.float32)
  ct = rng.standard_normal((B, T, cfg.num_query_heads, cfg.head_dim), np.float32)
  return q, k, v, sinks_N, ct


def _value_and_grads(op, mesh, q, k, v, sinks_N, ct):
  def attend(q, k, v, sinks_N):
    return op(q, k, v, None, None, "train", sinks=sinks_N)

  with jax.set_mesh(mesh):
    out = jax.jit(attend)(q, k, v, sinks_N)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a) * ct), argnums=(0, 1, 2, 3)))(q, k, v, sinks_N)
  return out, grads


@pytest.mark.parametrize("layer", ["LOCAL_SLIDING", "GLOBAL"])
def test_cudnn_flash_jax_with_sinks_equals_upstreams_dot_product(tiny, cpu_cudnn, layer):  # noqa: F811
  from maxtext.layers import attention_op  # pylint: disable=import-outside-toplevel

  cfg, mesh = tiny
  kind = getattr(attention_op.AttentionType, layer)
  q, k, v, sinks_N, ct = _operands(cfg)
  want_out, want = _value_and_grads(_op(tiny, "dot_product", kind), mesh, q, k, v, sinks_N, ct)
  try:
    attention_sinks.SEAM.apply(attention_sinks.wrap)
    got_out, got = _value_and_grads(_op(tiny, "cudnn_flash_jax", kind), mesh, q, k, v, sinks_N, ct)
  finally:
    attention_sinks.SEAM.undo()
  for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), (got_out, *got), (want_out, *want)):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=name)
  # the window masks: the sliding layer's output differs from the global layer's
  if layer == "LOCAL_SLIDING":
    global_out, _ = _value_and_grads(_op(tiny, "dot_product", attention_op.AttentionType.GLOBAL), mesh,
                                     q, k, v, sinks_N, ct)
    assert np.abs(np.asarray(global_out) - np.asarray(want_out)).max() > 1e-2


def test_without_the_seam_upstream_refuses_the_sinks(tiny, cpu_cudnn):  # noqa: F811
  from maxtext.layers import attention_op  # pylint: disable=import-outside-toplevel

  cfg, mesh = tiny
  q, k, v, sinks_N, ct = _operands(cfg)
  with pytest.raises(ValueError, match="Attention sinks on GPU are only supported with attention=cudnn_flash_te"):
    _value_and_grads(_op(tiny, "cudnn_flash_jax", attention_op.AttentionType.GLOBAL), mesh, q, k, v, sinks_N, ct)


def test_only_cudnn_flash_jax_training_calls_with_sinks_are_ours_and_undo_restores(tiny):
  from maxtext.layers import attention_op  # pylint: disable=import-outside-toplevel

  sliding = _op(tiny, "cudnn_flash_jax", attention_op.AttentionType.LOCAL_SLIDING)
  call = {"key": None, "value": None, "sinks": jnp.zeros(4), "model_mode": "train"}
  assert attention_sinks.ours(sliding, call) == tiny[0].sliding_window_size == 16
  assert attention_sinks.ours(_op(tiny, "cudnn_flash_jax", attention_op.AttentionType.GLOBAL), call) == 0
  assert attention_sinks.ours(sliding, {**call, "sinks": None}) is None
  assert attention_sinks.ours(sliding, {**call, "model_mode": "autoregressive"}) is None
  assert attention_sinks.ours(_op(tiny, "dot_product", attention_op.AttentionType.GLOBAL), call) is None
  assert attention_sinks.ours(_op(tiny, "cudnn_flash_jax", attention_op.AttentionType.CHUNK), call) is None
  before = attention_op.AttentionOp.apply_attention
  try:
    attention_sinks.SEAM.apply(attention_sinks.wrap)
    attention_sinks.SEAM.apply(attention_sinks.wrap)  # a no-op
    assert attention_op.AttentionOp.apply_attention is not before
  finally:
    attention_sinks.SEAM.undo()
  assert attention_op.AttentionOp.apply_attention is before
