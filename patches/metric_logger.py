"""Seam: maxtext.common.metric_logger.MetricLogger.write_metrics (maxtext 0.2.5).

Every train step's scalars pass through `write_metrics(metrics, step, "train")`
once they are materialized (upstream defers them one step so the host never
blocks the device). We observe them there, after upstream has logged them, to
drive our progress line and run summary (MaxText/metrics.py). Upstream's
behaviour is unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from patches._seam import Seam

SEAM = Seam(
    name="metric_logger",
    module="maxtext.common.metric_logger",
    attr="MetricLogger.write_metrics",
    sha256="9fed5b88e209850e",
)

# Called with (step, scalars) for each train step; set by apply().
_observer: Callable[[int, dict[str, Any]], None] | None = None


def _wrap(original):
  def write_metrics(self, metrics, step, metric_type="train"):
    original(self, metrics, step, metric_type)
    if metric_type == "train" and metrics and _observer is not None:
      _observer(int(step), metrics.get("scalar", {}))

  write_metrics.__wrapped__ = original
  return write_metrics


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  global _observer
  _observer = hooks.on_train_step if hooks is not None else None
  SEAM.apply(_wrap)


def undo() -> None:
  global _observer
  _observer = None
  SEAM.undo()
