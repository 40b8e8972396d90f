"""The GPU's SM clock and board power while a benchmark times something: `nvidia-smi` sampled in the background.

  python3 tools/gpu_clock.py [SECONDS]   # the means over SECONDS (default 1) of sampling, as bench_fp8 records them

  with ClockSampler() as clock:
    t0 = time.monotonic(); ...timed work...; t1 = time.monotonic()
    clock.window(t0, t1)   # {"sm_mhz": mean, "watts": mean, "samples": n}, or None

Why (BENCHMARKS.md "FP8 kernels"): under sustained GEMMs the H200 sits at its 700 W limit and its SM clock falls from
1,980 MHz to about 1,640 on average, so a kernel's cycle count (the on-device profile) is not its time, and a kernel
that does more work per cycle can give part of its gain back in clock. A timing row with the clock it ran at tells the
two apart. Without nvidia-smi (CPU runs) the sampler is off and every window is None.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

QUERY = ("--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits")


class ClockSampler:
  """Samples GPU `gpu_index` every `interval_ms` from `nvidia-smi -lms` on a reader thread."""

  def __init__(self, interval_ms: int = 50, gpu_index: int = 0, command: str = "nvidia-smi"):
    self._argv = [command, *QUERY, "-i", str(gpu_index), "-lms", str(interval_ms)]
    self._samples: list[tuple[float, float, float]] = []  # (monotonic s, MHz, W)
    self._lock = threading.Lock()
    self._proc = None
    self._thread = None

  def __enter__(self) -> "ClockSampler":
    if shutil.which(self._argv[0]) is None:
      return self
    self._proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()
    return self

  def _read(self) -> None:
    for line in self._proc.stdout:
      fields = [f.strip() for f in line.split(",")]
      try:
        mhz, watts = float(fields[0]), float(fields[1])
      except (IndexError, ValueError):  # "[N/A]" or a partial line
        continue
      with self._lock:
        self._samples.append((time.monotonic(), mhz, watts))

  def window(self, t0: float, t1: float) -> dict | None:
    """Means of the samples taken in [t0, t1] (time.monotonic()), or None if there are none."""
    with self._lock:
      inside = [(mhz, watts) for t, mhz, watts in self._samples if t0 <= t <= t1]
    if not inside:
      return None
    return {"sm_mhz": sum(m for m, _ in inside) / len(inside), "watts": sum(w for _, w in inside) / len(inside),
            "samples": len(inside)}

  def __exit__(self, *exc) -> None:
    if self._proc is not None:
      self._proc.terminate()
      self._proc.wait(timeout=10)
      self._thread.join(timeout=10)


if __name__ == "__main__":
  import json
  import sys

  seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
  with ClockSampler() as sampler:
    start = time.monotonic()
    time.sleep(seconds)
    print(json.dumps(sampler.window(start, time.monotonic())))
