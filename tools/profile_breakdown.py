#!/usr/bin/env python3
"""Where a training step's time goes: grouped GEMM, dispatch/combine, routing, attention, the rest.

  python3 tools/profile_breakdown.py RUN_DIR [--steps M] [--json]

RUN_DIR is a `python -m MaxText.train` run directory made with upstream's
profiler on and an HLO dump in the run directory:

  python -m MaxText.train ... profiler=xplane skip_first_n_steps_for_profiler=N profiler_steps=M dump_hlo=true

(`tools/bench_train.py --profile` does this for every variant; our entry
point puts the dump in `RUN_DIR/xla_dump`.)

How time is attributed:
- The trace (`<run>/tensorboard/plugins/profile/*/*.xplane.pb`, read with
  jax.profiler.ProfileData, no xprof needed) gives one event per executed HLO
  op. On GPU: the kernel events on "/device:GPU:*" planes. On CPU: the XLA op
  events on the host's thread lines (those with an `hlo_op` stat; the
  ThunkExecutor container events around them are skipped so nothing counts
  twice). Only ops of the train-step module count (other jitted helpers are
  reported apart). Times are summed over all lines, so with ops running in
  parallel (CPU threads, GPU streams) the total is busy time, not wall time.
- An event's `hlo_op` stat names an instruction of the optimized HLO
  (`*after_optimizations.txt` in the dump); its `metadata={op_name=...}` holds
  the JAX named-scope path, e.g. `jit(train_step)/.../dispatch/...`. A fusion
  without metadata takes its fused computation's root's (or first) op_name;
  an op XLA inserted without metadata (layout copies, split reductions) takes
  its nearest operand's, up to 3 producers back.
  Custom-call targets (cuDNN attention, Mosaic/Triton GEMM kernels) are kept
  too, and so are the source frames XLA records per op (file:function), which
  name ops whose op_name says nothing (an einsum's backward is ".../transpose").
  Events without an HLO match fall back to the op_name XLA's GPU runtime
  annotates kernels with (stat "name"/"op_name", XLA's "Thunk:#name=...,
  hlo_op=...#" annotation), then to their own name (kernel names such as
  *fmha*, *nccl*AllToAll*); what still matches nothing is "unattributed".
- Verified on CPU only (jax 0.11.2). The GPU plane layout is read as XLA
  documents it ("/device:GPU:N" planes, one line per stream, kernel events
  with hlo_op/hlo_module stats; an "XLA Ops" line is used alone when present)
  but has not been checked against a real H200 trace yet.
- The descriptor (op_name + custom-call target + event name) goes through
  MaxText/moe/time_split.py's RULES, first match wins.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's MaxText when run as a script
from MaxText.moe import time_split  # noqa: E402
from MaxText.moe.time_split import CONTROL_FLOW  # noqa: E402
from MaxText.plan.memory_report import largest_buffers  # noqa: E402  # shared with the planner

# The rules are MaxText/moe/time_split.py's, shared with the live split
# (moe_profile_every_n_steps); here dispatch and combine stay one column.
CATEGORIES = ("gmm", "dispatch_combine", "route", "attention", "rest", "unattributed")
_MERGED = {"dispatch": "dispatch_combine", "combine": "dispatch_combine"}


def classify(descriptor: str, frames: tuple[str, ...] = ()) -> str | None:
  """time_split.classify, with dispatch and combine merged; None when no rule matches."""
  category = time_split.classify(descriptor, frames)
  return _MERGED.get(category, category)


# ---------------------------------------------------------------- HLO text

_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\(")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_FRAME_ID_RE = re.compile(r"stack_frame_id=(\d+)")
_CALLS_RE = re.compile(r"calls=%?([\w.\-]+)")
_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
INHERIT_HOPS = 3
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
MAX_FRAMES = 8  # innermost frames kept per op: enough to reach the layer code


@dataclass(frozen=True)
class HloOp:
  opcode: str
  descriptor: str  # op_name (+ custom-call target); "" when the op has no metadata
  frames: tuple[str, ...]  # "path/file.py:function", innermost first
  inherited: bool = False  # metadata taken from an operand (a copy/transpose XLA inserted has none)


def _short_path(path: str) -> str:
  """site-packages/maxtext/layers/moe.py -> maxtext/layers/moe.py; /repo/MaxText/moe/x.py -> MaxText/moe/x.py."""
  for marker in ("site-packages/", "/MaxText/", "/patches/"):
    if marker in path:
      return (marker.strip("/") + "/" if marker != "site-packages/" else "") + path.split(marker, 1)[1]
  return path


def _stack_tables(lines: list[str]) -> dict[int, tuple[str, ...]]:
  """stack_frame_id -> frames innermost first, from the dump's header tables.

  Read empirically from jax 0.11.2 dumps: a frame's printed parent_frame_id
  is one more than its parent's printed id (a root frame points at a missing
  id), which yields call chains that match the source; only the innermost
  MAX_FRAMES are kept, and classification looks at the innermost match."""
  section, files, funcs, locs, frames = None, {}, {}, {}, {}
  for line in lines:
    if line in _TABLES:
      section = line
      continue
    if line.startswith(("%", "ENTRY")):  # the tables sit between the HloModule line and the computations
      break
    parts = line.split(" ", 1)
    if len(parts) != 2 or not parts[0].isdigit():
      continue
    key, rest = int(parts[0]), parts[1]
    if section == "FileNames":
      files[key] = _short_path(rest.strip('"'))
    elif section == "FunctionNames":
      funcs[key] = rest.strip('"')
    elif section == "FileLocations":
      f = dict(kv.split("=", 1) for kv in rest.strip("{}").split())
      locs[key] = f"{files.get(int(f.get('file_name_id', 0)), '?')}:{funcs.get(int(f.get('function_name_id', 0)), '?')}"
    elif section == "StackFrames":
      f = dict(kv.split("=", 1) for kv in rest.strip("{}").split())
      frames[key] = (int(f.get("file_location_id", 0)), int(f.get("parent_frame_id", 0)))
  chains = {}
  for frame_id in frames:
    chain, current, seen = [], frame_id, set()
    while current in frames and current not in seen and len(chain) < MAX_FRAMES:
      seen.add(current)
      loc, parent = frames[current]
      chain.append(locs.get(loc, "?"))
      current = parent - 1  # see the docstring: the parent's printed id is parent_frame_id - 1
    chains[frame_id] = tuple(chain)
  return chains


def parse_hlo(text: str) -> dict[str, HloOp]:
  """instruction name -> HloOp; a fusion without metadata takes its computation root's (else first)."""
  lines = text.splitlines()
  chains = _stack_tables(lines)
  raw: dict[str, tuple[str, str, tuple[str, ...]]] = {}
  operands: dict[str, list[str]] = {}
  calls: dict[str, str] = {}
  comp_first: dict[str, tuple[str, tuple[str, ...]]] = {}
  comp = None
  for line in lines:
    header = _COMP_RE.match(line)
    if header and not line.startswith(" "):
      comp = header.group(1)
      continue
    m = _INSTR_RE.match(line)
    if not m:
      continue
    name = m.group(1)
    parts = [found.group(1) for found in (_OP_NAME_RE.search(line), _TARGET_RE.search(line)) if found]
    frame = _FRAME_ID_RE.search(line)
    entry = (" ".join(parts), chains.get(int(frame.group(1)), ()) if frame else ())
    raw[name] = (m.group(2), *entry)
    operands[name] = _OPERAND_RE.findall(line[m.end():].split(")", 1)[0])
    called = _CALLS_RE.search(line)
    if called:
      calls[name] = called.group(1)
    if comp and entry[0] and (line.lstrip().startswith("ROOT") or comp not in comp_first):
      comp_first[comp] = entry
  ops = {}
  for name, (opcode, desc, frames) in raw.items():
    if not desc and name in calls:
      desc, frames = comp_first.get(calls[name], ("", ()))
    ops[name] = HloOp(opcode, desc, frames)
  # Ops XLA created (layout copies, split reductions) carry no metadata: they
  # take the nearest operand's, up to INHERIT_HOPS producers back.
  for name, op in list(ops.items()):
    if op.descriptor:
      continue
    frontier, seen = list(operands.get(name, ())), {name}
    for _ in range(INHERIT_HOPS):
      source = next((ops[o] for o in frontier if o in ops and ops[o].descriptor and not ops[o].inherited), None)
      if source:
        ops[name] = HloOp(op.opcode, source.descriptor, source.frames, inherited=True)
        break
      seen.update(frontier)
      frontier = [p for o in frontier for p in operands.get(o, ()) if p not in seen]
  return ops


def load_hlo_maps(run_dir: Path) -> dict[str | int, dict[str, HloOp]]:
  """{instruction -> HloOp} per module name (jit_train_step) and per program id, from every optimized dump.

  Dumps are named module_<program id>.<module name>.<backend>_after_optimizations.txt;
  the trace's events carry the same program id, which tells two compilations
  of one module name apart (the name-keyed map merges them)."""
  maps: dict[str | int, dict[str, HloOp]] = {}
  for path in sorted(glob.glob(str(run_dir / "**" / "*after_optimizations.txt"), recursive=True)):
    name = Path(path).name
    ops = parse_hlo(Path(path).read_text(errors="replace"))
    match = re.match(r"module_(\d+)\.([^.]+)\.", name)
    if match:
      maps[int(match.group(1))] = ops
      maps.setdefault(match.group(2), {}).update(ops)
    else:
      maps.setdefault(name, {}).update(ops)
  return maps


# ---------------------------------------------------------------- trace

# Device-plane lines that summarise kernels already on the stream lines.
_SUMMARY_LINES = ("xla modules", "steps", "framework", "source code", "launch stats", "xla traceme", "tensorflow ops")
_CONTAINERS = ("threadpoollistener", "thunkexecutor")


@dataclass(frozen=True)
class OpEvent:
  name: str
  hlo_op: str | None
  module: str | None
  run_id: object
  duration_ns: int
  scope: str = ""  # op_name the GPU runtime annotates kernels with ("name"/"op_name" stat); "" on CPU
  program_id: int | None = None


def read_events(xplane: Path) -> tuple[list[OpEvent], str]:
  """Executed-op events: GPU device-plane kernels if there are any, else CPU host op events."""
  import jax  # pylint: disable=import-outside-toplevel

  data = jax.profiler.ProfileData.from_file(str(xplane))
  warnings.filterwarnings("ignore", message="builtin type event_stats", category=DeprecationWarning)
  device_planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
  events: list[OpEvent] = []
  for plane in device_planes:
    lines = list(plane.lines)
    # "XLA Ops" (when present) already lists each op once; else take the stream lines.
    xla_ops = [l for l in lines if l.name.lower() == "xla ops"]
    for line in xla_ops or [l for l in lines if not l.name.lower().startswith(_SUMMARY_LINES)]:
      for e in line.events:
        stats = dict(e.stats)
        scope = stats.get("op_name") or stats.get("name") or stats.get("tf_op") or ""
        events.append(OpEvent(e.name, stats.get("hlo_op"), stats.get("hlo_module"), stats.get("run_id"),
                              int(e.duration_ns), str(scope), _int_or_none(stats.get("program_id"))))
  if events:
    return events, "gpu"
  for plane in data.planes:
    if not plane.name.startswith("/host:CPU"):
      continue
    for line in plane.lines:
      for e in line.events:
        if e.name.lower().startswith(_CONTAINERS):
          continue
        stats = dict(e.stats)
        if "hlo_op" in stats:
          events.append(OpEvent(e.name, stats["hlo_op"], stats.get("hlo_module"), stats.get("run_id"),
                                int(e.duration_ns), "", _int_or_none(stats.get("program_id"))))
  return events, "cpu"


def _int_or_none(value) -> int | None:
  try:
    return int(value)
  except (TypeError, ValueError):
    return None


def find_xplane(run_dir: Path) -> Path:
  found = sorted(glob.glob(str(run_dir / "**" / "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(f"no *.xplane.pb under {run_dir} (run with profiler=xplane)")
  return Path(found[-1])


def profiled_steps(run_dir: Path, events: list[OpEvent], module: str) -> int | None:
  """Distinct executions (run_id) of the step module; else upstream's profiler_steps of the run."""
  runs = {e.run_id for e in events if e.module == module and e.run_id is not None}
  if runs:
    return len(runs)
  effective = run_dir / "maxtext-moe" / "effective_config.json"
  if effective.exists():
    value = json.loads(effective.read_text()).get("upstream_overrides", {}).get("profiler_steps")
    if value is not None:
      return int(value)
  return None


# ---------------------------------------------------------------- memory

# ---------------------------------------------------------------- breakdown

_NO_OP = HloOp("", "", ())


def breakdown(run_dir: str | Path, steps: int | None = None, module: str = "jit_train_step", top: int = 10) -> dict:
  """Per-category ms/step and share of the step module's op time, plus the top ops of "rest"."""
  run_dir = Path(run_dir)
  xplane = find_xplane(run_dir)
  events, device = read_events(xplane)
  maps = load_hlo_maps(run_dir)
  steps = steps or profiled_steps(run_dir, events, module) or 1
  by_program = {k: v for k, v in maps.items() if isinstance(k, int)}
  return {"run_dir": str(run_dir), "xplane": str(xplane), "device": device,
          "largest_buffers": largest_buffers(run_dir, module),
          **summarize(events, maps.get(module, {}), steps, module, top, by_program)}


def summarize(events: list[OpEvent], step_map: dict[str, HloOp], steps: int, module: str = "jit_train_step",
              top: int = 10, by_program: dict[int, dict[str, HloOp]] | None = None) -> dict:
  """Attributes each event of `module` to a category (events of other modules are reported apart).

  The HLO map (instruction -> op_name and source frames) decides first; an
  event the dump does not know falls back to the op_name the GPU runtime
  annotated it with, then to its own name (kernel names like *fmha*, *nccl*)."""
  totals = collections.Counter()
  rest_ops = collections.Counter()
  unattributed_ops = collections.Counter()
  other_modules = collections.Counter()
  matched, inherited_ns = 0, 0
  for e in events:
    if e.module is not None and e.module != module:
      other_modules[e.module] += e.duration_ns
      continue
    ops = (by_program or {}).get(e.program_id, step_map)
    op = ops.get(e.hlo_op or e.name, _NO_OP)
    if op.opcode in CONTROL_FLOW:
      continue  # its body's ops have their own events
    desc = op.descriptor or e.scope
    matched += bool(desc)
    inherited_ns += e.duration_ns if op.inherited else 0
    # The HLO's metadata decides before the kernel's name: cuDNN's flash-attention kernels
    # are named "..._wgmma_...", which the gmm rule's "gmm" would claim (an H200 trace put
    # ~100 ms/step of attention under gmm that way).
    category = classify(desc, op.frames) if desc else None
    category = category or classify(e.name)
    if category is None:
      category = "rest" if desc else "unattributed"
    totals[category] += e.duration_ns
    if category == "rest":
      where = " < ".join(f.rsplit("/", 1)[-1] for f in op.frames[:3])
      rest_ops[f"{e.hlo_op or e.name}  [{desc[:80]}] {where}"] += e.duration_ns
    elif category == "unattributed":
      unattributed_ops[e.hlo_op or e.name] += e.duration_ns
  total_ns = sum(totals.values())
  per_step = lambda ns: ns / steps / 1e6  # noqa: E731
  return {
      "hlo_dump_found": bool(step_map),
      "steps": steps,
      "events": len(events),
      "events_with_hlo_metadata": matched,
      "total_ms_per_step": per_step(total_ns),
      "inherited_share": inherited_ns / total_ns if total_ns else 0.0,
      "categories": {
          c: {"ms_per_step": per_step(totals[c]), "share": totals[c] / total_ns if total_ns else 0.0} for c in CATEGORIES
      },
      "top_rest": [[name, per_step(ns)] for name, ns in rest_ops.most_common(top)],
      "top_unattributed": [[name, per_step(ns)] for name, ns in unattributed_ops.most_common(top)],
      "other_modules_ms_per_step": {m: per_step(ns) for m, ns in other_modules.most_common()},
  }


def format_breakdown(result: dict, title: str = "") -> str:
  lines = [f"step breakdown {title}".rstrip() + f" ({result['device']}, {result['steps']} profiled steps, "
           f"op time summed over streams/threads)"]
  if not result["hlo_dump_found"]:
    lines.append("  WARNING: no HLO dump for the step module; ops are classified by event name only")
  for c in CATEGORIES:
    v = result["categories"][c]
    lines.append(f"  {c:<18} {v['ms_per_step']:>10.2f} ms/step {100 * v['share']:>6.1f}%")
  lines.append(f"  {'total':<18} {result['total_ms_per_step']:>10.2f} ms/step"
               f"  ({100 * result['inherited_share']:.1f}% classified through an operand's metadata)")
  if result["top_rest"]:
    lines.append("  top ops in rest (ms/step):")
    lines += [f"    {ms:>9.3f}  {name}" for name, ms in result["top_rest"]]
  if result["top_unattributed"]:
    lines.append("  top unattributed (ms/step):")
    lines += [f"    {ms:>9.3f}  {name}" for name, ms in result["top_unattributed"]]
  if result.get("largest_buffers"):
    lines.append("  largest buffers of the step (XLA memory-usage report):")
    lines += [f"    {b['size']:>10}  {b['values']:>3} values  {b['shapes'][:140]}" for b in result["largest_buffers"]]
  return "\n".join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dir")
  parser.add_argument("--steps", type=int, default=None, help="profiled steps (default: from the trace)")
  parser.add_argument("--module", default="jit_train_step")
  parser.add_argument("--json", action="store_true", help="print the breakdown as JSON")
  args = parser.parse_args()
  result = breakdown(args.run_dir, steps=args.steps, module=args.module)
  print(json.dumps(result, indent=2) if args.json else format_breakdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
