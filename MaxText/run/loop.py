"""The training run: checks, the run directory's lock and records, upstream's pre-training main under our
step hooks, and the closing summary."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Sequence

from MaxText import config as fork_config
from MaxText import hardware
from MaxText.checkpoints import run_records
from MaxText.config import checks as config_checks
from MaxText.config import data_checks
from MaxText.config import command_line
from MaxText.config import environment
from MaxText.config import report as config_report
from MaxText.config import xla_presets
from MaxText.console import progress as progress_lines
from MaxText.run import quiet
from MaxText.run import disk_full
from MaxText.run import launch
from MaxText.run import lifecycle
from MaxText.run import metrics
from patches import grain_iterator_close


log = progress_lines.log


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


def run_training(run: fork_config.RunConfig, stop: lifecycle.StopRequest | None = None,
                 dry_run: bool = False, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """Trains; the summary's "stopped" entry says whether a stop signal ended the run early. With
  `dry_run`, stops after every check, before writing or compiling (`overrides`: the command line's key=value
  arguments, for the plan command it prints)."""
  import patches  # pylint: disable=import-outside-toplevel
  from patches import checkpoint_guard, checkpoint_restore, data_passes, metric_logger, moe_profile, step_metrics  # pylint: disable=import-outside-toplevel

  stop = stop or lifecycle.StopRequest()
  config_checks.check_fork(run)
  prepared = environment.prepare_environment(run)
  run, env, composed = prepared.run, prepared.env, prepared.composed
  process = launch.start(run, check_devices=not dry_run)  # jax.distributed (+ device checks), before upstream's
  # A dry run of a recipe for GPUs this machine lacks checks its mesh against its own GPU count instead.
  elsewhere = launch.devices_elsewhere(run) if dry_run else None
  if dry_run and elsewhere is None:
    launch.check_devices_fit(run)
  config_checks.check_backends(run)  # our MoE backends against this platform, before the patches resolve them
  tracker: list[_StepHook] = []
  on_restored: list[Any] = []
  on_data_pass: list[Any] = []
  hooks = patches.Hooks(on_train_step=lambda step, scalars: tracker[0](step, scalars),
                        on_expert_counts=lambda counts_E: tracker[0].tracker.on_expert_counts(counts_E),
                        stop_signal=lambda: stop.signal_name, step_scalars=step_metrics.latest_scalars,
                        on_restored=lambda step: on_restored[0](step),
                        on_data_pass=lambda pass_no, step: on_data_pass[0](pass_no, step))
  applied, config = environment.apply_patches_and_validate(run, hooks)
  # Every process trains and keeps its own summary (<run>/maxtext-moe/summary.rank<k>.json in a multi-process
  # job); only the first writes the run's own files and prints the [progress] lines, the compile and checkpoint
  # lines and the closing summary (torchtitan's LOG_RANK=0), which would otherwise come once per process.
  lead = process.process_id == 0
  records = run_records.RunRecords(run, config, lead)  # the run directory's records: resume, schedule, data passes
  on_data_pass.append(records.data_pass)
  if elsewhere is None:
    config_checks.check_devices(run, config)
    if not dry_run:
      launch.check_mesh_on_hosts(config)  # a node's ici_* group on one host, before anything is compiled
  records.check()  # before anything is compiled: the routing bias's semantics and the pipeline layout
  check_data_on_process_0(run, config, process.process_id)  # before the run directory exists
  if dry_run:
    for line in records.preview():  # read-only; a run checks this under the lock
      log(line)
    for line in config_report.dry_run_report(run, process, elsewhere, overrides):
      log(line)
    return {}

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
    opened = records.open()  # before upstream's main: checkpoints set aside, what the resume changes

    def record_run(restored: int | None) -> None:
      """Once upstream's restore settled where the run starts; a resume refused there writes nothing."""
      start = records.start(restored)
      data_passes.start(start.step, start.data_pass)
      if lead:
        write_run_files(run, env, applied, xla_presets.report(composed))

    on_restored.append(record_run)
    log(f"run directory {run.run_dir}")
    for line in opened:
      log(line)
    for line in start_lines(run, process, composed, env, applied):
      log(line)

    from absl import app  # pylint: disable=import-outside-toplevel
    from maxtext.trainers.pre_train import train as upstream_train  # pylint: disable=import-outside-toplevel

    quiet.install_filter(run.fork.verbose)
    quiet.closed_loop_hooks(run.fork.verbose)
    quiet.shared_memory_echo(run.fork.verbose)  # before grain starts a worker, and with it the resource tracker
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
      records.nonfinite_stop(e.step, checkpoint_restore.skipped)  # what the next resume skips
      raise
    except fork_config.ConfigError as e:
      changed = records.changed_since()
      if changed:
        raise fork_config.ConfigError(f"{e}; config keys changed since: {changed}") from e
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      if not disk_full.is_storage_failure(e):  # a full disk, whoever wrote first: TensorBoard, metrics, a checkpoint
        raise
      written = disk_full.try_write(lambda: close_summary(records, progress, compiles, process))
      raise disk_full.StorageFailure(disk_full.line(e, run.run_dir, written)) from e
    finally:
      compiles.stop()
      grain_iterator_close.close_open_iterators()  # now, not in exit's finalizers (patches/grain_iterator_close.py)
  finally:
    if lock:
      lock.release()
  summary = close_summary(records, progress, compiles, process)
  if lead:
    metrics.print_summary(summary)
  if summary.get("data_exhausted"):
    print(f"maxtext-moe: {data_exhausted_line(summary['data_exhausted'])}", file=sys.stderr, flush=True)
  if summary["stopped"]:
    s = summary["stopped"]
    if s["saved"] is not None:
      said = f"checkpoint of step {s['saved']} saved; run again with the same run_name to resume"
    else:
      said = (f"checkpointing is off (enable_checkpointing=false), so the {s['step'] + 1} steps trained are lost; "
              "a rerun starts at step 0")
    print(f"maxtext-moe: stopped by {s['signal']} after step {s['step']}: {said} (exit {command_line.EXIT_PREEMPTED})",
          file=sys.stderr, flush=True)
  return summary


def close_summary(records: run_records.RunRecords, progress: metrics.ProgressTracker,
                  compiles: progress_lines.CompileWatch, process: launch.ProcessInfo) -> dict[str, Any]:
  """The closing summary, written to summary.json (process 0) and summary.rank<k>.json (several processes)."""
  from patches import checkpoint_guard, data_passes, step_metrics  # pylint: disable=import-outside-toplevel

  run, run_dir = records.run, records.run.run_dir
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
  summary["data_passes"] = data_passes.current_pass() if data_passes.reading() else None  # grain's passes
  summary["data_epochs_per_pass"] = data_passes.epochs_per_pass() if data_passes.reading() else None  # num_epoch
  summary["data_exhausted"] = dict(data_passes.exhausted) or None
  if process.num_processes > 1:
    metrics.write_summary(summary, records.files, f"summary.rank{process.process_id}.json")
  if records.lead:
    metrics.write_summary(summary, run_dir)
  return summary


def data_exhausted_line(e: dict[str, Any]) -> str:
  """data_exhausted=stop's line: the files, the step whose batch was missing, and what was saved."""
  if e["saved"] is not None:
    saved = f"checkpoint of step {e['saved']}, the last step trained, saved"
  else:
    saved = "no step trained by this invocation, its last checkpoint kept"
  lacking = e.get("processes")  # several processes: whose shard ran out (the others stopped with them)
  where = f" on process{'es' if len(lacking) > 1 else ''} {', '.join(map(str, lacking))}" if lacking else ""
  return (f"data exhausted: grain_train_files {e['files']!r} ran out at step {e['step']}{where} (pass {e['pass']}, "
          f"data_exhausted=stop); {saved}; add data, or set data_exhausted=repeat for another pass, and run again "
          f"with the same run_name (exit {command_line.EXIT_DATA_EXHAUSTED})")


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
  if verbose or xla_flags != environment.NEUTRAL_XLA_FLAGS:
    lines.append(f"XLA_FLAGS={xla_flags}")
  return lines


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

  return progress_lines.CompileWatch(environment.TRAIN_STEP, on_phase, on_compiled).start()


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
