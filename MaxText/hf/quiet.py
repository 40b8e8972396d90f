"""export_hf and import_hf print our lines only: the libraries' chatter is off before they are imported, and what
orbax's writer threads print while a write fails goes to a file that is dropped.

Measured on a full-disk import before this: 7 lines on stdout (upstream's `[DECOUPLED NO-OP] ...` notices, bare
prints at import time), and on stderr XLA's PjRt INFO lines, transformers' import-time warnings (PyTorch not found,
its DeepSeek configs' rope_scaling), orbax's writer threads' errors and the "Event loop is closed" tracebacks that
tensorstore's callbacks print straight to stderr: 707 lines around our one. The switches are the trainer's
(MaxText/run/quiet.py, which this layer may not import), for good: these commands have no verbose mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Iterator

# Where our lines go: stderr, or a copy of it while fd 2 is diverted (captured_stderr).
_ours = {"fd": 2}


def hush() -> None:
  """The entry point's first step, before jax, transformers or an upstream module is imported."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # XLA's C++ INFO lines (read when jax is first imported)
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers is first imported
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel,unused-import
  from patches import quiet_notices  # pylint: disable=import-outside-toplevel

  quiet_notices.hold()
  quiet_notices.release(show=False)  # gcloud_stub's notices dropped, now and later
  # absl's own logger (made by absl.logging, imported first so that it is absl's class) at WARNING: upstream's
  # and orbax's INFO lines off. orbax's errors while a write fails go to captured_stderr's file.
  logging.getLogger("absl").setLevel(logging.WARNING)


def say(line: str, in_handler: bool = False) -> None:
  """One line of ours on stderr, wherever fd 2 points now: through sys.stderr (which tests capture) unless fd 2 is
  diverted or a signal handler says it (it may have interrupted a write to sys.stderr: os.write is safe there)."""
  if _ours["fd"] == 2 and not in_handler:
    print(line, file=sys.stderr, flush=True)
  else:
    os.write(_ours["fd"], (line.rstrip("\n") + "\n").encode())


@contextlib.contextmanager
def captured_stderr(keep_diverted) -> Iterator[None]:
  """fd 2 into a temporary file while the block runs; given back, and what was written replayed, when it ends,
  unless keep_diverted(exception) says the failure is one we say in our own line: then fd 2 stays in the file for
  the rest of the process (orbax's threads go on printing after the error reaches us) and say() writes to a copy
  of the real stderr."""
  sink = tempfile.TemporaryFile()
  real = os.dup(2)
  sys.stderr.flush()
  os.dup2(sink.fileno(), 2)
  try:
    yield
  except BaseException as e:
    if isinstance(e, Exception) and keep_diverted(e):
      _ours["fd"] = real
      raise
    _restore(sink, real)
    raise
  _restore(sink, real)


def _restore(sink, real: int) -> None:
  sys.stderr.flush()
  os.dup2(real, 2)
  os.close(real)
  sink.seek(0)
  os.write(2, sink.read())
  sink.close()
