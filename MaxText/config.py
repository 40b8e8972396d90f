"""Our config: load a YAML chain plus `key=value` overrides, split our keys from
upstream MaxText's, and validate both before anything is compiled or written.

A config file may name `base_config:` (one path or a list, merged in order).
Paths resolve relative to the file, then to our `configs/`, then to upstream's
`maxtext/configs/`. Upstream's `base.yml` is always the implicit root, so our
files hold only what differs from it.

Errors are `ConfigError`s whose message is one line naming the key or path.
"""

from __future__ import annotations

import datetime
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import omegaconf
import pydantic

# The shipped configs: MaxText/configs links to the repo's configs/ in a checkout
# and is a copy inside an installed wheel (pyproject package-data).
REPO_CONFIGS = Path(__file__).parent / "configs"
DEFAULT_CONFIG = REPO_CONFIGS / "deepseek3-tiny.yml"
BASE_CONFIG_KEY = "base_config"


class ConfigError(ValueError):
  """A config problem, described in one line that names the key or path."""


class ForkConfig(pydantic.BaseModel):
  """Keys that belong to maxtext-moe, not upstream. Upstream never sees them.

  Each subsystem owns a section; keep its keys together with a one-line why.
  """

  model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

  # --- run (MaxText/train.py) ---
  # Print our "[progress]" line every N train steps (0 turns it off).
  progress_every: int = pydantic.Field(default=1, ge=0)
  # Resume even when the learning-rate schedule differs from the checkpoint's (else refused; MaxText/lifecycle.py).
  allow_schedule_change: bool = False

  # --- MoE (MaxText/moe) ---
  # Grouped-GEMM backend (MaxText/moe/gmm) for upstream's sparse_matmul; "upstream" leaves
  # upstream's MoE path untouched. Others set megablox=true (see moe_gmm_upstream_keys).
  moe_gmm_backend: Literal["upstream", "auto", "xla", "tokamax", "mgpu", "te"] = "upstream"

  # --- MoE block (MaxText/moe/block.py, patches/routed_moe.py) ---
  # Routed-MoE block: upstream's, ours (route->dispatch->gmm->combine), or upstream's TE MoEBlock path.
  moe_block: Literal["upstream", "ours", "te"] = "upstream"
  # Our block's dispatch (MaxText/moe/dispatch); auto: local, or with EP ring (CPU) / a2a_padded (GPU).
  moe_dispatch_backend: Literal["auto", "local", "ring", "ragged_a2a", "a2a_padded", "te_ncclep"] = "auto"
  # a2a_padded: rows per peer buffer = factor x the balanced share (the EP size never overflows).
  moe_a2a_padded_capacity_factor: float = pydantic.Field(default=2.0, gt=0)
  # a2a_padded/ragged_a2a overflow: raise, or only flag moe_has_overflow (pair with moe_dropless_fallback=step).
  moe_a2a_padded_on_overflow: Literal["error", "flag"] = "error"
  # ragged_a2a: receive rows = factor x this shard's T*K (unset: the EP size, never overflows).
  moe_ragged_a2a_capacity_factor: float | None = pydantic.Field(default=None, gt=0)
  # te_ncclep: rows each rank receives (TE's recv_capacity_per_rank); unset: the dropless bound for the batch.
  moe_te_ncclep_recv_capacity_per_rank: int | None = pydantic.Field(default=None, ge=1)
  # te_ncclep: rows each local expert's zone is padded to, a power of two (TE's moe.py uses 128 for NCCL EP).
  moe_te_ncclep_alignment: int = pydantic.Field(default=128, ge=1)

  @pydantic.model_validator(mode="after")
  def _dispatch_needs_our_block(self):
    # Only our block dispatches: with any other block the key would be silently ignored.
    if self.moe_dispatch_backend != "auto" and self.moe_block != "ours":
      raise ValueError(f"config key 'moe_dispatch_backend' = {self.moe_dispatch_backend!r} is used only by moe_block=ours "
                       f"(moe_block is {self.moe_block}); set moe_block=ours, or drop moe_dispatch_backend")
    return self

  @pydantic.field_validator("moe_te_ncclep_alignment")
  @classmethod
  def _alignment_is_a_power_of_two(cls, value: int) -> int:
    if value & (value - 1):
      raise ValueError("must be a power of two (1, 2, 4, ..., 128)")
    return value

  # --- XLA / environment presets (MaxText/xla_presets.py) ---
  # Named flag/env presets, merged in order; the user's XLA_FLAGS win.
  xla_presets: list[str] = pydantic.Field(default_factory=list)
  # GPUs a recipe (configs/recipes/) is written for; the run refuses any other count.
  recipe_num_gpus: int | None = pydantic.Field(default=None, ge=1)


@dataclass(frozen=True)
class RunConfig:
  """A validated run: our keys, upstream's keys, and where outputs go.

  Attributes:
    config_path: the YAML the run was started from.
    fork: our keys.
    upstream: upstream keys that differ from upstream's base.yml (file chain
      merged with CLI overrides, plus our local-first defaults).
    explicit: keys the user set (in a file or on the command line).
  """

  config_path: Path
  fork: ForkConfig
  upstream: dict[str, Any]
  explicit: frozenset[str]

  @property
  def run_dir(self) -> Path:
    return Path(self.upstream["base_output_directory"]) / self.upstream["run_name"]

  def upstream_argv(self) -> list[str]:
    """argv for upstream's `train.main`: its base.yml, then every key as key=value.

    Keys go on the command line (not into a YAML) so that upstream treats them
    as overrides: its model config (`model_name`) must not override them back.
    JSON is valid YAML flow syntax, so values survive OmegaConf's CLI parser.
    """
    return ["maxtext-moe", str(upstream_configs_dir() / "base.yml")] + [
        f"{k}={json.dumps(v)}" for k, v in self.upstream.items()
    ]


def upstream_configs_dir() -> Path:
  import maxtext  # pylint: disable=import-outside-toplevel

  return Path(maxtext.__file__).resolve().parent / "configs"


def upstream_fields() -> dict[str, Any]:
  """Upstream's pydantic fields, including those of nested models."""
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  fields = dict(types.MaxTextConfig.model_fields)
  for info in list(fields.values()):
    nested = getattr(info.annotation, "model_fields", None)
    if nested:
      fields.update(nested)
  return fields


def _resolve_base(name: str, relative_to: Path) -> Path | None:
  """base_config lookup: next to the file, our configs/, upstream's configs/."""
  candidates = [Path(name)] if os.path.isabs(name) else [relative_to.parent / name, REPO_CONFIGS / name]
  if not os.path.isabs(name):
    candidates.append(upstream_configs_dir() / name)
  return next((c.resolve() for c in candidates if c.is_file()), None)


def load_yaml_chain(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
  """Loads `path` and its base_config chain, merged (later wins)."""
  path = path.resolve()
  if path in _seen:
    raise ConfigError(f"base_config cycle: {' -> '.join(str(p) for p in (*_seen, path))}")
  try:
    cfg = omegaconf.OmegaConf.load(path)
  except FileNotFoundError as e:
    raise ConfigError(f"config file not found: {path}") from e
  except Exception as e:  # yaml.YAMLError and friends: report the file and the parser's word
    raise ConfigError(f"cannot parse {path}: {str(e).splitlines()[0]}") from e
  if not isinstance(cfg, omegaconf.DictConfig):
    raise ConfigError(f"{path} must hold a mapping of key: value, not a {type(cfg).__name__}")
  merged = omegaconf.OmegaConf.create({})
  bases = cfg.pop(BASE_CONFIG_KEY, None)
  for base in [bases] if isinstance(bases, str) else list(bases or []):
    base_path = _resolve_base(str(base), path)
    if base_path is None:
      raise ConfigError(f"{path}: base_config '{base}' not found next to it, in {REPO_CONFIGS} or upstream's configs")
    if base_path == (upstream_configs_dir() / "base.yml").resolve():
      continue  # upstream's base.yml is always the root; upstream loads it itself
    merged = omegaconf.OmegaConf.merge(merged, load_yaml_chain(base_path, (*_seen, path)))
  return omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.merge(merged, cfg), resolve=True)


def parse_overrides(args: list[str]) -> dict[str, Any]:
  for arg in args:
    if "=" not in arg or arg.startswith("="):
      raise ConfigError(f"override '{arg}' is not of the form key=value")
  return omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.from_cli(list(args)), resolve=True)


def _unknown_key_error(key: str, origin: str, known: list[str]) -> ConfigError:
  close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
  hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
  return ConfigError(f"unknown config key '{key}' ({origin}){hint}")


def _check_upstream_type(key: str, value: Any, info: Any, origin: str) -> None:
  """Checks one upstream value against upstream's pydantic annotation."""
  if isinstance(value, str) and value.lower() == "none":
    return  # upstream maps "none" to None itself
  try:
    adapter = pydantic.TypeAdapter(info.annotation)
  except Exception:  # pylint: disable=broad-exception-caught
    return  # annotations pydantic cannot adapt standalone are left to upstream
  try:
    adapter.validate_python(value)
  except pydantic.ValidationError as e:
    reason = e.errors()[0]["msg"]
    raise ConfigError(f"config key '{key}' = {value!r} ({origin}): {reason}") from None


def _fork_error(e: pydantic.ValidationError, origins: dict[str, str]) -> ConfigError:
  err = e.errors()[0]
  if not err["loc"]:  # a model validator: its message names the keys
    return ConfigError(str(err["msg"]).removeprefix("Value error, "))
  key = str(err["loc"][0]) if err["loc"] else "?"
  return ConfigError(f"config key '{key}' = {err.get('input')!r} ({origins.get(key, 'default')}): {err['msg']}")


# Upstream keys under which upstream's sparse_matmul sends its grouped GEMMs to
# `maxtext.kernels.megablox.gmm`, the seam patches/megablox_gmm.py replaces
# (layers/moe.py ~2296-2319 in maxtext 0.2.5); upstream's defaults all qualify.
MOE_GMM_UPSTREAM_KEYS: dict[str, Any] = {
    "sparse_matmul": True,  # else the dense capacity path runs: no grouped GEMM
    "megablox": True,  # else jax.lax.ragged_dot is called directly, not the seam
    "use_tokamax_gmm": False,  # else tokamax.ragged_dot is called directly
    "te_moe_block": False,  # else TE's whole MoE block runs instead of sparse_matmul
    "quantization": "",  # our backends do not quantize
}


def moe_gmm_upstream_keys(fork: ForkConfig, upstream: dict[str, Any], origins: dict[str, str]) -> dict[str, Any]:
  """Upstream keys with what moe_gmm_backend needs; ConfigError on a conflict.

  megablox=false set in a config file (as the CPU configs do, to keep upstream's
  Pallas kernel out of interpret mode) becomes true: our patch replaces that
  call, so no Pallas kernel runs. Any conflicting value given on the command
  line, or any other conflicting key, is an error naming the key.
  """
  if fork.moe_gmm_backend == "upstream":
    return upstream
  out = dict(upstream)
  for key, need in MOE_GMM_UPSTREAM_KEYS.items():
    have = upstream.get(key, need)
    if have == need or (need == "" and not have):  # quantization: "" and None both mean off
      continue
    if key == "megablox" and origins.get(key) != "command line":
      out[key] = True
      continue
    raise ConfigError(
        f"config key '{key}' = {have!r} ({origins.get(key, 'default')}) conflicts with "
        f"moe_gmm_backend={fork.moe_gmm_backend}: it needs {key}={json.dumps(need)} "
        "(or moe_gmm_backend=upstream)"
    )
  return out


def local_first_defaults(upstream: dict[str, Any], config_path: Path) -> dict[str, Any]:
  """Fills output locations so that a run writes only under its run directory."""
  out = dict(upstream)
  out.setdefault("base_output_directory", str(Path.cwd() / "outputs"))
  out["base_output_directory"] = str(Path(os.path.expanduser(out["base_output_directory"])).absolute())
  if not out.get("run_name"):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out["run_name"] = f"{config_path.stem}-{stamp}"
  run_dir = Path(out["base_output_directory"]) / out["run_name"]
  # Upstream defaults: "~/jax_cache" (base.yml) and "/tmp/xla_dump/".
  out.setdefault("jax_cache_dir", str(run_dir / "jax_cache"))
  out.setdefault("dump_hlo_local_dir", str(run_dir / "xla_dump") + "/")
  return out


def load(args: list[str]) -> RunConfig:
  """`[config.yml] [key=value ...]` -> a validated RunConfig (nothing written)."""
  args = list(args)
  config_path = Path(args.pop(0)) if args and "=" not in args[0] else DEFAULT_CONFIG
  if not config_path.is_file():
    raise ConfigError(f"config file not found: {config_path}")
  from_file = load_yaml_chain(config_path)
  from_cli = parse_overrides(args)
  if BASE_CONFIG_KEY in from_cli:  # only files chain; on the command line upstream would ignore it
    raise ConfigError(f"'{BASE_CONFIG_KEY}={from_cli[BASE_CONFIG_KEY]}' on the command line is ignored by upstream: "
                      "pass the config file as the first argument, or put base_config: in a file")
  merged = {**from_file, **from_cli}
  origins = {k: "command line" if k in from_cli else str(config_path) for k in merged}

  fork_keys = set(ForkConfig.model_fields)
  up_fields = upstream_fields()
  ours, theirs = {}, {}
  for key, value in merged.items():
    if key in fork_keys:
      ours[key] = value
    elif key in up_fields:
      _check_upstream_type(key, value, up_fields[key], origins[key])
      theirs[key] = value
    else:
      raise _unknown_key_error(key, origins[key], sorted(fork_keys | set(up_fields)))
  try:
    fork = ForkConfig(**ours)
  except pydantic.ValidationError as e:
    raise _fork_error(e, origins) from None
  return RunConfig(
      config_path=config_path.resolve(),
      fork=fork,
      upstream=local_first_defaults(moe_gmm_upstream_keys(fork, theirs, origins), config_path),
      explicit=frozenset(merged),
  )
