"""Counts checkpoints holding a non-finite float array under a run directory.

  python tests/reliability_finite_checkpoints.py RUN_DIR

Restores each `checkpoints/<step>/items` with orbax (no model needed) and
checks every floating array; prints one line per checkpoint and the count.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp


def non_finite_arrays(items: Path) -> tuple[int, int]:
  tree = ocp.PyTreeCheckpointer().restore(items.resolve())
  floats = [x for x in jax.tree_util.tree_leaves(tree)
            if hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)]
  return len(floats), sum(not np.isfinite(np.asarray(x)).all() for x in floats)


def main(run_dir: Path) -> int:
  steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
  bad = 0
  for step in steps:
    total, non_finite = non_finite_arrays(run_dir / "checkpoints" / str(step) / "items")
    bad += non_finite > 0
    print(f"checkpoint {step}: {total} float arrays, {non_finite} non-finite")
  print(f"{bad} of {len(steps)} checkpoints hold a non-finite array")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main(Path(sys.argv[1])))
