"""The pipeline bubble: upstream's schedule, checked against the compiled program, and its cost in the step.

Upstream's pipeline (maxtext 0.2.5 layers/pipeline.py) runs every stage at every iteration of one
scanned loop: repeats x microbatches iterations of real work, plus delay x (stages - 1) in which
some stages compute on nothing (delay 2 with pipeline_delay_activation_forwarding, else 1).
Upstream's own count (pipeline.py ~862): "the total iterations is num_micro * repeat +
num_stages - 1, & we may consider the num_stages - 1 as bubble". So each stage spends

  bubble = delay (S - 1) / (R M + delay (S - 1))

of its pipeline iterations idle, S stages, R repeats, M microbatches.

The compiled program's pipeline loops are the while loops whose bodies permute activations over
the `stage` axis (MaxText/plan/hlo_inventory.py pipeline_loops); their known trip counts must be
R M + delay (S - 1), forward and backward. The dot FLOPs inside them, against the program's, give
the pipelined share of the compute (the dense layers, MTP, embedding and loss run outside).

In the estimate: the schedule's walk (MaxText/plan/schedule.py) runs the pipeline loop by its
trip count, so the bubble's iterations are in the step's path already (upstream computes them, on
zeros); their part of it, path x share x bubble / (1 - bubble + share x bubble) with the pipelined
share of the useful work, is reported, not added again.
"""

from __future__ import annotations

from typing import Any


def schedule(config: Any) -> dict[str, Any] | None:
  """The pipeline schedule of upstream's resolved config; None without pipeline parallelism."""
  stages = int(config.ici_pipeline_parallelism) * int(config.dcn_pipeline_parallelism)
  if stages <= 1:
    return None
  repeats, micro = int(config.num_pipeline_repeats), int(config.num_pipeline_microbatches)
  delay = 2 if config.pipeline_delay_activation_forwarding else 1
  iterations = repeats * micro + delay * (stages - 1)
  return {"stages": stages, "repeats": repeats, "microbatches": micro, "delay": delay, "iterations": iterations,
          "bubble_fraction": delay * (stages - 1) / iterations}


def _iterations(loop: dict[str, Any]) -> int | None:
  """Pipeline iterations one run of a compiled loop covers: trips x the induction variable's step (XLA's while-loop
  double buffering unrolls the body twice, step 2, and runs an odd count's last iteration outside)."""
  return None if loop["trip_count"] is None else loop["trip_count"] * loop.get("step", 1)


def cross_check(sched: dict[str, Any], loops: list[dict[str, Any]]) -> dict[str, Any]:
  """The compiled pipeline loops' iterations against the schedule's: `agrees` over the loops with a known trip
  count, `unchecked` where one has none."""
  want = sched["iterations"]
  covered = sorted({n for n in map(_iterations, loops) if n is not None})
  known = [l for l in loops if l["trip_count"] is not None]
  unchecked = len(known) < len(loops)  # a loop without a trip count: held to nothing, neither agreeing nor not
  # A loop agrees when it runs the schedule's iterations, less the remainder double buffering peels off (< step).
  agrees = bool(known) and all(0 <= want - _iterations(l) < l.get("step", 1) for l in known)
  if not loops:
    note = "no loop of the compiled program permutes over the stage axis"
  elif known and not agrees:
    note = f"compiled pipeline loops cover {covered} iterations, the schedule {want}"
  elif unchecked:
    note = f"a compiled pipeline loop has no known trip count (XLA's backend_config): cannot check the schedule's {want}"
  elif covered != [want]:
    note = (f"XLA unrolled the loops (step {max(l.get('step', 1) for l in loops)}): {covered[0]} iterations inside, "
            f"{want - covered[0]} outside")
  else:
    note = ""
  return {"compiled_loops": loops, "compiled_trip_counts": sorted({l["trip_count"] for l in known}),
          "compiled_iterations": covered, "agrees": agrees, "unchecked": unchecked, "note": note}


def verdict(check: dict[str, Any]) -> str:
  """cross_check's answer in a word: DISAGREE where a loop with a known trip count misses the schedule (or no loop
  permutes over the stages), "not checked" where the rest have none, else "agree"."""
  if check["compiled_trip_counts"] and not check["agrees"]:
    return "DISAGREE"
  if check.get("unchecked"):
    return "not checked"
  return "agree" if check["agrees"] else "DISAGREE"


def pipelined_share(sched: dict[str, Any], loops: list[dict[str, Any]], hlo_dot_flops: float) -> float | None:
  """Of the step's useful dot FLOPs, the share inside the pipeline (the loops' FLOPs, with any iteration XLA ran
  outside them, less their bubble)."""
  inside = sum(l["dot_flops"] * sched["iterations"] / _iterations(l) for l in loops if _iterations(l))
  if not inside or not hlo_dot_flops:
    return None
  bubble = inside * sched["bubble_fraction"]
  return (inside - bubble) / (hlo_dot_flops - bubble)


def bubble_seconds(sched: dict[str, Any], share: float, path_s: float) -> float:
  """The bubble's part of a step whose path (every executed iteration) takes path_s."""
  b = sched["bubble_fraction"]
  # Useful work u, pipelined share s: the loops execute s u / (1 - b), of which s u b / (1 - b) is bubble, and the
  # step executes u (1 - b + s b) / (1 - b).
  return path_s * share * b / (1 - b + share * b)


def report(sched: dict[str, Any] | None, loops: list[dict[str, Any]], hlo_dot_flops: float, path_s: float,
           fallback_share: float) -> dict[str, Any] | None:
  """The plan's "pipeline" entry: schedule, compiled cross-check, pipelined share and the bubble's seconds.

  fallback_share: the pipelined layers' share of the layers, used when the HLO shows no dots in the loops
  (every GEMM in kernels XLA cannot see)."""
  if sched is None:
    return None
  share = pipelined_share(sched, loops, hlo_dot_flops)
  share_from = "HLO dots inside the pipeline loops"
  if share is None:
    share, share_from = fallback_share, "pipeline_parallel_layers / num_decoder_layers"
  return {**sched, **cross_check(sched, loops), "pipelined_share": share, "pipelined_share_from": share_from,
          "bubble_s": bubble_seconds(sched, share, path_s)}
