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
import re
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import omegaconf
import pydantic

from MaxText.config.keys import ConfigError, ForkConfig, upstream_configs_dir, upstream_fields
from MaxText.config.moe_keys import check_moe_keys, moe_gmm_upstream_keys, node_limited_groups, router_checks
from MaxText.moe import overflow

# The shipped configs: MaxText/configs links to the repo's configs/ in a checkout
# and is a copy inside an installed wheel (pyproject package-data).
REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = REPO_CONFIGS / "deepseek3-tiny.yml"
BASE_CONFIG_KEY = "base_config"


@dataclass(frozen=True)
class RunConfig:
  """A validated run: our keys, upstream's keys, and where outputs go.

  Attributes:
    config_path: the YAML the run was started from.
    fork: our keys.
    upstream: upstream keys that differ from upstream's base.yml (file chain
      merged with CLI overrides, plus our local-first defaults).
    explicit: keys the user set (in a file or on the command line).
    origins: where each explicit key was set: a file of the chain, or "command line".
  """

  config_path: Path
  fork: ForkConfig
  upstream: dict[str, Any]
  explicit: frozenset[str]
  origins: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

  @property
  def run_dir(self) -> Path:
    return Path(self.upstream["base_output_directory"]) / self.upstream["run_name"]

  def upstream_argv(self) -> list[str]:
    """argv for upstream's `train.main`: its base.yml, then every key as key=value.

    Keys go on the command line (not into a YAML) so that upstream treats them
    as overrides: its model config (`model_name`) must not override them back.
    """
    return ["maxtext-moe", str(upstream_configs_dir() / "base.yml")] + [
        f"{k}={cli_value(v)}" for k, v in self.upstream.items()
    ]


# A JSON escape sequence; groups 1 and 2 are set when it is a UTF-16 surrogate pair (a character outside the BMP).
_JSON_ESCAPE = re.compile(r"\\(?:u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})|u[0-9a-f]{4}|.)")


def cli_value(value: Any) -> str:
  """value as OmegaConf's CLI parser (YAML) reads back exactly: JSON, which is YAML flow syntax, in ASCII.

  ASCII, because YAML takes a literal NEL (U+0085) in a quoted string for a line break and refuses C1 controls;
  but JSON escapes a character outside the BMP (an emoji) as a surrogate pair, which YAML refuses (a ScannerError
  traceback), so each pair becomes YAML's own \\UXXXXXXXX escape. An escaped backslash is matched as one escape,
  so a literal "\\ud83d" in a value is left as it is."""

  def one(m: re.Match) -> str:
    if not m.group(1):
      return m.group(0)
    high, low = int(m.group(1), 16), int(m.group(2), 16)
    return f"\\U{0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00):08x}"

  return _JSON_ESCAPE.sub(one, json.dumps(value, default=str))


def _resolve_base(name: str, relative_to: Path) -> Path | None:
  """base_config lookup: next to the file, our configs/, upstream's configs/."""
  candidates = [Path(name)] if os.path.isabs(name) else [relative_to.parent / name, REPO_CONFIGS / name]
  if not os.path.isabs(name):
    candidates.append(upstream_configs_dir() / name)
  return next((c.resolve() for c in candidates if c.is_file()), None)


def load_yaml_chain(path: Path, _seen: tuple[Path, ...] = (), origins: dict[str, str] | None = None) -> dict[str, Any]:
  """Loads `path` and its base_config chain, merged (later wins).

  `origins`, when given, receives each key's file (the last in the chain to set it).
  """
  path = path.resolve()
  if path in _seen:
    raise ConfigError(f"base_config cycle: {' -> '.join(str(p) for p in (*_seen, path))}")
  try:
    cfg = omegaconf.OmegaConf.load(path)
  except FileNotFoundError as e:
    raise ConfigError(f"config file not found: {path}") from e
  except Exception as e:  # yaml.YAMLError and friends: report the file and the parser's word
    raise ConfigError(f"cannot parse {path}: {_parse_problem(path, e)}") from e
  if not isinstance(cfg, omegaconf.DictConfig):
    raise ConfigError(f"{path} must hold a mapping of key: value, not a {type(cfg).__name__}")
  merged = omegaconf.OmegaConf.create({})
  bases = cfg.pop(BASE_CONFIG_KEY, None)
  bases = [bases] if isinstance(bases, str) else bases
  if bases is not None and not (isinstance(bases, (list, omegaconf.ListConfig)) and all(isinstance(b, str) for b in bases)):
    raise ConfigError(f"{path}: base_config must be a path or a list of paths, not {_yaml_value(bases)}")
  for base in bases or []:
    base_path = _resolve_base(str(base), path)
    if base_path is None:
      raise ConfigError(f"{path}: base_config '{base}' not found next to it, in {REPO_CONFIGS} or upstream's configs")
    if base_path == (upstream_configs_dir() / "base.yml").resolve():
      continue  # upstream's base.yml is always the root; upstream loads it itself
    merged = omegaconf.OmegaConf.merge(merged, load_yaml_chain(base_path, (*_seen, path), origins))
  if origins is not None:
    origins.update((str(k), str(path)) for k in cfg.keys())
  return _resolved(omegaconf.OmegaConf.merge(merged, cfg), str(path))


def _parse_problem(path: Path, e: Exception) -> str:
  """The parser's problem where it found it (line and column, counted from 1), not its context ("while scanning a
  plain scalar"); a tab in a line's indentation named as such (YAML indents with spaces only)."""
  mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
  if mark is None or not problem:
    return str(e).splitlines()[0]
  lines = path.read_text(errors="replace").splitlines()
  line = lines[mark.line] if mark.line < len(lines) else ""
  if "\t" in line[:len(line) - len(line.lstrip())]:
    return f"line {mark.line + 1} is indented with a tab; YAML indents with spaces only"
  return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _yaml_value(value: Any) -> str:
  if isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)):
    value = omegaconf.OmegaConf.to_container(value)
  return repr(value)


def _resolved(cfg: omegaconf.DictConfig, origin: str) -> dict[str, Any]:
  """Plain values, with ${...} interpolations resolved; one that does not resolve names its key."""
  try:
    return omegaconf.OmegaConf.to_container(cfg, resolve=True)
  except omegaconf.errors.OmegaConfBaseException as e:
    key = getattr(e, "full_key", None) or "?"
    raw = omegaconf.OmegaConf.to_container(cfg, resolve=False)
    value = raw.get(key, "?") if isinstance(raw, dict) else "?"
    reason = " ".join(str(e).splitlines()[0].split())
    raise ConfigError(f"config key '{key}' = {value!r} ({origin}): {reason}") from None


def parse_overrides(args: list[str]) -> dict[str, Any]:
  for arg in args:
    if "=" not in arg or arg.startswith("="):
      raise ConfigError(f"override '{arg}' is not of the form key=value")
    try:
      arg.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8, which Python's argv carries as lone surrogates
      raise ConfigError(f"override {ascii(arg)} is not UTF-8 text") from None
  try:
    cli = omegaconf.OmegaConf.from_cli(list(args))
  except omegaconf.errors.OmegaConfBaseException as e:
    raise ConfigError(f"overrides {' '.join(args)}: {' '.join(str(e).splitlines()[0].split())}") from None
  return _resolved(cli, "command line")


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


def recipe_num_slices(fork: ForkConfig, upstream: Mapping[str, Any]) -> int | None:
  """A GPU recipe's slices: one per node (jax's slice is a node's NVLink domain); None for one node.

  Upstream counts slices from the devices as it validates, so without them (a laptop) it refuses a DCN
  axis; named as the planner names it (MaxText/plan/planner.py), the recipe validates anywhere as it runs."""
  if not fork.recipe_num_gpus or not str(upstream.get("hardware", "tpu")).startswith("gpu"):
    return None
  nodes = fork.recipe_num_gpus // fork.gpus_per_node
  return nodes if nodes > 1 else None


def resolve_config_path(name: str) -> Path:
  """The config named on the command line: as given (from the working directory),
  else the shipped one (a leading `configs/` dropped), so that
  `configs/recipes/x.yml` works from any directory: in a container, or with only
  the installed package (Kubernetes, the wheelhouse)."""
  path = Path(name)
  if path.is_file() or path.is_absolute():
    return path
  parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
  shipped = REPO_CONFIGS.joinpath(*parts) if parts else path
  return shipped if shipped.is_file() else path


def load(args: list[str]) -> RunConfig:
  """`[config.yml] [key=value ...]` -> a validated RunConfig (nothing written)."""
  args = list(args)
  config_path = resolve_config_path(args.pop(0)) if args and "=" not in args[0] else DEFAULT_CONFIG
  if not config_path.is_file():
    raise ConfigError(f"config file not found: {config_path}")
  origins: dict[str, str] = {}
  from_file = load_yaml_chain(config_path, origins=origins)
  from_cli = parse_overrides(args)
  if BASE_CONFIG_KEY in from_cli:  # only files chain; on the command line upstream would ignore it
    raise ConfigError(f"'{BASE_CONFIG_KEY}={from_cli[BASE_CONFIG_KEY]}' on the command line is ignored by upstream: "
                      "pass the config file as the first argument, or put base_config: in a file")
  merged = {**from_file, **from_cli}
  origins.update((k, "command line") for k in from_cli)

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
  check_moe_keys(fork, origins)
  problem, theirs = overflow.upstream_keys(fork, theirs, origins)
  if problem:
    raise ConfigError(problem)
  theirs = node_limited_groups(fork, theirs)
  router_checks(fork, theirs, origins)
  if fork.moe_profile_every_n_steps and theirs.get("profiler"):
    raise ConfigError(f"config keys 'moe_profile_every_n_steps' = {fork.moe_profile_every_n_steps} "
                      f"({origins['moe_profile_every_n_steps']}) and 'profiler' = {theirs['profiler']!r} "
                      f"({origins['profiler']}) contradict each other: one profiler trace at a time; unset one")
  gpus, per_node = fork.recipe_num_gpus, fork.gpus_per_node
  if gpus and gpus > per_node and gpus % per_node:  # fewer than a node is one node, partly used
    raise ConfigError(f"recipe_num_gpus={gpus} is not whole nodes of gpus_per_node={per_node}: give a multiple of "
                      f"{per_node} (recipe_num_gpus: {origins.get('recipe_num_gpus')}; gpus_per_node: "
                      f"{origins.get('gpus_per_node', 'default')})")
  if "num_slices" not in merged and (slices := recipe_num_slices(fork, theirs)):
    theirs["num_slices"] = slices  # print-config names its source (MaxText/config/report.py)
  if fork.moe_log_expert_load and fork.moe_block != "ours":
    raise ConfigError(f"config key 'moe_log_expert_load' = True ({origins['moe_log_expert_load']}): "
                      "only our block reports the expert load; set moe_block=ours")
  return RunConfig(
      config_path=config_path.resolve(),
      fork=fork,
      upstream=local_first_defaults(moe_gmm_upstream_keys(fork, theirs, origins), config_path),
      explicit=frozenset(merged),
      origins=origins,
  )
