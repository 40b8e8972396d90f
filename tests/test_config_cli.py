"""Config discovery from the command line: --help, --print-config, --dry-run, and
the launch mistakes that used to end in a jax.distributed traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, run_rejected
from MaxText import config as fork_config


def _cli(tmp_path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  """`python -m MaxText.train ARGS` from an empty directory, outputs under tmp_path."""
  environ = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  environ["PYTHONPATH"] = os.pathsep.join([str(REPO), environ.get("PYTHONPATH", "")])
  cwd = tmp_path / "cwd"
  cwd.mkdir(exist_ok=True)
  return subprocess.run([sys.executable, "-m", "MaxText.train", *args], cwd=cwd, env={**environ, **(env or {})},
                        capture_output=True, text=True, timeout=300, check=False)


def test_every_key_of_ours_has_a_description():
  missing = [k for k, f in fork_config.ForkConfig.model_fields.items() if not (f.description or "").strip()]
  assert missing == []


def test_help_lists_our_keys_and_the_exit_codes(tmp_path):
  proc = _cli(tmp_path, "--help")
  assert proc.returncode == 0, proc.stderr
  for name, field in fork_config.ForkConfig.model_fields.items():
    assert f"  {name} (" in proc.stdout and field.description in proc.stdout
  assert "exit codes:" in proc.stdout and "  2  bad config" in proc.stdout
  assert "--print-config" in proc.stdout and "--dry-run" in proc.stdout


def test_print_config_shows_every_value_with_its_source(tmp_path):
  """From a directory without configs/: the shipped file is found; nothing is written."""
  proc = _cli(tmp_path, "--print-config", "configs/bench/proxy-1xh200.yml", "steps=7", "xla_presets=[host_offload]",
              "remat_policy=custom", "moe_mlpwi_1=device", f"base_output_directory={tmp_path / 'outputs'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = dict(line.split(" = ", 1) for line in proc.stdout.splitlines() if " = " in line)
  shipped = fork_config.REPO_CONFIGS.resolve()
  assert lines["steps"] == "7  # command line"
  assert lines["xla_presets"] == '["host_offload"]  # command line'
  assert lines["recipe_num_gpus"] == f"1  # {shipped}/bench/proxy-1xh200.yml"
  assert lines["num_experts"] == f"32  # {shipped}/models/deepseek3-proxy-1gpu.yml"  # the chain's own file
  assert lines["moe_block"] == '"upstream"  # maxtext-moe default'
  assert lines["moe_mlpwi_0"] == '"offload"  # xla_presets host_offload'
  assert lines["remat_policy"] == '"custom"  # command line'  # over the file's full (host_offload needs custom)
  assert lines["moe_mlpwi_1"] == '"device"  # command line'  # the user wins over the preset
  assert lines["run_name"].endswith("# maxtext-moe default")
  assert lines["learning_rate"].endswith("# upstream base.yml")
  assert len(lines) > 500  # upstream's whole config, not only what the run sets
  assert not (tmp_path / "outputs").exists() and list((tmp_path / "cwd").iterdir()) == []


def test_dry_run_checks_everything_and_writes_nothing(tmp_path):
  proc = _cli(tmp_path, "--dry-run", "configs/deepseek3-tiny.yml", f"base_output_directory={tmp_path / 'outputs'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "dry run: config, presets, launch (single, process 0 of 1) and upstream's checks pass" in proc.stdout
  assert not (tmp_path / "outputs").exists()
  wrong = _cli(tmp_path, "--dry-rum")
  assert wrong.returncode == 2 and wrong.stderr.startswith("maxtext-moe: config error: option(s) --dry-rum: use one of")


def test_model_only_yaml_is_one_line_not_a_traceback(tmp_path):
  result = run_rejected(tmp_path, "configs/models/deepseek3-tiny.yml")
  assert result.returncode == 2
  (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("maxtext-moe:")]
  assert line.startswith("maxtext-moe: config error: hardware is not set, and upstream's default is tpu")
  assert "Traceback" not in result.stderr


def test_incomplete_upstream_launch_variables_are_one_line(tmp_path):
  result = run_rejected(tmp_path, env={"NNODES": "2", "NODE_RANK": "0"})
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert ("maxtext-moe: config error: NNODES=2, NODE_RANK=0 is set (upstream MaxText's GPU launch variables) but "
          "JAX_COORDINATOR_IP, JAX_COORDINATOR_PORT is not") in result.stderr
