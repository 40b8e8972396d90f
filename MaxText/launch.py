"""Process discovery and the device-count checks every launcher shares.

One code path for all launchers: `discover(environ)` turns the environment a
scheduler gives a process into (coordinator, num_processes, process_id),
`initialize` hands that to `jax.distributed.initialize`, and `check_topology`
refuses a mesh or recipe that does not fit the devices found, naming the
values, before anything is compiled.

  scripts/launch_local.sh   sets JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
  scripts/slurm/*.sbatch    srun: SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST
  scripts/k8s/*.yaml        indexed Job: JOB_COMPLETION_INDEX + JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES

Upstream's `maybe_initialize_jax_distributed_system` returns early when
jax.distributed is already initialized, so ours is the only initialization.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Mapping

from MaxText.config import ConfigError, RunConfig, upstream_configs_dir

DEFAULT_PORT = 12345  # coordinator port when the environment names none
Scheduler = Literal["single", "env", "slurm", "k8s"]


class LaunchError(ConfigError):
  """A launch environment or topology that cannot work; the message names the value."""


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  """Who this process is in the job.

  Attributes:
    scheduler: which environment it was read from ("single": no multi-process job).
    coordinator_address: host:port of process 0's coordination service.
    num_processes: processes in the job.
    process_id: this process's rank, 0..num_processes-1.
    local_device_ids: the accelerators this process drives (None: all it sees).
  """

  scheduler: Scheduler
  coordinator_address: str | None
  num_processes: int
  process_id: int
  local_device_ids: tuple[int, ...] | None = None

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1


def _int(environ: Mapping[str, str], name: str) -> int:
  try:
    return int(environ[name])
  except ValueError:
    raise LaunchError(f"{name}={environ[name]!r} is not an integer") from None


def first_host(nodelist: str) -> str:
  """First host of a SLURM nodelist: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
  match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
  if not match:
    raise LaunchError(f"cannot read SLURM nodelist {nodelist!r}")
  prefix, ranges = match.groups()
  return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _local_ids(environ: Mapping[str, str]) -> tuple[int, ...] | None:
  ids = environ.get("JAX_LOCAL_DEVICE_IDS", "").strip()
  return tuple(int(i) for i in ids.split(",")) if ids else None


def discover(environ: Mapping[str, str]) -> ProcessInfo:
  """The environment a launcher gave this process -> ProcessInfo."""
  port = environ.get("JAX_COORDINATOR_PORT", str(DEFAULT_PORT))
  if "JAX_NUM_PROCESSES" in environ:  # launch_local.sh, k8s manifest, or by hand
    if "JAX_COORDINATOR_ADDRESS" not in environ:
      raise LaunchError("JAX_NUM_PROCESSES is set but JAX_COORDINATOR_ADDRESS is not")
    rank_var = "JAX_PROCESS_ID" if "JAX_PROCESS_ID" in environ else "JOB_COMPLETION_INDEX"
    if rank_var not in environ:
      raise LaunchError("JAX_NUM_PROCESSES is set but neither JAX_PROCESS_ID nor JOB_COMPLETION_INDEX is")
    info = ProcessInfo(
        scheduler="k8s" if rank_var == "JOB_COMPLETION_INDEX" else "env",
        coordinator_address=environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=_int(environ, "JAX_NUM_PROCESSES"),
        process_id=_int(environ, rank_var),
        local_device_ids=_local_ids(environ),
    )
  elif "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
      raise LaunchError("SLURM_PROCID is set but SLURM_STEP_NODELIST/SLURM_JOB_NODELIST are not")
    local = environ.get("SLURM_LOCALID")
    gpus_per_task = environ.get("MAXTEXT_GPUS_PER_TASK")  # one process per node drives them all when unset
    ids = None
    if local is not None and gpus_per_task:
      n = int(gpus_per_task)
      ids = tuple(range(int(local) * n, (int(local) + 1) * n))
    info = ProcessInfo(
        scheduler="slurm",
        coordinator_address=f"{first_host(nodelist)}:{port}",
        num_processes=_int(environ, "SLURM_NTASKS"),
        process_id=_int(environ, "SLURM_PROCID"),
        local_device_ids=ids,
    )
  else:
    return ProcessInfo("single", None, 1, 0)
  if not 0 <= info.process_id < info.num_processes:
    raise LaunchError(f"process id {info.process_id} is outside 0..{info.num_processes - 1}")
  return info


def initialize(info: ProcessInfo, hardware: str) -> None:
  """jax.distributed for a multi-process job (no-op for a single process).

  On CPU, cross-process collectives go through gloo (jax's
  `jax_cpu_collectives_implementation`); without it a CPU job cannot all-reduce.
  """
  if not info.multi_process:
    return
  import jax  # pylint: disable=import-outside-toplevel

  if jax.distributed.is_initialized():
    return
  if hardware == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=info.coordinator_address,
      num_processes=info.num_processes,
      process_id=info.process_id,
      local_device_ids=list(info.local_device_ids) if info.local_device_ids is not None else None,
  )


# --- topology checks --------------------------------------------------------


@functools.cache
def _upstream_base() -> Mapping[str, Any]:
  """Upstream's base.yml (parsed once: the mesh defaults our checks fill in)."""
  import omegaconf  # pylint: disable=import-outside-toplevel

  base = omegaconf.OmegaConf.load(Path(upstream_configs_dir()) / "base.yml")
  return MappingProxyType(omegaconf.OmegaConf.to_container(base))


def mesh_axes(upstream: Mapping[str, Any], prefix: str) -> dict[str, int]:
  """`ici_`/`dcn_` parallelism keys (upstream base.yml defaults under the run's values)."""
  merged = {**_upstream_base(), **upstream}
  return {k: int(v) for k, v in merged.items() if k.startswith(prefix) and k.endswith("_parallelism")}


def _fill(axes: dict[str, int], target: int, what: str) -> dict[str, int]:
  """Upstream's rule: at most one -1, filled so that the product is `target`."""
  auto = [k for k, v in axes.items() if v == -1]
  fixed = math.prod(v for v in axes.values() if v != -1)
  shown = " x ".join(f"{k}={v}" for k, v in axes.items() if v not in (1,))
  if len(auto) > 1:
    raise LaunchError(f"{what}: only one axis may be -1, got {', '.join(auto)}")
  if (auto and target % fixed) or (not auto and fixed != target):
    raise LaunchError(f"{what} mesh {shown or 'all 1'} = {fixed} does not match {target} device(s)")
  return {k: (target // fixed if v == -1 else v) for k, v in axes.items()}


def check_topology(upstream: Mapping[str, Any], recipe_num_gpus: int | None, num_devices: int, num_slices: int) -> None:
  """Refuses, naming the values, a job the devices found cannot run.

  Args:
    upstream: the run's upstream keys (base.yml defaults fill the rest).
    recipe_num_gpus: the device count a recipe was written for (None: any).
    num_devices: jax.device_count() (all processes).
    num_slices: upstream's slice count (nodes on GPU; 1 on CPU).
  """
  if recipe_num_gpus is not None and recipe_num_gpus != num_devices:
    raise LaunchError(f"recipe_num_gpus={recipe_num_gpus}: this recipe is for {recipe_num_gpus} GPUs, {num_devices} present")
  if num_devices % num_slices:
    raise LaunchError(f"num_slices={num_slices} does not divide {num_devices} devices")
  ici = _fill(mesh_axes(upstream, "ici_"), num_devices // num_slices, "ICI (per slice)")
  dcn = mesh_axes(upstream, "dcn_")
  if num_slices > 1:
    dcn = _fill(dcn, num_slices, f"DCN (across {num_slices} slices)")
  else:
    wanted = {k: v for k, v in dcn.items() if v > 1}
    if wanted:
      raise LaunchError(f"{', '.join(f'{k}={v}' for k, v in wanted.items())} needs more than the 1 slice present")
    dcn = {k: 1 for k in dcn}
  experts = int(upstream.get("num_experts", 1))
  ep = ici["ici_expert_parallelism"] * dcn["dcn_expert_parallelism"]
  if experts > 1 and experts % ep:
    raise LaunchError(f"expert parallelism {ep} (ici_expert_parallelism x dcn_expert_parallelism) does not divide num_experts={experts}")


def num_slices_of(devices, upstream: Mapping[str, Any]) -> int:
  """Upstream's slice count: num_slices if set, 1 on CPU, else distinct device slice_index."""
  requested = int({**_upstream_base(), **upstream}.get("num_slices", -1))
  if requested != -1:
    return requested
  if upstream.get("hardware") == "cpu":
    return 1
  return len({getattr(d, "slice_index", 0) for d in devices})


def start(run: RunConfig, environ: Mapping[str, str] | None = None) -> ProcessInfo:
  """Discover this process, join the job, and check the devices fit the run."""
  info = discover(os.environ if environ is None else environ)
  initialize(info, str(run.upstream.get("hardware", "tpu")))
  import jax  # pylint: disable=import-outside-toplevel

  devices = jax.devices()
  check_topology(run.upstream, run.fork.recipe_num_gpus, len(devices), num_slices_of(devices, run.upstream))
  return info
