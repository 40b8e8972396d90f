"""Seam: maxtext.utils.max_utils.initialize_summary_writer (maxtext 0.2.5).

With DECOUPLE_GCLOUD=TRUE (our default: no Google Cloud client is touched),
upstream never imports tensorboardX and hands back a no-op writer, or writes
into a folder next to its own installed package. Yet it still prints the
"tensorboard --logdir" hint. We write real event files to the run's
`tensorboard_dir`, where upstream's non-decoupled path would put them.
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


def _wrap(original):
  def initialize_summary_writer(tensorboard_dir, run_name, enable_tensorboard=True):
    import jax  # pylint: disable=import-outside-toplevel

    if jax.process_index() != 0 or not enable_tensorboard:
      return original(tensorboard_dir, run_name, enable_tensorboard)
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

    # Same layout as upstream's non-decoupled path: <tensorboard_dir>/<run_name>.
    logdir = os.path.join(tensorboard_dir, run_name) if run_name else tensorboard_dir
    os.makedirs(logdir, exist_ok=True)
    return SummaryWriter(logdir)

  initialize_summary_writer.__wrapped__ = original
  return initialize_summary_writer


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  SEAM.apply(_wrap)


def undo() -> None:
  SEAM.undo()
