"""Seam: maxtext.utils.max_utils.initialize_summary_writer (maxtext 0.2.5).

With DECOUPLE_GCLOUD=TRUE (our default: no Google Cloud client is touched),
upstream never imports tensorboardX and hands back a no-op writer, or writes
into a folder next to its own installed package. Yet it still prints the
"tensorboard --logdir" hint. We write real event files to the run's
`tensorboard_dir`, where upstream's non-decoupled path would put them.

The events are written in the caller's thread, not by tensorboardX's writer
thread: on a full disk that thread died with a traceback, its
multiprocessing queue filled, and the next `add_scalar` (or tensorboardX's
atexit close) blocked for good (a run hung over 10 minutes at exit, deaf to
SIGTERM). Written here, a full disk is an OSError naming the event file, which
the trainer turns into its one exit-6 line. An event is a few hundred bytes
into a buffered file, flushed when upstream flushes (every log_period).
"""

from __future__ import annotations

import os

from patches._seam import Seam

SEAM = Seam(
    name="tensorboard",
    module="maxtext.utils.max_utils",
    attr="initialize_summary_writer",
    sha256="69640817273d4bbe",
)


class _EventFile:
  """tensorboardX's EventFileWriter interface (add_event, flush, close, get_logdir, reopen), synchronous."""

  def __init__(self, logdir: str, filename_suffix: str = ""):
    from tensorboardX.event_file_writer import EventsWriter  # pylint: disable=import-outside-toplevel

    self._logdir = logdir
    self._path = os.path.join(logdir, "events.out.tfevents")
    os.makedirs(logdir, exist_ok=True)
    self._writer = self._call(lambda: EventsWriter(os.path.join(logdir, "events"), filename_suffix))
    self._path = getattr(self._writer, "_file_name", self._path)
    self._closed = False

  def _call(self, write):
    try:
      return write()
    except OSError as e:  # a buffered write's error names no file: name the event file
      if e.filename:
        raise
      raise OSError(e.errno, e.strerror, self._path) from e

  def get_logdir(self) -> str:
    return self._logdir

  def add_event(self, event) -> None:
    if not self._closed:
      self._call(lambda: self._writer.write_event(event))

  def flush(self) -> None:
    if not self._closed:
      self._call(self._writer.flush)

  def close(self) -> None:
    if not self._closed:
      self._closed = True
      self._call(self._writer.close)

  def reopen(self) -> None:
    pass  # never closed by upstream mid-run


def summary_writer(logdir: str):
  """tensorboardX's SummaryWriter whose file writer writes synchronously (_EventFile)."""
  from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  from tensorboardX.writer import FileWriter  # pylint: disable=import-outside-toplevel

  class _FileWriter(FileWriter):
    def __init__(self, logdir, max_queue=10, flush_secs=120, filename_suffix=""):  # pylint: disable=super-init-not-called,unused-argument
      # FileWriter.__init__ would start the writer thread and register its atexit close.
      self.event_writer = _EventFile(str(logdir), filename_suffix)
      self._default_metadata = {}

  class _SummaryWriter(SummaryWriter):
    def _get_file_writer(self):
      if not self._write_to_disk:
        return super()._get_file_writer()
      if self.all_writers is None or self.file_writer is None:
        self.file_writer = _FileWriter(self.logdir, filename_suffix=self._filename_suffix)
        self.all_writers = {self.file_writer.get_logdir(): self.file_writer}
      return self.file_writer

  return _SummaryWriter(logdir)


def wrap(original):
  def initialize_summary_writer(tensorboard_dir, run_name, enable_tensorboard=True):
    import jax  # pylint: disable=import-outside-toplevel

    if jax.process_index() != 0 or not enable_tensorboard:
      return original(tensorboard_dir, run_name, enable_tensorboard)
    # Same layout as upstream's non-decoupled path: <tensorboard_dir>/<run_name>.
    logdir = os.path.join(tensorboard_dir, run_name) if run_name else tensorboard_dir
    os.makedirs(logdir, exist_ok=True)
    return summary_writer(logdir)

  initialize_summary_writer.__wrapped__ = original
  return initialize_summary_writer


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True
