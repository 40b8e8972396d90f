"""Process discovery (local / SLURM / Kubernetes), topology checks, and a real 2-process CPU job."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import numpy as np
import yaml

from conftest import _SHARED_JAX_CACHE, JAX_CACHE_ENV, REPO, run_rejected  # pylint: disable=protected-access
from MaxText.run import launch
from MaxText.config import parallelism


# --- discovery: one code path for every launcher ---------------------------

# Variables any launcher or scheduler may have left in the test's own environment.
_JOB_VARS = re.compile(r"^(SLURM_|OMPI_|PMIX_|JAX_|JOB_COMPLETION_INDEX$|KUBERNETES_SERVICE_HOST$|NNODES$|NODE_RANK$"
                       r"|CUDA_VISIBLE_DEVICES$)")


@pytest.fixture
def job_env(monkeypatch):
  """Replaces the launcher variables of os.environ (JAX's cluster classes read it) with the given ones."""
  def _set(**env: str):
    for name in [n for n in os.environ if _JOB_VARS.match(n)]:
      monkeypatch.delenv(name)
    for name, value in env.items():
      monkeypatch.setenv(name, value)
  return _set


def test_single_process_when_no_launcher_env(job_env):
  job_env()
  assert launch.discover() == launch.ProcessInfo("single", None, 1, 0)
  job_env(SLURM_JOB_ID="7", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_STEP_NODELIST="n1")
  assert not launch.discover().multi_process


def test_local_launcher_env(job_env):
  job_env(JAX_COORDINATOR_ADDRESS="127.0.0.1:4000", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1",
          JAX_LOCAL_DEVICE_IDS="4,5,6,7")
  assert launch.discover() == launch.ProcessInfo("env", "127.0.0.1:4000", 2, 1, (4, 5, 6, 7))


def _slurm(procid: int, tasks_per_node: int, nodes: int = 2, gpus_on_node: int = 8, **extra: str) -> dict[str, str]:
  """What srun gives task `procid` of a job on `nodes` nodes (--ntasks-per-node, --gpus-per-node)."""
  return {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[003-018],cpu1", "SLURM_NTASKS": str(nodes * tasks_per_node),
          "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % tasks_per_node),
          "SLURM_NODEID": str(procid // tasks_per_node), "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})",
          "SLURM_GPUS_ON_NODE": str(gpus_on_node), "JAX_COORDINATOR_PORT": "20042", **extra}


@pytest.mark.parametrize("tasks_per_node, bound, devices", [
    (8, False, lambda local: (local,)),  # one process per GPU (JAX's convention), each sees all 8
    (8, True, lambda local: None),  # one per GPU, srun --gpus-per-task=1: each sees only its own
    (1, False, lambda local: None),  # one per node (train.sbatch's default): every GPU of the node
    (2, False, lambda local: tuple(range(4 * local, 4 * local + 4))),  # two per node, four GPUs each
])
def test_slurm_layouts_give_each_process_its_gpus(job_env, tasks_per_node, bound, devices):
  """Every task of a 2-node job with 8 GPUs per node: same coordinator, ranks 0..N-1, its GPUs."""
  seen = []
  for procid in range(2 * tasks_per_node):
    local = procid % tasks_per_node
    visible = str(local) if bound else "0,1,2,3,4,5,6,7"
    job_env(**_slurm(procid, tasks_per_node, CUDA_VISIBLE_DEVICES=visible))
    info = launch.discover()
    assert info == launch.ProcessInfo("slurm", "gpu003:20042", 2 * tasks_per_node, procid, devices(local))
    seen.append(info.local_device_ids)
  if not bound and tasks_per_node > 1:  # the processes of a node share its 8 GPUs out, none twice
    assert sorted(i for ids in seen[:tasks_per_node] for i in ids) == list(range(8))


def test_slurm_layout_that_does_not_split_names_the_counts(job_env):
  job_env(**_slurm(0, 3))
  with pytest.raises(parallelism.LaunchError, match="8 GPUs on this node do not split evenly over its 3 processes"):
    launch.discover()
  assert launch.tasks_on_node("8(x2),4", 2) == 4 and launch.tasks_on_node("2,1", 1) == 1


_JAX_SEES = (
    "import json, jax\n"
    "from MaxText.run import launch\n"
    "info = launch.discover()\n"
    "launch.initialize(info, 'cpu')\n"
    "print('SEES', json.dumps([info.scheduler, jax.process_index(), jax.process_count(),"
    " jax.config.values['jax_cuda_visible_devices']]))\n"
)


@pytest.mark.parametrize("tasks_per_node, nodes, visible", [(1, 2, ["all", "all"]), (2, 1, ["0", "1"])])
def test_jax_distributed_gets_each_layouts_devices(tasks_per_node, nodes, visible):
  """Two real processes under simulated srun environments join one jax.distributed job;
  each reports the GPUs JAX restricts it to (jax_cuda_visible_devices; 'all' = every GPU it sees).
  One per node on 2 nodes, and one per GPU on a node with 2 GPUs."""
  port = str(20000 + os.getpid() % 20000)
  base = {k: v for k, v in os.environ.items() if not _JOB_VARS.match(k) and k != "XLA_FLAGS"}
  procs = []
  for procid in range(2):
    env = {**base, **_slurm(procid, tasks_per_node, nodes=nodes, gpus_on_node=2), "SLURM_STEP_NODELIST": "localhost",
           "JAX_COORDINATOR_PORT": port}
    procs.append(subprocess.Popen([sys.executable, "-c", _JAX_SEES], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  outs = [p.communicate(timeout=180)[0] for p in procs]
  seen = [json.loads(re.search(r"^SEES (.*)$", out, re.M)[1]) for out in outs]
  assert seen == [["slurm", rank, 2, visible[rank]] for rank in range(2)], outs


def test_upstream_gpu_variables_are_read_or_named(job_env):
  job_env(JAX_COORDINATOR_IP="10.0.0.1", JAX_COORDINATOR_PORT="1234", NNODES="4", NODE_RANK="3")
  assert launch.discover() == launch.ProcessInfo("upstream-env", "10.0.0.1:1234", 4, 3, None)
  job_env(JAX_COORDINATOR_IP="10.0.0.1", NNODES="4")
  with pytest.raises(parallelism.LaunchError, match=r"^JAX_COORDINATOR_IP=10.0.0.1, NNODES=4 is set \(upstream MaxText's "
                     r"GPU launch variables\) but JAX_COORDINATOR_PORT, NODE_RANK is not"):
    launch.discover()


def test_first_host_of_a_slurm_nodelist_is_the_coordinator(job_env):
  for nodelist, first in [("n1", "n1"), ("gpu[7-9]", "gpu7"), ("x[01,05]", "x01"), ("a,b", "a")]:
    job_env(**_slurm(1, 1, SLURM_STEP_NODELIST=nodelist))
    assert launch.discover().coordinator_address == f"{first}:20042"


def _fake_slurm(tmp_path, job_name: str | None = None, srun_steps: int = 300, **env: str) -> tuple[dict[str, str], Path]:
  """srun/scancel/scontrol stand-ins on PATH that log their argv (srun runs srun_steps x 0.1 s, or until USR1)."""
  bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
  bin_dir.mkdir()
  (bin_dir / "srun").write_text(f"""#!/usr/bin/env bash
echo "srun $*" >> {log}
echo $$ > {tmp_path}/srun.pid
trap 'echo "srun got USR1" >> {log}; exit 0' USR1
for _ in $(seq {srun_steps}); do sleep 0.1; done
""")
  (bin_dir / "scancel").write_text(f"""#!/usr/bin/env bash
echo "scancel $*" >> {log}
kill -USR1 "$(cat {tmp_path}/srun.pid)"
""")
  (bin_dir / "scontrol").write_text(f'#!/usr/bin/env bash\necho "scontrol $*" >> {log}\n')
  for f in bin_dir.iterdir():
    f.chmod(0o755)
  image = tmp_path / "maxtext-moe.sqsh"
  image.write_text("")
  base = {k: v for k, v in os.environ.items() if not _JOB_VARS.match(k)}
  full = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(tmp_path),
          **({"SLURM_JOB_NAME": job_name} if job_name else {}), **env}
  return full, log


def _sbatch(env: dict[str, str], *args: str) -> subprocess.Popen:
  return subprocess.Popen(["bash", str(REPO / "scripts/slurm/train.sbatch"), "configs/deepseek3-tiny.yml", *args],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path, timeout=20.0):
  deadline = time.monotonic() + timeout
  while not path.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert path.exists(), f"{path} never appeared"


@pytest.mark.parametrize("job_name, env, run_name", [
    (None, {}, "slurm-77"),  # sbatch's default job name: the job id, kept across requeues
    ("maxtext-moe", {}, "slurm-77"),
    ("ds3-exp1", {}, "ds3-exp1"),  # sbatch -J ds3-exp1: resubmitting it resumes the run
    ("ds3-exp1", {"RUN_NAME": "mine"}, "mine"),
])
def test_sbatch_run_name_survives_requeue_and_resubmission(tmp_path, job_name, env, run_name):
  environ, log = _fake_slurm(tmp_path, job_name, srun_steps=0, **env)
  proc = _sbatch(environ, "steps=3")
  proc.communicate(timeout=30)
  assert proc.returncode == 0
  (srun,) = [line for line in log.read_text().splitlines() if line.startswith("srun ")]
  assert f"--container-image={tmp_path}/maxtext-moe.sqsh" in srun
  assert srun.endswith(f"python3 -m MaxText.train configs/deepseek3-tiny.yml steps=3 "
                       f"base_output_directory={tmp_path}/outputs run_name={run_name}"), srun


def test_sbatch_time_limit_signal_saves_then_requeues(tmp_path):
  """SLURM's USR1 (--signal=B:USR1@120) reaches every task, then the job is requeued."""
  script = (REPO / "scripts/slurm/train.sbatch").read_text()
  assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", script, re.M) and "#SBATCH --requeue" in script
  assert "XLA_FLAGS" not in script  # flags come from presets only
  environ, log = _fake_slurm(tmp_path)
  proc = _sbatch(environ)
  _wait_for(tmp_path / "srun.pid")
  proc.send_signal(signal.SIGUSR1)
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == 0, err
  assert log.read_text().splitlines()[1:] == ["scancel --signal=USR1 77", "srun got USR1", "scontrol requeue 77"]
  assert "requeueing job 77; it resumes run slurm-77" in out


def test_sbatch_runs_the_images_package_unless_a_checkout_is_mounted(tmp_path):
  """By default nothing of the host's shadows the image's installed package: only OUTPUT_DIR is mounted and the
  tasks start in the image's working directory (docker/Dockerfile's WORKDIR: configs, no source). REPO_MOUNT
  mounts a checkout and starts there, so its MaxText/ and patches/ are imported first."""
  workdir = re.findall(r"^WORKDIR (\S+)$", (REPO / "docker/Dockerfile").read_text(), re.M)[-1]
  environ, log = _fake_slurm(tmp_path, srun_steps=0)
  proc = _sbatch(environ)
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == 0, err
  (srun,) = [line for line in log.read_text().splitlines() if line.startswith("srun ")]
  assert f"--container-mounts={tmp_path}/outputs:{tmp_path}/outputs --container-workdir={workdir} " in srun, srun
  assert "code installed in the image" in out

  checkout = tmp_path / "checkout"
  for d in (checkout / "MaxText", tmp_path / "second", tmp_path / "third"):
    d.mkdir(parents=True)
  environ, log = _fake_slurm(tmp_path / "second", srun_steps=0, REPO_MOUNT=str(checkout))
  proc = _sbatch(environ)
  proc.communicate(timeout=30)
  assert proc.returncode == 0
  (srun,) = [line for line in log.read_text().splitlines() if line.startswith("srun ")]
  outputs = tmp_path / "second" / "outputs"
  assert (f"--container-mounts={checkout}:/workspace/maxtext-moe,{outputs}:{outputs} "
          "--container-workdir=/workspace/maxtext-moe ") in srun, srun

  environ, _ = _fake_slurm(tmp_path / "third", REPO_MOUNT=str(tmp_path / "outputs"))
  proc = _sbatch(environ)
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 2 and err.strip() == (f"train.sbatch: REPO_MOUNT={tmp_path}/outputs is not a maxtext-moe "
                                                  "checkout (no MaxText/ in it)")


def test_sbatch_without_an_image_says_how_to_make_one(tmp_path):
  environ, _ = _fake_slurm(tmp_path)
  (tmp_path / "maxtext-moe.sqsh").unlink()
  proc = _sbatch(environ)
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 2
  assert err.strip().endswith("or set CONTAINER_IMAGE=registry#image:tag") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("environ, message", [
    ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0", "JAX_LOCAL_DEVICE_IDS": "0-3"},
     "JAX_LOCAL_DEVICE_IDS='0-3' is not a comma-separated list"),
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_COORDINATOR_ADDRESS is not"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, "neither JAX_PROCESS_ID nor JOB_COMPLETION_INDEX"),
    ({"JAX_NUM_PROCESSES": "two", "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES='two'"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "2"}, "process id 2 is outside 0..1"),
])
def test_bad_launch_env_names_the_value(environ, message):
  with pytest.raises(parallelism.LaunchError, match=re.escape(message)):
    launch.discover(environ)


# --- topology checks --------------------------------------------------------


def test_mesh_product_must_match_the_device_count():
  with pytest.raises(parallelism.LaunchError, match=r"ICI \(per slice\) mesh ici_fsdp_parallelism=4 x ici_expert_parallelism=2 = 8 does not match 4 device"):
    parallelism.check_topology({"ici_fsdp_parallelism": 4, "ici_expert_parallelism": 2}, None, 4, 1)
  parallelism.check_topology({"ici_fsdp_parallelism": -1, "ici_expert_parallelism": 2, "num_experts": 8}, None, 4, 1)


def test_expert_parallelism_must_divide_num_experts():
  with pytest.raises(parallelism.LaunchError, match=r"expert parallelism 3 .* does not divide num_experts=8"):
    parallelism.check_topology({"ici_fsdp_parallelism": 1, "ici_expert_parallelism": 3, "num_experts": 8}, None, 3, 1)


def test_recipe_for_more_gpus_than_present():
  with pytest.raises(parallelism.LaunchError, match=r"recipe_num_gpus=128: this recipe is for 128 GPUs, 8 present"):
    parallelism.check_topology({}, 128, 8, 1)
  with pytest.raises(parallelism.LaunchError, match=r"dcn_fsdp_parallelism=16 needs more than the 1 slice present"):
    parallelism.check_topology({"dcn_fsdp_parallelism": 16, "ici_fsdp_parallelism": 1, "ici_expert_parallelism": 8}, None, 8, 1)


def test_dcn_axes_fill_the_slices():
  parallelism.check_topology({"dcn_fsdp_parallelism": 16, "ici_fsdp_parallelism": 1, "ici_expert_parallelism": 8,
                         "num_experts": 256}, 128, 128, 16)
  with pytest.raises(parallelism.LaunchError, match=r"DCN \(across 16 slices\) mesh dcn_fsdp_parallelism=8 = 8 does not match 16"):
    parallelism.check_topology({"dcn_fsdp_parallelism": 8, "dcn_data_parallelism": 1, "ici_fsdp_parallelism": 1,
                           "ici_expert_parallelism": 8}, None, 128, 16)
  # upstream's default dcn_data_parallelism=-1 takes up the rest: 8 x 2 = 16
  parallelism.check_topology({"dcn_fsdp_parallelism": 8, "ici_fsdp_parallelism": 1, "ici_expert_parallelism": 8}, None, 128, 16)


# --- the same checks from the command line, before any compile --------------


def test_cli_mesh_mismatch_fails_before_compile(tmp_path):
  result = run_rejected(tmp_path, "ici_fsdp_parallelism=2")
  assert result.returncode == 2
  assert "ici_fsdp_parallelism=2 = 2 does not match 1 device(s)" in result.stderr
  assert not result.run_dir.exists()


def test_cli_ep_not_dividing_experts_fails_before_compile(tmp_path):
  result = run_rejected(tmp_path, "ici_fsdp_parallelism=1", "ici_expert_parallelism=3",
                        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=3"})
  assert result.returncode == 2
  assert "expert parallelism 3 (ici_expert_parallelism x dcn_expert_parallelism) does not divide num_experts=8" in result.stderr
  assert not result.run_dir.exists()


def test_cli_recipe_for_more_gpus_than_present(tmp_path):
  result = run_rejected(tmp_path, "configs/recipes/deepseek3-671b-128xh100.yml")
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
  # verbose=true: upstream's INFO lines too, among them its mesh ("Num_devices: 2")
  cmd = ["bash", str(REPO / "scripts/launch_local.sh"), "-n", "2", "configs/deepseek3-tiny.yml", "steps=2",
         "enable_checkpointing=false", "xla_presets=[lhs,gpu_runtime]", f"base_output_directory={tmp_path}",
         "run_name=two", "verbose=true"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:]
  for rank in (0, 1):
    assert f"[p{rank}] [maxtext-moe] process {rank} of 2 (env)" in proc.stdout
  # Process 0 alone prints the progress lines and the closing summary (as torchtitan's LOG_RANK=0); each process
  # keeps its own summary file, and summary.json is process 0's.
  assert re.search(r"^\[p0\] \[progress\] step 2/2 ", proc.stdout, re.M)
  assert not re.search(r"^\[p1\] \[progress\]", proc.stdout, re.M)
  assert re.findall(r"^\[p(\d)\] \[maxtext-moe\] run summary: ", proc.stdout, re.M) == ["0"]
  assert re.findall(r"^\[p(\d)\] \[maxtext-moe\] compiled the train step in ", proc.stdout, re.M) == ["0"]
  run_files = tmp_path / "two" / "maxtext-moe"
  ranks = {rank: json.loads((run_files / f"summary.rank{rank}.json").read_text()) for rank in (0, 1)}
  assert ranks[0]["losses"] and ranks[0]["losses"] == ranks[1]["losses"], ranks
  assert ranks[1]["compile_s"] > 0  # every process compiled, and kept its time
  assert json.loads((tmp_path / "two" / "summary.json").read_text())["losses"] == ranks[0]["losses"]
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


@pytest.mark.slow
def test_two_processes_on_an_expert_parallel_mesh_resume_exactly(tmp_path):
  """A resume on an expert-parallel mesh, as far as CPUs allow: our block at EP=2 over two processes (each holds
  half the experts, so each checkpoint is written and read in two halves through orbax's multi-process path),
  stopped after step 2's checkpoint and resumed, gives an unbroken run's losses to the bit. The three runs share
  the session's compile cache (tests/conftest.py): the two resumed runs load the unbroken run's train step, which
  each process compiled cold before."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env.update({**JAX_CACHE_ENV, "MAXTEXT_MOE_PYTHON": sys.executable})
  # verbose=true: upstream's INFO lines too, among them the step each process restores
  common = ["configs/deepseek3-tiny.yml", "moe_block=ours", "ici_expert_parallelism=2", "checkpoint_period=2",
            "learning_rate_schedule_steps=4", f"base_output_directory={tmp_path}", "verbose=true",
            f"jax_cache_dir={_SHARED_JAX_CACHE[0]}"]

  def run(run_name: str, steps: int) -> tuple[dict[int, float], str]:
    cmd = ["bash", str(REPO / "scripts/launch_local.sh"), "-n", "2", *common, f"steps={steps}", f"run_name={run_name}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads((tmp_path / run_name / "summary.json").read_text())
    return {int(k): v for k, v in summary["losses"].items()}, proc.stdout

  unbroken, out = run("unbroken", 4)
  assert "[p0] [maxtext-moe] routed MoE layer -> our block (dispatch ring, gmm xla, EP 2)" in out
  first, _ = run("resumed", 2)
  second, out = run("resumed", 4)
  assert sorted(first) == [0, 1] and sorted(second) == [2, 3], (first, second)
  for rank in (0, 1):
    assert re.search(rf"^\[p{rank}\] .*restoring from this run's directory step 1", out, re.M), rank
  assert {**first, **second} == unbroken  # exact on CPU


def test_an_unreachable_coordinator_is_one_line_naming_its_address():
  """jax.distributed's own wait ends in a fatal check inside XLA that blames another task; ours names the address."""
  with socket.socket() as free:  # a port nothing listens on
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
  info = launch.ProcessInfo("explicit", f"127.0.0.1:{port}", 4, 3)
  started = time.monotonic()
  with pytest.raises(parallelism.LaunchError, match=rf"process 3 of 4 could not reach the coordinator at 127.0.0.1:{port} "
                                               r"in 1 s \(Connection refused\): is process 0 running"):
    launch.wait_for_coordinator(info.coordinator_address, 1, info, poll_s=0.2)
  assert time.monotonic() - started < 5


def test_a_listening_coordinator_is_reached():
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    launch.wait_for_coordinator(address, 5, launch.ProcessInfo("explicit", address, 2, 1))


def _mesh_of(monkeypatch, nodes: int, per_node: int, ici_shape: tuple[int, ...], dcn_shape: tuple[int, ...]):
  """A hybrid mesh as patches/cpu_slices.py lays it out, of stand-in devices (id, process_index: one per GPU);
  having no physical coordinates, each node's ICI mesh is a plain reshape of its devices."""
  import types as pytypes  # pylint: disable=import-outside-toplevel

  from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel

  from patches import cpu_slices  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(mesh_utils, "create_device_mesh", lambda shape, devs, **_: np.array(devs, object).reshape(shape))
  devices = [pytypes.SimpleNamespace(id=i, process_index=i) for i in range(nodes * per_node)]
  return cpu_slices.hybrid_device_mesh(ici_shape, dcn_shape, devices)


def test_each_node_of_the_mesh_must_be_one_hosts_devices(monkeypatch):
  """EP 16 = 2 nodes x 8 (dcn_expert 2, ici_expert 8, other axes 1): ranks 0-7 on host a, 8-15 on b is the layout
  the mesh assumes; a cyclic rank order (even ranks on a) puts each "node-local" EP group on both hosts."""
  mesh = _mesh_of(monkeypatch, 2, 8, (1, 8), (1, 2))
  groups = launch.node_groups(mesh, (1, 8))
  assert sorted(sorted(d.id for d in g) for g in groups.values()) == [list(range(8)), list(range(8, 16))]
  launch.check_nodes_on_hosts(mesh, (1, 8), {p: "a" if p < 8 else "b" for p in range(16)})
  with pytest.raises(parallelism.LaunchError, match=r"the mesh's node \(0, 0\) \(devices 0..7\) spans hosts a, b: "
                                               r"processes must be ranked node by node"):
    launch.check_nodes_on_hosts(mesh, (1, 8), {p: "ab"[p % 2] for p in range(16)})


@pytest.mark.slow
def test_a_sigterm_to_every_process_of_a_two_process_job_saves_once_and_exits_75(tmp_path):
  """As scancel does: SIGTERM to every process of the job, each trainer and the keeper in front of it
  (MaxText/run/keeper.py), which forwards it. Both processes stop at the same step, save it and exit 75."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env["MAXTEXT_MOE_PYTHON"] = sys.executable
  cmd = ["bash", str(REPO / "scripts/launch_local.sh"), "-n", "2", "configs/deepseek3-tiny.yml", "steps=200",
         "checkpoint_period=1000", f"base_output_directory={tmp_path}", "run_name=job"]
  run = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out = []
  for line in run.stdout:
    out.append(line)
    if re.match(r"^\[p0\] \[progress\] step 3/", line):
      mine = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_holds(int(p), str(tmp_path))]
      trainers = [p for p in mine if b"MaxText.train" in Path(f"/proc/{p}/cmdline").read_bytes()]
      assert len(trainers) == 4, trainers  # two keepers, two trainers
      for pid in trainers:
        os.kill(pid, signal.SIGTERM)
      break
  out += run.stdout.readlines()
  assert run.wait(timeout=600) == 75, "".join(out)[-3000:]
  text = "".join(out)
  assert "Traceback" not in text and "aborted" not in text, text[-3000:]
  saved = sorted(int(p.name) for p in (tmp_path / "job" / "checkpoints").iterdir() if p.name.isdigit())
  assert len(saved) == 2 and saved[0] == 0 and 3 <= saved[1] < 200, saved  # the first step's, and the stop's


def _cmdline_holds(pid: int, text: str) -> bool:
  try:
    return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
  except OSError:
    return False  # ended meanwhile
