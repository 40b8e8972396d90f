"""What the plan reports beside the walk's step: the sensitivity line (MaxText/plan/step_report.py) on hand-written
scheduled HLO, at the round rates of tests/test_plan_account.py."""

from __future__ import annotations

import textwrap

import pytest

from MaxText.plan import schedule, step_report
from test_plan_account import GPU

SPREAD = """\
    HloModule m, is_scheduled=true

    ENTRY %main (w: f32[64,512], v: f32[64,64]) -> f32[256,512] {
      %w = f32[64,512]{1,0} parameter(0)
      %v = f32[64,64]{1,0} parameter(1)
      %ags = (f32[64,512]{1,0}, f32[256,512]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
      %agd = f32[256,512]{1,0} all-gather-done(%ags)
      %inside = f32[64,64]{1,0} all-to-all(%v), channel_id=2, replica_groups={{0,1},{2,3}}, dimensions={1}
      %across = f32[64,64]{1,0} all-to-all(%inside), channel_id=3, replica_groups={{0,2},{1,3}}, dimensions={1}
      ROOT %r = f32[256,512]{1,0} bitcast(%agd)
    }
    """


def test_the_sensitivity_line_walks_the_step_again_at_each_changed_constant():
  """InfiniBand x0.5 / x2 moves the gather across nodes and the all-to-all across them; all-to-all at 0.5 / 1.0 of
  its link moves both all-to-alls (inside the node: of NVLink's rate, not the measured all_to_all's)."""
  module = schedule.parse(textwrap.dedent(SPREAD))
  nodes = [0, 0, 1, 1]
  terms = schedule.estimate(module, GPU, {"fsdp": 4}, nodes)
  gather = 256 * 512 * 4 * 3 / 4 / 1e7  # over InfiniBand, exposed
  inside, across = 64 * 64 * 4 / 2 / 1e9, 64 * 64 * 4 / 2 / 1e7  # pairs: half of each on the wire
  assert terms.step_s == pytest.approx(gather + inside + across)
  rows = step_report.sensitivity(module, GPU, {"fsdp": 4}, nodes, terms, model_flops=1e12)
  steps = {r["label"]: r["step_s"] for r in rows}
  assert steps == pytest.approx({
      "as planned": gather + inside + across,
      "IB x0.5": 2 * gather + inside + 2 * across, "IB x2": gather / 2 + inside + across / 2,
      "all-to-all at 0.5 of its link": gather + 2 * inside + 2 * across,  # NVLink 1 GB/s here, so 0.5 halves both
      "all-to-all at 1.0 of its link": gather + inside + across})
  assert rows[1]["tflops_per_gpu"] == pytest.approx(1.0 / steps["IB x0.5"])
  e = {**step_report.report(terms, 1e12, 0.0), "sensitivity": rows}
  line = [l for l in step_report.lines(e) if "sensitivity" in l][0]
  assert line.startswith("  sensitivity: as planned ") and "IB x0.5" in line and line.endswith("(step, TFLOP/s/GPU)")
