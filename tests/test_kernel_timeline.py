"""scripts/kernel_timeline.py on a synthetic trace in the format of jax 0.11.2's Mosaic GPU
profiler (B/E pairs, ts in us, pid = 1 + SM, one tid per warpgroup trace)."""

from __future__ import annotations

import json

import pytest

from conftest import load_script

timeline = load_script("kernel_timeline", "scripts/kernel_timeline.py")


def _trace(ranges):
  """ranges: (name, sm, tid, begin, end); nested ranges listed outer first."""
  events = []
  for name, sm, tid, b, e in ranges:
    events.append(dict(name=name, ph="B", ts=b, pid=sm + 1, tid=tid))
    events.append(dict(name=name, ph="E", ts=e, pid=sm + 1, tid=tid))
  # Each tid's events in time order, E before a B at the same time, as the profiler emits.
  events.sort(key=lambda ev: (ev["tid"], ev["ts"], ev["ph"] == "B"))
  return {"displayTimeUnit": "ns", "traceEvents": events}


def test_summary_of_two_sms_one_finishing_early(tmp_path, capsys):
  # SM 0: tiles of 10 us at 0-10, 10-20, 20-30; SM 1: 10-us tiles at 0-10, 10-20, then idle.
  # A nested scope inside SM 0's first tile must pair with its own end.
  ranges = [("full_tile", 0, 1, 0.0, 10.0), ("mma", 0, 1, 1.0, 9.0),
            ("full_tile", 0, 1, 10.0, 20.0), ("full_tile", 0, 1, 20.0, 30.0),
            ("full_tile", 1, 4, 0.0, 10.0), ("zero_tile", 1, 4, 10.0, 20.0)]
  s = timeline.summarize(timeline.load_ranges(_trace(ranges)))
  assert s["span_us"] == 30.0 and s["sms"] == 2
  assert s["scopes"]["full_tile"]["count"] == 4 and s["scopes"]["full_tile"]["median_us"] == 10.0
  assert s["scopes"]["mma"]["total_us"] == 8.0 and s["scopes"]["zero_tile"]["count"] == 1
  # SM 1 ends at 20 of 30: idle 1/3 of its time, SM 0 none -> mean 1/6.
  assert s["tail_idle"] == pytest.approx(1 / 6) and s["tail_idle_max"] == pytest.approx(1 / 3)

  path = tmp_path / "trace.json"
  path.write_text(json.dumps(_trace(ranges)))
  assert timeline.main([str(path)]) == 0
  out = capsys.readouterr().out
  assert "idle at the end 16.7%" in out and "full_tile" in out


def test_unbalanced_or_empty_traces_are_refused():
  bad = {"traceEvents": [dict(name="a", ph="B", ts=0, pid=1, tid=1),
                         dict(name="b", ph="E", ts=1, pid=1, tid=1)]}
  with pytest.raises(ValueError, match="unbalanced"):
    timeline.load_ranges(bad)
  with pytest.raises(ValueError, match="profile_dir"):
    timeline.summarize([])
