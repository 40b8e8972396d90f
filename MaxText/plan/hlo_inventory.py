"""What one step of a compiled program moves and multiplies, read from its HLO text.

  inventory(compiled.as_text(), mesh_shape={"fsdp": 4, ...}, nodes=[0, 0, 0, 0])

Walks the computations from ENTRY, multiplying by each while loop's trips
(`loop_trips`: XLA's known_trip_count, else its condition's bound; the layer
scan runs its body once per layer), and a conditional's branches (every one,
or those the schedule's walk took: MaxText/plan/account.py), and returns
  collectives   one row per (kind, mesh axes, crosses nodes): count per step,
                bytes (the collective's full buffer, see below) and wire bytes
                (what each device sends over its link with a ring/pairwise
                algorithm) and link bytes (what one link carries: a ring across
                nodes spreads a member's wire bytes over its members' NICs on a
                node, nics_per_member; the figure link bandwidth divides)
  hlo_dot_flops FLOPs of the dots and cuBLAS GEMM calls the HLO shows, per
                device; kernels opaque to XLA (Mosaic GPU, cuDNN attention)
                are not in it
  pipeline_loops the while loops of upstream's pipeline: those whose body
                (not a loop nested in it) permutes over the `stage` mesh axis;
                each with its known trip count, its induction step (2 when XLA
                double-buffered it), executions per step and the dot FLOPs
                inside (MaxText/plan/bubble.py reads the bubble off them)
Buffer bytes per kind, for a collective over n devices with result R bytes:
  all-gather R (gathered) wire R(n-1)/n;  reduce-scatter R*n, wire R(n-1);
  all-reduce R, wire 2R(n-1)/n;  all-to-all R, wire R(n-1)/n;
  ragged-all-to-all R (its receive buffer, an upper bound), wire R(n-1)/n;
  collective-permute R, wire R.
Replica groups name partition ids, which are positions in the jit's mesh
(row-major over mesh_shape): a group's mesh axes are those its members'
coordinates differ in; it crosses nodes when its members sit on two nodes.
Inter-node bytes: the share of a device's wire bytes exchanged with members on
other nodes, wire x (members on other nodes) / (n - 1), averaged over the
groups' members; exact for an all-to-all (the blocks addressed to other nodes)
and a permute (its pairs that cross), a flat ring's figure for the others. Two
all-to-alls over subgroups of one mesh axis (a two-level dispatch: one between
nodes, one inside them) are two rows of that axis, told apart by crosses_nodes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter, defaultdict
from typing import Any

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-$.]*)\((.*)$")


def dtype_bytes(dtype: str) -> float:
  if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
    return 1 if dtype.startswith("f8") else 0.5
  return DTYPE_BYTES.get(dtype, 0)


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """Every array in an HLO type ('bf16[4,8]{1,0}' or a tuple of them)."""
  return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(type_text)]


def nbytes(type_text: str) -> float:
  return sum(dtype_bytes(d) * math.prod(s) for d, s in arrays(type_text))


@dataclasses.dataclass
class Instr:
  name: str
  type_text: str
  opcode: str
  operands: list[str]
  attrs: str
  computation: str = ""  # the computation it is in


@dataclasses.dataclass
class Computation:
  name: str
  instrs: list[Instr]
  shapes: dict[str, str]  # name -> type text, parameters included
  constants: dict[str, int] = dataclasses.field(default_factory=dict)  # integer scalar constants, name -> value
  index: dict[str, Instr] = dataclasses.field(default_factory=dict)  # its instructions by name


def _split_call(rest: str) -> tuple[str, str]:
  """'a, b), attrs' -> ('a, b', 'attrs'): the operand list up to its closing parenthesis."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[:i], rest[i + 1 :]
  return rest, ""


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
  """HLO module text -> (computations by name, the ENTRY computation's name)."""
  comps: dict[str, Computation] = {}
  entry, current = "", None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      shapes = {m.group(1): m.group(2) for m in re.finditer(r"([\w.\-]+):\s*((?:\([^)]*\))|[^,()]+\])", header.group(3))}
      current = Computation(header.group(2), [], shapes)
      comps[current.name] = current
      entry = current.name if header.group(1) else entry
      continue
    match = _INSTR.match(line) if current is not None else None
    if match:
      name, type_text, opcode, rest = match.groups()
      operand_text, attrs = _split_call(rest)
      instr = Instr(name, type_text, opcode, re.findall(r"%([\w.\-]+)", operand_text), attrs, current.name)
      if opcode == "constant" and re.fullmatch(r"[su]\d+\[\]\S*", type_text) and re.fullmatch(r"-?\d+", operand_text):
        current.constants[name] = int(operand_text)
      current.instrs.append(instr)
      current.index[name] = instr
      current.shapes[name] = type_text
  return comps, entry


def _called(instr: Instr) -> list[str]:
  names = re.findall(r"(?:calls|body|true_computation|false_computation)=%?([\w.\-]+)", instr.attrs)
  for group in re.findall(r"(?:calls|branch_computations)=\{([^}]*)\}", instr.attrs):
    names += re.findall(r"%?([\w.\-]+)", group)
  if instr.opcode == "call":
    names += re.findall(r"to_apply=%?([\w.\-]+)", instr.attrs)
  return names


def induction_step(instr: Instr) -> int:
  """How far a while loop's induction variable moves a trip: 2 after XLA's double buffering unrolled it."""
  match = re.search(r'"known_init_step":\{"init":"-?\d+","step":"(\d+)"', instr.attrs)
  return int(match.group(1)) if match else 1


def trip_count(instr: Instr) -> int | None:
  match = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
  return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class Trips:
  """How often one execution of a while loop runs its body, and from what: "known" (XLA's known_trip_count),
  "bound" (its condition's `i < N`, from the induction variable's init and step where XLA gives them, else 0
  and 1), "once" (neither readable). `note` names the loop and the bound for the report ("" when known)."""

  count: int
  source: str
  note: str = ""


def loop_trips(instr: Instr, comps: dict[str, Computation]) -> Trips:
  """The one trip count the inventory and the schedule's walk both use (MaxText/plan/schedule.py)."""
  known = trip_count(instr)
  if known is not None:
    return Trips(known, "known")
  condition = re.search(r"condition=%?([\w.\-]+)", instr.attrs)[1]
  bound = _condition_bound(comps, condition)
  if bound is None:
    return Trips(1, "once", f"while loop {instr.name}: no known trip count and no readable bound in {condition}: "
                 "its body counted once")
  init, step, source = _induction(instr, comps, condition)
  if step <= 0:
    return Trips(1, "once", f"while loop {instr.name}: no known trip count and its induction variable steps by {step}: "
                 "its body counted once")
  count = max(0, math.ceil((bound - init) / step))
  return Trips(count, "bound", f"while loop {instr.name}: no known trip count; its condition {condition} bounds "
               f"the induction variable at {bound} (init {init} {source}, step {step}): counted {count} times")


def _induction(instr: Instr, comps: dict[str, Computation], condition: str) -> tuple[int, int, str]:
  """(init, step, where the init came from) of a while loop's induction variable: XLA's known_init_step; else the
  variable at the known induction variable's tuple index (or the one tuple element its condition reads): the init
  and step XLA gives for it, else the value the while's init tuple holds there, followed through copies to a
  constant (the gradient-accumulation loop after XLA peeled a microbatch before it enters at copy(constant 1):
  assuming 0 counted a microbatch too many); else 0 and 1, assumed."""
  known = re.search(r'"known_init_step":\{"init":"(-?\d+)","step":"(-?\d+)"', instr.attrs)
  if known:
    return int(known[1]), int(known[2]), "from XLA"
  index = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"', instr.attrs)
  index = int(index[1]) if index else _condition_index(comps, condition)
  if index is None:
    return 0, 1, "assumed"
  dynamic = re.search(r'\{"tuple_index":"%d","init":"(-?\d+)","step":"(-?\d+)"' % index, instr.attrs)
  if dynamic:
    return int(dynamic[1]), int(dynamic[2]), "from XLA"
  init = _init_element(instr, comps, index)
  return (0, 1, "assumed") if init is None else (init, 1, "from the while's init")


def _condition_index(comps: dict[str, Computation], condition: str) -> int | None:
  """The tuple element a loop's condition reads, where it reads one."""
  comp = comps.get(condition)
  read = {re.search(r"index=(\d+)", i.attrs)[1] for i in comp.instrs if i.opcode == "get-tuple-element"} if comp else set()
  return int(read.pop()) if len(read) == 1 else None


def _init_element(instr: Instr, comps: dict[str, Computation], index: int) -> int | None:
  """The integer constant element `index` of a while's init tuple holds, through copies, bitcasts and converts."""
  comp = comps.get(instr.computation)
  init = comp.index.get(instr.operands[0]) if comp and instr.operands else None
  if init is None or init.opcode != "tuple" or index >= len(init.operands):
    return None
  name = init.operands[index]
  while name not in comp.constants:
    source = comp.index.get(name)
    if source is None or source.opcode not in ("copy", "bitcast", "convert") or not source.operands:
      return None
    name = source.operands[0]
  return comp.constants[name]


def _condition_bound(comps: dict[str, Computation], name: str) -> int | None:
  """N of `i < N` (N + 1 of `i <= N`) in a loop's condition, through the fusions it calls: the one integer
  constant other than 0 and 1 there, under a compare LT/LE (or GT/GE with the constant first); None otherwise."""
  seen, stack, directions = [], [name], set()
  while stack:
    comp = comps.get(stack.pop())
    if comp is None or comp.name in seen:
      continue
    seen.append(comp.name)
    for i in comp.instrs:
      if i.opcode == "compare" and (d := re.search(r"direction=(LT|LE|GT|GE)", i.attrs)):
        if i.operands and i.operands[0] in comp.constants:  # N > i is i < N
          directions.add({"GT": "LT", "GE": "LE"}.get(d[1], "other"))
        else:
          directions.add(d[1] if d[1] in ("LT", "LE") else "other")
      stack += re.findall(r"calls=%?([\w.\-]+)", i.attrs)
  bounds = {v for c in seen for v in comps[c].constants.values() if v not in (0, 1)}
  if len(directions) != 1 or "other" in directions or len(bounds) != 1:
    return None
  return bounds.pop() + (directions == {"LE"})


# --- replica groups -> partition-id groups -------------------------------------------


def replica_groups(attrs: str, num_partitions: int) -> list[list[int]] | None:
  """A collective's groups of partition ids, from any of XLA's spellings (None: unreadable)."""
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if pairs:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")]
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if mesh:
    axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
    chosen = set(re.findall(r"'([^']+)'", mesh.group(2)))
    shape = [int(n) for _, n in axes]
    ids = np.arange(math.prod(shape)).reshape(shape)
    inside = [i for i, (a, _) in enumerate(axes) if a in chosen]
    outside = [i for i in range(len(axes)) if i not in inside]
    moved = ids.transpose(outside + inside).reshape(-1, math.prod([shape[i] for i in inside]) if inside else 1)
    return moved.tolist()
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if iota:
    groups, size = int(iota.group(1)), int(iota.group(2))
    dims = [int(x) for x in iota.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(4):
      ids = ids.transpose([int(x) for x in iota.group(4).split(",")])
    return ids.reshape(groups, size).tolist()
  explicit = re.search(r"replica_groups=\{(.*?)\}(?:,|$)", attrs)
  if explicit is not None:
    body = explicit.group(1).strip()
    if not body:
      return [list(range(num_partitions))]
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", body + "}")]
  return None


def group_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
  """Mesh axes along which a collective's group members differ."""
  names, shape = list(mesh_shape), list(mesh_shape.values())
  varying: set[int] = set()
  for group in groups:
    coords = np.array(np.unravel_index(np.asarray(group), shape)).T
    varying |= {i for i in range(len(shape)) if len(set(coords[:, i])) > 1}
  return tuple(names[i] for i in sorted(varying))


# --- the walk ----------------------------------------------------------------------------


def _kind(opcode: str) -> str | None:
  base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
  return base if base in KINDS else None


def _result_bytes(kind: str, instr: Instr, n: int) -> float:
  """The collective's result bytes. Async -start ops return (operands, results[, sync flags])
  tuples: in + out = out (n + 1) / n for a gather over n, out (n + 1) for a reduce-scatter
  (its operand is n times its result: counting it made the 128 x H100 plan's reduce-scatters
  1.5 TB, 2026-12-01), 2 out for a permute or an all-to-all. An all-reduce-start is printed
  either with its results alone (a tuple of them where several arrays are reduced together) or,
  like the others, with its operands and results (and u32 sync flags): the operands' arrays again
  as the next ones is the latter, and its transfer is the results. Compared array by array, scalars
  included: counting only the shaped ones took a pair with a scalar operand for results alone, twice."""
  shaped = [(d, s) for d, s in arrays(instr.type_text) if s]
  total = sum(dtype_bytes(d) * math.prod(s) for d, s in shaped)
  if not instr.opcode.endswith("-start") or not instr.type_text.startswith("("):
    return total
  if kind == "all-reduce":  # operands then results: the first k arrays again as the next k (a scalar operand too)
    every, k = arrays(instr.type_text), len(instr.operands)
    if len(every) >= 2 * k and every[:k] == every[k:2 * k]:
      return sum(dtype_bytes(d) * math.prod(s) for d, s in every[k:2 * k])
    return total
  if kind in ("collective-permute", "all-to-all"):
    return total / 2
  if kind == "all-gather":
    return total * n / (n + 1)
  if kind == "reduce-scatter":
    return total / (n + 1)
  return total


def _sizes(kind: str, result: float, n: int) -> tuple[float, float]:
  """(buffer bytes, wire bytes per device) for a collective of result `result` over n devices."""
  if n <= 1:
    return (result * n if kind == "reduce-scatter" else result), 0.0
  return {
      "all-gather": (result, result * (n - 1) / n),
      "reduce-scatter": (result * n, result * (n - 1)),
      "all-reduce": (result, 2 * result * (n - 1) / n),
      "all-to-all": (result, result * (n - 1) / n),
      "ragged-all-to-all": (result, result * (n - 1) / n),
      "collective-permute": (result, result),
  }[kind]


def off_node_share(kind: str, groups: list[list[int]], nodes: list[int]) -> float:
  """The share of a member's wire bytes exchanged with other nodes (see the module docstring)."""
  node = lambda i: nodes[i] if i < len(nodes) else -1  # noqa: E731
  if kind == "collective-permute":
    return sum(node(a) != node(b) for a, b in groups) / len(groups) if groups else 0.0
  off_node, members = 0.0, 0
  for g in (g for g in groups if len(g) > 1):  # members per node: linear in the group, not pairwise
    per_node = Counter(node(i) for i in g)
    off_node += sum(c * (len(g) - c) for c in per_node.values()) / (len(g) - 1)
    members += len(g)
  return off_node / members if members else 0.0


def _dot_flops(instr: Instr, comp: Computation) -> float:
  out = arrays(instr.type_text)
  if not out:
    return 0.0
  lhs = arrays(comp.shapes.get(instr.operands[0], "")) if instr.operands else []
  if instr.opcode == "dot":
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
  else:  # cuBLAS GEMM custom-call: dimension numbers in its backend config
    dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
  if not lhs or not dims:
    return 0.0
  contracting = [int(x.strip('"')) for x in dims.group(1).split(",") if x.strip('"')]
  k = math.prod(lhs[0][1][i] for i in contracting)
  return 2.0 * math.prod(out[0][1]) * k


def nics_per_member(kind: str, groups: list[list[int]], nodes: list[int]) -> int:
  """The NICs one member's wire bytes share across nodes. A ring (all-gather, reduce-scatter, all-reduce) leaves a
  node once per pass, and NCCL runs a ring on each NIC of the group's members there (one NIC a GPU, HGX/DGX): a
  group with c members a node moves a member's wire bytes at c NICs' rate (pricing it at one read 8x slow). An
  all-to-all or a permute sends each member's own bytes over its own NIC: 1. The fewest on any node bound it."""
  if kind not in ("all-gather", "reduce-scatter", "all-reduce"):
    return 1
  per_node = [c for g in groups for c in Counter(nodes[i] for i in g if i < len(nodes)).values()]
  return max(1, min(per_node, default=1))


def collective(instr: Instr, mesh_shape: dict[str, int], nodes: list[int],
               notes: set[str]) -> tuple[tuple[str, tuple[str, ...], bool], int, float, float, float, float] | None:
  """((kind, mesh axes, crosses nodes), group size, and per device: buffer bytes, wire bytes, those exchanged with
  other nodes, those its link carries (over `nics_per_member` across nodes)) of one collective instruction (its
  -start for an async one); None for a group of one, which moves nothing."""
  kind = _kind(instr.opcode)
  num_partitions = len(nodes)
  groups = replica_groups(instr.attrs, num_partitions)
  if groups is None:
    notes.add(f"unreadable replica groups on {instr.opcode}: counted as all devices")
    groups = [list(range(num_partitions))]
  n = len(groups[0]) if kind != "collective-permute" else 2
  if n <= 1 and kind != "collective-permute":
    return None
  axes = group_axes(groups, mesh_shape) if kind != "collective-permute" or groups else ()
  crosses = any(len({nodes[i] for i in g if i < len(nodes)}) > 1 for g in groups)
  buffer, wire = _sizes(kind, _result_bytes(kind, instr, n), n)
  per_link = wire / nics_per_member(kind, groups, nodes) if crosses else wire
  return (kind, axes, crosses), n, buffer, wire, wire * off_node_share(kind, groups, nodes), per_link


def inventory(text: str, mesh_shape: dict[str, int], nodes: list[int],
              branches: dict[str, list[str]] | None = None) -> dict[str, Any]:
  """Collectives and dot FLOPs of one execution of the module (see the module docstring).

  branches: per conditional (by name), the branch computations to count, as the schedule's walk took them
  (MaxText/plan/schedule.py `_Walk.branches`); a conditional not named counts every branch (an upper bound)."""
  comps, entry = parse_module(text)
  rows: dict[tuple[str, tuple[str, ...], bool], dict[str, float]] = defaultdict(
      lambda: {"count": 0, "bytes": 0.0, "wire_bytes": 0.0, "inter_node_bytes": 0.0, "link_bytes": 0.0, "group_size": 0})
  notes: set[str] = set()
  flops = [0.0]
  pipeline_loops: list[dict[str, Any]] = []
  stage_axis = STAGE_AXIS if mesh_shape.get(STAGE_AXIS, 1) > 1 else None

  def visit(name: str, mult: int, depth: int = 0) -> None:
    comp = comps.get(name)
    if comp is None or depth > 64:
      return
    for instr in comp.instrs:
      kind = _kind(instr.opcode)
      if kind:
        described = collective(instr, mesh_shape, nodes, notes)
        if described is None:
          continue  # a group of one moves nothing
        (kind, axes, crosses), n, buffer, wire, inter_node, per_link = described
        row = rows[(kind, axes, crosses)]
        row["count"] += mult
        row["bytes"] += buffer * mult
        row["wire_bytes"] += wire * mult
        row["inter_node_bytes"] += inter_node * mult
        row["link_bytes"] += per_link * mult
        row["group_size"] = max(row["group_size"], n)
      elif instr.opcode == "dot" or (instr.opcode == "custom-call" and re.search(r"cublas.*(gemm|matmul)", instr.attrs)):
        flops[0] += _dot_flops(instr, comp) * mult
      if instr.opcode == "while":
        trips = loop_trips(instr, comps)
        if trips.note:
          notes.add(trips.note)
        for body in re.findall(r"body=%?([\w.\-]+)", instr.attrs):
          before, inner = flops[0], len(pipeline_loops)
          visit(body, mult * trips.count, depth + 1)
          # A loop holding a pipeline loop is not one: the gradient-accumulation loop, whose body also runs the
          # iteration XLA's double buffering peeled off the pipeline loop (stage permutes of its own).
          if stage_axis and len(pipeline_loops) == inner and _permutes_over(comps, body, stage_axis, mesh_shape,
                                                                            len(nodes)):
            pipeline_loops.append({"trip_count": trip_count(instr), "step": induction_step(instr), "count": mult,
                                   "dot_flops": flops[0] - before})
        continue
      called = _called(instr)
      if instr.opcode == "conditional":
        if branches is not None and instr.name in branches:
          called = branches[instr.name]
        else:
          notes.add(f"conditional {instr.name}: every branch counted (an upper bound)")
      for name in called:
        visit(name, mult, depth + 1)

  visit(entry, 1)
  collectives = [
      {"kind": kind, "axes": list(axes), "crosses_nodes": crosses, **{k: v for k, v in row.items()}}
      for (kind, axes, crosses), row in sorted(rows.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1]))
  ]
  return {"collectives": collectives, "inter_node_bytes": sum(r["inter_node_bytes"] for r in collectives),
          "hlo_dot_flops": flops[0], "inventory_notes": sorted(notes), "pipeline_loops": pipeline_loops}


# The mesh axis of upstream's pipeline stages (maxtext 0.2.5 configs/types.py: ici/dcn_pipeline_parallelism).
STAGE_AXIS = "stage"


def _permutes_over(comps: dict[str, Computation], name: str, axis: str, mesh_shape: dict[str, int],
                   num_partitions: int, depth: int = 0) -> bool:
  """Whether computation `name`, or one it calls other than a loop body, has a collective-permute over `axis`."""
  comp = comps.get(name)
  if comp is None or depth > 64:
    return False
  for instr in comp.instrs:
    if _kind(instr.opcode) == "collective-permute":
      groups = replica_groups(instr.attrs, num_partitions)
      if groups and axis in group_axes(groups, mesh_shape):
        return True
    if instr.opcode != "while" and any(_permutes_over(comps, c, axis, mesh_shape, num_partitions, depth + 1)
                                       for c in _called(instr)):
      return True
  return False


if __name__ == "__main__":  # python -m MaxText.plan.hlo_inventory HLO.txt '{"fsdp": 4}'
  import sys

  shape = json.loads(sys.argv[2])
  print(json.dumps(inventory(open(sys.argv[1]).read(), shape, [0] * math.prod(shape.values())), indent=2))

