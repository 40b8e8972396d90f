"""A run's environment, shared by the trainer and the planner so both compile the same program: its XLA
presets composed into upstream keys and os.environ, our patches applied, and upstream's own validation."""

from __future__ import annotations

import dataclasses
import logging
import os

from MaxText.config import checks as config_checks
from MaxText import config as fork_config
from MaxText.config import xla_presets

# Used when no XLA flag is set and no HLO dump is asked for. Upstream 0.2.5
# fills an empty XLA_FLAGS with `--xla_dump_to=/tmp/xla_dump/` (types.py,
# validate_and_set_hlo_dump_defaults), so every run would dump HLO outside its
# run directory. This flag is a no-op (false is XLA's default) that keeps
# XLA_FLAGS non-empty; XLA rejects a blank value.
NEUTRAL_XLA_FLAGS = "--xla_cpu_enable_fast_math=false"
# The name upstream gives its jitted train step (maxtext_utils.get_functional_train_with_signature sets the
# partial's __name__), which jax's compile events carry: how the trainer and the planner follow its compile.
TRAIN_STEP = "train_step"


def run_environment(
    run: fork_config.RunConfig, environ: dict[str, str], composed: xla_presets.Composed | None = None
) -> dict[str, str]:
  """Environment variables this run sets (only those that change).

  `composed`: the run's XLA presets merged with the user's environment
  (xla_presets.compose_for); computed here when not given.
  """
  env: dict[str, str] = {}
  # Local-first: never reach for Google Cloud clients; patches/tensorboard.py
  # keeps event files in the run directory in this mode.
  if "DECOUPLE_GCLOUD" not in environ:
    env["DECOUPLE_GCLOUD"] = "TRUE"
  env.update((composed or xla_presets.compose_for(run, environ)).env)
  xla_flags = env.get("XLA_FLAGS", environ.get("XLA_FLAGS", "")).strip()
  if run.upstream.get("dump_hlo", False):
    # Upstream adds its dump flags to XLA_FLAGS while validating its config,
    # which is after launch.start has created the backend: XLA never sees them.
    # So they are set here, into the run directory, and upstream (seeing
    # XLA_FLAGS set and dump_hlo_xla_flags empty) leaves them alone.
    env["XLA_FLAGS"] = f"{xla_flags} {hlo_dump_flags(run)}".strip()
  elif not xla_flags:
    env["XLA_FLAGS"] = NEUTRAL_XLA_FLAGS
  return env


def hlo_dump_flags(run: fork_config.RunConfig) -> str:
  """Upstream's own dump flags (its dump_hlo_xla_flags default), into the run directory."""
  if run.upstream.get("dump_hlo_xla_flags"):
    return str(run.upstream["dump_hlo_xla_flags"])
  flags = f"--xla_dump_to={run.upstream['dump_hlo_local_dir']} --xla_dump_large_constants"
  module = run.upstream.get("dump_hlo_local_module_name", "jit_train_step")
  return f"{flags} --xla_dump_hlo_module_re={module}" if module else flags


def validate_with_upstream(run: fork_config.RunConfig):
  """Upstream's own full validation (cross-field checks included), no compile."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.utils import train_utils  # pylint: disable=import-outside-toplevel

  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.WARNING)  # upstream logs the full config again when the run starts
  try:
    config = pyconfig.initialize(run.upstream_argv())
    train_utils.validate_train_config(config)
    config_checks.check_upstream_values(run, config)
  except fork_config.ConfigError:
    raise  # ours (config_checks): already one line naming the key
  except (ValueError, TypeError, KeyError, AssertionError) as e:
    raise config_checks.upstream_error(run, e) from e
  finally:
    absl_logger.setLevel(level)
  return config


# Upstream aborts on a NaN/Inf loss with sys.exit(1) from its metric logger;
# we turn these off for upstream and do the same check in our step hook, which
# stops with one line naming the step (patches/checkpoint_guard.NonFiniteState).
ABORT_KEYS = ("abort_on_nan_loss", "abort_on_inf_loss")


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A run with its presets composed and its environment set in os.environ.

  Attributes:
    run: the run with the presets' upstream keys added.
    env: the variables the run set (only those that change).
    composed: its XLA presets merged with the user's environment.
  """

  run: fork_config.RunConfig
  env: dict[str, str]
  composed: xla_presets.Composed
  abort_on_nonfinite: bool  # upstream's abort_on_nan/inf_loss, done by our step hook (ABORT_KEYS)


def prepare_environment(run: fork_config.RunConfig, extra_xla_flags: str = "") -> Prepared:
  """Presets -> upstream keys and os.environ, before anything creates a jax backend.

  Shared by the trainer and the planner (MaxText/plan/planner.py), so both compile the same
  program. `extra_xla_flags` (the planner's) are appended to the run's XLA_FLAGS.
  """
  composed = xla_presets.compose_for(run, dict(os.environ))
  run = xla_presets.with_upstream_defaults(run, composed)
  abort_on_nonfinite = all(run.upstream.get(k, True) for k in ABORT_KEYS)
  run = dataclasses.replace(run, upstream={**run.upstream, **{k: False for k in ABORT_KEYS}})
  env = run_environment(run, dict(os.environ), composed)
  if extra_xla_flags:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))} {extra_xla_flags}".strip()
  os.environ.update(env)  # XLA reads these once, when the backend starts
  return Prepared(run, env, composed, abort_on_nonfinite)


def apply_patches_and_validate(run: fork_config.RunConfig, hooks=None):
  """Our patches onto upstream, then upstream's own validation: (applied, upstream config)."""
  import patches  # pylint: disable=import-outside-toplevel

  applied = patches.apply_all(run.fork, hooks)
  return applied, validate_with_upstream(run)

