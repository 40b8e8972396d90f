"""Runtime patches to upstream MaxText, one module per seam.

Nothing outside this package touches upstream internals. Each module declares
a `SEAM` (patches/_seam.py) that checks the installed maxtext version and the
target's source hash before it patches, refuses on a mismatch, is idempotent,
and can be undone.

`apply_all` is what `python -m MaxText.train` calls; tests use `undo_all`.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from patches._seam import UPSTREAM_VERSION, Seam, UpstreamMismatch, installed_maxtext_version

# Seam modules in the order they are applied. Each exposes SEAM, apply(...), undo().
SEAM_MODULES = (
    "patches.config_errors",
    "patches.metric_logger",
    "patches.tensorboard",
)


def seams() -> list[Seam]:
  return [importlib.import_module(name).SEAM for name in SEAM_MODULES]


def check_all() -> None:
  """Raises UpstreamMismatch for the first seam whose target moved; patches nothing."""
  for seam in seams():
    seam.check()


def apply_all(fork_config: Any, on_train_step: Callable[[int, dict], None] | None = None) -> list[str]:
  """Applies every seam for this run; returns the names applied.

  All seams are checked first, so a mismatch leaves upstream untouched.
  """
  del fork_config  # seams that need our keys read them here as they are added
  check_all()
  importlib.import_module("patches.config_errors").apply()
  importlib.import_module("patches.metric_logger").apply(on_train_step or (lambda step, scalars: None))
  importlib.import_module("patches.tensorboard").apply()
  return [seam.name for seam in seams() if seam.applied]


def undo_all() -> None:
  for name in reversed(SEAM_MODULES):
    importlib.import_module(name).undo()


__all__ = ["UPSTREAM_VERSION", "Seam", "UpstreamMismatch", "apply_all", "check_all", "installed_maxtext_version", "seams", "undo_all"]
