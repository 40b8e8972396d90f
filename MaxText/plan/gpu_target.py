"""Compile for GPUs this machine does not have: XLA's GPU compiler, run without a GPU, for a named target.

jax's CUDA plugin can build compile-only GPU devices from an XLA `GpuTargetConfigProto`
(the text in MaxText/data/gpu_targets/<gpu>.txtpb) and a topology "slices x hosts per
slice x devices per host":

  topologies.get_topology_desc(platform="cuda", target_config=TEXT, topology="16x8x1")

A jit over a mesh of those devices lowers and compiles for CUDA with XLA's GPU
pipeline (the same passes and Mosaic GPU kernels as on the cluster), and the
compiler's memory limit is the target's `device_memory_size`: an H100 recipe is
scheduled against 80 GB, not against the planning machine's GPU. No GPU is touched
(jax's own backend stays on CPU), so it runs on a laptop, in CI, or beside a training
job. It cannot autotune (there is no device to time on), and its memory figure has
read up to 8.5% below the same tree compiled on an H200 (plan.COMPILE_ONLY_SHORTFALL).

The plugin (jax-cuda13-plugin/-pjrt, the same version as jax) lives outside the
environment's site-packages, in GPU_PLAN_SITE: installed there, every CPU-only jax
import would try to start CUDA and warn. A GPU image's jax[cuda13] already has it.

Everything here runs in the planner's child process (MaxText/plan/aot.py), never in a trainer.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

TARGETS_DIR = Path(__file__).resolve().parents[1] / "data" / "gpu_targets"
# Where scripts/bootstrap.sh --gpu-plan installs the plugin (requirements/gpu-plan.txt).
GPU_PLAN_SITE = Path(os.environ.get("MAXTEXT_MOE_GPU_PLAN_SITE", Path(sys.prefix) / "gpu-plan"))
INSTALL_HINT = "scripts/bootstrap.sh --gpu-plan (installs jax's CUDA compiler plugin, ~410 MB, no GPU needed)"


def config_path(gpu: str) -> Path | None:
  """The target config for a GPU key of MaxText/hardware.py (None: none shipped)."""
  path = TARGETS_DIR / f"{gpu}.txtpb"
  return path if path.is_file() else None


def device_memory_size(gpu: str) -> int | None:
  """The target config's device_memory_size (what XLA's memory limit is taken from), None without one."""
  path = config_path(gpu)
  return int(_field(path.read_text(), "device_memory_size")) if path else None


# Targets whose XLA programs compile here but whose MoE kernels do not: the compute capability the compile-only
# devices report instead, and why. The B200's: ptxas rejects our Mosaic GPU kernels' wgmma for sm_100a (they are
# Hopper's), tokamax 0.0.17's sm100 kernel has no dW form (a ragged contraction) and cannot take shard_map-varying
# operands (Pallas's mpmd_map), and Transformer Engine (Blackwell's grouped GEMM, moe_gmm_backend=te) is not
# installed for the compile. Compiled for sm_90a, the step is the same program with Hopper's kernels in place of
# TE's, scheduled against the B200's memory, SM count and clocks; the planner costs it at the B200's rates.
KERNEL_STAND_INS = {
    "b200": ("9.0", "our grouped GEMMs have no Blackwell kernel that compiles here (Mosaic GPU's wgmma is sm_90a; "
             "tokamax 0.0.17's sm100 kernel has no dW; Transformer Engine is not installed): compiled for sm_90a "
             "with the B200's memory, SMs and clocks, Hopper's kernels standing in for TE's grouped GEMM"),
}


def kernel_stand_in(gpu: str | None, grouped_gemms: bool) -> tuple[str, str] | None:
  """(compute capability to compile for, why) where a step with our grouped GEMMs needs a stand-in on `gpu`."""
  return KERNEL_STAND_INS.get(gpu or "") if grouped_gemms else None


def plugin_importable() -> bool:
  """jax's CUDA plugin can be imported here (from site-packages or GPU_PLAN_SITE)."""
  return any((Path(base) / "jax_plugins" / "xla_cuda13").is_dir() for base in (*sys.path, str(GPU_PLAN_SITE)) if base)


def unavailable_reason(gpu: str | None) -> str | None:
  """None when a compile for `gpu` can run here without one; else why not."""
  if gpu is None:
    return "no target_gpu: name one (target_gpu=h100|h200|b200) to compile for it without a GPU"
  if config_path(gpu) is None:
    shipped = ", ".join(sorted(p.stem for p in TARGETS_DIR.glob("*.txtpb")))
    return f"no XLA target config for target_gpu={gpu} (shipped: {shipped})"
  if not plugin_importable():
    return f"jax's CUDA plugin is not installed: {INSTALL_HINT}"
  return None


def topology_spec(num_devices: int, gpus_per_node: int) -> str:
  """"slices x hosts per slice x devices per host": one slice (NVLink domain) per node and one process per
  GPU, as launch.py starts a job and as the mocked topology compiles it. (Measured not to matter for
  memory: the 128 x H200 recipe needed 109.64 GiB compiled for "16x1x8" and for "16x8x1".)"""
  per_node = min(num_devices, gpus_per_node)
  return f"{max(1, num_devices // per_node)}x{per_node}x1"


def with_compute_capability(text: str, capability: str) -> str:
  """The target config `text` with its cuda_compute_capability replaced by `capability` ("9.0")."""
  major, _, minor = capability.partition(".")
  fields = f"major: {major}\n" + (f"    minor: {minor}\n" if minor and minor != "0" else "")
  return re.sub(r"(cuda_compute_capability \{\s*)major: \d+\n(\s*minor: \d+\n)?", rf"\g<1>{fields}", text, count=1)


def enter(gpu: str, num_devices: int, gpus_per_node: int, compute_capability: str | None = None) -> list:
  """Makes this process see `num_devices` compile-only `gpu` devices; returns them. compute_capability: what they
  report instead of the target's (KERNEL_STAND_INS).

  Must run before anything starts a jax backend. jax's own backend is CPU (nothing
  runs on a GPU), and the public device queries upstream and our code ask
  (jax.devices, device_count, default_backend, local_devices, process_count) answer
  as process 0 of the planned job would: its global devices, platform "gpu".
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  if str(GPU_PLAN_SITE) not in sys.path and GPU_PLAN_SITE.is_dir():
    sys.path.append(str(GPU_PLAN_SITE))  # after site-packages: an image's own plugin wins
  jax.config.update("jax_platforms", "cpu")
  text = config_path(gpu).read_text()  # type: ignore[union-attr]
  if compute_capability:
    text = with_compute_capability(text, compute_capability)
  devices = list(topologies.get_topology_desc(platform="cuda", target_config=text,
                                              topology=topology_spec(num_devices, gpus_per_node)).devices)
  local = [d for d in devices if d.process_index == 0]
  processes = len({d.process_index for d in devices})
  answers = {
      "devices": lambda backend=None: list(devices),
      "device_count": lambda backend=None: len(devices),
      "local_devices": lambda process_index=None, backend=None, host_id=None: list(local),
      "local_device_count": lambda backend=None: len(local),
      "process_count": lambda backend=None: processes,
      "default_backend": lambda: "gpu",
  }
  for name, answer in answers.items():
    setattr(jax, name, answer)
  # tokamax picks its kernel (Mosaic GPU's sm90 or sm100, else TPU's) by the backend's default device.
  from jax.extend import backend  # pylint: disable=import-outside-toplevel
  backend.get_default_device = lambda: devices[0]
  # Upstream's multi-node mesh groups devices into nodes by slice_index, which compile-only devices leave at 0
  # (jax 0.11.2): patches/cpu_slices.py groups them by id instead, one GPU per process, gpus_per_node a node.
  _answer_cudnn_checks(text)
  return devices


def _field(text: str, name: str) -> str:
  match = re.search(rf'^\s*{name}: "?([^"\n]*)"?$', text, re.M)
  if not match:
    raise ValueError(f"{name} missing from the target config")
  return match.group(1)


def _answer_cudnn_checks(text: str) -> None:
  """jax's cuDNN attention asks the attached GPU for its compute capability and the loaded cuDNN for
  its version while tracing (jax/_src/cudnn/fused_attention_stablehlo.py). Here there is neither, so
  the target config answers: its `dnn_version` (the image's cuDNN) and `cuda_compute_capability`."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=import-outside-toplevel

  major, minor, patch = (int(x) for x in _field(text, "dnn_version").split("."))
  cc = re.search(r"cuda_compute_capability \{([^}]*)\}", text)
  if not cc:
    raise ValueError("cuda_compute_capability missing from the target config")
  # An absent field is 0 in protobuf text (the H200's reads "major: 9" and no minor).
  current = tuple(int(m[1]) if (m := re.search(rf"{part}: (\d+)", cc[1])) else 0 for part in ("major", "minor"))
  as_tuple = lambda capability: tuple(int(x) for x in capability.split("."))  # noqa: E731
  fa.check_cudnn_version = lambda: major * 10000 + minor * 100 + patch
  fa.check_compute_capability = lambda capability: current >= as_tuple(capability)
  fa.is_cuda_compute_capability_equal = lambda capability: current == as_tuple(capability)
