"""Run progress and the closing summary, fed per train step by
patches/metric_logger.py with the scalars upstream already computed."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from MaxText.console.progress import fmt_bytes, fmt_seconds, say


@dataclass
class StepRecord:
  step: int
  loss: float
  step_time_s: float
  tflops_per_device: float | None
  tokens_per_s_per_device: float | None
  moe: dict[str, float] = field(default_factory=dict)  # MOE_SCALARS this step logged
  grad_norm: float | None = None  # upstream's learning/raw_grad_norm: the backward's, before clipping


# Upstream's per-step MoE scalars kept in the summary (the diag/ ones need log_step_diagnostics=true):
# the balance and MTP losses, the routing-bias checksum (sum of every updated bias) and how many
# bias entries this step's update moved.
MOE_SCALARS = ("learning/moe_lb_loss", "learning/mtp_loss", "diag/moe_bias_checksum", "diag/moe_bias_update_nonzero")


@dataclass
class ProgressTracker:
  """Collects per-step scalars; prints a progress line with the ETA.

  `total_steps` is the run's last step + 1 (upstream counts steps from 0).
  Step-time statistics skip the warm-up steps (steady_records).
  """

  total_steps: int
  print_every: int = 1
  records: list[StepRecord] = field(default_factory=list)
  expert_load: list[float] = field(default_factory=list)  # max/mean tokens per expert, per MoE layer call
  moe_load: dict[str, Any] | None = None  # the last kept step's moe/ statistics (moe_metrics_every_n_steps)
  started: float = field(default_factory=time.monotonic)
  peak_flops: float | None = None  # per device, for MFU (MaxText/hardware.py mfu_peak); None: n/a
  peak_label: str = "n/a"
  _peak_said: bool = field(default=False, repr=False)  # the MFU's peak (or why none) goes on the first line only

  def on_train_step(self, step: int, scalars: dict[str, Any]) -> None:
    def scalar(name):
      value = scalars.get(name)
      return None if value is None else float(value)

    record = StepRecord(
        step=step,
        loss=scalar("learning/loss"),
        step_time_s=scalar("perf/step_time_seconds") or 0.0,
        tflops_per_device=scalar("perf/per_device_tflops_per_sec"),
        tokens_per_s_per_device=scalar("perf/per_device_tokens_per_sec"),
        moe={name: scalar(name) for name in MOE_SCALARS if scalars.get(name) is not None},
        grad_norm=scalar("learning/raw_grad_norm"),
    )
    self.records.append(record)
    self._on_moe_stats(step, scalars)
    if self.print_every and ((step + 1) % self.print_every == 0 or step + 1 == self.total_steps):
      say(self.progress_line(record))

  def _on_moe_stats(self, step: int, scalars: dict[str, Any]) -> None:
    """Keeps the latest moe/ statistics (patches/moe_metrics.py); warns loudly when rows were dropped."""
    if "moe/max_over_mean" not in scalars:
      return
    layers = {}
    for name, value in scalars.items():
      if name.startswith("moe/layer_") and name.endswith("/max_over_mean"):
        layers[int(name.split("/")[1][len("layer_"):])] = float(value)
    worst = max(layers, key=layers.get) if layers else None
    self.moe_load = {name[len("moe/"):]: float(v) for name, v in scalars.items()
                     if name.startswith("moe/") and not name.startswith("moe/layer_")}
    self.moe_load.update(step=step, worst_layer=worst, worst_layer_max_over_mean=layers.get(worst))
    if self.moe_load.get("overflow_layers", 0) > 0 or self.moe_load.get("dropped_tokens", 0) > 0:
      print(f"[maxtext-moe] WARNING step {step + 1}: {int(self.moe_load.get('overflow_layers', 0))} MoE layer(s) "
            f"overflowed their bounded dispatch buffer, {int(self.moe_load.get('dropped_tokens', 0))} token-expert "
            "rows were DROPPED (raise the capacity factor)",
            file=sys.stderr, flush=True)

  def on_expert_counts(self, counts_E) -> None:
    """One MoE layer call's tokens per expert (moe_log_expert_load), in arrival order."""
    counts = [float(c) for c in counts_E]
    mean = sum(counts) / len(counts)
    if mean > 0:
      self.expert_load.append(max(counts) / mean)

  def expert_load_summary(self) -> dict[str, Any] | None:
    """Max/mean tokens per expert, averaged over the first and last tenth of the layer calls.

    Calls arrive asynchronously (and twice per layer under remat), so they are not matched to
    steps; the first and last tenth are the run's start and end."""
    if not self.expert_load:
      return None
    tenth = max(1, len(self.expert_load) // 10)
    first, last = self.expert_load[:tenth], self.expert_load[-tenth:]
    return {"layer_calls": len(self.expert_load), "max_over_mean_first_tenth": sum(first) / len(first),
            "max_over_mean_last_tenth": sum(last) / len(last)}

  def steady_records(self) -> list[StepRecord]:
    """Steps after warm-up. Upstream times a step from host dispatch to the
    next, so the first steps hold compilation and async catch-up (on an H200
    the proxy's steps 0-2 read 0.69, 0.89 and 0.02 s, then 1.13 s steadily):
    skip 3 when there are enough steps, else the first."""
    skip = 3 if len(self.records) > 6 else 1
    return self.records[skip:] or self.records

  def steady_step_times(self) -> list[float]:
    return [r.step_time_s for r in self.steady_records()]

  def progress_line(self, record: StepRecord) -> str:
    """The run's one line a step (upstream's own per-step line shows only with verbose=true): this step's loss,
    time, TFLOP/s and tokens/s per device (upstream's figures), the ETA from the median step so far, and MFU.
    The first line says what MFU is measured against, or why there is none; the later ones say it no more."""
    done = record.step + 1
    remaining = max(self.total_steps - done, 0)
    per_step = statistics.median(self.steady_step_times())
    pct = 100.0 * done / max(self.total_steps, 1)
    mfu = self.mfu(record)
    if mfu is None:
      mfu_text = "MFU n/a" if self._peak_said else f"MFU {self.peak_label}"
    else:
      mfu_text = f"MFU {100 * mfu:.1f}%" + ("" if self._peak_said else f" of {self.peak_label}")
    self._peak_said = True
    return (f"[progress] step {done}/{self.total_steps} ({pct:.0f}%): loss {record.loss:.4f}, "
            f"{record.step_time_s:.3f} s, {_rate(record.tflops_per_device)} TFLOP/s/device, "
            f"{_rate(record.tokens_per_s_per_device)} tokens/s/device, ETA {fmt_seconds(remaining * per_step)}, "
            f"{mfu_text}")

  def mfu(self, record: StepRecord) -> float | None:
    """Upstream's model TFLOP/s per device over the dense bf16 peak (None: peak unknown, e.g. CPU)."""
    if self.peak_flops is None or not record.tflops_per_device:
      return None
    return record.tflops_per_device * 1e12 / self.peak_flops

  def summary(self, run_dir: Path, upstream: dict[str, Any]) -> dict[str, Any]:
    steady = self.steady_step_times()
    tflops = [r.tflops_per_device for r in self.steady_records() if r.tflops_per_device]
    tokens = [r.tokens_per_s_per_device for r in self.steady_records() if r.tokens_per_s_per_device]
    return {
        "steps_completed": len(self.records),
        "last_step": self.records[-1].step if self.records else None,
        "median_step_time_s": statistics.median(steady) if self.records else None,
        "median_tflops_per_device": statistics.median(tflops) if tflops else None,
        "median_tokens_per_s_per_device": statistics.median(tokens) if tokens else None,
        "first_loss": self.records[0].loss if self.records else None,
        "final_loss": self.records[-1].loss if self.records else None,
        "wall_time_s": time.monotonic() - self.started,
        "run_dir": str(run_dir),
        "checkpoints": str(run_dir / "checkpoints") if upstream.get("enable_checkpointing", True) else None,
        "tensorboard": str(run_dir / "tensorboard"),
        "losses": {r.step: r.loss for r in self.records},
        "grad_norms": {r.step: r.grad_norm for r in self.records if r.grad_norm is not None},
        "moe_scalars": {r.step: r.moe for r in self.records if r.moe},
        "expert_load": self.expert_load_summary(),
        "moe_load": self.moe_load,
    }


def device_memory_peak_bytes() -> int | None:
  """Peak bytes in use on this process's first device (None where the backend
  keeps no statistics, e.g. CPU)."""
  import jax  # pylint: disable=import-outside-toplevel

  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return int(peak) if peak is not None else None


def _rate(value: float | None) -> str:
  """12,345, 453.2, 9.87, 0.00612: three significant digits below 10, never an exponent."""
  if value is None:
    return "n/a"
  if value >= 10:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"
  return f"{value:.{max(0, 2 - math.floor(math.log10(value)))}f}" if value > 0 else "0"


def summary_lines(summary: dict[str, Any]) -> list[str]:
  """The closing summary: what the run did, how fast, and where its outputs are."""
  def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)

  done = summary["steps_completed"]
  last = summary["last_step"]
  steps = f"{done} steps ({last - done + 1}-{last})" if done else "0 steps"
  compiled = f" (the train step compiled in {summary['compile_s']:.1f} s)" if summary.get("compile_s") is not None else ""
  peak = summary.get("peak_device_memory_gib")
  return [
      f"[maxtext-moe] run summary: {steps} in {fmt_seconds(summary['wall_time_s'])}{compiled}; loss "
      f"{fmt(summary['first_loss'], '.4f')} -> {fmt(summary['final_loss'], '.4f')}",
      f"  step          {fmt(summary['median_step_time_s'], '.3f')} s median after warm-up, "
      f"{_rate(summary['median_tflops_per_device'])} TFLOP/s/device, "
      f"{_rate(summary.get('median_tokens_per_s_per_device'))} tokens/s/device"
      + (f", peak device memory {peak:.2f} GiB" if peak is not None else ""),
      *([f"  expert load   max/mean tokens per expert {load['max_over_mean_first_tenth']:.2f} (first tenth of "
         f"{load['layer_calls']} MoE layer calls) -> {load['max_over_mean_last_tenth']:.2f} (last tenth)"]
        if (load := summary.get("expert_load")) else []),
      *([f"  MoE load      step {m['step'] + 1}: max/mean {m['max_over_mean']:.2f} (worst layer "
         f"{m.get('worst_layer')}), CV {m['cv']:.2f}, {int(m['experts_without_tokens'])} idle expert(s), "
         f"router entropy {m['router_entropy']:.2f}, {int(m['overflow_layers'])} overflowed layer(s)"]
        if (m := summary.get("moe_load")) else []),
      *([f"  data          {_passes_text(summary['data_passes'], summary.get('data_epochs_per_pass') or 1)}"]
        if summary.get("data_passes") else []),
      f"  run directory {summary['run_dir']}",
      f"  checkpoints   {_saves_text(summary) if summary['checkpoints'] else 'disabled'}",
      f"  tensorboard   tensorboard --logdir {summary['tensorboard']}",
  ]


def _passes_text(pass_no: int, epochs: int) -> str:
  """The pass over the grain data; with upstream's num_epoch > 1 a pass holds that many epochs, so "pass 1" alone
  read as one epoch."""
  if epochs == 1:
    return f"pass {pass_no} over the grain data"
  return (f"pass {pass_no} over the grain data, epochs {(pass_no - 1) * epochs + 1}-{pass_no * epochs} (a pass is "
          f"num_epoch={epochs} epochs)")


def print_summary(summary: dict[str, Any]) -> None:
  print("\n".join(summary_lines(summary)), flush=True)


def _saves_text(summary: dict[str, Any]) -> str:
  saves = summary.get("checkpoint_saves")
  if not saves:
    return f"{summary['checkpoints']} (none saved by this run)"
  last = saves[-1]
  return (f"{len(saves)} saved in {summary['checkpoints']}; the last, step {last['step']}: {fmt_bytes(last['bytes'])} "
          f"in {last['seconds']:.1f} s")


def write_summary(summary: dict[str, Any], directory: Path, name: str = "summary.json") -> Path:
  """Atomically (a temporary file, then a rename): a disk that fills mid-write leaves the previous summary or none,
  never an empty or torn one (a full disk left a 0-byte summary.json while the run said it was not written)."""
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / name
  tmp = path.with_name(f".{name}.tmp{os.getpid()}")
  try:
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)
  return path
