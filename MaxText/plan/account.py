"""One account of every transfer: the plan's collective rows and the schedule's walk, checked against each other.

The rows (MaxText/plan/hlo_inventory.py) multiply each collective by the trip counts of the loops around it; the
walk (MaxText/plan/schedule.py) runs the loops and times each transfer against the stream. Both take a loop's
trips from `hlo_inventory.loop_trips` (XLA's known trip count, else the condition's bound, named in a note) and a
conditional's branch as the walk took it, so they count the same transfers. Every plan checks:

  rows = walk      per row, the walk's count and transfer seconds equal the inventory's (to 1%), and the rows'
                   seconds add up to the walk's collective seconds (to 1%)
  exposed <= time  per row, the stream waited for it no longer than its transfers took (a wait is charged to the
                   transfer its link moves at each moment, queued ones included)
  step <= serial   the critical path never exceeds compute + memory + every transfer + offload + bubble
  microbatches     the gradient-accumulation loop's trips (times the microbatches a trip runs where XLA double-
                   buffered it) and the microbatches XLA peeled out of it add up to the config's
                   gradient_accumulation_steps (`microbatches`); a pipeline's compiled loops with a known trip
                   count cover the schedule's iterations (MaxText/plan/bubble.py; one without: not checked)

  loops = microbatches(comps, entry, gradient_accumulation_steps)
  checked = check(rows, terms, estimate, loops, pipeline)  # {"ok": bool, "lines": [...], "violations": [...]}
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Any

from MaxText import hardware
from MaxText.plan import hlo_inventory
from MaxText.plan.hlo_inventory import Computation, Instr

# What a plan (and a search, any of whose plans) exits with when its account is violated: past the train step's
# codes (MaxText/config/command_line.py, 0-8), so no number means two things across the planner's entry points.
EXIT_VIOLATED = 9
TOLERANCE = 0.01  # relative: the rows against the walk
_SLACK_S = 1e-9  # float rounding in seconds


def violations_of(report: dict[str, Any]) -> list[str]:
  """A plan report's violated invariants (none for a plan only lowered, which has no account)."""
  return list((report.get("account") or {}).get("violations", []))


def rows(collectives: list[dict[str, Any]], walk_rows: dict[tuple, list[float]], gpu: hardware.Gpu) -> list[dict]:
  """The inventory's rows with their link, transfer seconds (the bytes a link carries, `link_bytes`: the wire bytes,
  a ring across nodes spread over its members' NICs on a node, at the link's rate), and the walk's
  exposed seconds, transfer seconds and count for the same (kind, axes, crosses nodes)."""
  out = []
  for row in collectives:
    key = (row["kind"], tuple(row["axes"]), row["crosses_nodes"])
    walked = walk_rows.get(key, [0.0, 0.0, 0.0])
    out.append({**row, "link": "ib" if row["crosses_nodes"] else "nvlink",
                "seconds": row["link_bytes"] / hardware.link_bytes(gpu, row["kind"], row["crosses_nodes"]).value,
                "exposed_s": walked[1], "walk_seconds": walked[0], "walk_count": int(round(walked[2]))})
  return out


def _close(a: float, b: float) -> bool:
  return abs(a - b) <= TOLERANCE * max(abs(a), abs(b)) + _SLACK_S


def _loops_in(comps: dict[str, Computation], name: str, seen: set[str]) -> list[Instr]:
  """The while loops computation `name` runs, through the computations it calls, not inside other loops."""
  seen.add(name)
  out = []
  for instr in comps[name].instrs:
    if instr.opcode == "while":
      out.append(instr)
      continue
    for called in hlo_inventory._called(instr):  # pylint: disable=protected-access
      if called in comps and called not in seen:
        out += _loops_in(comps, called, seen)
  return out


def microbatches(comps: dict[str, Computation], entry: str, expected: int | None) -> dict[str, Any] | None:
  """The microbatches a step walks: the gradient-accumulation loop (the one loop in ENTRY whose body runs loops of
  its own, the layer scans) by its trips (hlo_inventory.loop_trips), plus the copies of its body XLA peeled into
  ENTRY (ENTRY's other loops, by trip count, a whole number of times the body's). None where the config has one
  microbatch or none known; {"expected", "unchecked": why} where no such loop is found."""
  if not expected or expected <= 1:
    return None
  trips = lambda loop: hlo_inventory.loop_trips(loop, comps).count  # noqa: E731
  body = lambda loop: re.search(r"body=%?([\w.\-]+)", loop.attrs)[1]  # noqa: E731
  top = _loops_in(comps, entry, set())
  nested = {loop.name: Counter(trips(l) for l in _loops_in(comps, body(loop), set())) for loop in top}
  outer = [loop for loop in top if nested[loop.name]]
  if len(outer) != 1:
    return {"expected": expected, "unchecked": f"{len(outer)} loops in ENTRY run loops of their own, not one"}
  loop, per_trip = outer[0], nested[outer[0].name]
  # XLA's double buffering unrolls the body: each trip runs `step` microbatches, each microbatch's loops once
  step = hlo_inventory.induction_step(loop)
  step = step if step > 1 and all(n % step == 0 for n in per_trip.values()) else 1
  per_microbatch = {t: n // step for t, n in per_trip.items()}
  beside = Counter(trips(l) for l in top if l is not loop)
  peeled = min(beside[t] // n for t, n in per_microbatch.items())
  return {"expected": expected, "loop": loop.name, "trips": trips(loop), "per_trip": step, "peeled": peeled,
          "walked": trips(loop) * step + peeled}


def _loop_lines(loops: dict[str, Any] | None, pipeline: dict[str, Any] | None) -> tuple[list[str], list[str]]:
  """(lines, violations) of the loop counts: the microbatches walked, a pipeline's compiled iterations."""
  lines, violations = [], []
  if loops and "walked" in loops:
    per_trip = f" x {loops['per_trip']} (double-buffered)" if loops.get("per_trip", 1) > 1 else ""
    said = (f"microbatch loop {loops['loop']}: {loops['trips']} trips{per_trip} + {loops['peeled']} peeled = "
            f"{loops['walked']} microbatches walked, gradient_accumulation_steps {loops['expected']}")
    (lines if loops["walked"] == loops["expected"] else violations).append(said)
  elif loops:
    lines.append(f"microbatches not checked: {loops['unchecked']}")
  if pipeline and pipeline.get("compiled_trip_counts") and not pipeline["agrees"]:
    violations.append(f"pipeline: {pipeline['note']}")
  elif pipeline and pipeline.get("unchecked"):  # a loop without a trip count: nothing to hold it to
    lines.append(f"pipeline not checked: {pipeline['note']}")
  return lines, violations


def check(plan_rows: list[dict[str, Any]], walk_rows: dict[tuple, list[float]], estimate: dict[str, Any],
          loops: dict[str, Any] | None = None, pipeline: dict[str, Any] | None = None) -> dict:
  """The invariants of the module docstring on one plan: each violation one line naming the row or the loop."""
  loop_lines, violations = _loop_lines(loops, pipeline)
  for r in plan_rows:
    name = f"{r['kind']} over {','.join(r['axes']) or '-'} ({r['link']})"
    if r["exposed_s"] > r["seconds"] * (1 + TOLERANCE) + _SLACK_S:
      violations.append(f"{name}: exposed {r['exposed_s']:.4g} s > its transfers' {r['seconds']:.4g} s")
    if r["walk_count"] != r["count"] or not _close(r["walk_seconds"], r["seconds"]):
      violations.append(f"{name}: the walk counts {r['walk_count']} transfers, {r['walk_seconds']:.4g} s; the rows "
                        f"{r['count']}, {r['seconds']:.4g} s")
  listed = {(r["kind"], tuple(r["axes"]), r["crosses_nodes"]) for r in plan_rows}
  for key, (seconds, _, count) in walk_rows.items():
    if key[0] != "host-offload" and key not in listed and count:
      violations.append(f"{key[0]} over {','.join(key[1]) or '-'}: walked {int(count)} times, in no row")
  rows_s, walk_s = sum(r["seconds"] for r in plan_rows), estimate["collectives_s"]
  if not _close(rows_s, walk_s):
    violations.append(f"the rows' transfers {rows_s:.4g} s, the walk's {walk_s:.4g} s")
  if estimate["step_s"] > estimate["serial_step_s"] * (1 + 1e-9) + _SLACK_S:
    violations.append(f"step {estimate['step_s']:.4g} s > nothing overlapped {estimate['serial_step_s']:.4g} s")
  lines = [f"transfers: rows {rows_s:.4g} s, walk {walk_s:.4g} s; exposed {estimate['exposed_collectives_s']:.4g} s; "
           f"step {estimate['step_s']:.4g} s <= nothing overlapped {estimate['serial_step_s']:.4g} s", *loop_lines]
  return {"ok": not violations, "lines": lines, "violations": violations}


def refuse_violated(count: int, of: str, label: str, first: str) -> int:
  """The one line a search prints when `count` of its plans (`of`: "12 layouts") hold a violated account, left out
  of the best: the first one's label and violation. Returns EXIT_VIOLATED."""
  print(f"maxtext-moe: plan invariant violated in {count} of {of} (left out of the best): {label}: {first}",
        file=sys.stderr, flush=True)
  return EXIT_VIOLATED
