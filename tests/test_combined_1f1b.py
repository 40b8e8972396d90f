"""Combined 1F1B (MaxText/accumulate/combined_1f1b.py): layer l's forward of microbatch i+1 in one loop body with
layer L-1-l's backward of microbatch i gives the plain accumulation loop's loss, aux and gradients.

Fast: a one-device toy model, 1 and 3 microbatches, no remat / full remat / a names policy, and what the forward
stores. Slow (tests/combined_1f1b_check.py, 8 simulated CPU devices as 2 nodes x 4): our MoE block with a2a_padded
and hierarchical dispatch, full remat and the dispatched-rows policy, float32 to 1e-5."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.accumulate import combined_1f1b

HERE = Path(__file__).resolve().parent
L, T, D, V = 3, 5, 8, 11


def _toy():
  k = jax.random.split(jax.random.key(0), 6)
  params = ({"emb": jax.random.normal(k[0], (V, D))},
            {"a": jax.random.normal(k[1], (L, D, D)) * 0.3, "b": jax.random.normal(k[2], (L, D, D)) * 0.3},
            {"out": jax.random.normal(k[3], (D, V))})

  def layer(w, x_TD):
    h_TD = jax.ad_checkpoint.checkpoint_name(jnp.tanh(x_TD @ w["a"]), "h")
    return x_TD + jnp.sin(h_TD @ w["b"]), jnp.mean(h_TD ** 2) * 0.01

  def post(p, y_TD, mb):
    logp = jax.nn.log_softmax(y_TD @ p["out"])
    return -jnp.sum(jnp.take_along_axis(logp, mb["targets"][:, None], axis=1)), {"tokens": jnp.float32(T)}

  def microbatches(m):
    return {"ids": jax.random.randint(k[4], (m, T), 0, V), "targets": jax.random.randint(k[5], (m, T), 0, V)}

  return params, layer, post, microbatches


POLICIES = {"no_remat": None, "full_remat": jax.checkpoint_policies.nothing_saveable,
            "names": jax.checkpoint_policies.save_only_these_names("h")}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("microbatches", [1, 3])
def test_combined_equals_the_plain_loop(microbatches, policy):
  params, layer, post, make_mbs = _toy()
  layer = layer if POLICIES[policy] is None else jax.checkpoint(layer, policy=POLICIES[policy])
  stages = combined_1f1b.Stages(pre=lambda p, mb: p["emb"][mb["ids"]], layer=layer, post=post)
  mbs = make_mbs(microbatches)
  (t0, aux0), g0 = jax.jit(lambda p, m: combined_1f1b.accumulated(stages, p, m))(params, mbs)
  (t1, aux1), g1 = jax.jit(lambda p, m: combined_1f1b.value_and_grad(stages, p, m))(params, mbs)
  np.testing.assert_allclose(t1, t0, rtol=1e-6)
  assert float(aux1[0]["tokens"]) == microbatches * T and float(aux1[1]) > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), (aux1, g1), (aux0, g0))
  # every parameter group receives gradient: a loop that skipped a layer or a microbatch would not match above,
  # and one that dropped the layers' aux losses would move t1
  assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(g1))


def test_the_forward_stores_what_the_policy_saves_and_no_weight():
  params, layer, post, _ = _toy()
  stored = {}
  for policy in ("full_remat", "names"):
    stages = combined_1f1b.Stages(pre=None, layer=jax.checkpoint(layer, policy=POLICIES[policy]), post=post)
    shape = combined_1f1b._VjpShape()  # pylint: disable=protected-access
    _, kept, _ = jax.eval_shape(lambda: combined_1f1b._forward(stages, shape, params[1], jnp.zeros((T, D))))  # pylint: disable=protected-access
    stored[policy] = [a.shape for a in kept]
    assert sorted(i for i in shape.weight_leaf if i is not None) == [0, 1]  # both weights found, not stored
  assert stored == {"full_remat": [(L, T, D)], "names": [(L, T, D), (L, T, D)]}  # the layer input (and h)


@pytest.mark.slow  # 8 simulated devices, 8 compiles: --all only
def test_moe_layers_on_two_nodes_of_four_match_the_plain_loop():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, str(HERE / "combined_1f1b_check.py")], cwd=HERE.parent, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert [(r["backend"], r["policy"]) for r in rows] == [
      ("a2a_padded", "full_remat"), ("a2a_padded", "dispatched_rows_saved"),
      ("hierarchical", "full_remat"), ("hierarchical", "dispatched_rows_saved"), ("hierarchical", "full_remat")]
  assert [r["fp8"] for r in rows] == [False] * 4 + [True]
  for r in rows:
    assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5 and r["aux_equal"] and r["grad_norm"] > 0, r
