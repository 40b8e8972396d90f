"""The host-offload preset reaches the program upstream compiles.

Upstream's train step for the tiny model is lowered for CUDA on this CPU
machine (tests/lower_train_step.py): with `xla_presets=[host_offload]` the
MoE up-projections (moe_mlpwi_0/1, routed tokens x moe_mlp_dim) carry
`_xla_buffer_placement = "pinned_host"`; without it nothing is placed on host.
Peak memory and step time on the H200: docs/cluster.md "Host offload, measured" (tools/bench_train.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, run_train
from MaxText import config as fork_config
from MaxText.config import xla_presets

PLACEMENT = re.compile(r'annotate_device_placement\(%\w+\) \{[^}]*_xla_buffer_placement = "pinned_host"\}+ : \(tensor<(\w+)>\)')
# deepseek3-tiny: per_device_batch 2 x 128 tokens x top-4 = 1024 routed rows, base_moe_mlp_dim 32
TINY_MOE_MLPWI = "1024x32xbf16"


def _lowered(tmp_path, *args: str) -> str:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  cmd = [sys.executable, str(REPO / "tests/lower_train_step.py"), "configs/deepseek3-tiny.yml", "steps=1",
         "enable_checkpointing=false", f"base_output_directory={tmp_path}", *args]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("moe_block", ["upstream", "ours"])
def test_host_offload_preset_puts_moe_up_projections_in_pinned_host_memory(tmp_path, moe_block):
  """Our block tags its expert activations with upstream's names (MaxText/moe/block.py), so the
  preset offloads the same two tensors on either block; before that it was a silent no-op on ours."""
  offloaded = PLACEMENT.findall(_lowered(tmp_path, f"moe_block={moe_block}", "xla_presets=[host_offload]"))
  assert offloaded == [TINY_MOE_MLPWI, TINY_MOE_MLPWI]  # moe_mlpwi_0 and moe_mlpwi_1
  assert PLACEMENT.findall(_lowered(tmp_path, f"moe_block={moe_block}", "run_name=baseline")) == []


def test_host_offload_preset_carries_its_xla_and_pjrt_settings():
  run = fork_config.load(["xla_presets=[host_offload]"])
  composed = xla_presets.compose_for(run, {})
  assert composed.xla_flags["xla_gpu_enable_host_memory_offloading"] == "true"
  assert int(composed.env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]) >= 100  # 671B recipes offload ~100 GB/GPU
  assert dict(composed.upstream_defaults) == {
      "remat_policy": "custom", "decoder_layer_input": "device", "moe_mlpwi_0": "offload", "moe_mlpwi_1": "offload"}


@pytest.mark.slow
def test_custom_remat_saves_what_full_remat_recomputes(tmp_path):
  """The custom policy the offload preset implies, with the names kept on the device (docs/cluster.md "Host
  offload, measured": on the H200 its losses part from full remat's after the first update, +0.19 over 12 steps), trains as
  full remat on CPU within float32's rounding (measured 5e-7 at one step: the fusions differ; in bf16 the two ran
  bit for bit over 12 steps, not held here). A saved tensor that differed from its recomputation (another
  layer's, a stale one) would part the float32 losses by orders more. So the H200's drift is not a wrong saved
  tensor on this path; what is left there is GPU-only: cuDNN attention's residuals, or other fusions' rounding."""
  custom = ["remat_policy=custom", "decoder_layer_input=device", "moe_mlpwi_0=device", "moe_mlpwi_1=device"]
  common = ["configs/deepseek3-tiny.yml", "steps=4", "enable_checkpointing=false", "dtype=float32",
            "weight_dtype=float32", "moe_metrics_heatmap_every_n_steps=0"]
  full = run_train(tmp_path, *common, "remat_policy=full", run_name="full")
  assert full.returncode == 0, full.stderr[-3000:]
  saved = run_train(tmp_path, *common, *custom, run_name="custom")
  assert saved.returncode == 0, saved.stderr[-3000:]
  assert sorted(saved.losses()) == sorted(full.losses()) == [0, 1, 2, 3]
  assert saved.losses() == pytest.approx(full.losses(), rel=1e-5)
