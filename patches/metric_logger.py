"""Seam: maxtext.common.metric_logger.MetricLogger.write_metrics (maxtext 0.2.5).

Every train step's scalars pass through `write_metrics(metrics, step, "train")`
once they are materialized (upstream defers them one step so the host never
blocks the device). We observe them there, after upstream has logged them, to
drive our progress line and run summary (MaxText/run/metrics.py).

Our `moe/` statistics (patches/moe_metrics.py) are computed every step in the
jitted function; here the host keeps them only every moe_metrics_every_n_steps
steps (dropped from what upstream logs otherwise), and on those steps writes
the tokens-per-expert histograms and, every moe_metrics_heatmap_every_n_steps,
the layers x experts heatmap (MaxText/heatmap.py) into upstream's own
TensorBoard writer, and the heatmap's numbers on process 0's stdout. Scalars
computed on the host for a step (add_scalars: the moe_time/ split of
patches/moe_profile.py) join that step's metrics. Upstream's behaviour is
otherwise unchanged.
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
_moe = {"every": 0, "heatmap_every": 0}
_mfu_peak_flops: list[float | None] = [None]  # per device; set by MaxText/run/loop.py once devices are known
_extra: dict[int, dict[str, float]] = {}  # step -> scalars computed on the host (patches/moe_profile.py)


def set_mfu_peak(peak_flops: float | None) -> None:
  _mfu_peak_flops[0] = peak_flops


def add_scalars(step: int, scalars: dict[str, float]) -> None:
  """Host-side scalars written with train step `step`'s own metrics (upstream writes a step one step later)."""
  _extra.setdefault(int(step), {}).update(scalars)


def _lead_process() -> bool:
  import jax  # pylint: disable=import-outside-toplevel

  return jax.process_index() == 0  # the others' writer is upstream's no-op stub: the heatmap is printed once


def _keep_moe(step: int) -> bool:
  return _moe["every"] > 0 and (step + 1) % _moe["every"] == 0


def _wrap(original):
  def write_metrics(self, metrics, step, metric_type="train"):
    counts_LE = None
    if metric_type == "train" and metrics and "moe_expert_counts_LE" in metrics:
      metrics = dict(metrics)
      counts_LE = metrics.pop("moe_expert_counts_LE")
      if not _keep_moe(int(step)):
        counts_LE = None
        metrics["scalar"] = {k: v for k, v in metrics["scalar"].items() if not k.startswith("moe/")}
    extra = _extra.pop(int(step), None) if metric_type == "train" else None
    if extra and metrics:
      metrics = {**metrics, "scalar": {**metrics.get("scalar", {}), **extra}}
    tflops = (metrics or {}).get("scalar", {}).get("perf/per_device_tflops_per_sec")
    if metric_type == "train" and _mfu_peak_flops[0] and tflops is not None:  # perf/mfu next to upstream's TFLOP/s
      metrics = {**metrics, "scalar": {**metrics["scalar"], "perf/mfu": float(tflops) * 1e12 / _mfu_peak_flops[0]}}
    original(self, metrics, step, metric_type)
    if counts_LE is not None and getattr(self, "writer", None) is not None and hasattr(self.writer, "add_histogram"):
      from MaxText.console import progress  # pylint: disable=import-outside-toplevel
      from MaxText.moe import heatmap  # pylint: disable=import-outside-toplevel

      draw = _moe["heatmap_every"] > 0 and (int(step) + 1) % _moe["heatmap_every"] == 0
      heatmap.write(self.writer, counts_LE, int(step), heatmap=draw)
      if draw and _lead_process():
        progress.say("\n".join(f"[maxtext-moe] {line}" for line in heatmap.heatmap_lines(counts_LE, int(step))))
    if metric_type == "train" and metrics and _observer is not None:
      _observer(int(step), metrics.get("scalar", {}))

  write_metrics.__wrapped__ = original
  return write_metrics


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True


def apply(fork=None, hooks=None) -> None:
  global _observer
  _observer = hooks.on_train_step if hooks is not None else None
  _moe["every"] = getattr(fork, "moe_metrics_every_n_steps", 0) or 0
  _moe["heatmap_every"] = getattr(fork, "moe_metrics_heatmap_every_n_steps", 0) or 0
  SEAM.apply(_wrap)


def undo() -> None:
  global _observer
  _observer = None
  _moe.update(every=0, heatmap_every=0)
  _extra.clear()
  SEAM.undo()
