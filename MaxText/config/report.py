"""What `python -m MaxText.train --help` and `--print-config` print.

--help: usage, the flags, the exit codes (MaxText/config/command_line.py's), and our keys with their descriptions
(ForkConfig's pydantic `Field(description=...)`); upstream's ~900 keys are
listed by --print-config, not here.

--dry-run: what it could not check here, and the planner command that does, as a user runs it.

--print-config: the merged config a run would use, ours and upstream's (upstream's
own resolution: base.yml, then the model file of `model_name`, then the run's
keys), one `key = value  # source` line each. Nothing is compiled or written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

from MaxText import config as fork_config
from MaxText.config import command_line
from MaxText.config import parallelism
from MaxText.config import xla_presets

USAGE = "python -m MaxText.train [--print-config | --dry-run] [config.yml] [key=value ...]"
DESCRIPTION = """\
Trains a config: ours and upstream MaxText's keys, checked before anything is compiled or written.

  config.yml      a run config (default: {default}); a relative path that is not
                  found from here is looked up in the shipped configs/
  key=value       overrides, ours and upstream MaxText's alike (no leading dashes: steps=3)"""
FLAGS = ("--print-config", "--dry-run")


def train_parser() -> argparse.ArgumentParser:
  """`python -m MaxText.train`'s options; the config and its key=value overrides are the other arguments
  (parse_known_args), read by MaxText/config/loader.py."""

  parser = command_line.command_line_parser(
      "python -m MaxText.train", USAGE,
      DESCRIPTION.format(default=fork_config.DEFAULT_CONFIG.relative_to(fork_config.REPO_CONFIGS.parent)))
  parser.add_argument("--print-config", action="store_true",
                      help="print the merged config, each value with where it came from; exit")
  parser.add_argument("--dry-run", action="store_true",
                      help="validate everything (config, presets, launch environment, devices, upstream's checks), "
                      "then exit before compiling or writing anything; a recipe for GPUs this machine lacks is checked "
                      "against its own GPU count, and the printed plan command checks its devices and memory")
  parser.add_argument("-h", "--help", action="store_true", help="this text, and our keys")
  return parser


def parse_command_line(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """(our options, the config and key=value overrides); command_line.CommandLineError naming the argument."""
  from MaxText.config.command_line import CommandLineError  # pylint: disable=import-outside-toplevel

  options, rest = train_parser().parse_known_args(args)
  for arg in rest:
    if arg.startswith("--") and "=" in arg:  # --steps=3: an override written as an option
      raise CommandLineError(f"argument '{arg}': overrides are key=value without dashes ({arg.lstrip('-')})")
    if arg.startswith("--"):
      raise CommandLineError(f"option '{arg}' is not one of {', '.join(FLAGS)} (or --help)")
  if options.print_config and options.dry_run:
    raise CommandLineError(f"options {' and '.join(FLAGS)}: use one of them")
  return options, rest


DISTRIBUTED_KEY = "skip_jax_distributed_system"  # base.yml: false
# Upstream keys our loader fills when the user does not (MaxText/config/loader.py, local_first_defaults).
LOCAL_FIRST_KEYS = ("base_output_directory", "run_name", "jax_cache_dir", "dump_hlo_local_dir")


def _type_name(annotation: Any) -> str:
  if typing.get_origin(annotation) is typing.Literal:
    return "|".join(str(a) for a in typing.get_args(annotation))
  return str(annotation).replace("typing.", "") if not isinstance(annotation, type) else annotation.__name__


def key_lines() -> list[str]:
  """Our keys: name, type, default, description."""
  lines = []
  for name, field in fork_config.ForkConfig.model_fields.items():
    default = field.get_default(call_default_factory=True)
    lines.append(f"  {name} ({_type_name(field.annotation)}, default {json.dumps(default)})")
    lines.append(f"      {field.description}")
  return lines


def help_text() -> str:
  return "\n".join([
      train_parser().format_help(),
      "maxtext-moe keys (upstream never sees them; upstream's keys: --print-config):",
      *key_lines(),
  ])


def _sources(run: fork_config.RunConfig, composed: xla_presets.Composed) -> dict[str, str]:
  """Where each key the run sets came from (the rest is upstream's)."""
  src = {k: "maxtext-moe default" for k in LOCAL_FIRST_KEYS if k not in run.explicit}
  src.update((k, f"xla_presets {', '.join(composed.presets)}") for k in composed.upstream_defaults)
  src.update((k, f"moe_gmm_backend={run.fork.moe_gmm_backend}") for k, v in run.upstream.items()
             if k in fork_config.MOE_GMM_UPSTREAM_KEYS and k not in run.explicit)
  if "num_slices" in run.upstream and "num_slices" not in run.explicit:
    src["num_slices"] = f"recipe_num_gpus {run.fork.recipe_num_gpus} / gpus_per_node {run.fork.gpus_per_node}"
  src.update(run.origins)
  return src


def _upstream_model_keys(final: Mapping[str, Any]) -> set[str]:
  """Keys upstream took from `model_name`'s file (maxtext/configs/models/<name>.yml)."""
  import omegaconf  # pylint: disable=import-outside-toplevel

  path = fork_config.upstream_configs_dir() / "models" / f"{final.get('model_name', 'default')}.yml"
  return set(omegaconf.OmegaConf.load(path).keys()) if path.is_file() else set()


def print_config(run: fork_config.RunConfig) -> list[str]:
  """`key = value  # source` lines: ours first, then upstream's resolved config."""
  import omegaconf  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  composed = xla_presets.compose_for(run, {})
  run = xla_presets.with_upstream_defaults(run, composed)
  sources = _sources(run, composed)
  lines = [f"# config {run.config_path}", "# maxtext-moe keys"]
  for name, value in run.fork.model_dump().items():
    # cli_value: what key=value reads back (an emoji as YAML's \U escape, not JSON's surrogate pair)
    lines.append(f"{name} = {fork_config.cli_value(value)}  # {sources.get(name, 'maxtext-moe default')}")

  # Printing a config never joins a job: upstream would start jax.distributed while it resolves
  # (on CPU from XPK's variables), so it resolves without, and the run's own value is shown.
  quiet = dataclasses.replace(run, upstream={**run.upstream, DISTRIBUTED_KEY: True})
  final = pyconfig.initialize(quiet.upstream_argv()).get_keys()
  final[DISTRIBUTED_KEY] = run.upstream.get(DISTRIBUTED_KEY, False)
  base = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(fork_config.upstream_configs_dir() / "base.yml"))
  from_model = _upstream_model_keys(final)
  lines.append("# upstream MaxText keys")
  for name in sorted(final):
    if name in sources:
      source = sources[name]
    elif name in from_model:
      source = f"upstream models/{final['model_name']}.yml"
    elif name in base:
      source = "upstream base.yml" if base[name] == final[name] else "upstream, derived (base.yml has another value)"
    else:
      source = "upstream, derived"
    lines.append(f"{name} = {fork_config.cli_value(final[name])}  # {source}")
  return lines



def print_config_checked(run: fork_config.RunConfig) -> list[str]:
  """--print-config's lines; upstream's errors as one ConfigError line naming the key."""
  import patches  # pylint: disable=import-outside-toplevel
  from patches import config_errors  # pylint: disable=import-outside-toplevel

  patches.apply_module(config_errors)  # upstream's handler would exit (or raise past us) with its banner
  try:
    return print_config(run)
  except fork_config.ConfigError:
    raise
  except (ValueError, TypeError, KeyError, AssertionError) as e:
    from MaxText.config import checks as config_checks  # pylint: disable=import-outside-toplevel

    raise config_checks.upstream_error(run, e) from e


# --- what a dry run says it could not check, and the command that does ---


def dry_run_report(run: fork_config.RunConfig, process: Any, elsewhere: str | None,
                   overrides: Sequence[str] = ()) -> list[str]:
  """What a dry run checked, and (for GPU runs) what it could not and the command that does."""
  launched = f"launch ({process.scheduler}, process {process.process_id} of {process.num_processes})"
  gpus = run.fork.recipe_num_gpus
  mesh = f", the mesh against the recipe's {gpus} GPUs" if elsewhere and gpus else ""
  lines = [f"dry run: config, presets, {launched}{mesh} and upstream's checks pass; nothing compiled or written"]
  if elsewhere or str(run.upstream.get("hardware")).startswith("gpu"):
    unchecked = f"the devices ({elsewhere}) and the memory" if elsewhere else "the memory"
    command, target = plan_command(run, overrides)
    lines.append(f"dry run: not checked here: {unchecked}; {command} compiles the train step for {target} and "
                 f"checks {'both' if elsewhere else 'it'}")
  return lines


# A GPU count and GPU the planner takes where a config names neither: one 8-GPU H100 node.
PLAN_DEFAULTS = {"recipe_num_gpus": 8, "target_gpu": "h100"}


def plan_command(run: fork_config.RunConfig, overrides: Sequence[str] = ()) -> tuple[str, str]:
  """(the planner command for this run as a user types it here, what it plans for). scripts/plan.sh where this
  checkout has it (it installs the GPU compiler the compile-only targets need), else python -m MaxText.plan; the
  command line's key=value overrides come along; a config whose mesh leaves the GPU count open gets
  PLAN_DEFAULTS, said as such."""
  script = fork_config.REPO_CONFIGS.resolve().parent / "scripts" / "plan.sh"
  words = [_shown_path(script, configs=False) if script.is_file() else "python -m MaxText.plan",
           _shown_path(run.config_path), *map(shlex.quote, overrides)]
  gpus, target = run.fork.recipe_num_gpus, f"its {run.fork.recipe_num_gpus} GPUs"
  if not gpus and any(v == -1 for v in {**parallelism.mesh_axes(run.upstream, "ici_"),
                                         **parallelism.mesh_axes(run.upstream, "dcn_")}.values()):
    added = {k: v for k, v in PLAN_DEFAULTS.items() if not getattr(run.fork, k)}
    words += [f"{k}={v}" for k, v in added.items()]
    target = f"one node of {PLAN_DEFAULTS['recipe_num_gpus']} {str(run.fork.target_gpu or 'h100').upper()}s " \
             "(set recipe_num_gpus and target_gpu to your cluster's)"
  elif not gpus:
    target = "its GPUs"
  return " ".join(words), target


def _shown_path(path: Path, configs: bool = True) -> str:
  """A path as a user would type it here: relative to the working directory, else (a config) as shipped."""
  bases = ((Path.cwd(), ""), (fork_config.REPO_CONFIGS.resolve(), "configs/")) if configs else ((Path.cwd(), ""),)
  for base, prefix in bases:
    if path.is_relative_to(base):
      return prefix + str(path.relative_to(base))
  return str(path)
