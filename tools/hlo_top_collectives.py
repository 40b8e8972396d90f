"""The largest collectives of a compiled HLO text (`python -m MaxText.plan ... --hlo PATH`), with their source.

    python3 tools/hlo_top_collectives.py plan.hlo [N]

One line each: result bytes (per device, one execution), kind, result type,
replica groups and the tail of the op_name metadata, which says which model
code emitted it. For finding what a planner inventory row is made of.
"""

from __future__ import annotations

import re
import sys

from MaxText.plan import hlo_inventory

_OP = re.compile(r"\s*(?:ROOT )?%(\S+) = (.+?) (all-gather|reduce-scatter|all-reduce|all-to-all|ragged-all-to-all|"
                 r"collective-permute)(?:-start)?\(")


def top(text: str, n: int) -> list[str]:
  rows = []
  for line in text.splitlines():
    m = _OP.match(line)
    if not m:
      continue
    groups = re.search(r"\] (\{[^}]*\})", line)
    op_name = re.search(r'op_name="([^"]*)"', line)
    rows.append((hlo_inventory.nbytes(m.group(2)), m.group(3), m.group(2)[:60], groups.group(1) if groups else "",
                 op_name.group(1)[-110:] if op_name else ""))
  rows.sort(key=lambda r: -r[0])
  return [f"{b / 2**30:8.2f} GiB {k:18s} {t:60s} {g:20s} {o}" for b, k, t, g, o in rows[:n]]


if __name__ == "__main__":
  print("\n".join(top(open(sys.argv[1]).read(), int(sys.argv[2]) if len(sys.argv) > 2 else 20)))
