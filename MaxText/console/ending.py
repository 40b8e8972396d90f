"""How our commands end and what they keep off the console while they do: shared by the trainer (MaxText/run),
the Hugging Face commands (MaxText/hf) and the patches, which may not import one another.

  flush          stdout and stderr flushed as far as they can be (inside a signal handler too)
  exit_now       the process ended at once, without waiting for orbax's writer threads
  drop_errors    sys.excepthook, threading.excepthook and (optionally) sys.unraisablehook that drop the errors a
                 predicate names and pass every other one on; returns the undo
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, NoReturn


def flush() -> None:
  """A write a signal interrupted fails here, and its bytes are lost with the process either way."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except
      pass


def exit_now(code: int) -> NoReturn:
  """Ends the process without waiting for threads: a failed or interrupted orbax write leaves threads that print,
  or wait, at exit (after our one line)."""
  flush()
  os._exit(code)  # pylint: disable=protected-access


def drop_errors(drops: Callable[[BaseException | None], bool],
                drops_unraisable: Callable[[Any], bool] | None = None) -> Callable[[], None]:
  """Errors for which drops(exception) is true are not printed, whether they end the main thread (sys.excepthook,
  which C code's PyErr_Print also goes through) or another (threading.excepthook, which sys.excepthook does not
  see); with drops_unraisable, unraisable ones (sys.unraisablehook's argument) too. Returns the undo, which puts
  the hooks found back."""
  excepthook, thread_excepthook, unraisablehook = sys.excepthook, threading.excepthook, sys.unraisablehook

  def quiet_excepthook(kind, value, tb):
    if not drops(value):
      excepthook(kind, value, tb)

  def quiet_thread_excepthook(args):
    if not drops(args.exc_value):
      thread_excepthook(args)

  def quiet_unraisablehook(unraisable):
    if not drops_unraisable(unraisable):
      unraisablehook(unraisable)

  sys.excepthook, threading.excepthook = quiet_excepthook, quiet_thread_excepthook
  if drops_unraisable is not None:
    sys.unraisablehook = quiet_unraisablehook

  def undo() -> None:
    sys.excepthook, threading.excepthook, sys.unraisablehook = excepthook, thread_excepthook, unraisablehook

  return undo
