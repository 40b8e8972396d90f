"""SIGTERM (a scheduler's stop) and SIGINT (Ctrl-C) for export_hf and import_hf: one line, exit 143 / 130, and
nothing half-written left: OUT_DIR.tmp, orbax's temporary folders next to it and the lock are removed
(MaxText/hf/output.py), by a process image that no writer thread survives (MaxText/hf/reap.py).

The first signal raises Stopped in the main thread, so that the writer's own clean-up runs as for any failure; a
second one (a clean-up that hangs) removes the same paths and ends the process at once.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Iterator, NoReturn

from MaxText.console import ending
from MaxText.hf import output, quiet
from MaxText.hf.errors import INTERRUPTED, TERMINATED

CODES = {signal.SIGTERM: TERMINATED, signal.SIGINT: INTERRUPTED}


class Stopped(BaseException):
  """A signal, raised wherever the main thread was. A BaseException (as KeyboardInterrupt is), so that no
  `except Exception` on the way (the checkpoint reader turns any read failure into Damaged) takes it for an error."""

  def __init__(self, signum: int):
    self.name = signal.Signals(signum).name
    self.code = CODES[signum]
    super().__init__(self.name)


@contextlib.contextmanager
def on_signals(prog: str, out_dir: Path) -> Iterator[None]:
  """While inside, SIGTERM or SIGINT ends the process with one line and 128 + the signal, the partial output
  removed (exit_stopped); the previous handlers after, so that a caller in the same process (a test) keeps its
  own. Signal handlers can only be set from the main thread, where the CLIs run."""
  stopped: list[int] = []

  def handler(signum, _frame):
    if stopped:
      exit_stopped(prog, Stopped(signum), out_dir)
    stopped.append(signum)
    raise Stopped(signum)

  previous = {s: signal.signal(s, handler) for s in CODES}
  try:
    yield
  except Stopped as e:  # the writer's own clean-up has run on the way out
    exit_stopped(prog, e, out_dir)
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def exit_stopped(prog: str, e: Stopped, out_dir: Path) -> NoReturn:
  """Says so in one line and ends the process without waiting for writer threads (orbax's, mid-write, would go on
  writing). Where this process holds OUT_DIR's lock (a run refused because another holds it leaves that one's
  alone), the partial output and the lock are removed by reap.py once those threads are gone: removed before,
  tensorstore's threads could create its folders again."""
  removed = f", {output.tmp_dir(out_dir)} removed" if output.claimed(out_dir) else ""
  what = f"{out_dir} was complete and is kept" if out_dir.exists() else f"{out_dir} not written"
  quiet.say(f"{prog}: stopped by {e.name}; {what}{removed}", in_handler=True)
  ending.flush()
  if output.held(out_dir):
    output.exit_reaped(out_dir, e.code)
    output.remove_partial(out_dir)  # the exec failed: the best this process can do
    output.release(out_dir)
  ending.exit_now(e.code)
