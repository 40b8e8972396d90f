"""tools/kernel_timeline.py on a synthetic trace in the format of jax 0.11.2's Mosaic GPU
profiler (B/E pairs, ts in SM kilocycles, pid = 1 + SM, one tid per warpgroup trace)."""

from __future__ import annotations

import json

import pytest

from conftest import load_script

timeline = load_script("kernel_timeline", "tools/kernel_timeline.py")


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
  # SM 0: tiles of 10 kc at 0-10, 10-20, 20-30; SM 1: 10-kc tiles at 0-10, 10-20, then idle.
  # A nested scope inside SM 0's first tile must pair with its own end.
  ranges = [("full_tile", 0, 1, 0.0, 10.0), ("mma", 0, 1, 1.0, 9.0),
            ("full_tile", 0, 1, 10.0, 20.0), ("full_tile", 0, 1, 20.0, 30.0),
            ("full_tile", 1, 4, 0.0, 10.0), ("zero_tile", 1, 4, 10.0, 20.0)]
  s = timeline.summarize(timeline.load_ranges(_trace(ranges)))
  assert s["span_kc"] == 30.0 and s["sms"] == 2
  assert s["scopes"]["full_tile"]["count"] == 4 and s["scopes"]["full_tile"]["median_kc"] == 10.0
  assert s["scopes"]["mma"]["total_kc"] == 8.0 and s["scopes"]["zero_tile"]["count"] == 1
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


def test_block_sequences_follow_one_warpgroup_per_block():
  # 3 traces per block (memory + 2 compute warpgroups): tid 1 = block 0 wg 0, tid 4 =
  # block 1 wg 0, tid 2 = block 0 wg 1 (left out).
  ranges = timeline.load_ranges(_trace([
      ("full_tile", 5, 1, 10.0, 20.0), ("full_tile", 5, 1, 0.0, 10.0),
      ("zero_tile", 7, 4, 0.0, 3.0), ("full_tile", 5, 2, 0.0, 10.0), ("mma", 5, 1, 1.0, 2.0)]))
  seqs = timeline.block_sequences(ranges, {"full_tile", "zero_tile"}, traces_per_block=3)
  assert sorted(seqs) == [0, 1]
  assert [r.begin_kc for r in seqs[0]] == [0.0, 10.0] and seqs[1][0].name == "zero_tile"


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_tune_gmm_attributes_forward_tiles_to_their_pieces():
  # A synthetic profile of grouped_matmul's persistent loop (4 blocks, steps b, b+4, ...),
  # each tile's duration set by its piece: tune_gmm must recover the durations per class.
  import sys
  import numpy as np
  import jax.numpy as jnp
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from conftest import REPO
  sys.path.insert(0, str(REPO / "tools"))
  tune = load_script("tune_gmm", "tools/tune_gmm.py")
  mk, mt = tune.sched, tune.mt
  sizes, m, n, num_blocks = [300, 0, 2000, 5000], 7400, 512, 4
  t = mt.FwdTiling()
  kind, group, _, _, size = (np.asarray(a) for a in mk.work_table(
      jnp.asarray(sizes), 0, 4, m, 128, window_align=t.window_align))
  grid_n = n // t.cta_n
  total = kind.shape[0] * grid_n
  expect = {"zero": 0.5, "partial (full_tile)": 1.0, "full, group < 1024 rows": 2.0,
            "full, group < 4096": 3.0, "full, group >= 4096": 4.0}
  ranges = []
  for b in range(num_blocks):
    clock = 0.0
    for f in range(b, total, num_blocks):
      i = int(plgpu.planar_snake(jnp.int32(f), (kind.shape[0], grid_n), 1, t.grid_block_n)[0])
      if kind[i] == mk.SKIP:
        continue
      if kind[i] == mk.ZERO:
        label = "zero"
      elif size[i] < 128:
        label = "partial (full_tile)"
      else:
        label = next(l for lim, l in tune._GROUP_BUCKETS if sizes[group[i]] < lim)
      name = "zero_tile" if kind[i] == mk.ZERO else "full_tile"
      ranges.append((name, b, 1 + 3 * b, clock, clock + expect[label]))
      clock += expect[label]
  text = tune.fwd_tile_classes(timeline.load_ranges(_trace(ranges)), sizes, m, t, n, num_blocks)
  got = {line[:26].strip(): float(line.split()[-1]) for line in text.splitlines()[1:]}
  assert got == expect, text


@pytest.mark.parametrize("argv,named", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                        (["--problems", "down,dwn"], "'dwn'"),
                                        (["--profile-variants", "0,x"], "'x' is not a variant index"),
                                        (["--family", "qwen3"], "unknown --family 'qwen3'")])
def test_tune_gmm_names_a_bad_argument(monkeypatch, capsys, argv, named):
  import sys
  from conftest import REPO
  sys.path.insert(0, str(REPO / "tools"))
  tune = load_script("tune_gmm", "tools/tune_gmm.py")
  monkeypatch.setattr(sys, "argv", ["tune_gmm.py", *argv])
  with pytest.raises(SystemExit) as exit_info:
    tune.main()
  assert exit_info.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_tune_gmm_variants_build_at_their_shapes():
  # Every variant the tuner will time lowers for CUDA at its problem's DeepSeek-V3 shape (a
  # variant that cannot be built would cost a device call to find out).
  import sys
  import jax
  import jax.numpy as jnp
  from conftest import REPO
  sys.path.insert(0, str(REPO / "tools"))
  tune = load_script("tune_gmm", "tools/tune_gmm.py")
  g, m = 32, 4096
  for name, (op, k, n, transpose) in tune.PROBLEMS.items():
    for t in tune.variants(name):
      if op == "fwd":
        fn = lambda x, w, gs, t=t, tr=transpose: tune.mgpu.gmm(x, w, gs, transpose_rhs=tr, tiling=t)
        shapes = [((m, k), jnp.bfloat16), ((g, n, k) if transpose else (g, k, n), jnp.bfloat16),
                  ((g,), jnp.int32)]
      else:
        fn = lambda x, d, gs, t=t: tune.mgpu.tgmm(x, d, gs, num_local_groups=g, tiling=t)
        shapes = [((m, k), jnp.bfloat16), ((m, n), jnp.bfloat16), ((g,), jnp.int32)]
      args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text, (name, t)
