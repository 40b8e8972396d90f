"""Sweep tilings of the mgpu grouped-GEMM kernels and print the best per (op, K, N), as
entries for `MaxText/moe/gmm/mgpu/tiling.TABLE` (copy them there; comments cite this run).

  python tools/tune_gmm.py --m 65536 --g 32 --dist zipf1.2 --out /tmp/tune
  python tools/tune_gmm.py --family qwen3-moe --dist zipf1.2   # a family's six products at its proxy's M and G

Each variant is checked against a float32 reference (rel err < 1e-2) before it is timed;
variants that exceed shared memory or fail to compile are reported and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_gmm as bench  # noqa: E402
import kernel_timeline as timeline  # noqa: E402
from MaxText.moe.gmm.mgpu import bf16 as mgpu  # noqa: E402
from MaxText.moe.gmm.mgpu import kernels as mk  # noqa: E402
from MaxText.moe.gmm.mgpu import schedule as sched  # noqa: E402
from MaxText.moe.gmm.mgpu import tiling as mt  # noqa: E402

# (op, K, N, transpose_rhs): the DeepSeek-V3 products (dlhs = fwd with K, N swapped).
PROBLEMS = {
    "up": ("fwd", 7168, 2048, False),
    "down": ("fwd", 2048, 7168, False),
    "dlhs_down": ("fwd", 7168, 2048, True),  # dout[M,7168] @ w_down[g]^T (w_down [G,2048,7168])
    "dlhs_up": ("fwd", 2048, 7168, True),  # dout[M,2048] @ w_up[g]^T (w_up [G,7168,2048])
    "dw_up": ("tgmm", 7168, 2048, False),
    "dw_down": ("tgmm", 2048, 7168, False),
}


def family_problems(family: str) -> dict[str, tuple[str, int, int, bool]]:
  """The same six products at a family's expert shape (bench_gmm.FAMILIES: hidden D, expert width F), named
  <family>_<product>."""
  d, f, _, _ = bench.FAMILIES[family]
  return {f"{family}_up": ("fwd", d, f, False), f"{family}_down": ("fwd", f, d, False),
          f"{family}_dlhs_down": ("fwd", d, f, True), f"{family}_dlhs_up": ("fwd", f, d, True),
          f"{family}_dw_up": ("tgmm", d, f, False), f"{family}_dw_down": ("tgmm", f, d, False)}
# Variants, as changes to the table's current entry for the problem (`mgpu_tiling.lookup`).
# The on-device profile (--profile-dir) found the forward's K loop at the tensor cores' peak and ~3 kc
# (thousands of SM cycles) per tile outside it, ~1.9 kc of which is the epilogue, and split a 128x64
# epilogue chunk into wait 0.06, shared-memory write 0.23 and TMA issue 0.50 kc (named
# scopes at commit 5e9e2df). Measured without gain and left out (docs/kernels.md, "Tried, and why it did not help"):
# pingpong, with or without multicast (13-30% slower: a ring's slots run too little ahead
# of the load latency), a direct register-to-global epilogue (5-13% slower), 64-row
# epilogue pieces through two slots (3% slower), epi_swizzle, chain, half_tiles,
# group_aligned False, and grid_block_n 4, 8 and 32. Variant 1 (one 128-column chunk per
# warpgroup, the cheapest epilogue, at the stage it costs) stays as the comparison.
FWD_VARIANTS = [{}, dict(epi_n=128, stages=3)]
TGMM_VARIANTS = [{}, dict(exact_start=False, largest_first=False),  # JAX's block-aligned windows
                 dict(warp_specialized=True, stages=3, grid_block_n=4),
                 dict(warp_specialized=True, stages=3, grid_block_n=16)]


VARIANTS_BY_OP = {"fwd": FWD_VARIANTS, "tgmm": TGMM_VARIANTS}


def variants(name):
  """The problem's tilings to time: its table entry with each of its op's changes."""
  op, k, n, _ = PROBLEMS[name]
  return [dataclasses.replace(mt.lookup(op, k, n), **v) for v in VARIANTS_BY_OP[op]]


# Forward tiles by the piece they computed: full pieces of small / medium / large groups,
# partial pieces (a group's boundary), zero pieces.
_FWD_SCOPES = {"full_tile", "half_tile", "zero_tile"}
_GROUP_BUCKETS = ((1024, "full, group < 1024 rows"), (4096, "full, group < 4096"),
                  (1 << 31, "full, group >= 4096"))


def fwd_tile_classes(ranges, sizes_G, m, t, n, num_blocks):
  """Median duration (kc: thousands of SM cycles) and count per piece class, matching each
  block's tile ranges (one compute warpgroup's trace) to the loop steps b, b + num_blocks,
  ... of `grouped_matmul`."""
  kind, group, _, _, size = (np.asarray(a) for a in sched.work_table(
      jnp.asarray(sizes_G), 0, len(sizes_G), m, t.block_m, window_align=t.window_align))
  grid_n = n // t.cta_n
  total = kind.shape[0] * grid_n
  item = np.asarray(sched.tile_items(jnp.arange(total), kind.shape[0], grid_n, t.grid_block_n))
  rows_of_group = np.asarray(sizes_G)
  durs: dict[str, list[float]] = {}
  mismatched = 0
  by_block = timeline.block_sequences(ranges, _FWD_SCOPES, traces_per_block=mk.NUM_WARPGROUPS)
  for b, seq in by_block.items():
    steps = [f for f in range(b, total, num_blocks) if kind[item[f]] != sched.SKIP]
    if len(steps) != len(seq):
      mismatched += 1
      continue
    for f, r in zip(steps, seq):
      i = item[f]
      if kind[i] == sched.ZERO:
        label = "zero"
      elif size[i] < t.block_m:
        label = f"partial ({r.name})"
      else:
        label = next(l for lim, l in _GROUP_BUCKETS if rows_of_group[group[i]] < lim)
      durs.setdefault(label, []).append(r.dur_kc)
  lines = [f"{'piece':26} {'count':>6} {'median kc':>10}"]
  lines += [f"{k:26} {len(v):6d} {np.median(v):10.2f}" for k, v in sorted(durs.items())]
  if mismatched:
    lines.append(f"# {mismatched} blocks' ranges did not match their loop steps (left out)")
  return "\n".join(lines)


def profile_tiling(t, tiles_per_sm: int):
  """The tiling to profile in place of t: a forward tiling's trace (two ranges per tile per
  warpgroup) must fit in the shared memory the tiling leaves, so its stages are cut until it
  does (printed with the profile)."""
  need = max(2 * tiles_per_sm + 1, mk.PROFILE_RANGES_MIN)  # a tile's range and its epilogue's
  fits = lambda t: mk.profile_ranges(t.smem_bytes(), mk.NUM_WARPGROUPS) >= need
  # Stages, not the epilogue: the one profile run with epi_n=32 (bf16, 64-byte rows) ended
  # in "misaligned address" on the H200 (mgpu_tiling.check_epilogue_rows). A chain keeps its stage count
  # a divisor of the K steps by halving it.
  while not fits(t) and t.stages > 2:
    t = dataclasses.replace(t, stages=t.stages // 2 if t.chain else t.stages - 1)
  return t


def profile_variant(make_fn, args, out_dir, classify=None):
  """One run of the variant's kernel with Mosaic GPU's on-device profiler: its summary (per
  tile kind, idle SMs at the end) from tools/kernel_timeline.py, and classify(ranges)."""
  profiled = timeline.profile_once(lambda d: jax.jit(make_fn(d))(*args), out_dir)
  if profiled is None:
    return f"# no trace written to {out_dir}"
  path, ranges = profiled
  text = timeline.format_summary(path, timeline.summarize(ranges))
  return text + ("\n" + classify(ranges) if classify else "")


def print_table(results):
  print(f"{'problem':10} {'ms':>7} {'min ms':>7} {'spread':>6} {'TF/s':>6} {'err':>8}  change")
  for r in results:
    err = "-" if r["err"] is None else f"{r['err']:.1e}"
    ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
    rs = r["rounds_ms"]
    low = f"{min(rs):.3f}" if rs else "-"
    spread = f"{(max(rs) - min(rs)) / r['ms']:.1%}" if len(rs) > 1 else "-"
    print(f"{r['problem']:10} {ms:>7} {low:>7} {spread:>6} {r['tflops']:6.0f} {err:>8}  {r['change'] or 'table'}"
          + (f"  {r['error'][:60]}" if r.get("error") else ""), flush=True)


def run_problem(name, m, g, dist, seed, deadline, rounds, profile_dir=None, profile_variants=()):
  op, k, n, transpose = PROBLEMS[name]
  sizes = bench.group_sizes(dist, m, g, np.random.default_rng(seed))
  gs = jnp.asarray(sizes)
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  results = []
  if op == "fwd":
    wshape = (g, n, k) if transpose else (g, k, n)
    w = (jax.random.normal(kw, wshape, jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    ref = bench.ref_fwd(x, jnp.swapaxes(w, 1, 2) if transpose else w, sizes)
  else:
    d = jax.random.normal(kw, (m, n), jnp.bfloat16)
    ref = bench.ref_tgmm(x, d, sizes)
  args = (x, w, gs) if op == "fwd" else (x, d, gs)

  def variant_fn(t, profile_dir=None):
    if op == "fwd":
      return lambda x, w, gs: mgpu.gmm(x, w, gs, transpose_rhs=transpose, tiling=t,
                                       profile_dir=profile_dir)
    return lambda x, d, gs: mgpu.tgmm(x, d, gs, num_local_groups=g, tiling=t,
                                      profile_dir=profile_dir)

  ready = []  # (variant index, record, jitted fn, tiling): compiled and passed the check
  for i, t in enumerate(variants(name)):
    if time.monotonic() > deadline:
      print(f"# deadline: {name} variants {i}.. not run", flush=True)
      break
    fn = jax.jit(variant_fn(t))
    rec = dict(problem=name, op=op, k=k, n=n, tiling=dataclasses.asdict(t),
               change=VARIANTS_BY_OP[op][i], err=None, ms=None, tflops=0.0, rounds_ms=[])
    try:
      rec["err"] = bench.rel_err(fn(*args), ref)
      if rec["err"] < bench.TOL:
        ready.append((i, rec, fn, t))
    except Exception as e:
      rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
      traceback.print_exc(limit=2)
    results.append(rec)
  # Timed in interleaved rounds (A B C A B C ...): back-to-back variants measured one after
  # the other drifted by several % on the H200 (clocks, the other GPU's load), more than
  # some of the differences being decided.
  for r in range(rounds):
    if r and time.monotonic() > deadline:
      print(f"# deadline: {name} timed in {r} of {rounds} rounds", flush=True)
      break
    for _, rec, fn, _ in ready:
      rec["rounds_ms"].append(bench.time_ms(fn, args, reps=5, target_s=0.1)[0])
  for _, rec, _, _ in ready:
    rec["ms"] = float(np.median(rec["rounds_ms"]))
    rec["tflops"] = 2.0 * m * k * n / rec["ms"] / 1e9
  print_table(results)  # before profiling: a profile that fails must not lose the timings
  for rec in results:
    print(json.dumps(rec), flush=True)
  if profile_dir:  # after the timing: a profiled kernel is slower and compiles separately
    for i, rec, _, t in ready:
      if i not in profile_variants:
        continue
      if time.monotonic() > deadline:
        print(f"# deadline: {name} profiles not run", flush=True)
        break
      classify = None
      if op == "fwd":
        items = sched.num_work_items(m, g, t.block_m, t.window_align)
        t = profile_tiling(t, -(-items * (n // t.cta_n) // mk.num_sms()))
        if not t.pingpong:  # its warpgroups take alternate tiles: no one trace holds them all
          classify = lambda ranges, t=t: fwd_tile_classes(ranges, sizes, m, t, n, mk.num_sms())
      print(f"# profile {name} {rec['change'] or 'table'}, profiled as {t}", flush=True)
      try:
        print(profile_variant(lambda d, t=t: variant_fn(t, d), args,
                              os.path.join(profile_dir, f"{name}_{i}"), classify), flush=True)
      except Exception:  # pylint: disable=broad-except
        traceback.print_exc(limit=3)
  return results


def main():
  # Lines reach a redirected log even when a time limit kills the run.
  sys.stdout.reconfigure(line_buffering=True)
  ap = argparse.ArgumentParser()
  ap.add_argument("--m", type=int, default=65536)
  ap.add_argument("--g", type=int, default=32)
  ap.add_argument("--dist", default="zipf1.2")
  ap.add_argument("--problems", default=None, help="default: DeepSeek-V3's six (up ... dw_down)")
  ap.add_argument("--family", default=None,
                  help=f"one of {', '.join(bench.FAMILIES)}: its six products at its proxy's M and G "
                       "(tools/bench_gmm.py FAMILIES); replaces --problems, --m and --g")
  ap.add_argument("--out", default=None)
  ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per problem")
  ap.add_argument("--profile-dir", default=None,
                  help="also run each variant once under Mosaic GPU's on-device profiler, "
                       "write its trace here and print tools/kernel_timeline.py's summary")
  ap.add_argument("--profile-variants", default="0,1",
                  help="indices into the op's variant list to profile (default: the table's "
                       "entry and the first change)")
  ap.add_argument("--deadline-s", type=float, default=1e9,
                  help="start no variant after this many seconds (the summary still prints)")
  args = ap.parse_args()
  if args.rounds < 1:
    ap.error(f"--rounds must be >= 1, got {args.rounds}")
  if args.family is not None:
    if args.family not in bench.FAMILIES:
      ap.error(f"unknown --family {args.family!r}; valid: {', '.join(bench.FAMILIES)}")
    args.g = bench.FAMILIES[args.family][2]
    PROBLEMS.update(family_problems(args.family))
    args.m, args.problems = bench.proxy_rows(args.family), ",".join(family_problems(args.family))
  args.problems = args.problems or "up,down,dlhs_down,dlhs_up,dw_up,dw_down"
  unknown = [p for p in args.problems.split(",") if p not in PROBLEMS]
  if unknown:
    ap.error(f"unknown --problems {unknown}; valid: {', '.join(PROBLEMS)}")
  profile_variants = set()
  for v in filter(None, args.profile_variants.split(",")):
    if not v.isdigit():
      ap.error(f"--profile-variants: {v!r} is not a variant index (0, 1, ...)")
    profile_variants.add(int(v))
  deadline = time.monotonic() + args.deadline_s
  allres = []
  for i, name in enumerate(args.problems.split(",")):
    allres += run_problem(name, args.m, args.g, args.dist, 100 + i, deadline, args.rounds,
                          args.profile_dir, profile_variants)
  print(f"# {args.dist} M={args.m} G={args.g}; change = fields changed from the table's entry")
  print("# ms = median over interleaved rounds, min ms = fastest round; spread = (max - min) / median")
  print_table(allres)
  best = {}
  for r in allres:
    if r["ms"] is None or not (r["err"] is not None and r["err"] < bench.TOL):
      continue
    key = (r["op"], r["k"], r["n"], r["problem"])
    if key not in best or r["ms"] < best[key]["ms"]:
      best[key] = r
  print("# best tilings (op, K, N) <- problem: TF/s")
  for (op, k, n, prob), r in best.items():
    print(f"({op!r}, {k}, {n}): {r['tiling']},  # {prob} {r['tflops']:.0f} TF/s")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.json"), "w") as fh:
      json.dump(allres, fh, indent=1)


if __name__ == "__main__":
  main()
