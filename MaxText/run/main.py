"""`python -m MaxText.train [config.yml] [key=value ...]` (MaxText/train.py): the command and its exit codes.

load our config -> set the run's environment -> apply patches -> validate with
upstream -> run upstream's pre-training main -> print the summary.

Everything that can be wrong with the config is reported (one line, exit 2)
before the run directory is created or anything is compiled.
"""

from __future__ import annotations

import logging
import os
import re
import sys

from MaxText import config as fork_config
from MaxText.config import checks as config_checks
from MaxText.config import command_line
from MaxText.config import report as config_report
from MaxText.console import ending
from MaxText.run import quiet
from MaxText.checkpoints import resume
from MaxText.moe import overflow
from MaxText.run import disk_full
from MaxText.run import keeper
from MaxText.run import launch
from MaxText.run import lifecycle
from MaxText.run import loop
from patches import UpstreamMismatch


def main(argv: list[str] | None = None) -> int:
  """Runs; returns one of MaxText/config/command_line.py's exit codes (README "Exit codes")."""
  try:
    options, args = config_report.parse_command_line(sys.argv[1:] if argv is None else list(argv))
  except command_line.CommandLineError as e:
    print(f"maxtext-moe: config error: {e}", file=sys.stderr)
    return command_line.EXIT_CONFIG
  if options.help:
    print(config_report.help_text())
    return command_line.EXIT_OK
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
      return command_line.EXIT_OK
    summary = loop.run_training(run, stop, dry_run=options.dry_run, overrides=[a for a in args if "=" in a])
  except fork_config.ConfigError as e:
    return fail(command_line.EXIT_CONFIG, f"config error: {e}")
  except UpstreamMismatch as e:  # a patch refusing an upstream it was not written for
    return fail(command_line.EXIT_UPSTREAM, str(e))
  except resume.FinishedRun as e:
    return fail(command_line.EXIT_OK, str(e))
  except lifecycle.RunLocked as e:
    return fail(command_line.EXIT_LOCKED, f"run directory locked: {e}")
  except checkpoint_guard.NonFiniteState as e:
    return fail(command_line.EXIT_NONFINITE, f"non-finite state: {e}")
  except overflow.DispatchOverflow as e:
    return fail(command_line.EXIT_MOE_OVERFLOW, f"MoE dispatch overflow: {e}")
  except disk_full.StorageFailure as e:
    _exit_now(command_line.EXIT_SAVE_FAILED, str(e))
  except KeyboardInterrupt:
    _exit_now(command_line.EXIT_ABORTED, _ABORTED)
  except Exception as e:  # pylint: disable=broad-exception-caught
    if (backend := config_checks.backend_failure(e)) is not None:  # before anything was written
      return fail(command_line.EXIT_CONFIG, f"config error: {backend}")
    if (oom := out_of_memory_line(e, run)) is not None:
      return fail(command_line.EXIT_OUT_OF_MEMORY, oom)
    if run is None or not disk_full.is_storage_failure(e):
      keeper.await_verdict(e)  # a collective whose peer died: the keeper's line names it, not a traceback
      raise
    # A full disk outside the training loop (the lock, the run's records, summary.json): no hang at exit.
    _exit_now(command_line.EXIT_SAVE_FAILED, disk_full.line(e, run.run_dir))
  if summary.get("stopped"):
    return command_line.EXIT_PREEMPTED
  return command_line.EXIT_DATA_EXHAUSTED if summary.get("data_exhausted") else command_line.EXIT_OK


# How XLA says an allocation failed. The status code varies with where the failure surfaced, so the allocator's
# words are what is matched (ALLOCATION_WORDS), whatever code precedes them:
#   GPU (BFC allocator): "RESOURCE_EXHAUSTED: Out of memory while trying to allocate N bytes."
#   CPU (PjRt CPU client, host memory): "RESOURCE_EXHAUSTED: Out of memory allocating N bytes." at the step itself,
#     and "INTERNAL: Error dispatching computation: Out of memory allocating N bytes." when the step failed
#     asynchronously and the next computation on its outputs reports it (the finite check before a save did:
#     tests/test_out_of_memory.py makes both happen under an address-space limit)
#   CUDA: "CUDA_ERROR_OUT_OF_MEMORY"; XLA's TPU/GPU buffer allocation: "Error allocating device buffer"
# and numpy on the host: MemoryError("Unable to allocate 510. GiB for an array with shape ...").
HOST_WORDS = "Out of memory allocating"
STATUS_CODES = ("RESOURCE_EXHAUSTED", "INTERNAL", "UNKNOWN")  # the PjRt status a line begins with, kept in ours
ALLOCATION_WORDS = re.compile(r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|error allocating device buffer", re.I)


def out_of_memory_line(e: BaseException, run: fork_config.RunConfig | None) -> str | None:
  """An allocation that failed (XLA's words on a device or on the host, or numpy's MemoryError), at the compile
  or at a step, as one line naming the figure and what to change; None for any other error. The cause chain is
  searched: a wrapper's message (orbax's, upstream's) need not repeat XLA's."""
  found = _allocation_failure(e)
  if found is None:
    return None
  said = next((" ".join(line.split()) for line in found.splitlines() if line.strip()), found)[:240]
  config = run.config_path if run is not None else "CONFIG"
  if HOST_WORDS in said or ALLOCATION_WORDS.search(said) is None:  # the CPU client's words, or numpy's
    return (f"out of host memory: {said}; the step, its state or its data does not fit in this machine's memory (or "
            f"the job's limit, `ulimit -v`): scripts/plan.sh {config} (with the same key=value overrides) shows what "
            "the step needs; lower per_device_batch_size, or set remat_policy=full, or give the job more memory")
  return (f"out of device memory: {said}; scripts/plan.sh {config} (with the same key=value overrides) shows what "
          "the step needs: lower per_device_batch_size, or set remat_policy=full or xla_presets=[host_offload]")


def _allocation_failure(e: BaseException) -> str | None:
  """The text of the first error in e's cause chain that is a failed allocation: from its status code (or the
  allocator's words) on, or a MemoryError's message. A full disk's RESOURCE_EXHAUSTED names no memory."""
  seen: set[int] = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    text = str(e)
    if isinstance(e, MemoryError):
      return text or "MemoryError (no figure given)"
    if (words := ALLOCATION_WORDS.search(text)) is not None:
      line_start = text.rfind("\n", 0, words.start()) + 1
      status = max(text.rfind(code, line_start, words.start()) for code in STATUS_CODES)
      return text[status if status >= 0 else line_start:]
    e = e.__cause__ or e.__context__
  return None


def _exit_now(code: int, message: str) -> None:
  """Exits without waiting for orbax's writer threads, which a failed or
  interrupted save leaves mid-write (a normal exit would print their errors
  after our line); a partial step directory is never resumed from."""
  print(f"maxtext-moe: {message}", file=sys.stderr, flush=True)
  logging.shutdown()
  ending.exit_now(code)


_ABORTED = "aborted by a second SIGINT; nothing saved since the last checkpoint"


def _abort_on_second_sigint() -> None:
  """StopRequest's abort, run inside the signal handler at whatever bytecode the main thread was at: the line
  goes straight to fd 2 (print could re-enter a stream the main thread is in the middle of writing), then the
  process ends, as _exit_now's does."""
  os.write(2, f"maxtext-moe: {_ABORTED}\n".encode())
  ending.exit_now(command_line.EXIT_ABORTED)


def cli() -> None:
  if not keeper.kept() and _multi_process():  # a survivor of a lost process then ends in one line of ours
    sys.exit(keeper.keep([sys.executable, "-m", "MaxText.train", *sys.argv[1:]], launch.discover().process_id))
  try:
    sys.exit(main())
  except BrokenPipeError:  # a reader that stopped early (`--help | head`): no traceback
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(command_line.EXIT_ERROR)


def _multi_process() -> bool:
  try:
    return launch.discover().multi_process
  except launch.LaunchError:
    return False  # main() says what is wrong with the environment, in one line, exit 2


if __name__ == "__main__":
  cli()
