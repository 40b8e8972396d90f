"""Entry point: `python -m MaxText.train [config.yml] [key=value ...]`.

load our config -> set the run's environment -> apply patches -> validate with
upstream -> run upstream's pre-training main -> print the summary.

Everything that can be wrong with the config is reported (one line, exit 2)
before the run directory is created or anything is compiled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from MaxText import checkpoint_compat
from MaxText import config as fork_config
from MaxText import config_report
from MaxText import launch
from MaxText import metrics
from MaxText import xla_presets
from patches import UpstreamMismatch

# Used when no XLA flag is set and no HLO dump is asked for. Upstream 0.2.5
# fills an empty XLA_FLAGS with `--xla_dump_to=/tmp/xla_dump/` (types.py,
# validate_and_set_hlo_dump_defaults), so every run would dump HLO outside its
# run directory. This flag is a no-op (false is XLA's default) that keeps
# XLA_FLAGS non-empty; XLA rejects a blank value.
NEUTRAL_XLA_FLAGS = "--xla_cpu_enable_fast_math=false"


def log(msg: str) -> None:
  print(f"[maxtext-moe] {msg}", flush=True)


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
  except (ValueError, TypeError, KeyError, AssertionError) as e:
    message = " ".join(str(e).split())
    raise fork_config.ConfigError(f"rejected by upstream MaxText: {message[:400]}") from e
  finally:
    absl_logger.setLevel(level)
  return config


def write_run_files(
    run: fork_config.RunConfig, env: dict[str, str], applied: list[str], presets: dict[str, Any] | None = None
) -> None:
  """The effective config and environment, so a run can be reproduced."""
  out = run.run_dir / "maxtext-moe"
  out.mkdir(parents=True, exist_ok=True)
  effective = {
      "config_path": str(run.config_path),
      "fork": run.fork.model_dump(),
      "upstream_overrides": run.upstream,
      "environment": {**env, "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                      "DECOUPLE_GCLOUD": os.environ.get("DECOUPLE_GCLOUD", "")},
      "patches": applied,
      "xla_presets": presets or {},
  }
  (out / "effective_config.json").write_text(json.dumps(effective, indent=2, sort_keys=True, default=str))


class _DropOrbaxInfo(logging.Filter):
  """Orbax logs each checkpoint file operation at INFO through absl's logger
  (about 12 lines a save); upstream's own INFO lines (loss, TFLOP/s) stay."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or "/orbax/" not in record.pathname


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


def prepare_environment(run: fork_config.RunConfig, extra_xla_flags: str = "") -> Prepared:
  """Presets -> upstream keys and os.environ, before anything creates a jax backend.

  Shared by the trainer and the planner (MaxText/plan.py), so both compile the same
  program. `extra_xla_flags` (the planner's) are appended to the run's XLA_FLAGS.
  """
  composed = xla_presets.compose_for(run, dict(os.environ))
  run = xla_presets.with_upstream_defaults(run, composed)
  env = run_environment(run, dict(os.environ), composed)
  if extra_xla_flags:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))} {extra_xla_flags}".strip()
  os.environ.update(env)  # XLA reads these once, when the backend starts
  return Prepared(run, env, composed)


def apply_patches_and_validate(run: fork_config.RunConfig, hooks=None):
  """Our patches onto upstream, then upstream's own validation: (applied, upstream config)."""
  import patches  # pylint: disable=import-outside-toplevel

  applied = patches.apply_all(run.fork, hooks)
  return applied, validate_with_upstream(run)


def run_training(run: fork_config.RunConfig, dry_run: bool = False) -> dict[str, Any]:
  """Trains; with `dry_run`, stops after every check, before writing or compiling."""
  import patches  # pylint: disable=import-outside-toplevel

  prepared = prepare_environment(run)
  run, env, composed = prepared.run, prepared.env, prepared.composed
  process = launch.start(run)  # jax.distributed + device-count checks, before upstream's
  tracker: list[metrics.ProgressTracker] = []
  hooks = patches.Hooks(on_train_step=lambda step, scalars: tracker[0].on_train_step(step, scalars),
                        on_expert_counts=lambda counts_E: tracker[0].on_expert_counts(counts_E))
  applied, config = apply_patches_and_validate(run, hooks)
  checkpoint_compat.check_resume(run)  # before anything is compiled: the routing bias's semantics must match
  if dry_run:
    log(f"dry run: config, presets, launch ({process.scheduler}, process {process.process_id} of "
        f"{process.num_processes}) and upstream's checks pass; nothing compiled or written")
    return {}

  # Every process trains and prints its progress (as upstream logs per
  # process); only the first writes the run's own files.
  lead = process.process_id == 0
  tracker.append(metrics.ProgressTracker(total_steps=int(config.steps), print_every=run.fork.progress_every))
  if lead:
    write_run_files(run, env, applied, xla_presets.report(composed))
  log(f"run directory {run.run_dir}")
  log(f"patches applied: {', '.join(applied) or 'none'}")
  log(f"process {process.process_id} of {process.num_processes} ({process.scheduler})")
  for line in xla_presets.summary_lines(composed, env):
    log(line)
  log(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")

  from absl import app  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train as upstream_train  # pylint: disable=import-outside-toplevel

  logging.getLogger("absl").addFilter(_DropOrbaxInfo())
  try:
    # app.run parses absl flags (upstream's logging reads them) and calls main.
    app.run(lambda _argv: upstream_train.main(run.upstream_argv()), argv=[sys.argv[0] or "maxtext-moe"])
  except SystemExit as e:
    if e.code not in (0, None):
      raise
  summary = tracker[0].summary(run.run_dir, run.upstream)
  peak = metrics.device_memory_peak_bytes()
  summary["peak_device_memory_gib"] = peak / 2**30 if peak is not None else None
  if lead:
    metrics.write_summary(summary, run.run_dir)
  metrics.print_summary(summary)
  return summary


def main(argv: list[str] | None = None) -> int:
  args = sys.argv[1:] if argv is None else list(argv)
  if any(a in ("-h", "--help") for a in args):
    print(config_report.help_text())
    return 0
  flags = {a for a in args if a.startswith("--")}
  args = [a for a in args if not a.startswith("--")]
  if flags - {"--print-config", "--dry-run"} or len(flags) > 1:
    print(f"maxtext-moe: config error: option(s) {' '.join(sorted(flags))}: use one of --print-config, --dry-run "
          "(or --help)", file=sys.stderr)
    return 2
  # Local-first: never reach for Google Cloud clients. Set before the config is
  # loaded, because upstream modules decide at import time (maxtext.utils.gcs_utils
  # would otherwise bind the real storage client, and upload_dump would call it).
  os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
  try:
    run = fork_config.load(args)
    if "--print-config" in flags:
      print("\n".join(config_report.print_config(run)))
    else:
      run_training(run, dry_run="--dry-run" in flags)
  except fork_config.ConfigError as e:
    print(f"maxtext-moe: config error: {e}", file=sys.stderr, flush=True)
    return 2
  except UpstreamMismatch as e:  # a patch refusing an upstream it was not written for
    print(f"maxtext-moe: {e}", file=sys.stderr, flush=True)
    return 3
  return 0


def cli() -> None:
  sys.exit(main())


if __name__ == "__main__":
  cli()
