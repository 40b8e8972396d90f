"""What runs while each asynchronous collective is in flight, read from a compiled, scheduled HLO module.

  overlaps(compiled.as_text(), "all-to-all")   # one row per all-to-all-start

XLA:GPU splits a collective it runs asynchronously into `<kind>-start` and `<kind>-done`; in a scheduled
module (`is_scheduled=true`) each computation's instructions are listed in the order they are issued, so
the instructions between a start and its done are what the GPU may run while the collective moves data.
A row names the collective's replica groups and the GEMMs issued in that window: our grouped GEMM's
Mosaic GPU custom call (`mosaic_gpu`), cuBLAS (`__cublas$gemm`, `__cublas$lt$matmul...`) and XLA's Triton
GEMM fusions (`__triton_gemm`, `__triton_nested_gemm_fusion`). A collective with no GEMM in its window
is exposed: the step waits for it; so is a collective XLA left synchronous (`<kind>(`: it found nothing to
run beside it and converted the pair back).

  summary(text, "all-to-all")  # {"bytes", "bytes_beside_gemm", "async", "async_beside_gemm", "sync"}
"""

from __future__ import annotations

import dataclasses
import re

from MaxText.plan import hlo_inventory

_GEMM_MARKS = ("mosaic_gpu", "__cublas$gemm", "__cublas$lt$matmul", "__triton_gemm", "__triton_nested_gemm_fusion")


@dataclasses.dataclass(frozen=True)
class Window:
  """One asynchronous collective, from its start to its done.

  Attributes:
    computation: the computation it is scheduled in (the layer scan's body, the entry...).
    start: the -start instruction's name.
    replica_groups: its groups as XLA prints them.
    gemms: the GEMMs issued between the start and the done (instruction names).
    issued: how many instructions were issued in between.
    bytes: the collective's result bytes.
  """

  computation: str
  start: str
  replica_groups: str
  gemms: tuple[str, ...]
  issued: int
  bytes: float = 0.0


def is_gemm(instr: hlo_inventory.Instr) -> bool:
  """A matrix multiply the GPU runs as its own kernel (see the module docstring)."""
  if instr.opcode == "custom-call":
    return any(mark in instr.attrs for mark in _GEMM_MARKS)
  if instr.opcode == "fusion":
    return any(mark in instr.attrs for mark in _GEMM_MARKS[3:])
  return False


def overlaps(text: str, kind: str = "all-to-all") -> list[Window]:
  """Every `<kind>-start` of the module with the GEMMs scheduled before its `<kind>-done`."""
  if "is_scheduled=true" not in text.split("\n", 1)[0]:
    raise ValueError("the module is not scheduled: read the compiled text (compiled.as_text()), not the lowered")
  comps, _ = hlo_inventory.parse_module(text)
  windows = []
  for comp in comps.values():
    open_at: dict[str, int] = {}
    for i, instr in enumerate(comp.instrs):
      if instr.opcode == f"{kind}-start":
        open_at[instr.name] = i
      elif instr.opcode == f"{kind}-done" and instr.operands and instr.operands[0] in open_at:
        begin = open_at.pop(instr.operands[0])
        start = comp.instrs[begin]
        between = comp.instrs[begin + 1:i]
        groups = re.search(r"replica_groups=(\{[^=]*?\}\}|\[[^ ]*|mesh\[[^\]]*\]\s*\{[^}]*\})", start.attrs)
        windows.append(Window(comp.name, start.name, groups.group(1) if groups else "?",
                              tuple(b.name for b in between if is_gemm(b)), len(between),
                              hlo_inventory.nbytes(instr.type_text)))
  return windows


def summary(text: str, kind: str = "all-to-all") -> dict[str, float]:
  """Bytes of every `kind` collective of the module (once per appearance; loops not multiplied) and of those
  with a GEMM in their window; counts of the asynchronous ones, with a GEMM, and of the synchronous ones."""
  windows = overlaps(text, kind)
  comps, _ = hlo_inventory.parse_module(text)
  sync = [i for c in comps.values() for i in c.instrs if i.opcode == kind]
  sync_bytes = sum(hlo_inventory.nbytes(i.type_text) for i in sync)
  return {"bytes": sync_bytes + sum(w.bytes for w in windows),
          "bytes_beside_gemm": sum(w.bytes for w in windows if w.gemms),
          "async": len(windows), "async_beside_gemm": sum(bool(w.gemms) for w in windows), "sync": len(sync)}
