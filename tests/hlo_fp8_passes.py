"""Where a compiled FP8 step quantizes: the fusions of its HLO text that write e4m3 values, and the Mosaic GPU
kernels that do (kind `mosaic`: the one-pass quantization kernels, `MaxText/moe/gmm/mgpu/fp8_quant_kernels.py`).

    python3 tests/hlo_fp8_passes.py plan.hlo       # from `python -m MaxText.plan ... moe_fp8=blockwise --hlo plan.hlo`

One line per (fusion kind, e4m3 output type, what reads into it, where jax emitted it), with a count.
"Reads" names the producers that are not plain values: `mpmd_map` is a Mosaic GPU kernel's output (the
quantization fused into the kernel's consumer), `all-to-all` the dispatch's exchange, `select` a
computed scale (the amax reduction ran before, as its own fusion). "Where" is the tail of the op_name
scope: the forward, `rematted_computation` (full remat's forward again), `gmm_dlhs`, `gmm_drhs`.
For the account of the FP8 step's quantization passes (docs/fp8.md, "What runs where").
"""

from __future__ import annotations

import collections
import re
import sys

from MaxText.plan import hlo_inventory

_SCOPES = ("rematted_computation", "gmm_dlhs", "gmm_drhs")


def _where(attrs: str) -> str:
  op_name = re.search(r'op_name="([^"]*)"', attrs)
  name = op_name.group(1) if op_name else ""
  found = [scope for scope in _SCOPES if scope in name]
  return "+".join(found) or ("backward" if "transpose(" in name else "forward")


def _reads(instr: hlo_inventory.Instr, producers: dict[str, str]) -> str:
  kinds = []
  for operand in instr.operands:
    opcode = producers.get(operand, "")
    tag = next((t for t in ("mpmd_map", "all-to-all", "select") if t in operand or t in opcode), None)
    if tag and tag not in kinds:
      kinds.append(tag)
  return ",".join(kinds) or "values"


def fp8_fusions(text: str) -> collections.Counter:
  comps, _ = hlo_inventory.parse_module(text)
  rows: collections.Counter = collections.Counter()
  for comp in comps.values():
    producers = {i.name: i.opcode for i in comp.instrs}
    for instr in comp.instrs:
      mosaic = instr.opcode == "custom-call" and 'custom_call_target="mosaic_gpu' in instr.attrs
      if not (instr.opcode == "fusion" or mosaic) or "f8e4m3fn" not in instr.type_text:
        continue
      fusion_kind = re.search(r"kind=(\w+)", instr.attrs)
      kind = "mosaic" if mosaic else fusion_kind.group(1) if fusion_kind else "?"
      types = ",".join(dict.fromkeys(re.findall(r"f8e4m3fn\[[\d,]*\]", instr.type_text)))
      rows[(kind, types, _reads(instr, producers), _where(instr.attrs))] += 1
  return rows


def main(path: str) -> None:
  rows = fp8_fusions(open(path).read())
  print(f"{'n':>3s}  {'kind':7s} {'e4m3 output':34s} {'reads':22s} where")
  for (kind, types, reads, where), n in sorted(rows.items(), key=lambda r: (r[0][1], r[0][3])):
    print(f"{n:3d}  {kind:7s} {types:34s} {reads:22s} {where}")


if __name__ == "__main__":
  main(sys.argv[1])
