"""tools/gpu_clock.py: the clock and power beside a timing, from a stand-in nvidia-smi on CPU."""

from __future__ import annotations

import os
import stat
import time

from conftest import load_script

gpu_clock = load_script("gpu_clock", "tools/gpu_clock.py")


def _fake_smi(tmp_path, lines):
  """An executable printing `lines` one per 20 ms, as `nvidia-smi -lms` does, then idling until terminated."""
  script = tmp_path / "fake-smi"
  body = "".join(f"echo '{line}'; sleep 0.02\n" for line in lines)
  script.write_text(f"#!/bin/sh\n{body}sleep 30\n")
  script.chmod(script.stat().st_mode | stat.S_IEXEC)
  return str(script)


def test_a_window_averages_the_samples_taken_inside_it(tmp_path):
  smi = _fake_smi(tmp_path, ["1980, 120.5", "[N/A], 130.0", "1500, 690.0", "1700, 700.0"])
  t0 = time.monotonic()
  with gpu_clock.ClockSampler(command=smi) as clock:
    deadline = time.monotonic() + 5
    while (got := clock.window(t0, time.monotonic())) is None or got["samples"] < 3:
      assert time.monotonic() < deadline, "the sampler read nothing"
      time.sleep(0.01)
  assert got == {"sm_mhz": (1980 + 1500 + 1700) / 3, "watts": (120.5 + 690 + 700) / 3, "samples": 3}  # N/A skipped
  assert clock.window(t0 - 10, t0 - 5) is None


def test_without_nvidia_smi_every_window_is_none():
  with gpu_clock.ClockSampler(command=os.path.join("/nonexistent", "nvidia-smi")) as clock:
    assert clock.window(0, time.monotonic()) is None
