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
import math
import os
import sys
from typing import Any, Sequence

from MaxText import checkpoint_compat
from MaxText import config as fork_config
from MaxText import config_checks
from MaxText import config_report
from MaxText import data_checks
from MaxText import disk_full
from MaxText.plan import hardware
from MaxText import launch
from MaxText import lifecycle
from MaxText import metrics
from MaxText import overflow
from MaxText import progress as progress_lines
from MaxText import quiet
from MaxText import xla_presets
from patches import UpstreamMismatch

# Used when no XLA flag is set and no HLO dump is asked for. Upstream 0.2.5
# fills an empty XLA_FLAGS with `--xla_dump_to=/tmp/xla_dump/` (types.py,
# validate_and_set_hlo_dump_defaults), so every run would dump HLO outside its
# run directory. This flag is a no-op (false is XLA's default) that keeps
# XLA_FLAGS non-empty; XLA rejects a blank value.
NEUTRAL_XLA_FLAGS = "--xla_cpu_enable_fast_math=false"
# The name upstream gives its jitted train step (maxtext_utils.get_functional_train_with_signature sets the
# partial's __name__), which jax's compile events carry: how the trainer and the planner follow its compile.
TRAIN_STEP = "train_step"


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
    config_checks.check_upstream_values(run, config)
  except fork_config.ConfigError:
    raise  # ours (config_checks): already one line naming the key
  except (ValueError, TypeError, KeyError, AssertionError) as e:
    raise config_checks.upstream_error(run, e) from e
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


# Upstream aborts on a NaN/Inf loss with sys.exit(1) from its metric logger;
# we turn these off for upstream and do the same check in our step hook, which
# stops with one line naming the step (patches/checkpoint_guard.NonFiniteState).
ABORT_KEYS = ("abort_on_nan_loss", "abort_on_inf_loss")


class _StepHook:
  """patches/metric_logger.py's observer: progress, then the loss check."""

  def __init__(self, tracker: metrics.ProgressTracker, abort_on_nonfinite: bool):
    self.tracker, self.abort = tracker, abort_on_nonfinite
    self.raised = False

  def __call__(self, step: int, scalars: dict[str, Any]) -> None:
    from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

    self.tracker.on_train_step(step, scalars)
    loss = scalars.get("learning/loss")
    if self.abort and not self.raised and loss is not None and not math.isfinite(float(loss)):
      self.raised = True  # upstream flushes its metric buffer once more while the error propagates
      grad = scalars.get("learning/raw_grad_norm")
      raise checkpoint_guard.NonFiniteState(
          f"step {step}: loss {float(loss)}, gradient norm {'n/a' if grad is None else float(grad)}; stopped "
          "before any checkpoint of a non-finite state; lower learning_rate or set gradient_clipping_threshold",
          step=step)


def _previous_overrides(run: fork_config.RunConfig) -> dict[str, Any]:
  try:
    previous = json.loads((run.run_dir / lifecycle.RUN_FILES / "effective_config.json").read_text())
    return dict(previous["upstream_overrides"])
  except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
    return {}  # only the refusal's hint uses it: without it, the hint names no keys


def _changed_keys(before: dict[str, Any], now: dict[str, Any]) -> str:
  keys = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k) and k not in ("steps", "run_name"))
  return ", ".join(f"{k} {before.get(k, '(default)')} -> {now.get(k, '(default)')}" for k in keys[:6])


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


def run_training(run: fork_config.RunConfig, stop: lifecycle.StopRequest | None = None,
                 dry_run: bool = False, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """Trains; the summary's "stopped" entry says whether a stop signal ended the run early. With
  `dry_run`, stops after every check, before writing or compiling (`overrides`: the command line's key=value
  arguments, for the plan command it prints)."""
  import patches  # pylint: disable=import-outside-toplevel
  from patches import checkpoint_guard, checkpoint_restore, metric_logger, moe_profile, step_metrics  # pylint: disable=import-outside-toplevel

  stop = stop or lifecycle.StopRequest()
  config_checks.check_fork(run)
  prepared = prepare_environment(run)
  run, env, composed = prepared.run, prepared.env, prepared.composed
  process = launch.start(run, check_devices=not dry_run)  # jax.distributed (+ device checks), before upstream's
  # A dry run of a recipe for GPUs this machine lacks checks its mesh against its own GPU count instead.
  elsewhere = launch.devices_elsewhere(run) if dry_run else None
  if dry_run and elsewhere is None:
    launch.check_devices_fit(run)
  config_checks.check_backends(run)  # our MoE backends against this platform, before the patches resolve them
  tracker: list[_StepHook] = []
  on_restored: list[Any] = []
  hooks = patches.Hooks(on_train_step=lambda step, scalars: tracker[0](step, scalars),
                        on_expert_counts=lambda counts_E: tracker[0].tracker.on_expert_counts(counts_E),
                        stop_signal=lambda: stop.signal_name, step_scalars=step_metrics.latest_scalars,
                        on_restored=lambda step: on_restored[0](step))
  applied, config = apply_patches_and_validate(run, hooks)
  if elsewhere is None:
    config_checks.check_devices(run, config)
    if not dry_run:
      launch.check_mesh_on_hosts(config)  # a node's ici_* group on one host, before anything is compiled
  checkpoint_compat.check_resume(run)  # before anything is compiled: the routing bias's semantics must match
  checkpoint_compat.check_pipeline_resume(run, config)  # and the pipeline layout the checkpoint was written with
  checkpoint_compat.check_load_parameters(run)
  check_data_on_process_0(run, config, process.process_id)  # before the run directory exists
  if dry_run:
    for line in _resume_preview(run, config):  # read-only; a run checks this under the lock
      log(line)
    for line in config_report.dry_run_report(run, process, elsewhere, overrides):
      log(line)
    return {}

  # Every process trains and keeps its own summary (<run>/maxtext-moe/summary.rank<k>.json in a multi-process
  # job); only the first writes the run's own files and prints the [progress] lines, the compile and checkpoint
  # lines and the closing summary (torchtitan's LOG_RANK=0), which would otherwise come once per process.
  lead = process.process_id == 0
  import jax  # pylint: disable=import-outside-toplevel

  peak_flops, peak_label = hardware.mfu_peak(jax.devices()[0].device_kind, run.fork.mfu_peak_tflops)
  progress = metrics.ProgressTracker(total_steps=int(config.steps), print_every=run.fork.progress_every if lead else 0,
                                     peak_flops=peak_flops, peak_label=peak_label)
  metric_logger.set_mfu_peak(peak_flops)
  moe_profile.set_run_dir(run.run_dir)  # moe_profile_every_n_steps's traces stay in the run directory
  tracker.append(_StepHook(progress, prepared.abort_on_nonfinite))
  lock = lifecycle.RunLock.for_run(run.run_dir) if lead else None
  if lock:
    lock.acquire()
    stop.on_abort(lock.release)
  try:
    set_aside = lifecycle.set_aside_unusable(run.run_dir) if lead else []  # before orbax lists the steps
    resumed_from, warnings = lifecycle.check_resume(run.run_dir, config, run.fork.allow_schedule_change,
                                                    run.fork.allow_data_change)
    previous = _previous_overrides(run)

    def record_run(restored: int | None) -> None:
      """Once upstream's restore settled where the run starts; a resume refused there writes nothing."""
      if lead:
        write_run_files(run, env, applied, xla_presets.report(composed))
        checkpoint_compat.record_pipeline_layout(run, config)
        if restored is None or warnings:  # a new run (or one whose checkpoints all failed), or an allowed change
          lifecycle.record_schedule(run.run_dir, config)
          lifecycle.record_data(run.run_dir, config)

    on_restored.append(record_run)
    log(f"run directory {run.run_dir}")
    for line in set_aside:
      log(line)
    if resumed_from is not None:
      log(f"resuming from checkpoint step {resumed_from}")
      stop_record = lifecycle.nonfinite_stop(run.run_dir) or {}
      if not run.fork.nonfinite_skip_batches and stop_record.get("checkpoint") == resumed_from:
        log("this run last stopped at a non-finite step after this checkpoint and replays its batches; "
            "nonfinite_skip_batches=K skips them")
    for line in warnings:
      log(line)
    for line in start_lines(run, process, composed, env, applied):
      log(line)

    from absl import app  # pylint: disable=import-outside-toplevel
    from maxtext.trainers.pre_train import train as upstream_train  # pylint: disable=import-outside-toplevel

    quiet.install_filter(run.fork.verbose)
    compiles = _watch_train_step_compile(lead)

    def upstream_main(_argv):
      quiet.upstream_logging(run.fork.verbose)  # after app.run's flag parsing set absl's verbosity
      return upstream_train.main(run.upstream_argv())

    try:
      # app.run parses absl flags (upstream's logging reads them) and calls main.
      app.run(upstream_main, argv=[sys.argv[0] or "maxtext-moe"])
    except SystemExit as e:
      if e.code not in (0, None):
        raise
    except checkpoint_guard.NonFiniteState as e:
      if lead and e.step is not None:  # what the next resume skips with nonfinite_skip_batches
        skip = checkpoint_restore.skipped
        lifecycle.record_nonfinite(run.run_dir, e.step, (skip["checkpoint"], skip["batches"]) if skip else None)
      raise
    except fork_config.ConfigError as e:
      if resumed_from is not None and _changed_keys(previous, run.upstream):
        raise fork_config.ConfigError(f"{e}; config keys changed since: {_changed_keys(previous, run.upstream)}") from e
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      if not disk_full.is_storage_failure(e):  # a full disk, whoever wrote first: TensorBoard, metrics, a checkpoint
        raise
      written = disk_full.try_write(lambda: close_summary(run, progress, compiles, process, lead))
      raise disk_full.StorageFailure(disk_full.line(e, run.run_dir, written)) from e
    finally:
      compiles.stop()
  finally:
    if lock:
      lock.release()
  summary = close_summary(run, progress, compiles, process, lead)
  if lead:
    metrics.print_summary(summary)
  if summary["stopped"]:
    s = summary["stopped"]
    if s["saved"] is not None:
      said = f"checkpoint of step {s['saved']} saved; run again with the same run_name to resume"
    else:
      said = (f"checkpointing is off (enable_checkpointing=false), so the {s['step'] + 1} steps trained are lost; "
              "a rerun starts at step 0")
    print(f"maxtext-moe: stopped by {s['signal']} after step {s['step']}: {said} (exit {lifecycle.EXIT_PREEMPTED})",
          file=sys.stderr, flush=True)
  return summary


def close_summary(run: fork_config.RunConfig, progress: metrics.ProgressTracker,
                  compiles: progress_lines.CompileWatch, process: launch.ProcessInfo, lead: bool) -> dict[str, Any]:
  """The closing summary, written to summary.json (process 0) and summary.rank<k>.json (several processes)."""
  from patches import checkpoint_guard, step_metrics  # pylint: disable=import-outside-toplevel

  run_dir = run.run_dir
  stopped = dict(checkpoint_guard.stopped)
  if stopped and (not progress.records or progress.records[-1].step < stopped["step"]):
    # The stop ended the loop before upstream's metric logger saw the saved step (it runs a step behind).
    progress.on_train_step(stopped["step"], step_metrics.latest_scalars())
  summary = progress.summary(run_dir, run.upstream)
  peak = metrics.device_memory_peak_bytes()
  summary["peak_device_memory_gib"] = peak / 2**30 if peak is not None else None
  summary["stopped"] = stopped or None
  summary["compile_s"] = sum(compiles.compiles) if compiles.compiles else None
  summary["checkpoint_saves"] = list(checkpoint_guard.finish_save_reports())
  if process.num_processes > 1:
    metrics.write_summary(summary, run_dir / lifecycle.RUN_FILES, f"summary.rank{process.process_id}.json")
  if lead:
    metrics.write_summary(summary, run_dir)
  return summary


def start_lines(run: fork_config.RunConfig, process: launch.ProcessInfo, composed: xla_presets.Composed,
                env: dict[str, str], applied: list[str]) -> list[str]:
  """What the run says about its set-up before compiling: the presets, overrides and XLA_FLAGS when any are set,
  the process when there are several; everything with verbose (all of it is in effective_config.json)."""
  verbose = run.fork.verbose
  lines = [f"patches applied: {', '.join(applied) or 'none'}"] if verbose else []
  if verbose or process.num_processes > 1:
    lines.append(f"process {process.process_id} of {process.num_processes} ({process.scheduler})")
  presets = xla_presets.summary_lines(composed, env)
  if verbose or len(presets) > 1 or composed.presets:
    lines += presets
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if verbose or xla_flags != NEUTRAL_XLA_FLAGS:
    lines.append(f"XLA_FLAGS={xla_flags}")
  return lines


def _resume_preview(run: fork_config.RunConfig, config: Any) -> list[str]:
  """What this run would do to an existing run directory (nothing written): the step directories it would set
  aside and the checkpoint it would resume; FinishedRun or a refused resume raise as they would under the lock."""
  lines = lifecycle.set_aside_unusable(run.run_dir, dry_run=True)
  resumed_from, warnings = lifecycle.check_resume(run.run_dir, config, run.fork.allow_schedule_change,
                                                  run.fork.allow_data_change)
  if resumed_from is not None:
    lifecycle.batches_to_skip(run.run_dir, resumed_from, run.fork.nonfinite_skip_batches)  # a garbled record
    lines.append(f"the run would resume from checkpoint step {resumed_from}")
  return lines + warnings


def _watch_train_step_compile(lead: bool) -> progress_lines.CompileWatch:
  """Says when the train step starts compiling (upstream compiles it ahead of the loop, or at its first call)
  and how long that took (trace, lower and compile); every compile's time goes to the summary."""
  announced = [False]

  def on_phase(phase: str) -> None:  # pylint: disable=unused-argument
    if not announced[0]:  # once per compile, at its first phase
      announced[0] = True
      if lead:
        log("compiling the train step...")

  def on_compiled(seconds: float) -> None:
    announced[0] = False
    if lead:
      log(f"compiled the train step in {seconds:.1f} s")

  return progress_lines.CompileWatch(TRAIN_STEP, on_phase, on_compiled).start()


def main(argv: list[str] | None = None) -> int:
  """Runs; returns one of MaxText/lifecycle.py's exit codes (README "Exit codes")."""
  try:
    options, args = config_report.parse_command_line(sys.argv[1:] if argv is None else list(argv))
  except lifecycle.CommandLineError as e:
    print(f"maxtext-moe: config error: {e}", file=sys.stderr)
    return lifecycle.EXIT_CONFIG
  if options.help:
    print(config_report.help_text())
    return lifecycle.EXIT_OK
  # Local-first: never reach for Google Cloud clients. Set before the config is
  # loaded, because upstream modules decide at import time (maxtext.utils.gcs_utils
  # would otherwise bind the real storage client, and upload_dump would call it).
  os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
  quiet.before_jax()  # XLA's C++ INFO lines, read once when the config's loading first imports jax
  from patches import checkpoint_guard, quiet_notices  # pylint: disable=import-outside-toplevel

  stop = lifecycle.StopRequest(abort=_abort_on_second_sigint)

  def fail(code: int, message: str) -> int:
    print(f"maxtext-moe: {message}", file=sys.stderr, flush=True)
    return code

  run = None
  try:
    quiet_notices.hold()  # loading the config imports upstream modules that print; held until `verbose` is known
    stop.install(multi_process=launch.discover(os.environ).multi_process)
    run = fork_config.load(args)
    quiet.import_notices(run.fork.verbose)
    if options.print_config:
      print("\n".join(config_report.print_config_checked(run)))
      return lifecycle.EXIT_OK
    summary = run_training(run, stop, dry_run=options.dry_run, overrides=[a for a in args if "=" in a])
  except fork_config.ConfigError as e:
    return fail(lifecycle.EXIT_CONFIG, f"config error: {e}")
  except UpstreamMismatch as e:  # a patch refusing an upstream it was not written for
    return fail(lifecycle.EXIT_UPSTREAM, str(e))
  except lifecycle.FinishedRun as e:
    return fail(lifecycle.EXIT_OK, str(e))
  except lifecycle.RunLocked as e:
    return fail(lifecycle.EXIT_LOCKED, f"run directory locked: {e}")
  except checkpoint_guard.NonFiniteState as e:
    return fail(lifecycle.EXIT_NONFINITE, f"non-finite state: {e}")
  except overflow.DispatchOverflow as e:
    return fail(lifecycle.EXIT_MOE_OVERFLOW, f"MoE dispatch overflow: {e}")
  except disk_full.StorageFailure as e:
    _exit_now(lifecycle.EXIT_SAVE_FAILED, str(e))
  except KeyboardInterrupt:
    _exit_now(lifecycle.EXIT_ABORTED, _ABORTED)
  except Exception as e:  # pylint: disable=broad-exception-caught
    if (backend := config_checks.backend_failure(e)) is not None:  # before anything was written
      return fail(lifecycle.EXIT_CONFIG, f"config error: {backend}")
    if (oom := out_of_memory_line(e, run)) is not None:
      return fail(lifecycle.EXIT_OUT_OF_MEMORY, oom)
    if run is None or not disk_full.is_storage_failure(e):
      raise
    # A full disk outside the training loop (the lock, the run's records, summary.json): no hang at exit.
    _exit_now(lifecycle.EXIT_SAVE_FAILED, disk_full.line(e, run.run_dir))
  return lifecycle.EXIT_PREEMPTED if summary.get("stopped") else lifecycle.EXIT_OK


def check_data_on_process_0(run: fork_config.RunConfig, config: Any, process_id: int) -> None:
  """The data files and the tokenizer (MaxText/data_checks.py), read by process 0 alone: the checks glob and stat
  every shard, which a thousand processes would do a thousand times over one shared filesystem. The verdict is
  shared (one all-gather), so every process stops on bad data, process 0 with the line naming the key."""
  from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

  error = None
  if process_id == 0:
    try:
      data_checks.check(run, config)
    except fork_config.ConfigError as e:
      error = e
  if not checkpoint_restore.agree(error is None)[0]:
    raise error or fork_config.ConfigError("the data checks failed on process 0, whose line names the key")


def out_of_memory_line(e: BaseException, run: fork_config.RunConfig | None) -> str | None:
  """XLA running out of device memory (RESOURCE_EXHAUSTED, at the compile or at a step) as one line naming XLA's
  figure and what to change; None for any other error."""
  text = str(e)
  if "RESOURCE_EXHAUSTED" not in text or "memory" not in text.lower():
    return None
  said = next((" ".join(line.split()) for line in text.splitlines() if "RESOURCE_EXHAUSTED" in line), text)[:240]
  config = run.config_path if run is not None else "CONFIG"
  return (f"out of device memory: {said}; scripts/plan.sh {config} (with the same key=value overrides) shows what "
          "the step needs: lower per_device_batch_size, or set remat_policy=full or xla_presets=[host_offload]")


def _exit_now(code: int, message: str) -> None:
  """Exits without waiting for orbax's writer threads, which a failed or
  interrupted save leaves mid-write (a normal exit would print their errors
  after our line); a partial step directory is never resumed from."""
  print(f"maxtext-moe: {message}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  logging.shutdown()
  os._exit(code)  # pylint: disable=protected-access


_ABORTED = "aborted by a second SIGINT; nothing saved since the last checkpoint"


def _abort_on_second_sigint() -> None:
  """StopRequest's abort, run inside the signal handler at whatever bytecode the main thread was at: the line
  goes straight to fd 2 (print could re-enter a stream the main thread is in the middle of writing), then the
  process ends, as _exit_now's does."""
  os.write(2, f"maxtext-moe: {_ABORTED}\n".encode())
  try:
    sys.stdout.flush()
  except Exception:  # pylint: disable=broad-except
    pass  # a write the signal interrupted: its bytes are lost with the process either way
  os._exit(lifecycle.EXIT_ABORTED)  # pylint: disable=protected-access


def cli() -> None:
  try:
    sys.exit(main())
  except BrokenPipeError:  # a reader that stopped early (`--help | head`): no traceback
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(lifecycle.EXIT_ERROR)


if __name__ == "__main__":
  cli()
