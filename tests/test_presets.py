"""XLA presets: composition, user precedence, flag validation against the installed jaxlib."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, run_rejected
from MaxText import config as fork_config
from MaxText.config import xla_presets as xp


def test_every_preset_composes_and_its_flags_are_known_to_jaxlib():
  known, source = xp.known_flags()
  assert "jaxlib 0.11.2" in source
  for name in xp.PRESETS:
    composed = xp.compose([name], {}, {})
    assert set(composed.xla_flags) <= known, name
    assert composed.presets[-1] == name


def test_known_flags_come_from_the_binaries_and_the_gpu_reference():
  known, source = xp.known_flags()
  assert "xla_force_host_platform_device_count" in known  # only in jaxlib's own .so
  assert "xla_gpu_host_bfc" in known  # only in the CUDA plugin's list (vendored reference)
  assert "no CUDA plugin" in source  # this CPU machine has no plugin: the reference filled in
  assert xp.REFERENCE_GPU_FLAGS.is_file()


def test_multistream_uses_the_flag_names_jax_0_11_2_ships():
  reference = set(xp.REFERENCE_GPU_FLAGS.read_text().split())
  flags = xp.compose(["multistream"], {}, {}).xla_flags
  assert flags["xla_gpu_experimental_enable_collective_multi_streaming"] == "true"
  assert {"xla_gpu_experimental_parallel_collective_overlap_limit",
          "xla_gpu_experimental_parallel_scale_up_collective_overlap_limit"} <= set(flags)
  assert set(flags) <= reference
  assert flags["xla_gpu_enable_latency_hiding_scheduler"] == "true"  # includes lhs


def test_unknown_preset_is_refused_with_the_closest_names():
  with pytest.raises(xp.PresetError, match=r"unknown XLA preset 'multistreem'; did you mean multistream\?"):
    xp.compose(["multistreem"], {}, {})


def test_unknown_flag_in_user_xla_flags_is_refused_with_the_closest_names():
  env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_schedular=true"}
  with pytest.raises(xp.PresetError, match=r"'--xla_gpu_enable_latency_hiding_schedular' \(your XLA_FLAGS\); did you mean xla_gpu_enable_latency_hiding_scheduler"):
    xp.compose(["lhs"], env, {})


def test_unknown_flag_in_a_preset_is_refused():
  bad = xp.Preset("bad", "a typo", flags={"xla_gpu_enable_pipelined_all_gathr": "true"})
  with pytest.raises(xp.PresetError, match=r"unknown XLA flag '--xla_gpu_enable_pipelined_all_gathr' \(preset 'bad'\); did you mean xla_gpu_enable_pipelined_all_gather"):
    xp.check_flag_names(bad.flags, "preset 'bad'", xp.known_flags()[0])


def test_user_xla_flags_win_and_each_conflict_is_reported():
  env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d"}
  composed = xp.compose(["lhs"], env, {})
  assert composed.xla_flags["xla_gpu_enable_latency_hiding_scheduler"] == "false"
  assert composed.xla_flags["xla_dump_to"] == "/tmp/d"
  assert "--xla_gpu_enable_highest_priority_async_stream=true" in composed.env["XLA_FLAGS"]
  assert composed.overrides == (
      "XLA flag xla_gpu_enable_latency_hiding_scheduler: your XLA_FLAGS value 'false' wins over preset 'lhs' ('true')",
  )


def test_user_environment_wins_over_preset_environment():
  composed = xp.compose(["gpu_runtime"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, {})
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in composed.env  # left as the user set it
  assert composed.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
  assert any("XLA_PYTHON_CLIENT_MEM_FRACTION: your value '0.5' wins" in o for o in composed.overrides)


def test_later_preset_overrides_earlier_and_says_so():
  composed = xp.compose(["combine_thresholds", "nvidia_maxtext_default"], {}, {})
  assert composed.xla_flags["xla_gpu_all_reduce_combine_threshold_bytes"] == "51200"
  assert any("preset 'nvidia_maxtext_default' sets '51200' over preset 'combine_thresholds'" in o for o in composed.overrides)


def test_includes_expand_once_in_order():
  assert xp.compose(["deepseek_v3_reference", "lhs"], {}, {}).presets == (
      "gpu_runtime", "lhs", "pipelined_collectives", "multistream", "combine_thresholds", "no_command_buffers",
      "deepseek_v3_reference")


def test_no_preset_turns_on_nvlink_multicast():
  for preset in xp.PRESETS.values():
    assert preset.env.get("NCCL_NVLS_ENABLE", "0") == "0", preset.name
  assert xp.PRESETS["gpu_runtime"].env["NCCL_NVLS_ENABLE"] == "0"
  with pytest.raises(xp.PresetError, match="NCCL_NVLS_ENABLE=1"):
    xp.check_house_rules(xp.Preset("nvls", "bad", env={"NCCL_NVLS_ENABLE": "1"}))


def test_xla_flags_parse_and_format_round_trip():
  flags = xp.parse_xla_flags("--a=1 --b --xla_gpu_enable_command_buffer='' --a=2")
  assert flags == {"a": "2", "b": "true", "xla_gpu_enable_command_buffer": ""}
  assert xp.parse_xla_flags(xp.format_xla_flags(flags)) == flags
  with pytest.raises(xp.PresetError, match="'oops' does not start with --"):
    xp.parse_xla_flags("oops")


def test_preset_upstream_keys_apply_unless_the_user_set_them():
  run = fork_config.load(["xla_presets=[host_offload]"])
  composed = xp.compose_for(run, {})
  run2 = xp.with_upstream_defaults(run, composed)
  assert run2.upstream["remat_policy"] == "custom"
  assert run2.upstream["moe_mlpwi_0"] == run2.upstream["moe_mlpwi_1"] == "offload"
  assert composed.env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == "128"

  mine = fork_config.load(["xla_presets=[host_offload]", "moe_mlpwi_1=device"])
  composed = xp.compose_for(mine, {})
  assert xp.with_upstream_defaults(mine, composed).upstream["moe_mlpwi_1"] == "device"
  assert "config key moe_mlpwi_1: your value 'device' wins over preset 'host_offload' ('offload')" in composed.overrides


def test_the_live_time_split_runs_without_command_buffers():
  """A CUDA graph is one trace event, so a run with moe_profile_every_n_steps gets no_command_buffers."""
  plain = xp.compose_for(fork_config.load([]), {})
  assert "xla_gpu_enable_command_buffer" not in plain.xla_flags
  profiled = xp.compose_for(fork_config.load(["moe_profile_every_n_steps=5"]), {})
  assert profiled.presets[-1] == "no_command_buffers" and profiled.xla_flags["xla_gpu_enable_command_buffer"] == ""
  already = xp.compose_for(fork_config.load(["moe_profile_every_n_steps=5", "xla_presets=[deepseek_v3_reference]"]), {})
  assert already.presets.count("no_command_buffers") == 1 and not already.overrides
  theirs = xp.compose_for(fork_config.load(["moe_profile_every_n_steps=5"]),
                          {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION"})
  assert theirs.xla_flags["xla_gpu_enable_command_buffer"] == "FUSION"  # the user's flag still wins, and says so
  assert any("your XLA_FLAGS value 'FUSION' wins" in line for line in theirs.overrides)


def test_cli_unknown_preset_fails_before_anything_is_written(tmp_path):
  result = run_rejected(tmp_path, "xla_presets=[lhs,multistreem]")
  assert result.returncode == 2
  assert "unknown XLA preset 'multistreem'" in result.stderr
  assert not result.run_dir.exists()


def test_nothing_before_run_environment_creates_a_jax_backend():
  """XLA reads XLA_FLAGS once, at backend creation: presets must be in the environment by then.

  Everything `python -m MaxText.train` does before `run_environment` (imports,
  loading and validating the config, composing presets) runs here; a flag set
  afterwards must still take effect.
  """
  code = (
      "import os\n"
      "from MaxText import config\nfrom MaxText.config import environment, xla_presets\n"
      "run = config.load(['configs/bench/proxy-1xh200.yml', 'xla_presets=[deepseek_v3_reference,host_offload]', 'remat_policy=custom'])\n"
      "composed = xla_presets.compose_for(run, dict(os.environ))\n"
      "run = xla_presets.with_upstream_defaults(run, composed)\n"
      "env = environment.run_environment(run, dict(os.environ), composed)\n"
      "env['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=3'\n"
      "os.environ.update(env)\n"
      "import jax\n"
      "print('devices', jax.device_count())\n"
  )
  environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environ, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "devices 3" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["remat_policy=full"], "host_offload has no effect with remat_policy='full'"),
    (["moe_mlpwi_0=remat", "moe_mlpwi_1=device"], "no remat location .* is 'offload'"),
])
def test_host_offload_that_can_offload_nothing_is_a_config_error(args, message):
  run = fork_config.load(["xla_presets=[host_offload]", *args])
  with pytest.raises(xp.PresetError, match=message):
    xp.with_upstream_defaults(run, xp.compose_for(run, {}))


def test_host_offload_of_the_layer_inputs_alone_acts():
  """The 128-GPU 671B recipes offload only the layer inputs (decoder_layer_input), their experts' activations
  recomputed: the preset has that to do, on any block."""
  run = fork_config.load(["xla_presets=[host_offload]", "moe_mlpwi_0=remat", "moe_mlpwi_1=remat",
                          "decoder_layer_input=offload", "moe_block=ours"])
  assert xp.with_upstream_defaults(run, xp.compose_for(run, {})).upstream["decoder_layer_input"] == "offload"


def test_host_offload_acts_on_both_blocks_that_tag_the_activations():
  for block in ("upstream", "ours"):
    run = fork_config.load(["xla_presets=[host_offload]", f"moe_block={block}"])
    assert xp.with_upstream_defaults(run, xp.compose_for(run, {})).upstream["moe_mlpwi_0"] == "offload"
