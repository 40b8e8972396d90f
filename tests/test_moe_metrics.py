"""MoE observability (moe_metrics_every_n_steps): routing statistics computed in the step, their TensorBoard output,
and that turning them off compiles nothing extra."""

from __future__ import annotations

import glob
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, config_error_line

TINY = "configs/deepseek3-tiny.yml"


def test_layer_stats_against_a_hand_computed_routing():
  import jax.numpy as jnp

  from MaxText.moe import stats

  # 4 experts, top-2, 3 tokens: expert 0 chosen 3 times, 1 twice, 2 once, 3 never.
  ids_TK = jnp.array([[0, 1], [0, 2], [1, 0]], jnp.int32)
  scores_TE = jnp.array([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])
  bias_E = jnp.array([-3.0, 0.0, 4.0, 0.0])
  got = stats.layer_stats(ids_TK, scores_TE, bias_E, 4, overflow=jnp.bool_(False), score_func="softmax")
  np.testing.assert_array_equal(got[stats.COUNTS], [3, 2, 1, 0])
  # entropies: ln 2, ln 4, 0 -> mean
  assert float(got[stats.ENTROPY]) == pytest.approx((math.log(2) + math.log(4)) / 3, rel=1e-5)
  np.testing.assert_allclose(got[stats.BIAS], [-3.0, 4.0, 5.0])
  assert float(got[stats.OVERFLOW]) == 0.0

  # second layer perfectly balanced; summarize over both
  counts_LE = np.array([[3, 2, 1, 0], [2, 2, 2, 2]], np.float32)
  s = stats.summarize(counts_LE, [0.5, 1.5], [[-3, 4, 5], [-1, 1, 2]], [0.0, 1.0])
  mean0 = 1.5
  std0 = math.sqrt(((3 - mean0) ** 2 + (2 - mean0) ** 2 + (1 - mean0) ** 2 + mean0**2) / 4)
  assert float(s["moe/layer_000/tokens_per_expert_min"]) == 0
  assert float(s["moe/layer_000/tokens_per_expert_max"]) == 3
  assert float(s["moe/layer_000/max_over_mean"]) == pytest.approx(2.0)
  assert float(s["moe/layer_000/cv"]) == pytest.approx(std0 / mean0, rel=1e-5)
  assert float(s["moe/layer_000/experts_without_tokens"]) == 1
  assert float(s["moe/layer_001/max_over_mean"]) == pytest.approx(1.0)
  assert float(s["moe/layer_001/cv"]) == 0.0
  assert float(s["moe/max_over_mean"]) == pytest.approx(2.0)
  assert float(s["moe/max_over_mean_avg"]) == pytest.approx(1.5)
  assert float(s["moe/worst_layer"]) == 0
  assert float(s["moe/tokens_per_expert_mean"]) == pytest.approx(1.75)
  assert float(s["moe/experts_without_tokens"]) == 1
  assert float(s["moe/router_entropy"]) == pytest.approx(1.0)
  assert (float(s["moe/bias_min"]), float(s["moe/bias_max"]), float(s["moe/bias_norm"])) == (-3, 4, 5)
  assert float(s["moe/overflow_layers"]) == 1


def test_heatmap_colours_load_relative_to_the_layer_mean():
  from MaxText.moe import heatmap

  img = heatmap.heatmap_HWC(np.array([[0, 2, 4, 2]], np.float32))  # mean 2: idle, mean, 2x, mean
  scale = img.shape[1] // 4
  assert img.shape == (scale, 4 * scale, 3)
  cells = [tuple(img[0, i * scale]) for i in range(4)]
  assert cells == [(0, 0, 255), (255, 255, 255), (255, 0, 0), (255, 255, 255)]


@pytest.mark.parametrize("value", ["-1", "two"])
@pytest.mark.parametrize("key", ["moe_metrics_every_n_steps", "moe_metrics_heatmap_every_n_steps"])
def test_bad_interval_is_one_config_error_line(key, value):
  line = config_error_line(TINY, f"{key}={value}")
  assert f"config key '{key}' = " in line and ("greater than or equal to 0" if value == "-1" else "valid integer") in line


def _lowered(tmp_path, *args: str) -> str:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  cmd = [sys.executable, str(REPO / "tests/lower_train_step.py"), TINY, "steps=1", "enable_checkpointing=false",
         f"base_output_directory={tmp_path}", "moe_block=ours", "moe_gmm_backend=xla", *args]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def _ops(hlo: str) -> int:
  return len(re.findall(r"= stablehlo\.\w+|= \"?mhlo\.|stablehlo\.\w+\(", hlo))


@pytest.mark.slow
def test_metrics_off_compiles_no_extra_work(tmp_path):
  """Off (0) must lower the step without the statistics: fewer ops than on, and no moe/ outputs."""
  off = _lowered(tmp_path, "moe_metrics_every_n_steps=0", "run_name=metrics_off")
  on = _lowered(tmp_path, "moe_metrics_every_n_steps=1", "run_name=metrics_on")
  assert _ops(off) < _ops(on)
  assert "moe/" not in off and "moe/max_over_mean" in on  # jax names the outputs by their pytree path
  # Off lowers the step exactly as before the feature: no op is added anywhere for it.
  assert "moe_stats" not in off


@pytest.mark.slow
def test_tiny_run_writes_moe_scalars_histograms_and_heatmap(train):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  result = train(TINY, "steps=4", "enable_checkpointing=false", "moe_block=ours", "moe_metrics_every_n_steps=2",
                 "moe_metrics_heatmap_every_n_steps=4")
  assert result.returncode == 0, result.stderr[-3000:]
  events = glob.glob(str(result.run_dir / "tensorboard" / "**" / "events.out.tfevents.*"), recursive=True)
  acc = EventAccumulator(events[0], size_guidance={"scalars": 0, "images": 0, "histograms": 0})
  acc.Reload()
  tags = acc.Tags()
  for name in ("tokens_per_expert_min", "tokens_per_expert_mean", "tokens_per_expert_max", "max_over_mean", "cv",
               "experts_without_tokens", "router_entropy", "bias_min", "bias_max", "bias_norm", "overflow_layers",
               "capacity_used_pct", "dropped_tokens"):
    assert f"moe/{name}" in tags["scalars"], name
  assert "moe/layer_000/max_over_mean" in tags["scalars"]
  # the config view turns on upstream's hook only for train_step: the model's layers sow no activation stats
  assert not [tag for tag in tags["scalars"] if tag.startswith("activ_")]
  assert [e.step for e in acc.Scalars("moe/max_over_mean")] == [1, 3]  # every 2nd step (counted from 1)
  tokens = acc.Scalars("moe/tokens_per_expert_mean")[0].value
  assert tokens > 0
  assert "moe/tokens_per_expert/layer_000" in tags["histograms"]
  assert tags["images"] == ["moe/load_over_mean"] and [e.step for e in acc.Images("moe/load_over_mean")] == [3]
  assert "MFU n/a" in [line for line in result.stdout.splitlines() if line.startswith("[progress]")][-1]
  # The heatmap's numbers on stdout with the image: load / mean per MoE layer (2) and expert (8), mean 1.
  out = result.stdout.splitlines()
  at = out.index("[maxtext-moe] MoE load at step 4, tokens per expert / the layer's mean (2 MoE layers x 8 experts; "
                 "TensorBoard image moe/load_over_mean):")
  rows = [[float(v) for v in line.split()[3:]] for line in out[at + 1:at + 3]]
  assert [line.split()[:3] for line in out[at + 1:at + 3]] == [["[maxtext-moe]", "layer", "0"],
                                                               ["[maxtext-moe]", "layer", "1"]]
  assert all(len(row) == 8 and abs(sum(row) / 8 - 1) < 0.01 for row in rows), rows
  summary = result.summary["moe_load"]
  assert summary["step"] == 3 and summary["worst_layer"] >= 0 and summary["max_over_mean"] >= 1.0


def test_the_quick_start_runs_our_block_and_shows_its_heatmap():
  """configs/deepseek3-tiny.yml (scripts/train.sh with no arguments): our block, and the heatmap at least once in
  its steps (every step's statistics are kept, so a heatmap step has its counts)."""
  from MaxText import config as fork_config

  run = fork_config.load([TINY])
  every, heatmap, steps = (run.fork.moe_metrics_every_n_steps, run.fork.moe_metrics_heatmap_every_n_steps,
                           run.upstream["steps"])
  assert run.fork.moe_block == "ours" and run.fork.moe_gmm_backend == "auto"
  assert 0 < heatmap <= steps and heatmap % every == 0


def test_heatmap_lines_show_load_over_the_layer_mean_where_they_fit():
  from MaxText.moe import heatmap

  lines = heatmap.heatmap_lines(np.array([[2, 2, 4, 0], [1, 1, 1, 1]]), step=9)
  assert lines == ["MoE load at step 10, tokens per expert / the layer's mean (2 MoE layers x 4 experts; "
                   "TensorBoard image moe/load_over_mean):",
                   "  layer   0 1.00 1.00 2.00 0.00",
                   "  layer   1 1.00 1.00 1.00 1.00"]
  wide = np.ones((3, 64))
  wide[2, 17] = 5.0
  (line,) = heatmap.heatmap_lines(wide, step=99)
  assert line.endswith("(3 MoE layers x 64 experts; TensorBoard image moe/load_over_mean): hottest expert 17 of "
                       "layer 2 at 4.71")


def test_mfu_peak_from_the_gpu_table_or_the_override():
  from MaxText.run import metrics
  from MaxText import hardware

  assert hardware.mfu_peak("NVIDIA H200") == (989e12, "H200 dense bf16 989 TF/s")
  assert hardware.mfu_peak("NVIDIA B200")[0] == 2250e12
  assert hardware.mfu_peak("NVIDIA H100 80GB HBM3", 500.0) == (500e12, "500 TF/s (mfu_peak_tflops)")
  peak, label = hardware.mfu_peak("cpu")
  assert peak is None and label.startswith("n/a")
  tracker = metrics.ProgressTracker(total_steps=2, print_every=0, peak_flops=989e12, peak_label="H200 dense bf16 989 TF/s")
  tracker.on_train_step(0, {"learning/loss": 1.0, "perf/step_time_seconds": 1.0, "perf/per_device_tflops_per_sec": 494.5})
  assert tracker.progress_line(tracker.records[0]).endswith("MFU 50.0% of H200 dense bf16 989 TF/s")
  cpu = metrics.ProgressTracker(total_steps=2, print_every=0, peak_label=label)
  cpu.on_train_step(0, {"learning/loss": 1.0, "perf/per_device_tflops_per_sec": 1.0})
  assert cpu.progress_line(cpu.records[0]).endswith(f"MFU {label}")


def test_progress_line_carries_the_step_and_says_the_mfu_reason_once(capsys):
  """One line a step with this step's loss, time, TFLOP/s and tokens/s per device, the ETA and MFU; what MFU is
  measured against (or why there is none) on the first line only."""
  from MaxText.run import metrics
  from MaxText import hardware

  _, label = hardware.mfu_peak("cpu")
  for peak, first, later in ((989e12, "MFU 50.0% of H200 dense bf16 989 TF/s", "MFU 50.0%"),
                             (None, f"MFU {label}", "MFU n/a")):
    tracker = metrics.ProgressTracker(total_steps=3, peak_flops=peak, peak_label=label if peak is None else first[13:])
    for step in range(3):
      tracker.on_train_step(step, {"learning/loss": 2.0 - step, "perf/step_time_seconds": 1.5,
                                   "perf/per_device_tflops_per_sec": 494.5, "perf/per_device_tokens_per_sec": 12345.6})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"[progress] step 1/3 (33%): loss 2.0000, 1.500 s, 494.5 TFLOP/s/device, 12,346 tokens/s/device, " \
                       f"ETA 3s, {first}"
    assert lines[1:] == [f"[progress] step 2/3 (67%): loss 1.0000, 1.500 s, 494.5 TFLOP/s/device, 12,346 tokens/s/device, "
                         f"ETA 2s, {later}",
                         f"[progress] step 3/3 (100%): loss 0.0000, 1.500 s, 494.5 TFLOP/s/device, 12,346 tokens/s/device, "
                         f"ETA 0s, {later}"]
    assert "no dense bf16 peak" not in " ".join(lines[1:])


def test_summary_lines_say_what_ran_how_fast_and_where_the_outputs_are(tmp_path):
  from MaxText.run import metrics

  tracker = metrics.ProgressTracker(total_steps=2, print_every=0)
  for step in range(2):
    tracker.on_train_step(step, {"learning/loss": 3.0 - step, "perf/step_time_seconds": 0.25,
                                 "perf/per_device_tflops_per_sec": 0.00612, "perf/per_device_tokens_per_sec": 2073.0})
  summary = {**tracker.summary(tmp_path, {}), "compile_s": 30.84, "peak_device_memory_gib": None,
             "checkpoint_saves": [{"step": 1, "bytes": 3 * 2**20, "seconds": 0.31}]}
  lines = metrics.summary_lines(summary)
  assert lines[0].startswith("[maxtext-moe] run summary: 2 steps (0-1) in ")
  assert lines[0].endswith(" (the train step compiled in 30.8 s); loss 3.0000 -> 2.0000")
  assert lines[1] == "  step          0.250 s median after warm-up, 0.00612 TFLOP/s/device, 2,073 tokens/s/device"
  assert lines[2:] == [f"  run directory {tmp_path}",
                       f"  checkpoints   1 saved in {tmp_path / 'checkpoints'}; the last, step 1: 3.00 MiB in 0.3 s",
                       f"  tensorboard   tensorboard --logdir {tmp_path / 'tensorboard'}"]
  assert metrics.summary_lines({**summary, "data_passes": 2, "data_epochs_per_pass": 1})[2] == \
      "  data          pass 2 over the grain data"
  # Upstream's num_epoch=3: a pass holds 3 epochs (it read as "pass 1", as if one).
  assert metrics.summary_lines({**summary, "data_passes": 2, "data_epochs_per_pass": 3})[2] == \
      "  data          pass 2 over the grain data, epochs 4-6 (a pass is num_epoch=3 epochs)"


def test_bad_mfu_peak_is_one_config_error_line():
  assert "config key 'mfu_peak_tflops' = -5 (command line): Input should be greater than 0" in config_error_line(
      TINY, "mfu_peak_tflops=-5")


def test_bounded_buffer_fill_and_dropped_rows_from_the_dispatch_meta():
  import types

  import jax.numpy as jnp

  from MaxText.moe import block, stats

  # a2a_padded's meta: rows bound for each of 3 peers, capacity C = 4: fullest 6/4, 2 + 1 rows beyond C.
  meta = types.SimpleNamespace(capacity=4, send_P=jnp.array([6, 4, 5], jnp.int32))
  np.testing.assert_allclose(block._buffer_12(meta), [[1.5, 3.0]])  # pylint: disable=protected-access
  np.testing.assert_array_equal(block._buffer_12(types.SimpleNamespace()), [[0.0, 0.0]])  # pylint: disable=protected-access
  s = stats.summarize(np.ones((2, 4)), [0, 0], np.zeros((2, 3)), [1.0, 0.0], [[1.5, 3.0], [0.5, 0.0]])
  assert float(s["moe/capacity_used_pct"]) == pytest.approx(150.0)
  assert float(s["moe/layer_001/capacity_used_pct"]) == pytest.approx(50.0)
  assert float(s["moe/dropped_tokens"]) == 3.0


@pytest.mark.slow
def test_a2a_padded_reports_fill_and_drops_over_two_devices(tmp_path):
  """Two simulated devices, EP 2, capacity factor 0.5: rows are dropped, flagged per shard and counted."""
  code = """
import jax, jax.numpy as jnp, numpy as np
from MaxText.moe import block, dispatch, routing
mesh = jax.make_mesh((2,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
T, D, E, K, F = 16, 8, 4, 2, 8
cfg = block.BlockConfig(router=routing.RouterConfig(num_experts=E, top_k=K, score_func="softmax",
                        bias_selects_only=False, deepseek_weights=False))
k = jax.random.split(jax.random.PRNGKey(0), 5)
kernel = jnp.zeros((D, E)).at[:, 0].set(1.0).at[:, 1].set(0.5)  # everyone picks experts 0 and 1 (peer 0)
x = jax.random.normal(k[1], (T, D)) ** 2
ex = block.Experts(*(jax.random.normal(kk, s) for kk, s in zip(k[2:], [(E, D, F), (E, D, F), (E, F, D)])))
disp = dispatch.make("a2a_padded", num_experts=E, axis_name="expert", ep_size=2, capacity_factor=0.5)
sharding = block.Sharding(mesh=mesh, token_axes=("expert",), expert_axis="expert")
overflow, buf = jax.jit(lambda x: block.moe_block_with_buffer(x, block.Router(kernel), ex, cfg, disp,
                                                              sharding)[2:])(x)
print("RESULT", bool(overflow.all()), float(buf[0]), float(buf[1]))
"""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  overflow, fill, dropped = proc.stdout.split("RESULT")[1].split()
  # each shard: 8 tokens x 2 = 16 rows, all for peer 0; capacity ceil(0.5 * 16 / 2) = 4 -> fill 4x, 12 dropped each
  assert overflow == "True" and float(fill) == pytest.approx(4.0) and float(dropped) == 24.0


@pytest.mark.slow  # 14 s: upstream's block compiled; the fast tier checks ours
def test_upstream_block_sows_the_statistics_of_its_own_routing():
  """moe_block=upstream with statistics on: counts from upstream's gate and get_topk, the block's output unchanged."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from maxtext.configs import pyconfig
  from maxtext.layers import initializers, moe
  from maxtext.utils import maxtext_utils

  from MaxText import config as fork_config
  from MaxText.moe import stats
  import patches
  from patches import deepseek_v3_router, routed_moe

  run = fork_config.load([TINY, "steps=1", "enable_checkpointing=false", "dtype=float32", "float32_gate_logits=true"])
  cfg = pyconfig.initialize(run.upstream_argv())
  mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
  layers = {}
  for metrics in (1, 0):
    fork = fork_config.ForkConfig(**{**run.fork.model_dump(), "moe_block": "upstream", "moe_gmm_backend": None,
                                     "moe_metrics_every_n_steps": metrics})
    assert routed_moe.wanted(fork) == bool(metrics)
    try:
      deepseek_v3_router.apply(fork)
      if routed_moe.wanted(fork):
        routed_moe.apply(fork)
      with jax.set_mesh(mesh):
        layers[metrics] = moe.RoutedAndSharedMoE(
            config=cfg, mesh=mesh, kernel_axes=("embed", None), rngs=nnx.Rngs(0), dtype=jnp.float32,
            weight_dtype=jnp.float32, kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
        ).MoeBlock_0
    finally:
      routed_moe.undo()
      patches.undo_module(deepseek_v3_router)
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.emb_dim))
  with jax.set_mesh(mesh):
    out_on = layers[1](x)[0]
    out_off = layers[0](x)[0]
    logits, pre_bias = layers[1].gate(x)
    _, ids = layers[1].get_topk(logits, pre_bias)
  np.testing.assert_allclose(np.asarray(out_on), np.asarray(out_off), rtol=1e-6, atol=1e-6)
  sown = nnx.state(layers[1], nnx.Intermediate)
  counts = [v for path, v in nnx.to_flat_state(sown) if stats.COUNTS in str(path)]
  assert len(counts) == 1, sown
  want = np.bincount(np.asarray(ids).reshape(-1), minlength=cfg.num_experts)
  np.testing.assert_array_equal(np.asarray(counts[0].get_value()).reshape(-1), want)
  off = nnx.to_flat_state(nnx.state(layers[0], nnx.Intermediate))  # off: upstream's own flag only
  assert not [path for path, _ in off if "moe_stats" in str(path)]
