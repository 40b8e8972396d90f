"""The memory-bound ops by name: each op's seconds and bytes from the schedule's walk (MaxText/plan/schedule.py),
grouped by the source op that emitted it, so that a plan says which code owns its memory-bound time.

  frames = memory_ops.stack_frames(compiled)          # in the compile's child (MaxText/plan/aot.py)
  module = schedule.parse(hlo_text, frames)
  terms = schedule.estimate(module, ...)              # terms.memory_ops: one row per group, largest first

A group's key is the op's jax name stack (its metadata's op_name) normalised, and its source line: a scanned layer's
op in every layer and every microbatch is one group (the loops' `while/body/` and `while/cond/` steps, and numbered
suffixes such as `layers_12` or `dot_general.3`, are dropped), while the forward (`jvp(...)`), its backward
(`transpose(...)`) and a remat's recompute stay apart. The source line is the op's metadata's source_file and
source_line where the HLO text holds them, else its stack_frame_id read through the module's stack-frame table
(the text prints only the id: `stack_frames` keeps the table beside it): the innermost frame in this repo's code or
upstream MaxText's, else the innermost frame. Owner: "ours" (this repo: MaxText/, patches/, tools/), "upstream"
(site-packages maxtext/), "jax/flax" (jax, flax and every other library), "xla" (an op without an op_name: the
compiler's own, such as a loop's carried buffer copied; grouped by opcode and shape), "?" (no source).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from MaxText.plan.hlo_inventory import Instr

Frames = list[tuple[str, int, int]]  # stack_frame_id - 1 -> (file, line, parent frame id; 0: none)
REPO = Path(__file__).resolve().parents[2]
KEPT = 15  # the groups a plan keeps (its JSON: estimate.memory_ops)
SHOWN = 8  # of them, the groups the printout and a recipe's summary keep


def owner(path: str) -> str:
  """Who owns a source file, by its path."""
  if not path:
    return "?"
  if re.search(r"-packages/maxtext/", path, re.IGNORECASE):
    return "upstream"
  if "-packages/" in path:
    return "jax/flax"
  return "ours" if path.startswith(f"{REPO}/") or re.search(r"(^|/)(MaxText|patches)/", path) else "jax/flax"


def short_path(path: str) -> str:
  """A path from its package or the repo: 'MaxText/moe/dispatch.py', 'maxtext/layers/moe.py', 'jax/_src/...'."""
  packaged = re.search(r"-packages/(.*)$", path)  # first: the venv may sit inside the repo
  if packaged:
    return packaged[1]
  if path.startswith(f"{REPO}/"):
    return path[len(str(REPO)) + 1:]
  ours = re.search(r"(?:^|/)((?:MaxText|patches)/.*)$", path)
  return ours[1] if ours else path


def normalise(op_name: str) -> str:
  """The name stack with the loops' body steps and numbered suffixes dropped (the module docstring)."""
  steps = [s for s in op_name.split("/") if s not in ("while", "body", "cond")]
  return "/".join(re.sub(r"([_.])\d+(?=$|\))", r"\1N", s) for s in steps)


def source(attrs: str, frames: Frames) -> tuple[str, str]:
  """(path:line, owner) of one op's metadata, ("", "?") where it has none."""
  file_line = re.search(r'source_file="([^"]*)"\s+source_line=(\d+)', attrs)
  if file_line:
    return f"{short_path(file_line[1])}:{file_line[2]}", owner(file_line[1])
  frame_id = re.search(r"stack_frame_id=(\d+)", attrs)
  chain, seen = [], set()
  at = int(frame_id[1]) if frame_id else 0
  while 0 < at <= len(frames) and at not in seen:  # innermost first
    seen.add(at)
    path, line, at = frames[at - 1]
    chain.append((path, line))
  if not chain:
    return "", "?"
  path, line = next(((p, ln) for p, ln in chain if owner(p) in ("ours", "upstream")), chain[0])
  return f"{short_path(path)}:{line}", owner(path)


@dataclasses.dataclass
class Groups:
  """The walk's memory-bound ops by group: (op, source) -> [seconds, bytes, ops] (scaled with a loop's repeated
  trips, as schedule.Terms is), and each key's example op and owner."""

  totals: dict[tuple[str, str], list[float]] = dataclasses.field(default_factory=dict)
  info: dict[tuple[str, str], tuple[str, str]] = dataclasses.field(default_factory=dict)  # -> (example op, owner)

  def add(self, instr: Instr, seconds: float, moved: float, frames: Frames) -> None:
    op_name = re.search(r'op_name="([^"]*)"', instr.attrs)
    where, who = source(instr.attrs, frames)
    if op_name:
      key = (normalise(op_name[1]), where)
    else:  # the compiler's own op (a loop's carried buffer copied, a layout changed): by opcode and shape
      key, who = (f"{instr.opcode} {re.sub(r'[{][^}]*[}]', '', instr.type_text)}", where), "xla"
    row = self.totals.setdefault(key, [0.0, 0.0, 0.0])
    row[0], row[1], row[2] = row[0] + seconds, row[1] + moved, row[2] + 1
    self.info.setdefault(key, (instr.name, who))

  def add_scaled(self, later: Groups, earlier: Groups, times: int) -> None:
    """self += times * (later - earlier): a loop trip's ops repeated (schedule.Terms.add_scaled)."""
    for key, row in later.totals.items():
      before, mine = earlier.totals.get(key, [0.0, 0.0, 0.0]), self.totals.setdefault(key, [0.0, 0.0, 0.0])
      self.info.setdefault(key, later.info[key])
      for i in range(3):
        mine[i] += times * (row[i] - before[i])

  def rows(self, n: int | None = None) -> list[dict[str, Any]]:
    """The groups, largest seconds first (the first n): op (normalised name stack), source, owner, seconds, bytes,
    ops (executions per step), example (one HLO op's name)."""
    ordered = sorted(self.totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"op": key[0], "source": key[1], "owner": self.info[key][1], "seconds": row[0], "bytes": row[1],
             "ops": int(round(row[2])), "example": self.info[key][0]} for key, row in ordered]


def stack_frames(compiled: Any) -> Frames:
  """The module's stack-frame table (HloModuleProto.stack_frame_index), which the HLO text refers to by
  stack_frame_id only; [] where the compiled object gives no module."""
  try:
    proto = compiled.runtime_executable().hlo_modules()[0].as_serialized_hlo_module_proto()
  except Exception:  # pylint: disable=broad-except  # a compile-only executable may hold no module: op names only
    return []
  index = next((v for f, v in _fields(proto) if f == 17), b"")  # stack_frame_index
  files, locations, frames = [], [], []
  for f, v in _fields(index):
    if f == 1:  # file_names
      files.append(v.decode())
    elif f == 3:  # file_locations: file_name_id 1, function_name_id 2, line 3 (ids 1-based)
      loc = dict(_fields(v))
      locations.append((loc.get(1, 0), loc.get(3, 0)))
    elif f == 4:  # stack_frames: file_location_id 1, parent_frame_id 2
      frame = dict(_fields(v))
      file_id, line = locations[frame.get(1, 0) - 1] if 0 < frame.get(1, 0) <= len(locations) else (0, 0)
      frames.append((files[file_id - 1] if 0 < file_id <= len(files) else "", line, frame.get(2, 0)))
  return frames


def _fields(data: bytes) -> list[tuple[int, Any]]:
  """A protobuf message's (field number, value) pairs: varints as ints, length-delimited fields as bytes."""
  out, i = [], 0
  while i < len(data):
    key, i = _varint(data, i)
    wire = key & 7
    if wire == 0:
      value, i = _varint(data, i)
    elif wire == 2:
      size, i = _varint(data, i)
      value, i = data[i:i + size], i + size
    elif wire in (1, 5):
      value, i = data[i:i + (8 if wire == 1 else 4)], i + (8 if wire == 1 else 4)
    else:
      raise ValueError(f"protobuf wire type {wire} at byte {i}")
    out.append((key >> 3, value))
  return out


def _varint(data: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = data[i]
    i += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if byte < 0x80:
      return value, i
