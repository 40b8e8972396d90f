"""Seam: the notices of maxtext.common.gcloud_stub (maxtext 0.2.5), held back unless `verbose=true`.

With DECOUPLE_GCLOUD=TRUE (our default, MaxText/run/main.py) every upstream module that reaches for a
Google Cloud client gets a stub, and gcloud_stub says so with a bare print() on stdout, at import time:
eight `[DECOUPLED NO-OP] ...: using stub(s).` lines before a run's first line of ours, one of them on
`--print-config`'s stdout. A module global named `print` shadows the builtin for every function of
that module (the stubs' own methods too), so the seam is one name added to the module and removed by
`undo`. The guard hashes the whole module: every print in it is such a notice.

The entry point holds the lines back (`hold`) before our config is loaded, since loading it imports
upstream modules that print; once the run's `verbose` is known, `release` prints them (and restores
upstream's print) or drops them, and any later ones.
"""

from __future__ import annotations

import builtins
import importlib
from typing import Any

from patches._seam import Seam

SEAM = Seam(
    name="quiet_notices",
    module="maxtext.common",
    attr="gcloud_stub",  # the module itself: its source hash covers every print it makes
    sha256="15129dd38d5c2384",
)
_STUB_MODULE = "maxtext.common.gcloud_stub"
importlib.import_module(_STUB_MODULE)  # so that the guard can read it; importing it prints nothing

# What the stub module printed while held, as print()'s arguments; None once the lines are dropped.
_held: list[tuple[tuple[Any, ...], dict[str, Any]]] | None = []


def _print(*args: Any, **kwargs: Any) -> None:
  if _held is not None:
    _held.append((args, kwargs))


def held_lines() -> list[str]:
  """The notices held so far (for tests and --verbose's replay)."""
  return [" ".join(str(a) for a in args) for args, _ in (_held or [])]


def wanted(fork) -> bool:
  return not getattr(fork, "verbose", False)


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  SEAM.check()
  module = importlib.import_module(_STUB_MODULE)
  module.print = _print  # shadows builtins.print inside gcloud_stub only


def hold() -> None:
  """The entry point's first step: hold the notices from now until `release`."""
  global _held
  _held = []
  apply()


def release(show: bool) -> None:
  """`show` (verbose=true): print the held notices as upstream would have, and print from now on;
  else drop them, and any later ones."""
  global _held
  if show:
    for args, kwargs in _held or []:
      builtins.print(*args, **kwargs)
    undo()
  else:
    _held = None


def undo() -> None:
  global _held
  module = importlib.import_module(_STUB_MODULE)
  if module.__dict__.get("print") is _print:
    del module.print
  _held = []
