"""The mesh a config asks for, against the devices a job has: upstream's ici_/dcn_ axes with base.yml's
defaults, filled as upstream fills them, and refused in one line (LaunchError) where they cannot fit. Shared by
the launcher, the dry run and the planner."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from MaxText.config.keys import ConfigError, upstream_configs_dir


class LaunchError(ConfigError):
  """A launch environment or topology that cannot work; the message names the value."""



def check_hardware(upstream: Mapping[str, Any], explicit: frozenset[str]) -> None:
  """A config that never set `hardware` gets upstream's default, tpu: refuse it.

  Typically a model YAML run on its own (configs/models/ holds architecture only).
  """
  if "hardware" not in explicit and upstream.get("hardware", "tpu") == "tpu":
    raise LaunchError("hardware is not set, and upstream's default is tpu: add hardware=gpu (or cpu), or run a "
                      "config that sets it (a model YAML under configs/models/ holds architecture only; "
                      "configs/deepseek3-tiny.yml and configs/bench/ are run configs)")



@functools.cache
def upstream_base() -> Mapping[str, Any]:
  """Upstream's base.yml (parsed once: the mesh defaults our checks fill in)."""
  import omegaconf  # pylint: disable=import-outside-toplevel

  base = omegaconf.OmegaConf.load(Path(upstream_configs_dir()) / "base.yml")
  return MappingProxyType(omegaconf.OmegaConf.to_container(base))


def mesh_axes(upstream: Mapping[str, Any], prefix: str) -> dict[str, int]:
  """`ici_`/`dcn_` parallelism keys (upstream base.yml defaults under the run's values)."""
  merged = {**upstream_base(), **upstream}
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
  requested = int({**upstream_base(), **upstream}.get("num_slices", -1))
  if requested != -1:
    return requested
  if upstream.get("hardware") == "cpu":
    return 1
  return len({getattr(d, "slice_index", 0) for d in devices})


