"""XLA's memory-usage report, written with every HLO dump: the step's largest device-memory buffers."""

from __future__ import annotations

import glob
import re
from pathlib import Path


def largest_buffers(run_dir: Path, module: str = "jit_train_step", n: int = 5) -> list[dict]:
  """The n largest slices of the step's device-memory buffer assignment, from XLA's memory-usage report
  (`*<module>*after_optimizations-memory-usage-report.txt`, written with every HLO dump): size, and the
  shapes of the values that share the slice over the step. Only the report's default memory space (HBM):
  its other sections are host memory (offloaded activations, "cmem (color=5)")."""
  paths = sorted(glob.glob(str(run_dir / "**" / f"*{module}*after_optimizations-memory-usage-report.txt"),
                           recursive=True))
  if not paths:
    return []
  rows, device_space = [], True
  for line in Path(paths[-1]).read_text().splitlines():
    if line.startswith("Memory Space:"):
      device_space = "(color=0)" in line
      continue
    fields = [f.strip() for f in line.split(";")]
    # "<cumulative>(<share>); <size>; <offset>; <used_by_n_values>; <shapes>"
    if device_space and len(fields) == 5 and fields[2].isdigit():
      rows.append({"size": fields[1], "bytes": _bytes(fields[1]), "values": int(fields[3]), "shapes": fields[4]})
  return sorted(rows, key=lambda r: -r["bytes"])[:n]


def _bytes(text: str) -> float:
  units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
  match = re.fullmatch(r"([\d.]+)\s*([KMGT]?i?B)", text)
  return float(match.group(1)) * units[match.group(2)] if match else 0.0
