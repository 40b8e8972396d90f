"""Named XLA flag / environment presets, validated against the installed jaxlib.

A run selects presets with `xla_presets: [lhs, multistream]` (YAML or CLI).
They are merged in order (a later preset overrides an earlier one), then the
user's own `XLA_FLAGS` and environment win over every preset; each override is
reported. Every flag name is checked against the flag names compiled into the
installed jaxlib (and its CUDA plugin) before anything initializes a backend.

A preset may also carry `upstream_keys`: upstream MaxText config defaults it
needs (host offload needs `remat_policy: custom`). They apply only where the
user did not set the key; a user's value wins and the conflict is reported.

XLA reads XLA_FLAGS and XLA_PYTHON_CLIENT_* once, when jax creates its first
backend, so `compose` must run before anything calls `jax.devices()`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import mmap
import re
import shlex
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from MaxText.config import ConfigError, RunConfig

# Flag names compiled into jax 0.11.2's CUDA 13 plugin (xla_cuda_plugin.so),
# used when the plugin is not installed (CPU machines, CI) and jaxlib is the
# same version. A list of names extracted from the binary, not code.
REFERENCE_GPU_FLAGS = Path(__file__).resolve().parent.parent / "data" / "xla_gpu_flags_jax-0.11.2_cuda13.txt"
REFERENCE_JAXLIB_VERSION = "0.11.2"
# Names as they appear in the binaries' string tables.
_FLAG_NAME = re.compile(rb"xla_[a-z0-9_]{3,}")


class PresetError(ConfigError):
  """An unknown preset or flag, or a preset that breaks a house rule."""


def _frozen(d: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
  return MappingProxyType(dict(d or {}))


@dataclasses.dataclass(frozen=True)
class Preset:
  """One named set.

  Attributes:
    name: what `xla_presets` lists.
    doc: one line: what it does and where it came from.
    flags: XLA flag name (no leading --) -> value, as XLA_FLAGS spells it.
    env: environment variables, read by XLA/PJRT/NCCL at backend start.
    upstream_keys: upstream MaxText config defaults this preset needs.
    includes: presets this one is made of, applied first.
  """

  name: str
  doc: str
  flags: Mapping[str, str] = dataclasses.field(default_factory=_frozen)
  env: Mapping[str, str] = dataclasses.field(default_factory=_frozen)
  upstream_keys: Mapping[str, Any] = dataclasses.field(default_factory=_frozen)
  includes: tuple[str, ...] = ()


def _preset(name, doc, flags=None, env=None, upstream_keys=None, includes=()) -> Preset:
  return Preset(name, doc, _frozen(flags), _frozen(env), _frozen(upstream_keys), tuple(includes))


_PRESET_LIST = (
    _preset(
        "lhs",
        "Latency-hiding scheduler: overlap async collectives with compute.",
        flags={
            "xla_gpu_enable_latency_hiding_scheduler": "true",
            # Collectives on a high-priority stream, so compute does not starve them.
            "xla_gpu_enable_highest_priority_async_stream": "true",
        },
    ),
    _preset(
        "pipelined_collectives",
        "FSDP: pipeline the scanned layers' all-gather/reduce-scatter/all-reduce across loop iterations.",
        flags={
            "xla_gpu_enable_pipelined_all_gather": "true",
            "xla_gpu_enable_pipelined_reduce_scatter": "true",
            "xla_gpu_enable_pipelined_all_reduce": "true",
            # Double-buffers the layer loop so the next layer's gather overlaps this one.
            "xla_gpu_enable_while_loop_double_buffering": "true",
        },
    ),
    _preset(
        "multistream",
        "Collectives on several streams, so independent ones (EP all-to-all, FSDP gathers) run concurrently.",
        flags={
            "xla_gpu_experimental_enable_collective_multi_streaming": "true",
            # How many collectives the scheduler may keep in flight at once
            # (XLA's default is 1: one collective at a time).
            "xla_gpu_experimental_parallel_collective_overlap_limit": "2",
            # The same limit for scale-up (NVLink, in-node) collectives.
            "xla_gpu_experimental_parallel_scale_up_collective_overlap_limit": "2",
        },
        includes=("lhs",),
    ),
    _preset(
        "pgle",
        "Profile-guided latency estimation: jax profiles the step's first runs, then recompiles it so that XLA's "
        "scheduler knows what each kernel and collective costs (a compile-only plan uses the planner's costs: "
        "MaxText/plan/pgle.py).",
        env={"JAX_ENABLE_PGLE": "true", "JAX_PGLE_PROFILING_RUNS": "3"},
    ),
    _preset(
        "command_buffers",
        "CUDA graphs for fusions and library calls (fewer launches on small MoE layers); collectives stay out.",
        flags={"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL"},
    ),
    _preset(
        "no_command_buffers",
        "No CUDA graphs: what upstream's GPU recipes use (a3/*/*.sh), easier to profile.",
        flags={"xla_gpu_enable_command_buffer": ""},
    ),
    _preset(
        "combine_thresholds",
        "Combine small collectives into large ones; thresholds of upstream's a3/llama_3.1_405b/128vm.sh.",
        flags={
            "xla_gpu_all_reduce_combine_threshold_bytes": "1073741824",
            "xla_gpu_all_gather_combine_threshold_bytes": "134217728",
            "xla_gpu_reduce_scatter_combine_threshold_bytes": "134217728",
            # Combining along one dim only keeps per-layer gathers separate, so they pipeline.
            "xla_gpu_enable_all_gather_combine_by_dim": "false",
            "xla_gpu_enable_reduce_scatter_combine_by_dim": "false",
        },
    ),
    _preset(
        "host_offload",
        "Offload the MoE up-projections' activations (moe_mlpwi_0/1) to pinned host memory instead of "
        "recomputing them; the rest of the layer is rematerialized (upstream remat_policy: custom).",
        flags={"xla_gpu_enable_host_memory_offloading": "true"},
        env={
            # Pinned host pool PJRT may use for offloaded buffers, GB per process
            # (PJRT's default is 64). The 671B recipes offload ~100 GB per GPU
            # at batch 6 (MaxText/plan/analytic_memory.py): ~800 GB of a 2 TB HGX node.
            "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "128",
        },
        upstream_keys={
            "remat_policy": "custom",
            "decoder_layer_input": "device",  # the remat checkpoints stay in HBM
            "moe_mlpwi_0": "offload",
            "moe_mlpwi_1": "offload",
        },
    ),
    _preset(
        "gpu_runtime",
        "Process environment for one GPU per process; NVLink multicast (NVLS) stays off.",
        env={
            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90",
            # One hardware queue: kernels launch in stream order, which the LHS schedule assumes.
            "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "NCCL_NVLS_ENABLE": "0",
        },
    ),
    _preset(
        "nvidia_maxtext_default",
        "JAX-Toolbox .github/container/test-maxtext.sh XLA_FLAGS and env, minus flags jax 0.11.2 no "
        "longer has (xla_gpu_simplify_all_fp_conversions, xla_gpu_enable_async_{all_gather,reduce_scatter,"
        "all_reduce} (async is the default), xla_gpu_enable_triton_softmax_fusion); xla_gpu_graph_level=0 "
        "is spelled xla_gpu_enable_command_buffer= now.",
        flags={
            "xla_gpu_enable_latency_hiding_scheduler": "true",
            "xla_gpu_enable_triton_gemm": "false",
            "xla_gpu_enable_highest_priority_async_stream": "true",
            "xla_gpu_all_reduce_combine_threshold_bytes": "51200",
            "xla_gpu_all_gather_combine_threshold_bytes": "8589934592",
            "xla_gpu_reduce_scatter_combine_threshold_bytes": "8589934592",
            "xla_gpu_enable_command_buffer": "",
            "xla_gpu_enable_pipelined_all_gather": "true",
            "xla_gpu_enable_pipelined_reduce_scatter": "true",
            "xla_gpu_enable_pipelined_all_reduce": "true",
            "xla_gpu_enable_while_loop_double_buffering": "true",
            "xla_disable_hlo_passes": "rematerialization",
        },
        env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.65", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    ),
    _preset(
        "deepseek_v3_reference",
        "DeepSeek-V3 on H100/H200 (the flags of NVIDIA's MaxText recipe for it): LHS, pipelined "
        "FSDP collectives, multi-stream collectives, combine thresholds, no CUDA graphs, GPU runtime env. "
        "Add host_offload for its moe_mlpwi_0/1 offload.",
        includes=("gpu_runtime", "lhs", "pipelined_collectives", "multistream", "combine_thresholds",
                  "no_command_buffers"),
        flags={
            "xla_gpu_enable_triton_gemm": "false",  # cuBLAS GEMMs, as every NVIDIA MaxText recipe
            # XLA's memory-pressure rematerialization aborts the 671B recipes' compile
            # (hlo_rematerialization.cc:2181 "Have nothing to place this before!", 128 x H100 at batch 2 and
            # 128 x H200, 2026-12-01); the remat policy decides what is recomputed. NVIDIA's MaxText flags
            # (nvidia_maxtext_default) disable it too.
            "xla_disable_hlo_passes": "rematerialization",
        },
    ),
)
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _PRESET_LIST})


@dataclasses.dataclass(frozen=True)
class Composed:
  """What a list of presets plus the user's environment comes to.

  Attributes:
    presets: the presets applied, includes expanded, in order.
    xla_flags: the effective XLA flags (name -> value), user's included.
    env: environment variables to set (XLA_FLAGS included when non-empty).
    upstream_defaults: upstream keys to set (the user's own keys removed).
    overrides: one line per value something overrode (who won, who lost).
    flag_source: where the known flag names came from.
  """

  presets: tuple[str, ...]
  xla_flags: Mapping[str, str]
  env: Mapping[str, str]
  upstream_defaults: Mapping[str, Any]
  overrides: tuple[str, ...]
  flag_source: str


def _close(name: str, known) -> str:
  close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
  return f"; did you mean {', '.join(close)}?" if close else ""


def expand(names: list[str] | tuple[str, ...]) -> list[Preset]:
  """Preset names -> Presets with includes first, each once, in order."""
  out: list[Preset] = []
  for name in names:
    if name not in PRESETS:
      raise PresetError(f"unknown XLA preset '{name}'{_close(name, PRESETS)} (known: {', '.join(PRESETS)})")
    preset = PRESETS[name]
    for inner in expand(preset.includes):
      if inner not in out:
        out.append(inner)
    if preset not in out:
      out.append(preset)
  return out


def parse_xla_flags(text: str) -> dict[str, str]:
  """'--a=1 --b' -> {'a': '1', 'b': 'true'}; a later repeat wins, as in XLA."""
  flags: dict[str, str] = {}
  for token in shlex.split(text or ""):
    if not token.startswith("--"):
      raise PresetError(f"XLA_FLAGS entry '{token}' does not start with --")
    name, sep, value = token[2:].partition("=")
    flags[name] = value if sep else "true"
  return flags


def format_xla_flags(flags: Mapping[str, str]) -> str:
  return " ".join(f"--{k}={v}" for k, v in flags.items())


def _plugin_libraries() -> list[Path]:
  """The installed CUDA PJRT plugin's shared objects (empty on CPU-only installs)."""
  libs: list[Path] = []
  for module in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    try:
      spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
      spec = None
    if spec and spec.submodule_search_locations:
      for location in spec.submodule_search_locations:
        libs += sorted(Path(location).glob("*.so"))
  return libs


def _names_in(path: Path) -> set[str]:
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
    return {m.decode() for m in _FLAG_NAME.findall(data)}


@functools.cache
def known_flags() -> tuple[frozenset[str], str]:
  """Flag names the installed jaxlib (and CUDA plugin) know, and where they came from.

  XLA registers its flags by name, so the names sit in the binaries' string
  tables; a superset (a few non-flag identifiers) is harmless for refusing
  typos. Without the CUDA plugin, the GPU names come from the reference list
  when jaxlib is the version it was taken from; otherwise only jaxlib's own.
  """
  import jaxlib  # pylint: disable=import-outside-toplevel

  root = Path(jaxlib.__file__).resolve().parent
  libs = sorted(root.glob("*.so")) + _plugin_libraries()
  names: set[str] = set()
  for lib in libs:
    names |= _names_in(lib)
  sources = [f"jaxlib {jaxlib.__version__} ({len(libs)} shared objects)"]
  if not _plugin_libraries():
    if jaxlib.__version__ == REFERENCE_JAXLIB_VERSION:
      if not REFERENCE_GPU_FLAGS.is_file():
        raise PresetError(f"GPU flag reference list missing: {REFERENCE_GPU_FLAGS}")
      names |= set(REFERENCE_GPU_FLAGS.read_text().split())
      sources.append(f"no CUDA plugin: GPU names from {REFERENCE_GPU_FLAGS.name}")
    else:
      sources.append("no CUDA plugin and no reference list for this jaxlib: jaxlib's own names only")
  return frozenset(names), "; ".join(sources)


def check_flag_names(flags: Mapping[str, str], origin: str, known: frozenset[str]) -> None:
  for name in flags:
    if name not in known:
      raise PresetError(f"unknown XLA flag '--{name}' ({origin}){_close(name, known)}")


def check_house_rules(preset: Preset) -> None:
  """NVLink multicast (NVLS) is never turned on by a preset (KINDS.md: it hangs our machines)."""
  if preset.env.get("NCCL_NVLS_ENABLE", "0") != "0":
    raise PresetError(f"preset '{preset.name}' sets NCCL_NVLS_ENABLE={preset.env['NCCL_NVLS_ENABLE']}; NVLS stays off")


def compose(names, environ: Mapping[str, str], user_keys: Mapping[str, Any]) -> Composed:
  """Presets + the user's XLA_FLAGS/env/config -> the effective flags, env and upstream defaults.

  Args:
    names: preset names, in order.
    environ: the process environment as the user launched it.
    user_keys: upstream keys the user set explicitly (name -> value).
  """
  presets = expand(list(names))
  known, source = known_flags()
  user_flags = parse_xla_flags(environ.get("XLA_FLAGS", ""))
  check_flag_names(user_flags, "your XLA_FLAGS", known)
  flags: dict[str, str] = {}
  env: dict[str, str] = {}
  upstream: dict[str, Any] = {}
  owner: dict[str, str] = {}
  overrides: list[str] = []

  def put(table: dict, key: str, value: Any, who: str, label: str) -> None:
    if key in table and table[key] != value:
      overrides.append(f"{label} {key}: preset '{who}' sets {value!r} over preset '{owner[label, key]}' ({table[key]!r})")
    table[key] = value
    owner[label, key] = who

  for preset in presets:
    check_house_rules(preset)
    check_flag_names(preset.flags, f"preset '{preset.name}'", known)
    for k, v in preset.flags.items():
      put(flags, k, v, preset.name, "XLA flag")
    for k, v in preset.env.items():
      put(env, k, v, preset.name, "env")
    for k, v in preset.upstream_keys.items():
      put(upstream, k, v, preset.name, "config key")

  for k, v in user_flags.items():
    if k in flags and flags[k] != v:
      overrides.append(f"XLA flag {k}: your XLA_FLAGS value {v!r} wins over preset '{owner['XLA flag', k]}' ({flags[k]!r})")
    flags[k] = v
  for k in list(env):
    if k in environ and environ[k] != env[k]:
      overrides.append(f"env {k}: your value {environ[k]!r} wins over preset '{owner['env', k]}' ({env[k]!r})")
      del env[k]
  for k in list(upstream):
    if k in user_keys:
      if user_keys[k] != upstream[k]:
        overrides.append(f"config key {k}: your value {user_keys[k]!r} wins over preset '{owner['config key', k]}' ({upstream[k]!r})")
      del upstream[k]
  if flags:
    env["XLA_FLAGS"] = format_xla_flags(flags)
  return Composed(
      presets=tuple(p.name for p in presets),
      xla_flags=_frozen(flags),
      env=_frozen(env),
      upstream_defaults=_frozen(upstream),
      overrides=tuple(overrides),
      flag_source=source,
  )


def describe() -> str:
  """One block per preset: name, doc, flags, env, upstream keys (for --help and the README)."""
  lines = []
  for p in PRESETS.values():
    lines.append(f"{p.name}: {p.doc}")
    if p.includes:
      lines.append(f"    includes: {', '.join(p.includes)}")
    lines += [f"    --{k}={v}" for k, v in p.flags.items()]
    lines += [f"    {k}={v}" for k, v in p.env.items()]
    lines += [f"    config {k}: {v}" for k, v in p.upstream_keys.items()]
  return "\n".join(lines)


# The live MoE time split (moe_profile_every_n_steps) attributes device time per HLO op, but a CUDA
# graph is one trace event: on the H200 proxy with XLA's default command buffers, xprof's op statistics
# held 85 ops and 83 of the step's ~770 ms, the grouped GEMM 0.08 ms (2026-12-01). So a run that
# profiles runs without them, as every recipe (deepseek_v3_reference) already does.
PROFILE_PRESET = "no_command_buffers"


def presets_for(run: RunConfig) -> list[str]:
  """The run's presets: its xla_presets, plus PROFILE_PRESET when it takes the live MoE time split."""
  names = list(run.fork.xla_presets)
  if run.fork.moe_profile_every_n_steps > 0 and PROFILE_PRESET not in [p.name for p in expand(names)]:
    names.append(PROFILE_PRESET)
  return names


def compose_for(run: RunConfig, environ: Mapping[str, str]) -> Composed:
  """`compose` for a run: its presets (presets_for), the user's env, the upstream keys the user set."""
  user_keys = {k: v for k, v in run.upstream.items() if k in run.explicit}
  return compose(presets_for(run), environ, user_keys)


def with_upstream_defaults(run: RunConfig, composed: Composed) -> RunConfig:
  """The run with the presets' upstream keys added (the user's own already removed).

  PresetError if host_offload can offload nothing in this run (see _check_offload_acts)."""
  if composed.upstream_defaults:
    run = dataclasses.replace(run, upstream={**run.upstream, **composed.upstream_defaults})
  if "host_offload" in composed.presets:
    _check_offload_acts(run)
  return run


def _check_offload_acts(run: RunConfig) -> None:
  """host_offload acts only through upstream's remat_policy=custom, on the tensors whose remat location is
  'offload': by default moe_mlpwi_0/1, which upstream's block and ours (MaxText/moe/block.py) tag and TE's does
  not, or a run's own (decoder_layer_input, ...); a user key that wins over the preset's can leave it nothing to do."""
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  up = run.upstream
  if up.get("remat_policy") != "custom":
    raise PresetError(f"xla preset host_offload has no effect with remat_policy={up.get('remat_policy')!r}: it "
                      "offloads through remat_policy=custom (drop your remat_policy or set it to custom)")
  offloaded = [k for k in types.RematAndOffload.model_fields if up.get(k) == "offload"]
  if not offloaded:
    raise PresetError("xla preset host_offload has no effect: no remat location (moe_mlpwi_0, moe_mlpwi_1, "
                      "decoder_layer_input, ...) is 'offload' (your values win over the preset's)")
  if run.fork.moe_block == "te" and all(k.startswith("moe_") for k in offloaded):
    raise PresetError(f"xla preset host_offload has no effect with moe_block=te: TE's MoE block does not tag "
                      f"{', '.join(offloaded)} (use moe_block=ours or upstream)")


def report(composed: Composed) -> dict[str, Any]:
  """What effective_config.json records under "xla_presets"."""
  return {
      "presets": list(composed.presets),
      "xla_flags": dict(composed.xla_flags),
      "env": dict(composed.env),
      "upstream_defaults": dict(composed.upstream_defaults),
      "overrides": list(composed.overrides),
      "flag_names_from": composed.flag_source,
  }


def summary_lines(composed: Composed, env: Mapping[str, str]) -> list[str]:
  """Lines printed at start: presets, every override, and each variable the run sets."""
  lines = [f"xla presets: {', '.join(composed.presets) or 'none'}"]
  lines += [f"config from presets: {k}={v}" for k, v in composed.upstream_defaults.items()]
  lines += [f"override: {line}" for line in composed.overrides]
  lines += [f"env {k}={v}" for k, v in sorted(env.items()) if k != "XLA_FLAGS"]
  return lines


if __name__ == "__main__":  # python -m MaxText.config.xla_presets: list the presets
  print(describe())
