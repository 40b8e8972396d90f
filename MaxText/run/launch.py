"""Process discovery and the device-count checks every launcher shares.

JAX finds most jobs itself (`jax._src.clusters`: SLURM, Open MPI, Kubernetes,
...); `discover` asks it, and adds only what it lacks:

  - explicit variables, which scripts/launch_local.sh and scripts/k8s/*.yaml set:
    JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID (or Kubernetes'
    JOB_COMPLETION_INDEX in an Indexed Job / JobSet pod);
  - upstream MaxText's GPU variables (JAX_COORDINATOR_IP + JAX_COORDINATOR_PORT +
    NNODES + NODE_RANK), read the same way so that they never reach upstream's
    own jax.distributed call after ours (a traceback);
  - which GPUs a process drives. JAX gives each process of a SLURM or Open MPI
    job the one GPU numbered by its local rank: right for one process per GPU,
    wrong for one process per node (it would drive GPU 0 of 8). `device_layout`
    gives a node's only process all its GPUs, and several processes an equal
    share each (JAX_LOCAL_DEVICE_IDS overrides).

`initialize` hands the result to `jax.distributed.initialize` with JAX's own
detection switched off (it would put local rank back), and `check_topology`
refuses a mesh or recipe that does not fit the devices found, naming the
values, before anything is compiled. Every problem is a one-line LaunchError.

Upstream's `maybe_initialize_jax_distributed_system` returns early when
jax.distributed is already initialized, so ours is the only initialization.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time
from typing import Any, Mapping

import numpy as np

from MaxText.config import RunConfig
from MaxText.config.parallelism import LaunchError, check_hardware, check_topology, num_slices_of
from MaxText.run import keeper

DEFAULT_PORT = 12345  # coordinator port when the environment names none
UPSTREAM_GPU_VARS = ("JAX_COORDINATOR_IP", "JAX_COORDINATOR_PORT", "NNODES", "NODE_RANK")
# What upstream's jax.distributed start reads on CPU (max_utils.initialize_jax_for_cpu): XPK's variables.
XPK_CPU_VARS = ("JOB_INDEX", "JOB_COMPLETION_INDEX", "PROCESSES_IN_JOB", "JAX_PROCESS_COUNT")
SKIP_DISTRIBUTED = "skip_jax_distributed_system"
# Processes on this node, per JAX cluster: Open MPI says it; SLURM says it per node.
_LOCAL_SIZE_VARS = {"ompi": ("OMPI_COMM_WORLD_LOCAL_SIZE",)}


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  """Who this process is in the job.

  Attributes:
    scheduler: where it was read from: "single" (no multi-process job), "env"
      (JAX_* variables), "k8s" (JOB_COMPLETION_INDEX), "upstream-env"
      (upstream's NNODES/NODE_RANK), or the JAX cluster's name ("slurm", "ompi", ...).
    coordinator_address: host:port of process 0's coordination service.
    num_processes: processes in the job.
    process_id: this process's rank, 0..num_processes-1.
    local_device_ids: the GPUs this process drives (None: all it sees).
  """

  scheduler: str
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


def _ids(name: str, value: str) -> tuple[int, ...]:
  try:
    return tuple(int(i) for i in value.split(","))
  except ValueError:
    raise LaunchError(f"{name}={value!r} is not a comma-separated list of GPU indices") from None


def tasks_on_node(spec: str, node_id: int) -> int:
  """SLURM's per-node task counts ('8(x2),4': 8, 8, 4) -> the count on node `node_id`."""
  counts: list[int] = []
  for part in spec.split(","):
    match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
    if not match:
      raise LaunchError(f"cannot read SLURM tasks per node {spec!r}")
    counts += [int(match[1])] * int(match[2] or 1)
  if not 0 <= node_id < len(counts):
    raise LaunchError(f"SLURM_NODEID={node_id} is outside the {len(counts)} node(s) of {spec!r}")
  return counts[node_id]


def _local_size(cluster: str, environ: Mapping[str, str]) -> int | None:
  """Processes of the job on this node (None: the environment does not say)."""
  if cluster == "slurm":
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    return tasks_on_node(spec, _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0) if spec else None
  for name in _LOCAL_SIZE_VARS.get(cluster, ()):
    if name in environ:
      return _int(environ, name)
  return None


def device_layout(local_rank: int | None, local_size: int | None, environ: Mapping[str, str]) -> tuple[int, ...] | None:
  """The GPUs one of `local_size` processes on a node drives; None: all it sees.

  One process on the node drives every GPU. Several split the node's GPUs
  (SLURM_GPUS_ON_NODE, else CUDA_VISIBLE_DEVICES) evenly by local rank, unless
  the scheduler already gave each only its share (CUDA_VISIBLE_DEVICES lists
  fewer than the node has). Unknown counts: JAX's convention, GPU `local_rank`.
  """
  if environ.get("JAX_LOCAL_DEVICE_IDS", "").strip():
    return _ids("JAX_LOCAL_DEVICE_IDS", environ["JAX_LOCAL_DEVICE_IDS"])
  if local_rank is None or local_size == 1:
    return None
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  n_visible = len([v for v in visible.split(",") if v.strip()]) if visible is not None else None
  on_node = _int(environ, "SLURM_GPUS_ON_NODE") if environ.get("SLURM_GPUS_ON_NODE") else n_visible
  if local_size is None or on_node is None:
    return (local_rank,)
  if n_visible is not None and n_visible < on_node:
    return None  # bound per task (--gpus-per-task, --gpu-bind): all it sees is its share
  if on_node % local_size:
    raise LaunchError(f"{on_node} GPUs on this node do not split evenly over its {local_size} processes")
  per = on_node // local_size
  return tuple(range(local_rank * per, (local_rank + 1) * per))


def _explicit(environ: Mapping[str, str]) -> ProcessInfo:
  """JAX_NUM_PROCESSES and friends (launch_local.sh, the Kubernetes manifests, by hand)."""
  if "JAX_COORDINATOR_ADDRESS" not in environ:
    raise LaunchError("JAX_NUM_PROCESSES is set but JAX_COORDINATOR_ADDRESS is not")
  rank_var = "JAX_PROCESS_ID" if "JAX_PROCESS_ID" in environ else "JOB_COMPLETION_INDEX"
  if rank_var not in environ:
    raise LaunchError("JAX_NUM_PROCESSES is set but neither JAX_PROCESS_ID nor JOB_COMPLETION_INDEX is")
  return ProcessInfo(
      scheduler="k8s" if rank_var == "JOB_COMPLETION_INDEX" else "env",
      coordinator_address=environ["JAX_COORDINATOR_ADDRESS"],
      num_processes=_int(environ, "JAX_NUM_PROCESSES"),
      process_id=_int(environ, rank_var),
      local_device_ids=device_layout(None, None, environ),
  )


def _upstream_env(environ: Mapping[str, str]) -> ProcessInfo:
  """Upstream MaxText's GPU variables: one process per node, every GPU it sees."""
  missing = [v for v in UPSTREAM_GPU_VARS if v not in environ]
  if missing:
    present = ", ".join(f"{v}={environ[v]}" for v in UPSTREAM_GPU_VARS if v in environ and v != "JAX_COORDINATOR_PORT")
    raise LaunchError(f"{present} is set (upstream MaxText's GPU launch variables) but {', '.join(missing)} "
                      "is not: set all four, or use JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID")
  return ProcessInfo(
      scheduler="upstream-env",
      coordinator_address=f"{environ['JAX_COORDINATOR_IP']}:{_int(environ, 'JAX_COORDINATOR_PORT')}",
      num_processes=_int(environ, "NNODES"),
      process_id=_int(environ, "NODE_RANK"),
      local_device_ids=device_layout(None, None, environ),
  )


def _jax_cluster() -> Any:
  """The first of JAX's cluster environments present (JAX's own order), or None."""
  from jax._src import clusters  # pylint: disable=import-outside-toplevel

  return next((c for c in clusters.ClusterEnv._cluster_types  # pylint: disable=protected-access
               if not c.opt_in_only_method and c.is_env_present()), None)


def _from_jax_cluster(cluster: Any, environ: Mapping[str, str]) -> ProcessInfo:
  name = cluster.name or cluster.__name__
  try:
    num_processes, process_id = cluster.get_process_count(), cluster.get_process_id()
    if num_processes <= 1:
      return ProcessInfo("single", None, 1, 0)
    address = cluster.get_coordinator_address(timeout_secs=None,
                                              override_coordinator_port=environ.get("JAX_COORDINATOR_PORT"))
    local_rank = cluster.get_local_process_id()
  except (KeyError, ValueError) as e:
    raise LaunchError(f"{name} job environment is incomplete or unreadable: {e!r}") from None
  return ProcessInfo(name, address, num_processes, process_id,
                     device_layout(local_rank, _local_size(name, environ), environ))


def discover(environ: Mapping[str, str] | None = None) -> ProcessInfo:
  """This process's place in the job, from its environment (os.environ by default).

  JAX's cluster classes read os.environ themselves: pass `environ` only where
  it is os.environ or no JAX cluster applies.
  """
  environ = os.environ if environ is None else environ
  if "JAX_NUM_PROCESSES" in environ:
    info = _explicit(environ)
  elif any(v in environ for v in ("JAX_COORDINATOR_IP", "NNODES", "NODE_RANK")):
    info = _upstream_env(environ)
  elif (cluster := _jax_cluster()) is not None:
    info = _from_jax_cluster(cluster, environ)
  else:
    return ProcessInfo("single", None, 1, 0)
  if not 0 <= info.process_id < info.num_processes:
    raise LaunchError(f"process id {info.process_id} is outside 0..{info.num_processes - 1}")
  return info


# The start's wait (keeper.coordinator_timeout_s: JAX's own default, 300 s). A process that cannot reach the
# coordinator in that time is killed by a fatal check inside XLA ("another task died; see the other task logs"),
# which Python cannot catch: wait_for_coordinator says it first. One whose peers never join ends the same way; the
# keeper's line then says so, naming the wait.

def wait_for_coordinator(address: str, timeout_s: float, info: ProcessInfo, poll_s: float = 1.0) -> None:
  """Returns once the coordinator's TCP port accepts a connection; else one LaunchError naming the address."""
  host, _, port = address.rpartition(":")
  deadline, said = time.monotonic() + timeout_s, "no answer"
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=min(poll_s * 5, timeout_s)):
        return
    except (OSError, ValueError) as e:
      said = e.strerror or str(e) if isinstance(e, OSError) else f"not a host:port ({e})"
    if time.monotonic() >= deadline:
      raise LaunchError(f"process {info.process_id} of {info.num_processes} could not reach the coordinator at "
                        f"{address} in {timeout_s:g} s ({said}): is process 0 running, and is that address reachable "
                        "from this node? (MAXTEXT_MOE_COORDINATOR_TIMEOUT_S sets the wait)")
    time.sleep(poll_s)


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
  timeout_s = keeper.coordinator_timeout_s()
  if info.process_id != 0:  # process 0 serves the coordinator; the others must reach it
    wait_for_coordinator(info.coordinator_address, timeout_s, info)
  jax.distributed.initialize(
      initialization_timeout=timeout_s,
      # A process that dies (killed, out of memory, its node lost) stops heartbeating: after this long the
      # coordination service declares it dead and every survivor ends, naming it, instead of waiting in a
      # collective or a barrier for good (jax's default is 100 s); MaxText/run/keeper.py turns XLA's fatal end
      # into one line of ours naming the lost process. docs/cluster.md "A dead process".
      heartbeat_timeout_seconds=keeper.heartbeat_timeout_s(),
      shutdown_timeout_seconds=keeper.heartbeat_timeout_s(),
      coordinator_address=info.coordinator_address,
      num_processes=info.num_processes,
      process_id=info.process_id,
      local_device_ids=list(info.local_device_ids) if info.local_device_ids is not None else None,
      cluster_detection_method="deactivate",  # discover() decided; JAX would reset local_device_ids
  )


def check_upstream_distributed(run: RunConfig, info: ProcessInfo) -> None:
  """A single CPU process whose config leaves upstream to start jax.distributed: refuse it, naming the key.

  Upstream's own start (max_utils.maybe_initialize_jax_distributed_system, while it validates) returns
  early when ours has run, that is in a multi-process job; in a single process with hardware=cpu it reads
  XPK's JOB_INDEX and friends and fails on the first one unset: "int() argument must be ... not 'NoneType'".
  """
  if info.multi_process or run.upstream.get("hardware") != "cpu" or run.upstream.get(SKIP_DISTRIBUTED, False):
    return
  where = run.origins.get(SKIP_DISTRIBUTED, "upstream default")
  raise LaunchError(f"config key '{SKIP_DISTRIBUTED}' = False ({where}) with hardware=cpu: upstream MaxText then "
                    f"starts jax.distributed from XPK's {', '.join(XPK_CPU_VARS)}, and this is one process; set "
                    f"{SKIP_DISTRIBUTED}=true (scripts/launch_local.sh -n N runs several processes)")


def start(run: RunConfig, environ: Mapping[str, str] | None = None, check_devices: bool = True) -> ProcessInfo:
  """Discover this process, join the job, and (unless told not to) check the devices fit the run."""
  check_hardware(run.upstream, run.explicit)
  info = discover(environ)
  check_upstream_distributed(run, info)
  initialize(info, str(run.upstream.get("hardware", "tpu")))
  if info.scheduler == "upstream-env":
    os.environ.pop("JAX_COORDINATOR_IP", None)  # read here; upstream would initialize again
  if check_devices:
    check_devices_fit(run)
  return info


def check_devices_fit(run: RunConfig) -> None:
  """The devices jax found against the run: the recipe's GPU count, the mesh, the slices."""
  import jax  # pylint: disable=import-outside-toplevel

  devices = jax.devices()
  check_topology(run.upstream, run.fork.recipe_num_gpus, len(devices), num_slices_of(devices, run.upstream))


def devices_elsewhere(run: RunConfig) -> str | None:
  """For a dry run: how the run's devices differ from this machine's, or None where they are these.

  A recipe for GPUs this machine lacks is then checked against its own GPU count instead (as
  MaxText/plan/planner.py checks it before compiling); LaunchError naming the values if it does not fit.
  """
  import jax  # pylint: disable=import-outside-toplevel

  hardware = str(run.upstream.get("hardware", "tpu"))
  backend, count, gpus = jax.default_backend(), jax.device_count(), run.fork.recipe_num_gpus
  here = f"this machine has {count} {backend.upper()} device{'s' if count > 1 else ''}"
  if gpus and (gpus != count or not hardware.startswith(backend)):
    nodes = max(1, gpus // run.fork.gpus_per_node)
    check_topology(run.upstream, gpus, gpus, nodes)
    per_node = min(gpus, run.fork.gpus_per_node)
    return f"the recipe is for {gpus} GPUs, {nodes} node{'s' if nodes > 1 else ''} of {per_node}; {here}"
  if not hardware.startswith(backend):
    return f"hardware={hardware}, {here}"
  return None


def node_groups(mesh_devices: np.ndarray, ici_shape: tuple[int, ...]) -> dict[tuple[int, ...], list]:
  """The devices of each node of a hybrid mesh: every axis is DCN x ICI, DCN-major (patches/cpu_slices.py), so a
  device at coordinates c sits on the node whose DCN coordinates are c // ici_shape, axis by axis."""
  groups: dict[tuple[int, ...], list] = {}
  for coords, device in np.ndenumerate(mesh_devices):
    groups.setdefault(tuple(c // n for c, n in zip(coords, ici_shape)), []).append(device)
  return groups


def check_nodes_on_hosts(mesh_devices: np.ndarray, ici_shape: tuple[int, ...], host_of: Mapping[int, str]) -> None:
  """Each node-local group of the mesh (what the layout puts inside one node: the EP group the two-level dispatch
  exchanges over NVLink, the FSDP shards gathered there) must be one host's devices. Processes ranked across nodes
  in another order than the mesh assumes (a cyclic SLURM distribution, say) would otherwise put "node-local"
  traffic on the network with nothing to say so. host_of: process index -> host name."""
  for dcn, devices in node_groups(mesh_devices, ici_shape).items():
    hosts = sorted({host_of[d.process_index] for d in devices})
    if len(hosts) > 1:
      ids = sorted(d.id for d in devices)
      raise LaunchError(f"the mesh's node {dcn} (devices {ids[0]}..{ids[-1]}) spans hosts {', '.join(hosts[:4])}: "
                        "processes must be ranked node by node (SLURM --distribution=block, one node's GPUs on "
                        "consecutive ranks) for the ici_* axes to stay inside a node")


def hosts_of_processes() -> dict[int, str]:
  """Every process's host name (one small all-gather of a hash; the names themselves stay local)."""
  import hashlib  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  digest = np.frombuffer(hashlib.sha256(socket.gethostname().encode()).digest()[:8], np.int64)
  gathered = np.asarray(multihost_utils.process_allgather(digest)).reshape(jax.process_count(), -1)[:, 0]
  return {p: f"host#{int(h) & 0xFFFF:04x}" if h != digest[0] else socket.gethostname() for p, h in enumerate(gathered)}


def check_mesh_on_hosts(config: Any) -> None:
  """check_nodes_on_hosts on the mesh upstream will build for this run (its own create_device_mesh, through
  patches/cpu_slices.py); only a multi-process job over several nodes can get it wrong."""
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext.utils import max_utils, maxtext_utils  # pylint: disable=import-outside-toplevel

  slices = int(config.num_slices)
  if jax.process_count() == 1 or slices <= 1:
    return
  ici = max_utils.fill_unspecified_mesh_axes(list(config.ici_parallelism), jax.device_count() // slices, "ICI")
  check_nodes_on_hosts(np.asarray(maxtext_utils.create_device_mesh(config)), tuple(ici), hosts_of_processes())
