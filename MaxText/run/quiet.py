"""What a run prints at the default verbosity, and what `verbose=true` adds back.

Upstream logs through absl at INFO: its own per-step line (`completed step: N, ...`, counted from 0, beside our
`[progress]` line counted from 1), the system information, the checkpoint manager's steps, memory statistics that
fail on CPU ("Memstats unavailable, error: 'NoneType' object is not subscriptable"), and orbax about a dozen lines a
save. Measured on the quick start before this module: 62 of its 119 lines. At the default verbosity these go
through the logging levels, not prints:

  absl's verbosity at WARNING   upstream's and orbax's INFO lines (set once upstream's absl flags are parsed);
                                its warnings and errors still show, and the INFO lines of ALWAYS_SHOWN (a
                                replayed step)
  XLA's C++ log at WARNING      TF_CPP_MIN_LOG_LEVEL=1 unless the environment sets it (upstream's package sets
                                0, which prints each PjRt client's device count); read when jax is imported
  UpstreamNoise                 orbax's per-file INFO lines and a full disk's tracebacks from orbax's writer
                                threads (our one line says it), in any mode; without verbose, the upstream
                                warnings a user cannot act on (upstream's own deprecated call into orbax)
  closed_loop_hooks             without verbose, "Event loop is closed" from tensorstore's callbacks: an async
                                save that failed (a full disk) leaves tensorstore completing writes whose
                                callbacks find orbax's loop closed; each printed a traceback (PyErr_Print, so
                                sys.excepthook, or unraisable) on whichever thread tensorstore completed the
                                write from, the main one included (tests/test_quiet.py)
  shared_memory_echo            without verbose, Python's resource tracker's "There appear to be N leaked
                                shared_memory objects to clean up at shutdown" after a grain run: the buffers
                                grain's worker had in flight when the iterator closed. The tracker unlinks them
                                (nothing is left in /dev/shm), so the warning, printed after our closing line,
                                asks for nothing

`verbose=true` keeps absl at INFO, as upstream runs. Upstream's bare prints are the patches' business
(patches/quiet_notices.py, released here by import_notices; patches/quiet_tflops.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from MaxText.console import ending

CPP_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
ASYNCIO_LOOP_FILE = os.path.join("asyncio", "base_events.py")  # where call_soon_threadsafe refuses a closed loop

# Upstream warnings that say nothing a user can change, or that ours say already: upstream 0.2.5 passes dataset_type
# to its own checkpointer factory (maxtext/common/checkpointing.py ~551), which then warns that the argument is
# deprecated.
# Orbax's warning as it removes the folder of a save the last run never finished (atomicity.py, on the next save of
# that step): our resume already said it in its words (MaxText/checkpoints/resume.py incomplete_saves).
UNACTIONABLE = ("Specifying dataset_type upon checkpointer creation is deprecated",
                "which already exists. Removing existing directory since it is not finalized")

# Upstream INFO lines a user must see at any verbosity: a step that overflowed its ragged buffer and was run again
# by the dropless program (maxtext/trainers/pre_train/train.py, moe_dropless_fallback=step). The step's own
# metrics come from the replay, which did not overflow, so nothing else of ours says it happened.
ALWAYS_SHOWN = ("Replaying step with dropless buffer",)


def before_jax(environ: dict[str, str] | None = None) -> None:
  """XLA's C++ INFO lines off unless the user's environment says otherwise; before jax is first imported."""
  (os.environ if environ is None else environ).setdefault(CPP_LOG_LEVEL, "1")


def import_notices(verbose: bool) -> None:
  """Upstream's import-time notices: gcloud_stub's (held since the entry point began) and transformers' warnings
  (PyTorch not found, its DeepSeek configs' rope_scaling), whose level transformers reads from the environment
  when it is first imported, which is after this."""
  from patches import quiet_notices  # pylint: disable=import-outside-toplevel

  quiet_notices.release(show=verbose)
  if not verbose:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def upstream_logging(verbose: bool) -> None:
  """absl's level for the run: INFO with verbose, else WARNING. Called inside absl's app.run, whose flag
  parsing sets absl's verbosity from its own `--verbosity` default.

  absl's verbosity is the root logger's level (absl's handler sits on root): WARNING there keeps jax's and
  orbax's INFO lines off. absl's own logger, which upstream's max_logging writes through, stays at INFO so that
  UpstreamNoise can let ALWAYS_SHOWN through and drop the rest."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

  absl_logging.set_verbosity(absl_logging.INFO if verbose else absl_logging.WARNING)
  if not verbose:
    logging.getLogger("absl").setLevel(logging.INFO)


class UpstreamNoise(logging.Filter):
  """Orbax's per-file INFO lines (about 12 a save), the full-disk tracebacks orbax's writer threads each log, in
  their message or in the exception they carry (patches/checkpoint_guard.SaveFailed says it once), and without
  verbose upstream's unactionable warnings."""

  def __init__(self, verbose: bool = False):
    super().__init__()
    self.verbose = verbose

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if not self.verbose and record.levelno < logging.WARNING:
      return any(words in message for words in ALWAYS_SHOWN)
    if not self.verbose and any(words in message for words in UNACTIONABLE):
      return False
    if "/orbax/" not in record.pathname:
      return True
    if record.levelno < logging.WARNING:
      return False
    from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

    if any(words in message for words in checkpoint_guard.NO_SPACE_WORDS):
      return False
    # An async save's commit thread logs "Failed to run N Handler Commit operations ..." with the error only in
    # its exc_info (async_checkpointer.py's _thread_func, about 80 lines of traceback): the disk's words are there.
    failed = record.exc_info[1] if record.exc_info else None
    return failed is None or checkpoint_guard.no_space_reason(failed) is None


# The resource tracker's warning, as a -W filter: the tracker is a process of its own, started on grain's first
# worker, and takes the interpreter's warning options from sys.warnoptions then (multiprocessing.resource_tracker,
# subprocess._args_from_interpreter_flags). The message is matched from its start.
TRACKER_FILTER = "ignore:resource_tracker:UserWarning"


def shared_memory_echo(verbose: bool) -> None:
  """Without verbose, the resource tracker started after this call cleans up grain's in-flight buffers silently."""
  if not verbose and TRACKER_FILTER not in sys.warnoptions:
    sys.warnoptions.append(TRACKER_FILTER)


def install_filter(verbose: bool) -> None:
  absl = logging.getLogger("absl")
  for old in [f for f in absl.filters if isinstance(f, UpstreamNoise)]:
    absl.removeFilter(old)
  absl.addFilter(UpstreamNoise(verbose))


def _a_closed_loops_echo(exc: BaseException | None) -> bool:
  """asyncio's refusal of a callback after its loop closed: the echo of a write orbax abandoned, whose own error
  reaches us (and our line) through orbax. Either called from C (a tensorstore callback: asyncio's
  call_soon_threadsafe is the outermost frame, nothing of Python's above it, on whichever thread tensorstore
  completed the write from, the main thread too) or raised through it off the main thread."""
  if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
    return False
  frames = []
  tb = exc.__traceback__
  while tb is not None:
    frames.append((tb.tb_frame.f_code.co_name, tb.tb_frame.f_code.co_filename))
    tb = tb.tb_next
  if frames and frames[0][0] == "call_soon_threadsafe" and frames[0][1].endswith(ASYNCIO_LOOP_FILE):
    return True
  if threading.current_thread() is threading.main_thread():
    return False  # the main thread's own errors always show
  return any(name == "call_soon_threadsafe" for name, _ in frames)


def closed_loop_hooks(verbose: bool) -> None:
  """sys.excepthook, threading.excepthook and sys.unraisablehook drop _a_closed_loops_echo, unless verbose; every
  other error prints as before. Idempotent."""
  if verbose or getattr(sys.excepthook, "closed_loop_quiet", False):
    return
  ending.drop_errors(_a_closed_loops_echo, lambda unraisable: _a_closed_loops_echo(unraisable.exc_value))  # no undo
  sys.excepthook.closed_loop_quiet = True
