"""A bounded dispatch buffer's overflow (MaxText/moe/overflow.py): refused combinations, the run stopped after the step
that dropped rows, and upstream's dropless replay training on every token on our block.

Fast: the config checks. Slow (training runs on 4 simulated CPU devices, EP 4 over a2a_padded, the tiny
DeepSeek-V3 with one MoE layer, float32): an overflow stops the run with one line and exit 8 before the step is
saved; the train step lowered for CUDA has no host callback; with moe_a2a_padded_on_overflow=flag and upstream's
moe_dropless_fallback=step every step overflows, is rolled back and replayed, and the losses and gradient norms
are those of a run whose buffers never overflow (capacity factor = the EP size), to 1e-5.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_train
from MaxText import config as fork_config
from MaxText.config import command_line
from MaxText.moe import overflow

FOUR_CPUS = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
EP4 = ("moe_block=ours", "dtype=float32", "base_num_decoder_layers=4", "max_target_length=64",
       "per_device_batch_size=1", "ici_expert_parallelism=4", "ici_fsdp_parallelism=1",
       "moe_dispatch_backend=a2a_padded", "enable_checkpointing=false")
# 64 tokens a device x top-4 = 256 slots, 64 a peer when balanced: 0.25 holds 16 a peer, which the tiny router's
# skew passes on every step.
OVERFLOWING = "moe_a2a_padded_capacity_factor=0.25"
DROPLESS = "moe_a2a_padded_capacity_factor=4.0"  # the EP size: a buffer holds every slot of its shard
REPLAY = ("moe_a2a_padded_on_overflow=flag", "moe_dropless_fallback=step")


# --- config -------------------------------------------------------------------------------------------------


def _refused(*keys: str) -> str:
  with pytest.raises(fork_config.ConfigError) as e:
    fork_config.load(["configs/deepseek3-tiny.yml", *keys])
  assert "\n" not in str(e.value)
  return str(e.value)


def test_flag_without_the_replay_and_the_replay_with_error_are_refused():
  msg = _refused("moe_a2a_padded_on_overflow=flag")
  assert "'moe_a2a_padded_on_overflow' = 'flag' (command line)" in msg and "'moe_dropless_fallback' = None" in msg
  assert "would drop the rows past a buffer's capacity with only a flag" in msg
  msg = _refused("moe_dropless_fallback=step")
  assert "'moe_a2a_padded_on_overflow' = 'error' (default)" in msg and "before upstream's replay" in msg
  assert "no in-layer fallback" in _refused(*REPLAY[:1], "moe_dropless_fallback=layer")
  assert "TE's receive capacity is fixed" in _refused(*REPLAY, "moe_dispatch_backend=te_ncclep")


def test_the_replay_sets_only_the_keys_upstreams_check_of_it_reads():
  """Upstream checks moe_dropless_fallback=step against three keys of its own block, which ours never reads:
  set where the config leaves them, named in --print-config's sources, a value given kept."""
  run = fork_config.load(["configs/deepseek3-tiny.yml", *REPLAY])
  for key, value in overflow.FALLBACK_VALIDATION_KEYS.items():
    assert run.upstream[key] == value and "moe_block=ours never reads it" in run.origins[key]
  run = fork_config.load(["configs/deepseek3-tiny.yml", *REPLAY, "ragged_buffer_factor=2.0"])
  assert run.upstream["ragged_buffer_factor"] == 2.0 and run.origins["ragged_buffer_factor"] == "command line"
  run = fork_config.load(["configs/deepseek3-tiny.yml"])
  assert not {"use_ring_of_experts", "use_ragged_sort", "ragged_buffer_factor"} & set(run.upstream)


# --- training runs ------------------------------------------------------------------------------------------


def _grad_norms(run_dir: Path) -> dict[int, float]:
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # pylint: disable=import-outside-toplevel

  (events,) = glob.glob(str(run_dir / "tensorboard" / "**" / "events.out.tfevents.*"), recursive=True)
  acc = EventAccumulator(events, size_guidance={"scalars": 0})
  acc.Reload()
  return {e.step: e.value for e in acc.Scalars("learning/raw_grad_norm")}


@pytest.mark.slow
def test_an_overflow_stops_the_run_after_that_step_with_one_line(tmp_path):
  """moe_a2a_padded_on_overflow=error (the default): exit 8, one line naming the step, the backend and the key to
  raise; the step that dropped rows is not saved (a checkpoint every step: none is written)."""
  result = run_train(tmp_path, *EP4, OVERFLOWING, "steps=3", "enable_checkpointing=true", "checkpoint_period=1",
                     run_name="over", env=FOUR_CPUS)
  assert result.returncode == command_line.EXIT_MOE_OVERFLOW == 8, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("maxtext-moe: MoE dispatch overflow:")]
  assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert "our block's a2a_padded dispatch" in lines[0] and "in step 0" in lines[0]
  assert "moe_a2a_padded_capacity_factor" in lines[0] and "token-expert rows past capacity" in lines[0]
  assert not list((result.run_dir / "checkpoints").glob("[0-9]*"))


@pytest.mark.slow
def test_the_train_step_carries_the_overflow_without_a_host_callback(tmp_path):
  """The train step with the default on_overflow=error, EP 2 over a2a_padded, lowered for CUDA: no host callback
  (before, one per MoE layer call: lowering it for CUDA without a GPU failed on it), and the step's overflow
  scalar is in its outputs."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  proc = subprocess.run([sys.executable, str(REPO / "tests/lower_train_step.py"), "configs/deepseek3-tiny.yml",
                         "steps=1", "enable_checkpointing=false", f"base_output_directory={tmp_path}", "moe_block=ours",
                         "moe_gmm_backend=xla", "base_num_decoder_layers=4", "max_target_length=64",
                         "ici_expert_parallelism=2", "ici_fsdp_parallelism=1", "moe_dispatch_backend=a2a_padded"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "callback" not in proc.stdout.lower()
  assert overflow.SCALAR in proc.stdout  # the output's name in the lowered program's result attributes


@pytest.mark.slow
def test_a_replayed_step_trains_on_every_token(tmp_path):
  """flag + upstream's moe_dropless_fallback=step with buffers that overflow on every step: each step is rolled
  back and replayed by upstream's dropless program, whose buffers hold the EP size. Its losses and gradient norms
  are those of a run that never overflows, to 1e-5 (float32: only the order of reductions differs). Before, our
  block ignored `force_dropless`: the replay overflowed again and every step was rolled back."""
  replayed = run_train(tmp_path, *EP4, OVERFLOWING, *REPLAY, "steps=3", run_name="replayed", env=FOUR_CPUS)
  assert replayed.returncode == 0, replayed.stderr[-3000:]
  assert replayed.stdout.count("Replaying step with dropless buffer") + replayed.stderr.count(
      "Replaying step with dropless buffer") == 3  # every step overflowed first
  assert "dropless replay: buffers at the EP size" in replayed.stdout
  reference = run_train(tmp_path, *EP4, DROPLESS, "steps=3", run_name="reference", env=FOUR_CPUS)
  assert reference.returncode == 0, reference.stderr[-3000:]
  got, want = replayed.losses(), reference.losses()
  got_norms, want_norms = _grad_norms(replayed.run_dir), _grad_norms(reference.run_dir)
  assert sorted(got) == sorted(want) == [0, 1, 2] and sorted(got_norms) == sorted(want_norms)
  for step in want:
    assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
    assert abs(got_norms[step] - want_norms[step]) <= 1e-5 * abs(want_norms[step]), (step, got_norms, want_norms)
  assert want[2] < want[0]  # it trains
