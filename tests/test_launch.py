"""Process discovery (local / SLURM / Kubernetes), topology checks, and a real 2-process CPU job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, run_train
from MaxText import launch


# --- discovery: one code path for every launcher ---------------------------


def test_single_process_when_no_launcher_env():
  assert launch.discover({}) == launch.ProcessInfo("single", None, 1, 0)
  assert not launch.discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).multi_process


def test_local_launcher_env():
  info = launch.discover({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:4000", "JAX_NUM_PROCESSES": "2",
                          "JAX_PROCESS_ID": "1", "JAX_LOCAL_DEVICE_IDS": "4,5,6,7"})
  assert info == launch.ProcessInfo("env", "127.0.0.1:4000", 2, 1, (4, 5, 6, 7))


def test_slurm_env_takes_the_first_node_as_coordinator():
  info = launch.discover({"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_LOCALID": "0",
                          "SLURM_STEP_NODELIST": "gpu[003-018],cpu1", "JAX_COORDINATOR_PORT": "20042"})
  assert info == launch.ProcessInfo("slurm", "gpu003:20042", 16, 3, None)
  per_gpu = launch.discover({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                             "SLURM_JOB_NODELIST": "a1,a2", "MAXTEXT_GPUS_PER_TASK": "4"})
  assert per_gpu.coordinator_address == f"a1:{launch.DEFAULT_PORT}" and per_gpu.local_device_ids == (4, 5, 6, 7)


@pytest.mark.parametrize("nodelist, first", [("n1", "n1"), ("gpu[7-9]", "gpu7"), ("x[01,05]", "x01"), ("a,b", "a")])
def test_first_host_of_a_slurm_nodelist(nodelist, first):
  assert launch.first_host(nodelist) == first


def test_k8s_manifest_env_reaches_discovery():
  docs = list(yaml.safe_load_all((REPO / "scripts/k8s/indexed-job.yaml").read_text()))
  job = next(d for d in docs if d["kind"] == "Job")
  container = job["spec"]["template"]["spec"]["containers"][0]
  env = {e["name"]: e["value"] for e in container["env"]}
  nodes = job["spec"]["completions"]
  assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == nodes
  assert container["command"] == ["python", "-m", "MaxText.train"]
  # Kubernetes sets JOB_COMPLETION_INDEX in each pod of an Indexed Job.
  info = launch.discover({**env, "JOB_COMPLETION_INDEX": "5"})
  assert info == launch.ProcessInfo("k8s", "maxtext-moe-0.maxtext-moe:12345", nodes, 5, None)
  recipe = container["args"][0]
  assert (REPO / recipe).is_file()
  assert yaml.safe_load((REPO / recipe).read_text())["recipe_num_gpus"] == nodes * 8


def test_sbatch_uses_pyxis_and_the_one_entry_point():
  script = (REPO / "scripts/slurm/train.sbatch").read_text()
  assert subprocess.run(["bash", "-n", str(REPO / "scripts/slurm/train.sbatch")], check=False).returncode == 0
  assert "--container-image=" in script and "python -m MaxText.train" in script
  assert "XLA_FLAGS" not in script  # flags come from presets only


@pytest.mark.parametrize("environ, message", [
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_COORDINATOR_ADDRESS is not"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, "neither JAX_PROCESS_ID nor JOB_COMPLETION_INDEX"),
    ({"JAX_NUM_PROCESSES": "two", "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES='two'"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "2"}, "process id 2 is outside 0..1"),
])
def test_bad_launch_env_names_the_value(environ, message):
  with pytest.raises(launch.LaunchError, match=re.escape(message)):
    launch.discover(environ)


# --- topology checks --------------------------------------------------------


def test_mesh_product_must_match_the_device_count():
  with pytest.raises(launch.LaunchError, match=r"ICI \(per slice\) mesh ici_fsdp_parallelism=4 x ici_expert_parallelism=2 = 8 does not match 4 device"):
    launch.check_topology({"ici_fsdp_parallelism": 4, "ici_expert_parallelism": 2}, None, 4, 1)
  launch.check_topology({"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 2, "num_experts": 8}, None, 4, 1)


def test_expert_parallelism_must_divide_num_experts():
  with pytest.raises(launch.LaunchError, match=r"expert parallelism 3 .* does not divide num_experts=8"):
    launch.check_topology({"ici_fsdp_parallelism": 1, "ici_expert_parallelism": 3, "num_experts": 8}, None, 3, 1)


def test_recipe_for_more_gpus_than_present():
  with pytest.raises(launch.LaunchError, match=r"recipe_num_gpus=128: this recipe is for 128 GPUs, 8 present"):
    launch.check_topology({}, 128, 8, 1)
  with pytest.raises(launch.LaunchError, match=r"dcn_fsdp_parallelism=16 needs more than the 1 slice present"):
    launch.check_topology({"dcn_fsdp_parallelism": 16, "ici_fsdp_parallelism": 1, "ici_expert_parallelism": 8}, None, 8, 1)


def test_dcn_axes_fill_the_slices():
  launch.check_topology({"dcn_fsdp_parallelism": 16, "ici_fsdp_parallelism": 1, "ici_expert_parallelism": 8,
                         "num_experts": 256}, 128, 128, 16)
  with pytest.raises(launch.LaunchError, match=r"DCN \(across 16 slices\) mesh dcn_fsdp_parallelism=8 = 8 does not match 16"):
    launch.check_topology({"dcn_fsdp_parallelism": 8, "dcn_data_parallelism": 1, "ici_fsdp_parallelism": 1,
                           "ici_expert_parallelism": 8}, None, 128, 16)
  # upstream's default dcn_data_parallelism=-1 takes up the rest: 8 x 2 = 16
  launch.check_topology({"dcn_fsdp_parallelism": 8, "ici_fsdp_parallelism": 1, "ici_expert_parallelism": 8}, None, 128, 16)


# --- the same checks from the command line, before any compile --------------


def test_cli_mesh_mismatch_fails_before_compile(tmp_path):
  result = run_train(tmp_path, "ici_fsdp_parallelism=2")
  assert result.returncode == 2
  assert "ici_fsdp_parallelism=2 = 2 does not match 1 device(s)" in result.stderr
  assert not result.run_dir.exists()


def test_cli_ep_not_dividing_experts_fails_before_compile(tmp_path):
  result = run_train(tmp_path, "ici_fsdp_parallelism=1", "ici_expert_parallelism=3",
                     env={"XLA_FLAGS": "--xla_force_host_platform_device_count=3"})
  assert result.returncode == 2
  assert "expert parallelism 3 (ici_expert_parallelism x dcn_expert_parallelism) does not divide num_experts=8" in result.stderr
  assert not result.run_dir.exists()


def test_cli_recipe_for_more_gpus_than_present(tmp_path):
  result = run_train(tmp_path, "configs/recipes/deepseek3-671b-128xh100.yml")
  assert result.returncode == 2
  assert "recipe_num_gpus=128: this recipe is for 128 GPUs, 1 present" in result.stderr
  assert not result.run_dir.exists()


# --- a real multi-process job ------------------------------------------------


@pytest.mark.slow
def test_two_cpu_processes_on_localhost_report_the_same_loss(tmp_path):
  """scripts/launch_local.sh -n 2: jax.distributed + gloo, one CPU device per process.

  The same run (one tiny run is CI time enough) checks that presets' flags and
  environment, and the user's override, are printed at start and saved.
  """
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env["MAXTEXT_MOE_PYTHON"] = sys.executable
  env["XLA_FLAGS"] = "--xla_gpu_enable_latency_hiding_scheduler=false"
  cmd = ["bash", str(REPO / "scripts/launch_local.sh"), "-n", "2", "configs/deepseek3-tiny.yml", "steps=2",
         "enable_checkpointing=false", "xla_presets=[lhs,gpu_runtime]", f"base_output_directory={tmp_path}",
         "run_name=two"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:]
  for rank in (0, 1):
    assert f"[p{rank}] [maxtext-moe] process {rank} of 2 (env)" in proc.stdout
  losses = {rank: re.findall(rf"^\[p{rank}\] \[progress\] step 2/2 .*loss ([0-9.]+)", proc.stdout, re.M) for rank in (0, 1)}
  assert losses[0] and losses[0] == losses[1], losses
  assert "Num_devices: 2" in proc.stdout  # one global mesh over both processes

  assert "[p0] [maxtext-moe] xla presets: lhs, gpu_runtime" in proc.stdout
  assert ("[p0] [maxtext-moe] override: XLA flag xla_gpu_enable_latency_hiding_scheduler: "
          "your XLA_FLAGS value 'false' wins") in proc.stdout
  assert "[p0] [maxtext-moe] env CUDA_DEVICE_MAX_CONNECTIONS=1" in proc.stdout
  saved = json.loads((tmp_path / "two" / "maxtext-moe" / "effective_config.json").read_text())
  assert saved["environment"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
  assert "--xla_gpu_enable_latency_hiding_scheduler=false" in saved["environment"]["XLA_FLAGS"]
  assert saved["xla_presets"]["presets"] == ["lhs", "gpu_runtime"]
  assert saved["xla_presets"]["xla_flags"]["xla_gpu_enable_highest_priority_async_stream"] == "true"
  assert len(saved["xla_presets"]["overrides"]) == 1
