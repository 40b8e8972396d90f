"""Qwen3-MoE and Mixtral out to transformers and back (MaxText/hf/gqa.py).

Slow: each family's tiny config (configs/<family>-tiny.yml, our block) trains 3 steps; its export, run by
transformers' class (torch, CPU, float32), gives our forward's logits within 1e-4; importing the export gives the
run's parameters bit for bit, from float32 and from bf16 (after the same rounding). The families no layout takes
are refused in tests/test_hf_layout.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import hf_helpers
from conftest import run_train
from MaxText.hf import checkpoint, safetensors

pytestmark = pytest.mark.slow
TOL = 1e-4
FAMILIES = {"qwen3-moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_goes_to_transformers_with_our_logits_and_comes_back(family, hf_python, tmp_path):
  run = run_train(tmp_path, f"configs/{family}-tiny.yml", "steps=3", "enable_checkpointing=true",
                  "checkpoint_period=2", "async_checkpointing=false", run_name=family)
  assert run.returncode == 0, run.stderr[-3000:]
  for dtype in ("f32", "bf16"):
    proc = hf_helpers.export(run.run_dir, tmp_path / dtype, "--dtype", dtype)
    assert proc.returncode == 0, proc.stderr[-3000:]
  names = set(safetensors.Reader(tmp_path / "f32").names())
  expert = "block_sparse_moe.experts.7.w2" if family == "mixtral" else "mlp.experts.7.down_proj"
  assert f"model.layers.1.{expert}.weight" in names and ("model.layers.0.self_attn.q_norm.weight" in names) == (
      family == "qwen3-moe")
  ours = hf_helpers.ours(run.run_dir, tmp_path / "ours.npy")
  theirs = hf_helpers.theirs(hf_python, tmp_path / "f32", tmp_path / "hf.npy", FAMILIES[family])
  diff = float(np.abs(ours - theirs).max())
  print(f"{family}: max |ours - transformers| = {diff:.2e} over logits of max |{np.abs(ours).max():.2f}|")
  assert diff < TOL
  ckpt = checkpoint.Checkpoint(run.run_dir)
  for dtype in ("f32", "bf16"):
    proc = hf_helpers.import_(tmp_path / dtype, tmp_path / f"params_{dtype}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = hf_helpers.params_checkpoint(tmp_path / f"params_{dtype}")
    assert sorted(got) == sorted(ckpt.arrays)
    for key, x in got.items():
      want = ckpt.peek(key, ())
      want = want.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == "bf16" else want
      assert np.array_equal(x.view(np.uint32), want.view(np.uint32)), (dtype, key)
