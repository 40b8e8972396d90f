"""Ahead-of-time compile of the train step `python -m MaxText.train` would run, for
a device count this machine does not have.

  topology = aot.choose_topology(num_devices=128, gpus_per_node=8, local_gpus=aot.local_gpu_count())
  aot.configure_backend(topology)        # the FIRST jax call of the process
  result = aot.compile_train_step(run)   # run: a RunConfig after environment.prepare_environment

For a target GPU with a shipped XLA target config (h100, h200), the step is
compiled for compile-only devices of that GPU (MaxText/plan/gpu_target.py), on any
machine, with or without a GPU: XLA's GPU compiler with the target's memory limit.

Otherwise, on a GPU machine, the GPU client is mocked to the target topology
(`jax_mock_gpu_topology` = "nodes x hosts per node x local GPUs"): jax then
compiles the many-process program on the local GPU(s), against the local GPU's
memory. This only works when it is set before anything starts a jax backend
(upstream 0.2.5's train_compile.py sets it later and fails), and it needs
`--xla_gpu_shard_autotuning=false` (without it the compile hung on one H200).
The mocked program cannot run.

Without a GPU, `jax_num_cpu_devices` simulated CPU devices stand in: the same
partitioning and collectives, but CPU buffers (no GPU memory figure) and CPU
kernels.

What differs from the trainer's compile, none of it in the program: the
planner's child adds skip_jax_distributed_system=true, a temporary output
directory, num_slices (a multi-node mock) and the autotuning flag above. Only
the main train step is compiled: with moe_dropless_fallback=step the trainer
also compiles its dropless retry program, and it compiles the eval step when
it evaluates.

`python -m MaxText.plan.aot REQUEST.json RESULT.json` is the planner's child process:
one compile per process (a fresh backend, patches applied once), so that the
parent can report a host out-of-memory kill or a timeout and name the knob.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Literal

from MaxText import config as fork_config

# The GPU mock hangs in sharded autotuning (measured on one H200; upstream's
# train_compile.py sets the same flag).
GPU_AOT_XLA_FLAGS = "--xla_gpu_shard_autotuning=false"
# Simulated CPU devices past this many compile too slowly on a small host to be useful; past it a CPU
# plan only lowers (traces the step and checks every sharding, ~15 s for 1,024 devices of the 671B
# recipe on 2 cores): enough to catch a mesh the parameters cannot be split over.
MAX_CPU_DEVICES = 64


class PlanError(fork_config.ConfigError):
  """A plan that cannot be made; the message names the key or knob."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """The devices a plan compiles for.

  Attributes:
    platform: "gpu_target" (compile-only devices of target_gpu, MaxText/plan/gpu_target.py),
      "gpu" (mocked GPU client) or "cpu" (simulated CPU devices).
    num_devices: devices in the planned job.
    gpus_per_node: devices sharing one NVLink domain (a slice to jax).
    local_gpus: GPUs on this machine (0 on CPU).
    lower_only: trace and lower, do not compile (CPU, more than MAX_CPU_DEVICES).
    target_gpu: the GPU key compiled for (gpu_target only).
    compute_capability: what the compile-only devices report instead of the target's (gpu_target only; a
      stand-in for kernels that do not compile for the target here: gpu_target.KERNEL_STAND_INS).
  """

  platform: Literal["gpu_target", "gpu", "cpu"]
  num_devices: int
  gpus_per_node: int
  local_gpus: int
  lower_only: bool = False
  target_gpu: str | None = None
  compute_capability: str | None = None

  @property
  def compiles_for_gpu(self) -> bool:
    """The compile is XLA:GPU's, with GPU buffer sizes (a memory verdict can be given)."""
    return self.platform in ("gpu", "gpu_target")

  @property
  def nodes(self) -> int:
    return max(1, self.num_devices // self.gpus_per_node)

  @property
  def mock_spec(self) -> str | None:
    """jax_mock_gpu_topology: "slices x hosts per slice x devices per host" (None: no mock needed)."""
    if self.platform != "gpu" or self.num_devices == self.local_gpus:
      return None
    per_node = min(self.num_devices, self.gpus_per_node)
    return f"{self.nodes} x {per_node // self.local_gpus} x {self.local_gpus}"


def local_gpu_memory_bytes() -> int | None:
  """The smallest local GPU's total memory (nvidia-smi), without starting jax; None if unknown."""
  smi = shutil.which("nvidia-smi")
  if not smi:
    return None
  try:
    out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                         text=True, timeout=30, check=False).stdout
    return min(int(line) for line in out.split()) * 2**20
  except (OSError, subprocess.TimeoutExpired, ValueError):
    return None


# XLA:GPU's default: its scheduler keeps a step under 95% of the device's memory (debug_options_flags.cc).
XLA_DEFAULT_SLOP_FACTOR = 95


def memory_limit_flag(target_bytes: int, local_bytes: int | None) -> str:
  """A mocked compile schedules against the local GPU's memory; this flag makes XLA's memory limit the target's.

  Measured (1,024 x H100 recipe on an H200): 74.99 GiB/GPU with the H200's 140 GiB as the limit, where the
  compile-only H100 devices (limit 79 GiB) read 63.08: the scheduler spends what it is given.
  """
  if not local_bytes or target_bytes >= local_bytes:
    return ""
  return f"--xla_gpu_memory_limit_slop_factor={XLA_DEFAULT_SLOP_FACTOR * target_bytes // local_bytes}"


def local_gpu_count(environ: dict[str, str] | None = None) -> int:
  """NVIDIA GPUs this process may use, without starting jax (which would fix its backend)."""
  environ = dict(os.environ) if environ is None else environ
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None and visible.strip() in ("", "-1"):
    return 0
  smi = shutil.which("nvidia-smi")
  if not smi:
    return 0
  try:
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
  except (OSError, subprocess.TimeoutExpired):
    return 0
  found = sum(1 for line in out.splitlines() if line.startswith("GPU "))
  return min(found, len(visible.split(","))) if visible else found


def choose_topology(num_devices: int, gpus_per_node: int, local_gpus: int, target_gpu: str | None = None,
                    mode: Literal["auto", "mock", "cpu"] = "auto") -> Topology:
  """auto: compile-only devices of target_gpu where its compiler can run here, else the mocked GPU
  topology, else simulated CPU devices; mock/cpu force one of the last two. PlanError if it cannot be built."""
  from MaxText.plan import gpu_target  # pylint: disable=import-outside-toplevel

  if mode == "auto" and gpu_target.unavailable_reason(target_gpu) is None:
    return Topology("gpu_target", num_devices, gpus_per_node, local_gpus, target_gpu=target_gpu)
  if mode == "mock" and local_gpus == 0:
    raise PlanError("--mock compiles on this machine's GPU, and it has none (CUDA_VISIBLE_DEVICES / nvidia-smi)")
  if local_gpus == 0 or mode == "cpu":
    return Topology("cpu", num_devices, gpus_per_node, 0, lower_only=num_devices > MAX_CPU_DEVICES)
  per_node = min(num_devices, gpus_per_node)
  if num_devices % per_node or per_node % local_gpus:
    raise PlanError(
        f"recipe_num_gpus={num_devices} with gpus_per_node={gpus_per_node} cannot be mocked with "
        f"{local_gpus} local GPU(s): set CUDA_VISIBLE_DEVICES to a count that divides {per_node}"
    )
  return Topology("gpu", num_devices, gpus_per_node, local_gpus)


def configure_backend(topology: Topology) -> None:
  """Points jax at the planned devices; must run before anything starts a jax backend."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

  if xla_bridge.backends_are_initialized():
    raise RuntimeError("configure_backend must be the first jax call: a backend is already up")
  if topology.platform == "gpu_target":
    from MaxText.plan import gpu_target  # pylint: disable=import-outside-toplevel

    gpu_target.enter(topology.target_gpu, topology.num_devices, topology.gpus_per_node, topology.compute_capability)
  elif topology.platform == "cpu":
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", topology.num_devices)
  elif topology.mock_spec:
    jax.config.update("jax_mock_gpu_topology", topology.mock_spec)


@dataclasses.dataclass
class Compiled:
  """One compiled train step.

  Attributes:
    compiled: jax's Compiled object (memory_analysis, cost_analysis, as_text).
    mesh: the device mesh it was compiled over.
    config: upstream's config object the step was built from.
    seconds: wall time of trace + lower + compile.
    layout: the parameters' groups and the keys the collectives' arithmetic reads (analytic_comms.layout_of).
  """

  compiled: Any
  mesh: Any
  config: Any
  seconds: float
  layout: dict | None = None  # MaxText/plan/analytic_comms.layout_of: what the layout's arithmetic reads


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """Upstream's train step for a mesh, ready for jax.jit: the function, its abstract
  arguments and jit's shardings (as upstream's train_compile.py builds them)."""

  func: Any
  args: tuple
  kwargs: dict
  in_shardings: Any
  out_shardings: Any
  static_argnums: Any
  donate_argnums: Any


def train_step(config: Any, mesh: Any) -> TrainStep:
  """Abstract state, shardings and the functional train step, from upstream's own functions."""
  from maxtext.trainers.pre_train import train as upstream_train  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train_compile  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, sharding  # pylint: disable=import-outside-toplevel

  shaped_args, shaped_kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
  in_state = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  func, in_shard, out_shard, static_argnums, donate_argnums = maxtext_utils.get_functional_train_with_signature(
      upstream_train.train_step, data_sharding, in_state, model, config, params_shardings
  )
  return TrainStep(func, shaped_args, shaped_kwargs, in_shard, out_shard, static_argnums, donate_argnums)


def start_upstream(run: fork_config.RunConfig) -> Any:
  """Our patches, upstream's validation, then upstream's own start of a run (its
  train.main calls `initialize`): the jax settings that shape the program (the PRNG
  implementation, hence the RNG keys' shape; shardy; size-one mesh axes). Returns
  upstream's config. tests/test_plan.py checks the result compiles to the trainer's HLO."""
  from maxtext.trainers.pre_train import train as upstream_train  # pylint: disable=import-outside-toplevel

  from MaxText.config import checks as config_checks  # pylint: disable=import-outside-toplevel
  from MaxText.config import environment  # pylint: disable=import-outside-toplevel

  config_checks.check_fork(run)  # as the trainer does, before the patches
  environment.apply_patches_and_validate(run)
  config, _ = upstream_train.initialize(run.upstream_argv())
  return config


def compile_train_step(run: fork_config.RunConfig, lower_only: bool = False,
                       on_phase: Callable[[str], None] = lambda phase: None,
                       pgle_with: tuple[Topology, Path] | None = None) -> Compiled:
  """Patches, upstream validation, and the AOT compile of upstream's train step.

  Call after environment.prepare_environment (the environment is the run's) and
  configure_backend; compiles over all the devices configure_backend set up.
  lower_only: stop after lowering (`compiled` is jax's Lowered): the shardings
  are checked against every array's shape, nothing is partitioned or compiled.
  on_phase(phase) as each phase starts: "starting upstream", "building the abstract
  state", then jax's "tracing", "lowering" and "compiling" (MaxText/console/progress.py's CompileWatch).
  pgle_with: (the compile-only GPU topology, a work folder): compile with the planner's costs as XLA's scheduling
  profile (MaxText/plan/pgle.py), as a run with the `pgle` preset schedules after its profiled steps.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from flax.core.spmd import logical_axis_rules as axis_rules  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train_compile  # pylint: disable=import-outside-toplevel
  from maxtext.utils import max_utils, maxtext_utils  # pylint: disable=import-outside-toplevel

  from MaxText.console import progress  # pylint: disable=import-outside-toplevel
  from MaxText.config import environment  # pylint: disable=import-outside-toplevel

  on_phase("starting upstream")
  config = start_upstream(run)
  start = time.perf_counter()
  mesh = maxtext_utils.get_mesh_from_config(config, jax.devices())
  watch = progress.CompileWatch(environment.TRAIN_STEP, on_phase).start()
  try:
    with max_utils.maybe_get_transformer_engine_context(config):  # as upstream's train.run
      on_phase("building the abstract state")
      step = train_step(config, mesh)
      layout = _layout(config, run, step, mesh)
      if pgle_with is not None:
        return _compile_with_profile(step, mesh, config, pgle_with, start, layout)
      if lower_only:
        with mesh, axis_rules(config.logical_axis_rules):
          lowered = jax.jit(step.func, in_shardings=step.in_shardings, out_shardings=step.out_shardings,
                            static_argnums=step.static_argnums, donate_argnums=step.donate_argnums,
                            ).lower(*step.args, **step.kwargs)
        return Compiled(lowered, mesh, config, time.perf_counter() - start, layout)
      compiled = train_compile.jit_and_compile(
          step.func, step.args, step.kwargs, mesh, step.in_shardings, step.out_shardings, step.static_argnums,
          step.donate_argnums, config, axis_rules(config.logical_axis_rules),
      )
  finally:
    watch.stop()
  return Compiled(compiled, mesh, config, time.perf_counter() - start, layout)


def _compile_with_profile(step: TrainStep, mesh: Any, config: Any, pgle_with: tuple[Topology, Path], start: float,
                          layout: dict[str, Any]) -> Compiled:
  """Upstream's jit and lower (train_compile.jit_and_compile's, which has no hook for compiler options), then the two
  compiles of MaxText/plan/pgle.py."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax.core.spmd import logical_axis_rules as axis_rules  # pylint: disable=import-outside-toplevel

  from MaxText import hardware  # pylint: disable=import-outside-toplevel
  from MaxText.plan import pgle  # pylint: disable=import-outside-toplevel

  topology, workdir = pgle_with
  with jax.set_mesh(mesh), axis_rules(config.logical_axis_rules):
    lowered = jax.jit(step.func, in_shardings=step.in_shardings, out_shardings=step.out_shardings,
                      static_argnums=step.static_argnums, donate_argnums=step.donate_argnums,
                      ).lower(*step.args, **step.kwargs)
  compiled, used = pgle.compile_with_profile(lowered, hardware.GPUS[topology.target_gpu], dict(mesh.shape),
                                             device_nodes(mesh, topology), workdir)
  return Compiled(compiled, mesh, config, time.perf_counter() - start, {**layout, "pgle_ops": used["instructions"]})


def _layout(config: Any, run: fork_config.RunConfig, step: TrainStep, mesh: Any) -> dict[str, Any]:
  """What the collectives' arithmetic reads (MaxText/plan/analytic_comms.py), or the error that stopped it: the
  plan goes on without the arithmetic."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.plan import analytic_comms  # pylint: disable=import-outside-toplevel

  try:
    return analytic_comms.layout_of(config, run.fork, step.args[0], {k: int(v) for k, v in mesh.shape.items()},
                                    "cpu" if jax.default_backend() == "cpu" else "gpu")
  except Exception as e:  # pylint: disable=broad-exception-caught  # a gap in the arithmetic, not in the plan
    return {"error": f"{type(e).__name__}: {e}"[:300]}


MEMORY_FIELDS = {
    "arguments": "argument_size_in_bytes",
    "outputs": "output_size_in_bytes",
    "temporaries": "temp_size_in_bytes",
    "aliases": "alias_size_in_bytes",
    "generated_code": "generated_code_size_in_bytes",
    "host_arguments": "host_argument_size_in_bytes",
    "host_outputs": "host_output_size_in_bytes",
    "host_temporaries": "host_temp_size_in_bytes",
    "host_aliases": "host_alias_size_in_bytes",
}


def memory_bytes(compiled: Any) -> dict[str, int]:
  """Per-device bytes from the compiler, plus `device_total` (what upstream's
  print_compiled_memory_stats adds up: arguments + outputs + temporaries - aliases,
  and the code) and `host_offloaded` (host temporaries + host arguments + outputs)."""
  stats = compiled.memory_analysis()
  out = {name: int(getattr(stats, attr, 0) or 0) for name, attr in MEMORY_FIELDS.items()}
  out["device_total"] = (
      out["arguments"] + out["outputs"] + out["temporaries"] - out["aliases"] + out["generated_code"]
  )
  out["host_offloaded"] = out["host_temporaries"] + out["host_arguments"] + out["host_outputs"] - out["host_aliases"]
  return out


def device_nodes(mesh: Any, topology: Topology) -> list[int]:
  """Node of each device, in the mesh's flat order (the partition ids collectives name)."""
  flat = list(mesh.devices.flat)
  if topology.platform == "gpu_target" or (topology.platform == "gpu" and topology.mock_spec):
    slices = [int(getattr(d, "slice_index", 0) or 0) for d in flat]
    if len(set(slices)) == topology.nodes:
      return slices
    # Processes fill a node in turn: compile-only devices (slice_index 0) are one GPU per process.
    gpus_per_process = topology.local_gpus if topology.platform == "gpu" else 1
    processes_per_node = max(1, min(topology.num_devices, topology.gpus_per_node) // gpus_per_process)
    return [d.process_index // processes_per_node for d in flat]
  # Simulated devices carry no node: consecutive device ids fill a node in turn (patches/cpu_slices.py lays a
  # multi-node mesh out so; without dcn_* axes the mesh is in id order).
  return [d.id // topology.gpus_per_node for d in flat]


_INDIVISIBLE = re.compile(r"key path (?P<path>.+?) was given the sharding .*?spec=(?P<spec>P\(.*?\)), memory_kind.*?"
                         r"array axis (?P<axis>\d+) is partitioned (?P<ways>\d+) times, but the dimension size is "
                         r"(?P<size>\d+) \(full shape: (?P<shape>\([^)]*\))", re.S)


def indivisible_message(error: str) -> str | None:
  """jax's IndivisibleError in one line naming the array, its dimension and the split (None: another error)."""
  m = _INDIVISIBLE.search(error)
  if not m:
    return None
  path = m["path"].replace("\\'", "'")
  return (f"{path} {m['shape']}: dimension {m['axis']} ({m['size']}) cannot be split {m['ways']} ways ({m['spec']}); "
          "use a mesh whose FSDP x EP product divides it, e.g. data parallelism across nodes (dcn_data_parallelism)")


# --- the child process -------------------------------------------------------------


def child_main(request_path: str, result_path: str) -> int:
  """Compiles one request (written by MaxText/plan/planner.py) and writes its result JSON."""
  from MaxText.console import progress  # pylint: disable=import-outside-toplevel
  from MaxText.config import environment  # pylint: disable=import-outside-toplevel

  request = json.loads(Path(request_path).read_text())
  topology = Topology(**request["topology"])

  def on_phase(phase: str) -> None:  # read by the parent's heartbeat (MaxText/plan/planner.py)
    progress.write_phase(request.get("phase_path"), phase)

  os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
  result: dict[str, Any] = {}
  try:
    on_phase("loading the config")
    run = fork_config.load(request["args"])
    extra = " ".join(filter(None, [GPU_AOT_XLA_FLAGS if topology.compiles_for_gpu else "", request.get("xla_flags", "")]))
    prepared = environment.prepare_environment(run, extra_xla_flags=extra)
    configure_backend(topology)
    result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    # The `pgle` preset's run profiles its first steps and recompiles; a compile-only plan uses the planner's costs.
    use_pgle = topology.platform == "gpu_target" and os.environ.get("JAX_ENABLE_PGLE", "").lower() in ("1", "true")
    with tempfile.TemporaryDirectory(prefix="maxtext-plan-pgle-") as workdir:
      step = compile_train_step(prepared.run, lower_only=topology.lower_only, on_phase=on_phase,
                                pgle_with=(topology, Path(workdir)) if use_pgle else None)
  except fork_config.ConfigError as e:
    result["config_error"] = str(e)
  except Exception as e:  # pylint: disable=broad-exception-caught  # the compiler's word, reported in one line
    traceback.print_exc()  # into the child's log, which a failed plan's message does not show
    result["compile_error"] = indivisible_message(str(e)) or f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
  else:
    if topology.lower_only:
      result.update(lowered_only=True, compile_seconds=step.seconds, layout=step.layout,
                    mesh={k: int(v) for k, v in step.mesh.shape.items()})
    else:
      on_phase("reading the HLO")
      result.update(_compiled_result(step, topology, request.get("hlo_path")))
  tmp = Path(result_path + ".tmp")
  tmp.write_text(json.dumps(result, indent=2))  # insertion order: the mesh axes in mesh order
  tmp.rename(result_path)
  return 0


def _compiled_result(step: Compiled, topology: Topology, hlo_path: str | None) -> dict[str, Any]:
  """Memory and FLOP counts of a compiled step, its HLO text kept at hlo_path (the parent reads the collectives and
  the estimate off it: MaxText/plan/planner.py)."""
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  from MaxText.plan import bubble, flops, memory_ops, memory_report  # pylint: disable=import-outside-toplevel

  hlo = step.compiled.as_text()
  if hlo_path:
    Path(hlo_path).write_text(hlo)
  dumps = re.findall(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))  # XLA takes the last one
  buffers = memory_report.largest_buffers(Path(dumps[-1]), n=8) if dumps else []
  model_tflops = maxtext_utils.calculate_tflops_training_per_device(step.config, log=False)[0]
  recompute, recompute_note = flops.recompute_flops(step.config)
  nodes = device_nodes(step.mesh, topology)
  return dict(
      compile_seconds=step.seconds,
      memory=memory_bytes(step.compiled),
      mesh={k: int(v) for k, v in step.mesh.shape.items()},
      model_tflops_per_device=float(model_tflops),
      recompute_flops=float(recompute), recompute_note=recompute_note,
      routed_expert_flops=float(flops.routed_expert_flops(step.config)),
      tokens_per_device=float(step.config.per_device_batch_size * step.config.max_target_length),
      largest_buffers=buffers, nodes=nodes, layout=step.layout,
      stack_frames=memory_ops.stack_frames(step.compiled),  # names the memory-bound ops' sources (schedule.parse)
      pipeline_schedule=bubble.schedule(step.config),
      pipelined_layers_share=float(step.config.pipeline_parallel_layers) / float(step.config.num_decoder_layers),
  )  # the collectives, read off the HLO by the parent beside the schedule's walk (MaxText/plan/planner.py)


if __name__ == "__main__":
  sys.exit(child_main(sys.argv[1], sys.argv[2]))
