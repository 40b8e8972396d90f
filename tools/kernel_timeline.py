"""Summarize a Mosaic GPU on-device profile of one kernel run: where its time goes per tile
kind, and how long SMs sit idle at the end waiting for the last one.

The profile is the Chrome-trace JSON that Mosaic GPU's profiler writes when a kernel is built
with `profile_dir` (`mgpu_kernels.compiler_params`; `tune_gmm.py --profile-dir`): one
begin ("B") / end ("E") event pair per `jax.named_scope` range entered, `pid` = 1 + SM id,
`tid` = one trace per warpgroup of each block (jax 0.11.2,
`jax/experimental/mosaic/gpu/profiler.py`). Its `ts` is not in microseconds, although the
Chrome format says so: it is (the trace's global-timer start in ns + SM clock cycles since
the trace's first event) / 1000. Durations are therefore thousands of SM cycles ("kc"
below). A kernel's clock follows its power draw: the H200 ran the grouped GEMM at about
1.3 GHz (a profiled span in kc over the timed ms, tune_gmm.py --profile-dir, 2026-11-30), so 1 kc ~ 0.78 us
there, and 1 kc per 128x256x64 step is the tensor cores' peak (4096 bf16 FLOP/cycle/SM).

  python tools/kernel_timeline.py TRACE.json [...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys


@dataclasses.dataclass(frozen=True)
class Range:
  name: str
  sm: int
  trace: int
  begin_kc: float
  end_kc: float

  @property
  def dur_kc(self) -> float:
    return self.end_kc - self.begin_kc


def load_ranges(trace: dict) -> list[Range]:
  """Pairs each trace's B/E events (nested ranges close innermost first)."""
  open_by_trace: dict[int, list[dict]] = {}
  ranges = []
  for ev in trace["traceEvents"]:
    stack = open_by_trace.setdefault(ev["tid"], [])
    if ev["ph"] == "B":
      stack.append(ev)
    elif ev["ph"] == "E":
      if not stack or stack[-1]["name"] != ev["name"]:
        raise ValueError(f"unbalanced trace: E {ev['name']!r} in tid {ev['tid']} with open "
                         f"{[e['name'] for e in stack]}")
      b = stack.pop()
      ranges.append(Range(ev["name"], ev["pid"] - 1, ev["tid"], b["ts"], ev["ts"]))
  return ranges


def profile_once(run, out_dir: str) -> tuple[str, list[Range]] | None:
  """run(out_dir) once, a kernel built with profile_dir=out_dir: (the trace it wrote there, its ranges), or None
  if it wrote none."""
  import jax  # pylint: disable=import-outside-toplevel

  os.makedirs(out_dir, exist_ok=True)
  before = set(os.listdir(out_dir))
  jax.block_until_ready(run(out_dir))
  jax.effects_barrier()  # the trace is written by a host callback
  new = sorted(set(os.listdir(out_dir)) - before)
  if not new:
    return None
  path = os.path.join(out_dir, new[-1])
  with open(path) as fh:
    return path, load_ranges(json.load(fh))


def summarize(ranges: list[Range]) -> dict:
  """Kernel span, per-scope duration statistics, and the end-of-kernel tail.

  tail_idle: mean over SMs of (last end of any SM - this SM's last end) / span, the share of
  the SMs' time spent waiting for the slowest one (0 = perfectly balanced)."""
  if not ranges:
    raise ValueError("no ranges: was the kernel built with profile_dir, and are its tiles in named scopes?")
  t0 = min(r.begin_kc for r in ranges)
  t1 = max(r.end_kc for r in ranges)
  span = t1 - t0
  scopes = {}
  for name in sorted({r.name for r in ranges}):
    durs = sorted(r.dur_kc for r in ranges if r.name == name)
    q = lambda f: durs[min(len(durs) - 1, int(f * len(durs)))]
    scopes[name] = dict(count=len(durs), median_kc=statistics.median(durs), p10_kc=q(0.1),
                        p90_kc=q(0.9), max_kc=durs[-1], total_kc=sum(durs))
  last_end = {}
  for r in ranges:
    last_end[r.sm] = max(last_end.get(r.sm, r.end_kc), r.end_kc)
  idle = [(t1 - e) / span for e in last_end.values()] if span > 0 else [0.0]
  return dict(span_kc=span, sms=len(last_end), scopes=scopes,
              tail_idle=statistics.mean(idle), tail_idle_max=max(idle))


def block_sequences(ranges: list[Range], names: set[str], traces_per_block: int,
                    trace_in_block: int = 0) -> dict[int, list[Range]]:
  """{block index: its ranges named in `names`, in time order}, from one warpgroup's trace
  per block (the profiler numbers traces 1 + trace_in_block + traces_per_block * block).
  With a persistent kernel, block b's i-th range is then loop step b + i * num_blocks."""
  by_block: dict[int, list[Range]] = {}
  for r in ranges:
    block, wg = divmod(r.trace - 1, traces_per_block)
    if r.name in names and wg == trace_in_block:
      by_block.setdefault(block, []).append(r)
  for seq in by_block.values():
    seq.sort(key=lambda r: r.begin_kc)
  return by_block


def format_summary(label: str, s: dict) -> str:
  lines = [f"# {label}: span {s['span_kc']:.1f} kc on {s['sms']} SMs; idle at the end "
           f"{s['tail_idle']:.1%} of SM time (worst SM {s['tail_idle_max']:.1%})",
           f"{'scope':14} {'count':>7} {'median kc':>10} {'p10':>8} {'p90':>8} {'max':>8}"]
  for name, st in s["scopes"].items():
    lines.append(f"{name:14} {st['count']:7d} {st['median_kc']:10.2f} {st['p10_kc']:8.2f} "
                 f"{st['p90_kc']:8.2f} {st['max_kc']:8.2f}")
  return "\n".join(lines)


def main(argv=None) -> int:
  sys.stdout.reconfigure(line_buffering=True)
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("traces", nargs="+")
  args = ap.parse_args(argv)
  for path in args.traces:
    with open(path) as fh:
      print(format_summary(path, summarize(load_ranges(json.load(fh)))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
