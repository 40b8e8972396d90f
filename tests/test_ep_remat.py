"""No EP exchange recomputed under remat when the dispatched rows are kept: tests/ep_remat_check.py on 8 simulated
CPU devices (a2a_padded on FSDP 2 x EP 4, hierarchical on 2 nodes x 4, the FP8 dispatch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SUBPROCESS_PYTHONPATH

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rows():
  proc = subprocess.run([sys.executable, str(REPO / "tests" / "ep_remat_check.py")], capture_output=True, text=True,
                        timeout=900, cwd=REPO, env={**os.environ, "PYTHONPATH": SUBPROCESS_PYTHONPATH}, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_keeping_the_dispatched_rows_drops_the_recomputed_exchange(rows):
  """Full remat exchanges the rows again in the backward; with moe_x_sorted kept on the device or offloaded the
  recompute reads them: one all-to-all fewer (two for hierarchical's two stages), the same loss and gradients."""
  by = {(r["backend"], r["policy"]): r for r in rows}
  assert len(by) == 7, rows
  for r in rows:
    assert r["err"] <= 1e-5, r  # float32: the remat'ed layer's loss and gradients against the plain layer's
  for backend, fewer in (("a2a_padded", 1), ("hierarchical", 2), ("a2a_padded+fp8", 1)):
    full, kept = by[backend, "full"], by[backend, "moe_x_sorted_device"]
    assert kept["all_to_alls"] == full["all_to_alls"] - fewer, (full, kept)
    assert kept["all_to_all_elements"] < full["all_to_all_elements"], (full, kept)
  offloaded = by["a2a_padded", "moe_x_sorted_offload"]
  assert offloaded["all_to_alls"] == by["a2a_padded", "moe_x_sorted_device"]["all_to_alls"], offloaded
