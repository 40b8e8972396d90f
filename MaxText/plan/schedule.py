"""The step as its scheduled HLO runs it: every op costed, and each async collective hidden behind the work XLA
put between its start and its done (MaxText/plan/planner.py prints the terms; alone:
`python -m MaxText.plan.schedule HLO.txt h200 '{"fsdp": 8}' [gpus_per_node]`).

  terms = schedule.estimate(hlo_text, hardware.GPUS["h200"], mesh_shape={"fsdp": 8}, nodes=[0] * 8)

Each op's cost (MaxText/plan/op_cost.py reads it; the rates are MaxText/hardware.py's, each with its source):
  GEMM         dots, convolutions, cuBLAS custom calls, fusions holding a dot (Triton/cuBLAS/cuDNN GEMM
               fusions), our Mosaic GPU grouped GEMMs: FLOPs at the dense GEMM rate (with FP8 experts,
               the grouped GEMMs at the FP8 grouped rate, whose measurement includes the quantization
               passes that are also costed as memory-bound: an upper bound by a few ms), or, where more, the
               bytes it reads and writes at XLA's HBM rate (the roofline: attention written out as dots, with a
               64-wide head, writes S x S scores for 128 FLOPs each)
  attention    cuDNN flash attention: FLOPs from Q, K, V and the mask, at its own rate
  memory-bound every other fusion and op (norms, softmax, routing, optimizer, elementwise, copies,
               gathers): bytes read and written at XLA's HBM rate
  collectives  wire bytes (hlo_inventory.collective) at their link's rate, a ring across nodes at its members' NICs
               on a node together (hlo_inventory.nics_per_member); host offload copies at PCIe's
The walk, a critical path: ops on the compute stream run one after another in schedule order. An async
collective (`*-start`/`*-done`, or `async-start` wrapping one) runs on its link's stream from its start,
after that link's previous transfer; its done waits for it, and the wait is the exposed part. A sync
collective waits for its link and blocks the stream. A while loop runs its body trip-count times (hlo_inventory.loop_trips,
the inventory's count: XLA's known_trip_count, else its condition's bound): two trips are walked and the second repeated, so a transfer
started in one trip and awaited in the next counts as pipelined. A conditional takes its slowest branch. The
step ends when the stream and every transfer have. A pipeline's bubble, a fraction b of the step, adds
path * b / (1 - b). Compute beside a transfer is not free: while any NCCL transfer is in flight, a kernel runs at
(1 - hardware.COLLECTIVE_SM_SHARE) of its rate (the SMs NCCL's kernels hold), the extra time `contention_s`. Not
modelled: launch gaps between kernels, GEMMs below the dense rate at small shapes, two links' transfers sharing a
GPU's copy engines.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import sys
from typing import Any

from MaxText import hardware
from MaxText.plan import hlo_inventory, op_cost
from MaxText.plan.hlo_inventory import Computation, Instr, nbytes
from MaxText.plan.memory_ops import Frames, Groups

# Ops that move no bytes of their own: structure, aliases, and the waits handled by the walk.
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "add-dependency", "opt-barrier",
        "partition-id", "replica-id", "domain", "copy-done", "fusion-done", "async-done", "async-update"}
RowKey = tuple[str, tuple[str, ...], bool]  # (kind, mesh axes, crosses nodes), as hlo_inventory's rows


@dataclasses.dataclass
class Terms:
  """Seconds and counts per step, summed over the walk.

  Attributes:
    seconds: gemm_s, fp8_gemm_s, attention_s, memory_s, collectives_s (every collective's transfer time),
      exposed_s (what the stream waited for them), offload_s and offload_exposed_s (host offload's copies),
      contention_s (kernels slowed beside NCCL transfers).
    counts: gemm_flops, fp8_flops (of them, grouped_flops: our grouped GEMMs'), attention_flops,
      memory_bytes, kernels (ops with a cost).
    rows: per collective row key (and ("host-offload", (), False)): [seconds, exposed seconds, count].
    memory_ops: the memory-bound ops' seconds and bytes by source op (MaxText/plan/memory_ops.py).
  """

  seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(
      ("gemm_s", "fp8_gemm_s", "attention_s", "memory_s", "collectives_s", "exposed_s", "offload_s",
       "offload_exposed_s", "contention_s"), 0.0))
  counts: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(
      ("gemm_flops", "fp8_flops", "grouped_flops", "attention_flops", "memory_bytes", "kernels"), 0.0))
  rows: dict[RowKey, list[float]] = dataclasses.field(default_factory=dict)
  memory_ops: Groups = dataclasses.field(default_factory=Groups)

  def add_scaled(self, later: Terms, earlier: Terms, times: int) -> None:
    """self += times * (later - earlier): a loop trip's terms repeated."""
    for mine, a, b in ((self.seconds, later.seconds, earlier.seconds), (self.counts, later.counts, earlier.counts)):
      for k in mine:
        mine[k] += times * (a[k] - b.get(k, 0.0))
    for key, row in later.rows.items():
      before = earlier.rows.get(key, [0.0, 0.0, 0.0])
      mine_row = self.rows.setdefault(key, [0.0, 0.0, 0.0])
      for i in range(3):
        mine_row[i] += times * (row[i] - before[i])
    self.memory_ops.add_scaled(later.memory_ops, earlier.memory_ops, times)


@dataclasses.dataclass(frozen=True)
class _Transfer:
  begin: float
  finish: float
  key: RowKey
  link: str


@dataclasses.dataclass
class _State:
  clock: float = 0.0  # the compute stream's time
  link_free: dict[str, float] = dataclasses.field(default_factory=dict)
  on_link: dict[str, list[_Transfer]] = dataclasses.field(default_factory=dict)  # link -> transfers not yet over
  pending: dict[str, _Transfer] = dataclasses.field(default_factory=dict)  # value -> its transfer in flight
  tuples: dict[str, dict[int, _Transfer]] = dataclasses.field(default_factory=dict)  # tuple value -> elements in flight
  terms: Terms = dataclasses.field(default_factory=Terms)

  def shift_from(self, since: float, by: float) -> None:
    """Transfers begun at or after `since` (and the links they hold) move `by` seconds later."""
    moved = lambda t: dataclasses.replace(t, begin=t.begin + by, finish=t.finish + by) if t.begin >= since else t  # noqa: E731
    self.pending = {k: moved(t) for k, t in self.pending.items()}
    self.tuples = {k: {i: moved(t) for i, t in v.items()} for k, v in self.tuples.items()}
    self.on_link = {k: [moved(t) for t in v] for k, v in self.on_link.items()}
    self.link_free = {k: v + by if v > since else v for k, v in self.link_free.items()}


@dataclasses.dataclass
class Module:
  """A scheduled HLO module parsed once for several walks (the estimate, its sensitivity: planner.py)."""

  comps: dict[str, Computation]
  entry: str
  param_index: dict[tuple[str, str], int]  # (computation, parameter) -> its number
  roots: dict[str, Instr | None]
  # What every walk of the module finds the same (only the rates change): each collective's description and the notes
  # it gave, each fusion's GEMM FLOPs, the custom-call targets whose FLOPs cannot be read.
  described: dict[str, Any] = dataclasses.field(default_factory=dict)
  described_notes: set[str] = dataclasses.field(default_factory=set)
  gemm_cache: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
  opaque: set[str] = dataclasses.field(default_factory=set)
  frames: Frames = dataclasses.field(default_factory=list)  # the stack-frame table its stack_frame_ids index


def parse(text: str, frames: Frames | None = None) -> Module:
  """`frames`: the compile's stack-frame table (memory_ops.stack_frames), which names the memory-bound ops' sources."""
  comps, entry = hlo_inventory.parse_module(text)
  # What hlo_inventory's parse leaves out, per computation: parameter numbers, roots.
  param_index: dict[tuple[str, str], int] = {}
  roots: dict[str, str] = {}
  current = ""
  for line in text.splitlines():
    if (header := hlo_inventory._HEADER.match(line)) and not line.startswith(" "):  # pylint: disable=protected-access
      current = header[2]
    elif m := re.match(r"\s*(ROOT )?%?([\w.\-]+) = (?:.*? parameter\((\d+)\))?", line):
      if m[3] is not None:
        param_index[(current, m[2])] = int(m[3])
      if m[1]:
        roots[current] = m[2]
  return Module(comps, entry, param_index, {
      c.name: next((i for i in c.instrs if i.name == roots.get(c.name)), c.instrs[-1] if c.instrs else None)
      for c in comps.values()}, frames=[tuple(f) for f in frames or []])


class _Walk:
  """One module's walk (see the module docstring); `run` returns the entry's terms and critical path."""

  def __init__(self, module: Module, gpu: hardware.Gpu, mesh_shape: dict[str, int], nodes: list[int],
               fp8_experts: bool, grouped_scale: float = 1.0):
    self.module, self.comps, self.entry = module, module.comps, module.entry
    self.param_index, self.roots, self.gemm_cache = module.param_index, module.roots, module.gemm_cache
    self.gpu, self.mesh_shape, self.nodes, self.fp8 = gpu, mesh_shape, nodes, fp8_experts
    self.grouped_scale = grouped_scale  # our grouped GEMMs' rows that hold tokens, of their buffers' (see estimate)
    self.opaque = module.opaque  # custom-call targets whose FLOPs the walk cannot read
    self.started: set[str] = set()  # every collective start seen, those that move nothing included
    self.notes: set[str] = set()
    self.branches: dict[str, list[str]] = {}  # conditional -> the branches it took (hlo_inventory counts the same)

  def run(self) -> tuple[_State, float]:
    state = _State()
    self.walk(self.entry, state, None)
    last = max(state.pending.values(), key=lambda t: t.finish, default=None)
    if last is not None and last.finish > state.clock:  # awaited by nothing: the step ends after it
      self._wait(last, state)
    return state, state.clock

  # --- the walk ---------------------------------------------------------------------------

  def walk(self, name: str, state: _State, carried: dict[int, _Transfer] | None) -> dict[int, _Transfer]:
    """Runs computation `name` on `state`; `carried`: its tuple parameter's elements in flight. Returns the
    root tuple's elements in flight (a loop body's carry into its next trip)."""
    comp = self.comps[name]
    for instr in comp.instrs:
      op = instr.opcode
      if op == "parameter" and carried:
        state.tuples[instr.name] = carried
      elif op == "get-tuple-element" and instr.operands and instr.operands[0] in state.tuples:
        index = int(re.search(r"index=(\d+)", instr.attrs)[1])
        if index in state.tuples[instr.operands[0]]:
          state.pending[instr.name] = state.tuples[instr.operands[0]][index]
      elif op == "tuple":
        inflight = {i: state.pending[o] for i, o in enumerate(instr.operands) if o in state.pending}
        if inflight:
          state.tuples[instr.name] = inflight
      elif op.endswith("-done") or op == "async-done":
        self._await(instr, state)
      elif op == "while":
        self._loop(instr, state)
      elif op == "conditional":
        self._branches(instr, state)
      elif op == "call":
        self.walk(re.search(r"to_apply=%?([\w.\-]+)", instr.attrs)[1], state, None)
      elif (inner := self._collective_of(instr)) is not None:
        self._transfer(instr, inner, state)
      elif op in ("copy-start", "fusion-start") and "S(5)" in instr.type_text:  # host offload: PCIe, beside the stream
        self._host_copy(instr, state)
      elif op == "async-start":
        for called in re.findall(r"calls=%?([\w.\-]+)", instr.attrs):
          self.walk(called, state, None)
      elif op not in FREE:
        self._compute(instr, comp, state)
    root = self.roots[name]
    return state.tuples.get(root.name, {}) if root is not None else {}

  def _compute(self, instr: Instr, comp: Computation, state: _State) -> None:
    kind, amount, grouped = self._cost(instr, comp)
    state.terms.counts["grouped_flops"] += grouped
    seconds = amount / self.rate(kind)
    if kind in ("gemm_s", "fp8_gemm_s"):
      # GPT-OSS's proxy (dot_product attention): its byte-bound GEMMs add 58 ms to a 434 ms step; the V3 proxy's, 0.5.
      seconds = max(seconds, self._op_bytes(instr, comp) / self.gpu.hbm_bandwidth.value)
    share = hardware.COLLECTIVE_SM_SHARE.value
    slowed = self._beside_transfers(state, seconds) * share / (1.0 - share)
    state.clock += seconds + slowed
    state.terms.seconds[kind] += seconds
    state.terms.seconds["contention_s"] += slowed
    state.terms.counts[{"gemm_s": "gemm_flops", "fp8_gemm_s": "fp8_flops", "attention_s": "attention_flops",
                        "memory_s": "memory_bytes"}[kind]] += amount
    state.terms.counts["kernels"] += 1
    if kind == "memory_s":
      state.terms.memory_ops.add(instr, seconds, amount, self.module.frames)

  @staticmethod
  def _beside_transfers(state: _State, seconds: float) -> float:
    """How much of [clock, clock + seconds] some NCCL transfer is in flight (the union over the links)."""
    end, covered, reach = state.clock + seconds, 0.0, state.clock
    spans = sorted((max(t.begin, state.clock), min(t.finish, end)) for link, ts in state.on_link.items()
                   if link != "host" for t in ts)
    for begin, finish in spans:
      if finish > max(begin, reach):
        covered += finish - max(begin, reach)
        reach = finish
    return covered

  def _collective_of(self, instr: Instr) -> Instr | None:
    """The collective an instruction starts or is (an async-start's wrapped one); None for anything else."""
    if hlo_inventory._kind(instr.opcode):  # pylint: disable=protected-access
      return instr
    if instr.opcode == "async-start":
      for called in re.findall(r"calls=%?([\w.\-]+)", instr.attrs):
        wrapped = self.comps[called].instrs if called in self.comps else []
        inner = [i for i in wrapped if hlo_inventory._kind(i.opcode)]  # pylint: disable=protected-access
        if inner:
          return inner[0]
    return None

  def rate(self, kind: str) -> float:
    """FLOP/s or bytes/s of an op kind of `_cost` on this GPU."""
    return {"gemm_s": self.gpu.gemm_flops, "attention_s": self.gpu.attention_flops,
            "memory_s": self.gpu.hbm_bandwidth, "fp8_gemm_s": self.gpu.fp8_grouped_flops}[kind].value

  def transfer(self, inner: Instr) -> tuple[RowKey, str, float] | None:
    """A collective's row key, link and seconds at that link's rate; None for one that moves nothing."""
    if inner.name not in self.module.described:  # the same for every walk of the module (only the rates change)
      self.module.described[inner.name] = hlo_inventory.collective(inner, self.mesh_shape, self.nodes,
                                                                   self.module.described_notes)
    described = self.module.described[inner.name]
    if described is None:
      return None
    key, per_link = described[0], described[-1]
    return key, "ib" if key[2] else "nvlink", per_link / hardware.link_bytes(self.gpu, key[0], key[2]).value

  def _transfer(self, instr: Instr, inner: Instr, state: _State) -> None:
    self.started.add(instr.name)
    if (moved := self.transfer(inner)) is not None:
      key, link, seconds = moved
      self._start(instr, state, key, link, seconds, asynchronous=instr.opcode.endswith("-start"))

  def _host_copy(self, instr: Instr, state: _State) -> None:
    """A copy to or from host memory (memory space S(5)): a whole array (copy-start), or the slice an async
    fusion reads from or writes into a host buffer (the layer scan's offloaded activations)."""
    self.started.add(instr.name)
    if instr.opcode == "fusion-start":
      fused = self.comps[re.search(r"calls=%?([\w.\-]+)", instr.attrs)[1]]
      moved = op_cost.written_bytes(self.roots[fused.name], fused)
    else:
      moved = max((nbytes(t) for t in re.findall(r"[a-z0-9]+\[[\d,]*\]\{[^}]*S\(5\)[^}]*\}", instr.type_text)), default=0.0)
    self._start(instr, state, ("host-offload", (), False), "host", moved / self.gpu.host_bytes.value, asynchronous=True)

  def _start(self, instr: Instr, state: _State, key: RowKey, link: str, seconds: float, asynchronous: bool) -> None:
    begin = max(state.clock, state.link_free.get(link, 0.0))
    transfer = _Transfer(begin, begin + seconds, key, link)
    state.link_free[link] = transfer.finish
    state.on_link.setdefault(link, []).append(transfer)
    row = state.terms.rows.setdefault(key, [0.0, 0.0, 0.0])
    row[0] += seconds
    row[2] += 1
    state.terms.seconds["offload_s" if link == "host" else "collectives_s"] += seconds
    if asynchronous:
      state.pending[instr.name] = transfer
    else:
      self._wait(transfer, state)

  def _await(self, instr: Instr, state: _State) -> None:
    transfer = state.pending.pop(instr.operands[0], None) if instr.operands else None
    if transfer is not None:
      self._wait(transfer, state)
    elif instr.operands and instr.operands[0] not in self.started and instr.opcode not in FREE:
      self.notes.add(f"{instr.opcode} whose start the walk did not follow: its transfer counted as overlapped")

  def _wait(self, transfer: _Transfer, state: _State) -> None:
    """The stream waits for `transfer`. Each moment of the wait is charged to the transfer its link moves then (one
    queued before it, or itself), so no row is exposed for longer than its own transfers take."""
    state.pending = {k: t for k, t in state.pending.items() if t != transfer}  # every name it went by
    waited = max(0.0, transfer.finish - state.clock)
    state.terms.seconds["offload_exposed_s" if transfer.key[0] == "host-offload" else "exposed_s"] += waited
    charged = 0.0
    for other in state.on_link.get(transfer.link, []):
      overlap = min(other.finish, transfer.finish) - max(other.begin, state.clock)
      if overlap > 0:
        state.terms.rows[other.key][1] += overlap
        charged += overlap
    state.terms.rows[transfer.key][1] += max(0.0, waited - charged)  # a gap on the link (none in a serial queue)
    state.clock += waited
    state.on_link[transfer.link] = [t for t in state.on_link.get(transfer.link, []) if t.finish > state.clock]

  def _loop(self, instr: Instr, state: _State) -> None:
    body = re.search(r"body=%?([\w.\-]+)", instr.attrs)[1]
    trips = self._trips(instr)
    carried = state.tuples.get(instr.operands[0]) if instr.operands else None
    for trip in range(min(trips, 2)):
      if trip == 1:
        clock, terms = state.clock, copy.deepcopy(state.terms)
      carried = self.walk(body, state, carried)
    if trips > 2:
      repeat, trip_s = trips - 2, state.clock - clock
      state.shift_from(clock, repeat * trip_s)
      state.terms.add_scaled(copy.deepcopy(state.terms), terms, repeat)
      state.clock += repeat * trip_s
    if carried:
      state.tuples[instr.name] = carried

  def _trips(self, instr: Instr) -> int:
    trips = hlo_inventory.loop_trips(instr, self.comps)  # the inventory's count, its note the same
    if trips.note:
      self.notes.add(trips.note)
    return trips.count

  def _branches(self, instr: Instr, state: _State) -> None:
    names = re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", instr.attrs)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", instr.attrs):
      names += re.findall(r"%?([\w.\-]+)", group)
    outcomes = []
    for name in names:
      branch = copy.deepcopy(state)
      self.walk(name, branch, None)
      outcomes.append((branch, name))
    if outcomes:
      slowest, name = max(outcomes, key=lambda o: o[0].clock)
      state.__dict__.update(slowest.__dict__)
      taken = self.branches.setdefault(instr.name, [])
      if name not in taken:
        taken.append(name)

  # --- one op's cost ----------------------------------------------------------------------

  def _cost(self, instr: Instr, comp: Computation) -> tuple[str, float, float]:
    """("gemm_s" | "fp8_gemm_s" | "attention_s" | "memory_s", FLOPs or bytes, of the FLOPs our grouped GEMMs')
    of one op on the stream."""
    target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
    if instr.opcode == "custom-call" and target and target[1].startswith("__cudnn$fmha"):
      return "attention_s", op_cost.attention_flops(instr, comp), 0.0
    self._note_opaque(instr)
    called = re.findall(r"calls=%?([\w.\-]+)", instr.attrs) if instr.opcode in ("fusion", "fusion-start") else []
    if called:
      other, grouped = self._gemm_flops(called[0])
    else:
      flops, is_grouped = op_cost.gemm_flops_of(instr, comp)
      other, grouped = (0.0, flops) if is_grouped else (flops, 0.0)
    grouped *= self.grouped_scale
    if other or grouped:
      return ("fp8_gemm_s" if grouped and self.fp8 else "gemm_s"), other + grouped, grouped
    return "memory_s", self._op_bytes(instr, comp), 0.0

  def _note_opaque(self, instr: Instr) -> None:
    target = re.search(r'custom_call_target="([^"]+)"', instr.attrs) if instr.opcode == "custom-call" else None
    if target and not op_cost.READ_TARGETS.search(target[1]):
      self.opaque.add(target[1])

  def _gemm_flops(self, name: str) -> tuple[float, float]:
    """FLOPs of the dots and GEMM calls inside a fused computation (and fusions nested in it): (others, our
    grouped GEMMs')."""
    if name not in self.gemm_cache:
      comp, other, grouped = self.comps[name], 0.0, 0.0
      for i in comp.instrs:
        self._note_opaque(i)
        if i.opcode == "fusion":
          inner = self._gemm_flops(re.search(r"calls=%?([\w.\-]+)", i.attrs)[1])
          other, grouped = other + inner[0], grouped + inner[1]
          continue
        flops, is_grouped = op_cost.gemm_flops_of(i, comp)
        other, grouped = (other, grouped + flops) if is_grouped else (other + flops, grouped)
      self.gemm_cache[name] = (other, grouped)
    return self.gemm_cache[name]

  def _op_bytes(self, instr: Instr, comp: Computation) -> float:
    """Bytes one op on the stream reads and writes: a fusion's through its fused computation, any other op's
    operands and output (op_cost.op_bytes). A memory-bound op's cost, and a GEMM's roofline."""
    called = re.findall(r"calls=%?([\w.\-]+)", instr.attrs) if instr.opcode in ("fusion", "fusion-start") else []
    return self._fusion_bytes(instr, comp, self.comps[called[0]]) if called else op_cost.op_bytes(instr, comp)

  def _fusion_bytes(self, instr: Instr, comp: Computation, fused: Computation) -> float:
    """Bytes a memory-bound fusion reads (its operands, or the slices it takes of them) and writes (its
    output, or the update it writes in place)."""
    uses = op_cost.users_of(fused)
    params = {self.param_index.get((fused.name, i.name)): i.name for i in fused.instrs if i.opcode == "parameter"}
    read = 0.0
    for index, operand in enumerate(instr.operands):
      full = nbytes(comp.shapes.get(operand, ""))
      read += min(full, op_cost.read_bytes(params[index], fused, uses)) if index in params else full
    return read + op_cost.written_bytes(self.roots[fused.name], fused)


# --- the estimate --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepTerms:
  """One step by its schedule (seconds unless named otherwise).

  compute_s = gemm_s + fp8_gemm_s + attention_s + hidden_flops_s; memory_s: memory-bound ops;
  collectives_s = exposed_s + overlapped_s, and host offload's copies apart (offload_s, offload_exposed_s);
  contention_s: what the kernels beside NCCL transfers lose (hardware.COLLECTIVE_SM_SHARE); path_s, the critical
  path, = compute_s + memory_s + contention_s + exposed_s + offload_exposed_s (a transfer that outlives the
  stream's last op is exposed); bubble_s = path_s b / (1 - b); step_s = path_s + bubble_s."""

  gemm_s: float
  fp8_gemm_s: float
  attention_s: float
  hidden_flops_s: float
  memory_s: float
  collectives_s: float
  exposed_s: float
  offload_s: float
  offload_exposed_s: float
  path_s: float
  bubble_s: float
  counts: dict[str, float]
  rows: dict[RowKey, list[float]]
  notes: list[str]
  branches: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # conditional -> the branches walked
  contention_s: float = 0.0
  grouped_scale: float = 1.0  # our grouped GEMMs' FLOPs counted, of their shapes' (see estimate)
  memory_ops: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # every group, largest first

  @property
  def compute_s(self) -> float:
    return self.gemm_s + self.fp8_gemm_s + self.attention_s + self.hidden_flops_s

  @property
  def overlapped_s(self) -> float:
    return self.collectives_s - self.exposed_s

  @property
  def step_s(self) -> float:
    return self.path_s + self.bubble_s


def estimate(text: str | Module, gpu: hardware.Gpu, mesh_shape: dict[str, int], nodes: list[int],
             fp8_experts: bool = False, counted_flops: float = 0.0, routed_flops: float = 0.0,
             bubble_fraction: float = 0.0, grouped_scale: float | None = None) -> StepTerms:
  """The step's terms from its scheduled HLO text, or the module `parse` read from it (see the module docstring).

  counted_flops: what the step multiplies by MaxText's count (plus the remat policy's recompute). Only where
  the HLO holds a custom call the walk cannot read (a Triton or Transformer Engine kernel), the FLOPs this
  count has beyond the HLO's GEMMs and attention run at the GEMM rate after the stream (`hidden_flops_s`).
  Otherwise the HLO's count stands: it is what runs (the proxy's is 424 T against MaxText's 441 T, whose
  recompute includes a dense layer's forward that XLA does not run twice).
  routed_flops: the routed experts' GEMM FLOPs per device by the config (flops.routed_expert_flops, routing
  balanced). Our grouped GEMMs multiply only the rows their group sizes hold; where their buffers are padded
  (a2a_padded's receive buffer holds the worst case), their shapes overcount, and every grouped GEMM is
  scaled down to this count. (The 1-GPU proxy's buffers hold exactly its tokens: 138.5 T both ways. Widths
  below a tile, as the tiny test model's, are padded and computed: there the scaling reads low.)
  bubble_fraction: a pipeline's idle share of the step, (stages - 1) / (repeats x microbatches + stages - 1).
  grouped_scale: that scaling as an earlier walk of the same module found it (the sensitivity's walks), skipping
  the walk that finds it.
  """
  if not 0.0 <= bubble_fraction < 1.0:
    raise ValueError(f"bubble_fraction={bubble_fraction}: must be in [0, 1)")
  if fp8_experts and gpu.fp8_grouped_flops is None:
    raise ValueError(f"moe_fp8: no FP8 grouped-GEMM rate for the {gpu.name} (its kernel is Hopper's)")
  module = parse(text) if isinstance(text, str) else text
  walk = _Walk(module, gpu, mesh_shape, nodes, fp8_experts, grouped_scale=grouped_scale or 1.0)
  state, path = walk.run()
  shapes_flops = state.terms.counts["grouped_flops"] / walk.grouped_scale
  if grouped_scale is None and routed_flops and shapes_flops > routed_flops:
    walk = _Walk(module, gpu, mesh_shape, nodes, fp8_experts, grouped_scale=routed_flops / shapes_flops)
    state, path = walk.run()
  if walk.grouped_scale < 1.0:
    walk.notes.add(f"our grouped GEMMs' shapes hold {1 / walk.grouped_scale:.3g}x the routed experts' FLOPs "
                   f"(padded buffers): scaled to their {shapes_flops * walk.grouped_scale / 1e12:.4g} T")
  s, c = state.terms.seconds, state.terms.counts
  seen = c["gemm_flops"] + c["fp8_flops"] + c["attention_flops"]
  hidden = max(0.0, counted_flops - seen) / gpu.gemm_flops.value if walk.opaque else 0.0
  if walk.opaque:
    walk.notes.add(f"custom calls the walk cannot read ({', '.join(sorted(walk.opaque))}): costed by their bytes, "
                   "and MaxText's FLOPs beyond the HLO's at the GEMM rate")
  path += hidden
  return StepTerms(gemm_s=s["gemm_s"], fp8_gemm_s=s["fp8_gemm_s"], attention_s=s["attention_s"], hidden_flops_s=hidden,
                   memory_s=s["memory_s"], collectives_s=s["collectives_s"], exposed_s=s["exposed_s"],
                   offload_s=s["offload_s"], offload_exposed_s=s["offload_exposed_s"], path_s=path,
                   bubble_s=path * bubble_fraction / (1.0 - bubble_fraction), counts=dict(c),
                   rows=state.terms.rows, notes=sorted(walk.notes | module.described_notes), branches=walk.branches,
                   grouped_scale=walk.grouped_scale, contention_s=s["contention_s"],
                   memory_ops=state.terms.memory_ops.rows())


if __name__ == "__main__":  # python -m MaxText.plan.schedule HLO.txt h200 '{"fsdp": 8}' [gpus_per_node]
  shape = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {"data": 1}
  per_node = int(sys.argv[4]) if len(sys.argv) > 4 else 8
  devices = math.prod(shape.values())
  result = estimate(open(sys.argv[1]).read(), hardware.GPUS[sys.argv[2]], shape, [i // per_node for i in range(devices)])
  print(json.dumps({**{k: v for k, v in dataclasses.asdict(result).items() if k != "rows"},
                    "compute_s": result.compute_s, "overlapped_s": result.overlapped_s, "step_s": result.step_s,
                    "rows": [[*k, *v] for k, v in result.rows.items()]}, indent=2, default=list))
