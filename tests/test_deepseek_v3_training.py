"""DeepSeek-V3's router in real (tiny) training runs at upstream's model_name "default".

Before moe_router=deepseek_v3, routed_bias_update_rate > 0 at model_name default crashed upstream's
train step while compiling (train.py:658: the scanned bias is a parameter stacked [experts, layers],
the update [layers, experts]); now the bias is V3's variable and moves. The token-count switches
(bias update -> 0, MTP weight 0.3 -> 0.1) act at the step they should, and a checkpoint written with
the bias as a trained parameter is refused with one line instead of being resumed half-way.
"""

from __future__ import annotations

import pytest

from conftest import run_train
from MaxText import config as fork_config

TOKENS_PER_STEP = 2 * 128  # tiny: per_device_batch_size 2 x max_target_length 128, one CPU device
OLD_ROUTER = ("moe_router=upstream", "n_routing_groups=-1", "topk_routing_group=-1", "routed_bias_update_rate=0")


def test_bias_update_at_model_name_default_needs_the_v3_router():
  """The setting that crashed upstream is a config error without moe_router=deepseek_v3, naming the key."""
  with pytest.raises(fork_config.ConfigError, match=r"'routed_bias_update_rate' = 0.001 .*moe_router=deepseek_v3"):
    fork_config.load([*OLD_ROUTER[:3], "routed_bias_update_rate=0.001"])
  with pytest.raises(fork_config.ConfigError, match=r"'n_routing_groups' = 4 .*moe_router=deepseek_v3"):
    fork_config.load(["moe_router=upstream"])  # the tiny config's groups would be ignored
  with pytest.raises(fork_config.ConfigError, match=r"'routed_score_func' = 'softmax'"):
    fork_config.load(["routed_score_func=softmax"])
  with pytest.raises(fork_config.ConfigError, match=r"'moe_log_expert_load' = True .*moe_block=ours"):
    fork_config.load(["moe_block=upstream", "moe_log_expert_load=true"])  # upstream's block has no load report


@pytest.mark.slow
@pytest.mark.parametrize("block", ["upstream", "ours"])
def test_bias_update_trains_at_model_name_default(train, block):
  load = ("moe_log_expert_load=true",) if block == "ours" else ()
  run = train("steps=3", "enable_checkpointing=false", "log_step_diagnostics=true", f"moe_block={block}",
              "routed_bias_update_rate=0.001", *load, run_name=block)
  assert run.returncode == 0, run.stderr[-3000:]
  if block == "ours":  # the expert-load report bench_train prints: one entry per MoE layer call (2 layers)
    assert run.summary["expert_load"]["layer_calls"] >= 3 * 2 and run.summary["expert_load"][
        "max_over_mean_last_tenth"] >= 1.0, run.summary["expert_load"]
    assert "expert load" in run.stdout
  moe = {int(k): v for k, v in run.summary["moe_scalars"].items()}
  assert all(moe[s]["diag/moe_bias_update_nonzero"] > 0 for s in range(3)), moe  # the bias moved every step
  assert len({round(moe[s]["diag/moe_bias_checksum"], 7) for s in range(3)}) > 1, moe


@pytest.mark.slow
def test_token_count_switches_stop_the_bias_and_lower_the_mtp_weight(train):
  """Switch after 2 steps' tokens: steps 0-1 move the bias at MTP weight 0.3, steps 2-3 don't, at 0.1."""
  run = train("steps=4", "enable_checkpointing=false", "log_step_diagnostics=true", "mtp_num_layers=1",
              "mtp_loss_scaling_factor=0.3", f"moe_bias_update_stop_tokens={2 * TOKENS_PER_STEP}",
              f"mtp_loss_switch_tokens={2 * TOKENS_PER_STEP}", "mtp_loss_scaling_factor_late=0.1")
  assert run.returncode == 0, run.stderr[-3000:]
  assert "from step 2" in run.stdout
  moe = {int(k): v for k, v in run.summary["moe_scalars"].items()}
  moved = [moe[s]["diag/moe_bias_update_nonzero"] for s in range(4)]
  checksum = [moe[s]["diag/moe_bias_checksum"] for s in range(4)]
  assert moved[0] > 0 and moved[1] > 0 and moved[2] == moved[3] == 0, moved
  assert checksum[1] == checksum[2] == checksum[3], checksum  # the sum of every routing bias, after each step
  mtp = [moe[s]["learning/mtp_loss"] for s in range(4)]
  # The unweighted MTP loss moves a few percent a step here; the weight drops 3x at step 2.
  assert mtp[1] / mtp[0] > 0.8 and 0.25 < mtp[2] / mtp[1] < 0.4, mtp


@pytest.fixture(scope="module")
def old_router_run(tmp_path_factory):
  """One step with the bias as a trained parameter (upstream's router), a checkpoint of it: what the two tests below
  start from. Neither writes to it (each asserts so or only reads it)."""
  root = tmp_path_factory.mktemp("old_router")
  old = run_train(root, "steps=1", "checkpoint_period=1", *OLD_ROUTER, run_name="r")
  assert old.returncode == 0, old.stderr[-3000:]
  return root, old


@pytest.mark.slow
def test_resuming_a_checkpoint_with_a_trained_bias_stops_naming_the_bias(old_router_run):
  root, old = old_router_run
  steps_before = sorted(p.name for p in (old.run_dir / "checkpoints").iterdir())
  new = run_train(root, "steps=2", "checkpoint_period=1", run_name="r")  # the tiny config: V3's router
  assert new.returncode == 2
  errors = [line for line in new.stderr.splitlines() if "config error" in line]
  assert len(errors) == 1 and "gate/bias" in errors[0] and "trained parameter" in errors[0], new.stderr[-2000:]
  assert "[progress] step" not in new.stdout  # no step trained
  assert sorted(p.name for p in (old.run_dir / "checkpoints").iterdir()) == steps_before  # nothing written


def _metadata(directory, *paths):
  import json  # pylint: disable=import-outside-toplevel

  directory.mkdir(parents=True)
  (directory / "_METADATA").write_text(json.dumps({"tree_metadata": {str(p): {} for p in paths}}))
  return directory


def test_load_parameters_path_with_the_other_bias_semantics_is_one_config_error(tmp_path):
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.checkpoints import compat as checkpoint_compat  # pylint: disable=import-outside-toplevel

  layer = ("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate")
  old = _metadata(tmp_path / "old" / "items", ("params", "params", *layer, "bias"), ("params", "params", *layer, "kernel"))
  new = _metadata(tmp_path / "new" / "items", ("nnx_aux", "model", *layer, "bias"), ("params", "params", *layer, "kernel"))
  v3 = lambda p: fork_config.load(["configs/deepseek3-tiny.yml", f"load_parameters_path={p}"])  # noqa: E731
  upstream = lambda p: fork_config.load(["configs/deepseek3-tiny.yml", *OLD_ROUTER,  # noqa: E731
                                         f"load_parameters_path={p}"])
  with pytest.raises(fork_config.ConfigError, match="load_parameters_path.*gate/bias.*trained parameter"):
    checkpoint_compat.check_load_parameters(v3(old))
  with pytest.raises(fork_config.ConfigError, match="load_parameters_path.*non-trained variable"):
    checkpoint_compat.check_load_parameters(upstream(new.parent))  # .../N as well as .../N/items
  checkpoint_compat.check_load_parameters(v3(new))  # the same semantics: fine
  checkpoint_compat.check_load_parameters(upstream(old))
  checkpoint_compat.check_load_parameters(v3("gs://bucket/ckpt/0/items"))  # remote: orbax's to read


@pytest.mark.slow
def test_loading_parameters_with_a_trained_bias_stops_naming_the_key(train, old_router_run):
  _, old = old_router_run
  items = old.run_dir / "checkpoints" / "0" / "items"
  assert (items / "_METADATA").is_file()
  new = train("steps=1", f"load_parameters_path={items}", run_name="new")  # the tiny config: V3's router
  assert new.returncode == 2
  errors = [line for line in new.stderr.splitlines() if "config error" in line]
  assert len(errors) == 1 and "load_parameters_path" in errors[0] and "gate/bias" in errors[0], new.stderr[-2000:]
  assert "[progress] step" not in new.stdout  # no step trained
