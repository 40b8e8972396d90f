"""The step estimate as the plan reports it: every term of the schedule's walk (MaxText/plan/schedule.py), the
grouped GEMMs' padding, and what the step rests on among assumed constants (the sensitivity line).

  e = step_report.report(terms, model_flops, recompute_flops)
  e["sensitivity"] = step_report.sensitivity(module, gpu, mesh_shape, nodes, terms, model_flops)
  print("\\n".join(step_report.lines(e)))

Sensitivity: the same module walked again with one link's rates changed: InfiniBand at x0.5 and x2 its datasheet rate
(every collective across nodes), every all-to-all across nodes at x0.5 its planned share of InfiniBand (the NIC's full
rate, assumed), and every all-to-all inside a node at x0.5 its planned rate (the measured 150 of NVLink's 450 GB/s,
ragged_all_to_all its own). Each walk takes the grouped GEMMs' scaling the first one found.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from MaxText import hardware
from MaxText.hardware import Figure, Gpu
from MaxText.plan import memory_ops, schedule


def report(t: schedule.StepTerms, model_flops: float, recompute_flops: float,
           bubble_fraction: float = 0.0) -> dict[str, Any]:
  """The planner report's "estimate": every term in seconds, what each counted, and MaxText's TFLOP/s at the step."""
  return {
      "step_s": t.step_s, "critical_path_s": t.path_s, "compute_s": t.compute_s, "gemm_s": t.gemm_s,
      "fp8_gemm_s": t.fp8_gemm_s, "attention_s": t.attention_s, "hidden_flops_s": t.hidden_flops_s,
      "memory_s": t.memory_s, "collectives_s": t.collectives_s, "exposed_collectives_s": t.exposed_s,
      "overlapped_collectives_s": t.overlapped_s, "offload_s": t.offload_s, "offload_exposed_s": t.offload_exposed_s,
      "contention_s": t.contention_s,
      "bubble_s": t.bubble_s, "bubble_fraction": bubble_fraction,
      "serial_step_s": t.compute_s + t.memory_s + t.collectives_s + t.offload_s + t.bubble_s,
      "flops_per_device": t.counts["gemm_flops"] + t.counts["fp8_flops"] + t.counts["attention_flops"],
      "gemm_flops": t.counts["gemm_flops"], "fp8_flops": t.counts["fp8_flops"], "grouped_flops": t.counts["grouped_flops"],
      "grouped_shapes_flops": t.counts["grouped_flops"] / t.grouped_scale,
      "attention_flops": t.counts["attention_flops"], "memory_bytes": t.counts["memory_bytes"],
      "kernels": int(t.counts["kernels"]), "model_tflops_per_device": model_flops / 1e12,
      "recompute_flops": recompute_flops, "notes": t.notes, "memory_ops": t.memory_ops[:memory_ops.KEPT],
      "tflops_per_gpu": model_flops / 1e12 / t.step_s if t.step_s else None,
  }



def _scaled(figure: Figure, factor: float, what: str) -> Figure:
  return Figure(figure.value * factor, f"sensitivity: {what}")


def _a2a_across(factor: float) -> Callable[[Gpu], Gpu]:
  """Every all-to-all across nodes at `factor` x its planned share of InfiniBand (the assumed 1.0); nothing else."""
  def change(g: Gpu) -> Gpu:
    share = g.a2a_ib_share.value if g.a2a_ib_share else 1.0
    return dataclasses.replace(g, a2a_ib_share=Figure(share * factor, f"sensitivity: all-to-all across nodes x{factor}"))
  return change


def _a2a_inside(factor: float) -> Callable[[Gpu], Gpu]:
  """Every all-to-all inside a node (all_to_all and ragged_all_to_all) at `factor` x its planned rate; nothing else."""
  def change(g: Gpu) -> Gpu:
    a2a = g.a2a_nvlink_bytes or g.nvlink_bytes
    ragged = g.ragged_a2a_bytes or a2a
    what = f"all-to-all inside a node x{factor}"
    return dataclasses.replace(g, a2a_nvlink_bytes=_scaled(a2a, factor, what), ragged_a2a_bytes=_scaled(ragged, factor, what))
  return change


# Each variant scales one link's rates, the same way: an all-to-all "at 0.5 of its link" once set NVLink's to 225 GB/s
# (faster than the measured 150 planned) while it halved InfiniBand's.
VARIANTS: tuple[tuple[str, Callable[[Gpu], Gpu]], ...] = (
    ("IB x0.5", lambda g: dataclasses.replace(g, ib_bytes=_scaled(g.ib_bytes, 0.5, "IB x0.5"))),
    ("IB x2", lambda g: dataclasses.replace(g, ib_bytes=_scaled(g.ib_bytes, 2.0, "IB x2"))),
    ("all-to-all across nodes x0.5", _a2a_across(0.5)),
    ("all-to-all inside a node x0.5", _a2a_inside(0.5)),
)


def sensitivity(module: schedule.Module, gpu: Gpu, mesh_shape: dict[str, int], nodes: list[int],
                terms: schedule.StepTerms, model_flops: float, fp8_experts: bool = False, counted_flops: float = 0.0,
                bubble_fraction: float = 0.0) -> list[dict[str, Any]]:
  """The step and TFLOP/s/GPU under each of VARIANTS (the module docstring), as planned first."""
  out = [{"label": "as planned", "step_s": terms.step_s, "tflops_per_gpu": model_flops / 1e12 / terms.step_s}]
  for label, change in VARIANTS:
    t = schedule.estimate(module, change(gpu), mesh_shape, nodes, fp8_experts=fp8_experts, counted_flops=counted_flops,
                          bubble_fraction=bubble_fraction, grouped_scale=terms.grouped_scale)
    out.append({"label": label, "step_s": t.step_s, "tflops_per_gpu": model_flops / 1e12 / t.step_s})
  return out


def _seconds(s: float) -> str:
  return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.4g} ms"


def memory_op_lines(rows: list[dict[str, Any]], memory_s: float) -> list[str]:
  """The largest memory-bound groups, one line each: ms, share, GB, ops a step, owner, source, name stack."""
  out = [f"    {'ms':>8} {'share':>5} {'GB':>7} {'ops':>5}  {'owner':<8} source: op (the largest memory-bound, by source)"]
  for r in rows:
    share = r["seconds"] / memory_s if memory_s else 0.0
    out.append(f"    {r['seconds'] * 1e3:8.2f} {share:5.1%} {r['bytes'] / 1e9:7.2f} {r['ops']:5d}  {r['owner']:<8} "
               f"{r['source'] or '(no source)'}: {_tail(r['op'])}")
  return out if rows else []


def _tail(op: str, width: int = 90) -> str:
  """A name stack's last `width` characters (its innermost steps say most)."""
  return op if len(op) <= width else "..." + op[-width + 3:]


def lines(e: dict[str, Any]) -> list[str]:
  """The estimate as the planner prints it."""
  ms = lambda s: f"{s * 1e3:9.2f} ms"  # noqa: E731
  compute = f"GEMMs {e['gemm_flops'] / 1e12:.4g} T {e['gemm_s'] * 1e3:.2f}"
  if e["fp8_flops"]:
    compute += f", FP8 grouped GEMMs {e['fp8_flops'] / 1e12:.4g} T {e['fp8_gemm_s'] * 1e3:.2f}"
  compute += f", attention {e['attention_flops'] / 1e12:.4g} T {e['attention_s'] * 1e3:.2f}"
  if e["hidden_flops_s"]:
    compute += f", FLOPs the HLO hides {e['hidden_flops_s'] * 1e3:.2f}"
  out = [
      f"estimate: step {e['step_s'] * 1e3:.2f} ms, the critical path through the scheduled step (MaxText/plan/schedule.py)",
      f"  compute         {ms(e['compute_s'])}  {compute}",
      f"  memory-bound    {ms(e['memory_s'])}  {e['memory_bytes'] / 1e9:.1f} GB read and written, {e['kernels']} kernels",
      *memory_op_lines(e.get("memory_ops", [])[:memory_ops.SHOWN], e["memory_s"]),
      f"  collectives     {ms(e['collectives_s'])}  exposed {e['exposed_collectives_s'] * 1e3:.2f}, overlapped "
      f"{e['overlapped_collectives_s'] * 1e3:.2f} (each transfer at its link's rate)",
      f"  beside NCCL     {ms(e.get('contention_s', 0.0))}  the kernels that ran beside a transfer, slowed by the SMs "
      f"its kernels hold ({hardware.COLLECTIVE_SM_SHARE.value:.0%}, MaxText/hardware.py)",
      *([f"  host offload    {ms(e['offload_s'])}  exposed {e['offload_exposed_s'] * 1e3:.2f} (PCIe, beside the stream)"]
        if e["offload_s"] else []),
      f"  pipeline bubble {ms(e['bubble_s'])}  (bubble fraction {e['bubble_fraction']:.3g})",
      f"  nothing overlapped {e['serial_step_s'] * 1e3:.2f} ms; FLOPs/device: the HLO's {e['flops_per_device'] / 1e12:.4g} T, "
      f"MaxText's count {e['model_tflops_per_device']:.4g} T + recompute {e['recompute_flops'] / 1e12:.4g} T",
      f"  TFLOP/s/GPU (MaxText's count) {e['tflops_per_gpu']:.1f}",
  ]
  if e["grouped_flops"]:
    out.append(f"  grouped GEMMs    their shapes {e['grouped_shapes_flops'] / 1e12:.4g} T, counted "
               f"{e['grouped_flops'] / 1e12:.4g} T ({e['grouped_shapes_flops'] / e['grouped_flops']:.3g}x: the rows "
               "of padded buffers, which the kernels' group sizes skip)")
  if e.get("sensitivity"):
    out.append("  sensitivity: " + "; ".join(f"{v['label']} {_seconds(v['step_s'])}, {v['tflops_per_gpu']:.1f}"
                                             for v in e["sensitivity"]) + " (step, TFLOP/s/GPU)")
  return out + [f"  note: {n}" for n in e["notes"]]
