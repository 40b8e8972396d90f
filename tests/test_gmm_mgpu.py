"""CPU-side tests of the mgpu grouped-GEMM backend: tiling table, work-table schedule,
argument validation, and that the Mosaic-GPU kernels lower for CUDA (shape plumbing and
the shared-memory budget are checked at lowering, which needs no GPU). The kernels' numbers
are checked on a GPU by `tools/bench_gmm.py --edge` (PASS/FAIL per case)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MANY_CPU_THREADS, in_own_process
from MaxText.moe.gmm.mgpu import bf16 as mgpu, kernels as mgpu_kernels, schedule as mgpu_schedule, tgmm as mgpu_tgmm, tiling as mgpu_tiling


# ------------------------------------------------------------------ tiling table
def test_lookup_hits_table_and_falls_back_to_default():
  assert mgpu_tiling.lookup("fwd", 7168, 4096) is mgpu_tiling.TABLE[("fwd", 7168, 4096)]
  assert mgpu_tiling.lookup("fwd", 512, 768) == mgpu_tiling.FwdTiling()
  assert mgpu_tiling.lookup("tgmm", 512, 768) == mgpu_tiling.TgmmTiling()
  with pytest.raises(ValueError, match="valid"):
    mgpu_tiling.lookup("nope", 1, 1)


def test_table_entries_fit_their_shapes_and_shared_memory():
  for (op, k, n), tiling in mgpu_tiling.TABLE.items():
    if op in ("fwd", "tgmm"):
      tiling.validate(k, n)  # raises if K/N indivisible or smem over the Hopper limit


def test_fit_output_drops_stages_for_f32_epilogue():
  t = mgpu_tiling.FwdTiling(stages=4)
  assert t.smem_bytes(4) > mgpu_tiling.SMEM_LIMIT_BYTES
  f32 = t.fit_output(4)
  assert f32.stages < 4 and f32.smem_bytes(4) <= mgpu_tiling.SMEM_LIMIT_BYTES
  assert t.fit_output(2) == t


def test_fit_output_unchains_when_it_drops_stages():
  t = mgpu_tiling.FwdTiling(stages=4, chain=True)
  f32 = t.fit_output(4)
  assert (f32.stages, f32.chain) == (3, False) and f32.smem_bytes(4) <= mgpu_tiling.SMEM_LIMIT_BYTES
  assert t.fit_output(2) == t


def test_validate_rejects_unchainable_tilings():
  with pytest.raises(ValueError, match="K/block_k=5 .* multiple of stages=4"):
    mgpu_tiling.FwdTiling(stages=4, chain=True).validate(320, 256)
  with pytest.raises(ValueError, match="chain and half_tiles"):
    mgpu_tiling.FwdTiling(stages=2, chain=True, half_tiles=True).validate(256, 256)


def test_swizzled_epilogue_rows_are_128_bytes():
  t = mgpu_tiling.FwdTiling(epi_swizzle=True)
  assert t.fit_output(2) == t and t.fit_output(4).epi_n == 32
  assert t.fit_output(4).smem_bytes(4) == t.smem_bytes(2)  # f32 keeps the bf16 stages
  with pytest.raises(ValueError, match="epi_swizzle needs 128-byte epilogue rows: epi_n=64 .* got epi_n=128"):
    dataclasses.replace(t, epi_n=128).validate(256, 256)


def test_validate_rejects_bad_shapes():
  t = mgpu_tiling.FwdTiling()
  with pytest.raises(ValueError, match="block_k"):
    t.validate(100, 256)
  with pytest.raises(ValueError, match="2\\*block_n"):
    t.validate(128, 128)
  with pytest.raises(ValueError, match="shared memory"):
    dataclasses.replace(t, stages=6).validate(128, 256)


# ------------------------------------------------------------------ work table
def _check_schedule(sizes, offset, num_local, m, block_m, group_aligned=False):
  kind, group, start, row0, size = (
      np.asarray(a) for a in mgpu_schedule.work_table(
          jnp.asarray(sizes, jnp.int32), offset, num_local, m, block_m,
          window_align=8 if group_aligned else None))
  assert kind.shape == (mgpu_schedule.num_work_items(
      m, num_local, block_m, 8 if group_aligned else None),)
  ends = np.cumsum(sizes)
  starts = ends - np.asarray(sizes)
  owner = np.full(m, -1)  # expected local group per row, -1 = zero row
  for g in range(num_local):
    owner[min(starts[offset + g], m):min(ends[offset + g], m)] = g
  covered = np.zeros(m, int)
  for kd, g, st, r0, sz in zip(kind, group, start, row0, size):
    if kd == mgpu_schedule.SKIP:
      assert sz == 0
      continue
    assert sz > 0 and 0 <= r0 and r0 + sz <= block_m  # a piece stays inside its window
    if group_aligned:
      assert st % 8 == 0 and r0 < 8  # windows start at the piece, aligned down to 8 rows
    else:
      assert st % block_m == 0  # windows are row blocks
    rows = np.arange(st + r0, st + r0 + sz)
    covered[rows] += 1
    expect = g if kd == mgpu_schedule.COMPUTE else -1
    assert (owner[rows] == expect).all()
  assert (covered == 1).all()  # every row written exactly once
  valid = kind != mgpu_schedule.SKIP
  assert (np.diff(valid.astype(int)) <= 0).all()  # SKIP items only at the tail


@pytest.mark.parametrize("sizes,offset,num_local,m", [
    ([0, 5, 130, 0, 3, 256, 1, 0], 0, 8, 400),   # empty groups, padding rows
    ([0, 5, 130, 0, 3, 256, 1, 0], 2, 3, 400),   # ring EP: local groups 2..4
    ([128, 128, 128], 0, 3, 384),                # tile-aligned: no extra pieces
    ([0, 0, 0], 0, 3, 50),                       # nothing routed
    ([300, 300], 1, 1, 500),                     # local group runs past M: clipped
])
@pytest.mark.parametrize("group_aligned", [False, True])
def test_work_table_partitions_rows(sizes, offset, num_local, m, group_aligned):
  _check_schedule(sizes, offset, num_local, m, 128, group_aligned)


@pytest.mark.parametrize("cases", [pytest.param(20, marks=pytest.mark.slow), 8])  # fast tier: the first 8
def test_work_table_random_schedules(cases):
  rng = np.random.default_rng(0)
  for _ in range(cases):
    g = int(rng.integers(1, 9))
    sizes = rng.integers(0, 300, g) * (rng.random(g) > 0.3)
    m = int(sizes.sum() + rng.integers(0, 200))
    num_local = int(rng.integers(1, g + 1))
    offset = int(rng.integers(0, g - num_local + 1))
    _check_schedule(sizes.tolist(), offset, num_local, max(m, 1), int(rng.choice([64, 128])),
                    bool(rng.integers(2)))


def test_group_aligned_windows_that_start_before_their_group():
  # Groups of 127 rows start at rows 0, 127, 254, ... (7, 6, 5 ... rows past a multiple of
  # 8): aligned down, most need 2 windows of 128 for their 127 rows; every row is still
  # written exactly once and the table's length bound holds.
  for g in (8, 32, 64):
    _check_schedule([127] * g, 0, g, 127 * g, 128, group_aligned=True)
    _check_schedule([125, 3] * (g // 2), 0, g, 128 * (g // 2) + 5, 128, group_aligned=True)


@pytest.mark.parametrize("group_aligned", [False, True])
def test_aligned_groups_cost_no_extra_tiles(group_aligned):
  kind, *_ = mgpu_schedule.work_table(jnp.full((4,), 256, jnp.int32), 0, 4, 1024, 128,
                                     window_align=8 if group_aligned else None)
  assert int((np.asarray(kind) == mgpu_schedule.COMPUTE).sum()) == 8


def test_group_aligned_cuts_cost_one_partial_tile_per_group():
  # Groups [0,100), [100,300), [300,400): cuts at multiples of 128 give 1 + 3 + 2 = 6 pieces
  # ([100,128) [128,256) [256,300) and [300,384) [384,400)); cuts from each group's first row
  # (aligned down to 8: windows at 96 and 296) give 1 + 2 + 1.
  sizes = jnp.asarray([100, 200, 100], jnp.int32)
  for align, pieces in ((None, 6), (8, 4)):
    kind, *_ = mgpu_schedule.work_table(sizes, 0, 3, 400, 128, window_align=align)
    assert int((np.asarray(kind) == mgpu_schedule.COMPUTE).sum()) == pieces


@pytest.mark.parametrize("num_sms,total", [(4, 8), (4, 10), (132, 28672), (5, 3)])
def test_boustrophedon_is_a_permutation(num_sms, total):
  perm = np.asarray(mgpu_schedule.boustrophedon(jnp.arange(total), num_sms, total))
  assert sorted(perm.tolist()) == list(range(total))
  assert perm[:num_sms].tolist() == list(range(min(num_sms, total)))  # round 0 as is


def test_largest_first_rounds_even_out_the_sms():
  # dW tiles of the benchmark's Zipf-1.2 draw (32 groups x 896 tiles, cost = row steps),
  # dealt to 132 SMs as nd_loop does (SM s: flat s, s+132, ...). In the drawn group order the
  # busiest SM has 2.4% more steps than the mean; largest first in alternating rounds, 0.8%.
  from conftest import load_script
  bench_gmm = load_script("bench_gmm", "tools/bench_gmm.py")
  sizes = bench_gmm.group_sizes("zipf1.2", 65536, 32, np.random.default_rng(2))

  def spread(sizes_G, perm):
    cost = np.repeat(-(-np.asarray(sizes_G) // 64), 896)[perm]
    per_sm = np.bincount(np.arange(cost.size) % 132, weights=cost, minlength=132)
    return per_sm.max() / per_sm.mean() - 1

  n = 32 * 896
  snake = np.asarray(mgpu_schedule.boustrophedon(jnp.arange(n), 132, n))
  assert spread(np.sort(sizes)[::-1], snake) < 0.01 < 0.02 < spread(sizes, np.arange(n))


@pytest.mark.parametrize("num_sms,grid_n,gbn", [(3, 2, 1), (7, 2, 1), (132, 28, 16), (5, 8, 4)])
def test_chain_states_start_and_stop_each_sm_s_compute_tiles(num_sms, grid_n, gbn):
  # Per SM (flat indices s, s+S, ...): its compute tiles read ALONE, or START STEADY* STOP.
  rng = np.random.default_rng(num_sms)
  kind = jnp.asarray(rng.choice([mgpu_schedule.COMPUTE, mgpu_schedule.ZERO, mgpu_schedule.SKIP],
                                size=40, p=[0.6, 0.2, 0.2]), jnp.int32)
  states = np.asarray(mgpu_schedule.chain_states(kind, grid_n, gbn, num_sms))
  item = np.asarray(mgpu_schedule.tile_items(jnp.arange(states.size), 40, grid_n, gbn))
  compute = np.asarray(kind)[item] == mgpu_schedule.COMPUTE
  S = mgpu_schedule
  for sm in range(num_sms):
    seq = states[sm::num_sms][compute[sm::num_sms]].tolist()
    if len(seq) == 1:
      assert seq == [S.ALONE]
    elif seq:
      assert seq == [S.START] + [S.STEADY] * (len(seq) - 2) + [S.STOP]


# ------------------------------------------------------------------ validation / availability
def test_unavailable_on_cpu_says_why():
  reason = mgpu.unavailable_reason()
  assert reason is not None and "GPU" in reason


def test_argument_validation():
  bf = jnp.bfloat16
  x = jnp.ones((16, 64), bf)
  with pytest.raises(ValueError, match="dtype"):
    mgpu.gmm(x, jnp.ones((2, 64, 256), jnp.float32), jnp.array([8, 8]))
  with pytest.raises(ValueError, match="contraction"):
    mgpu.gmm(x, jnp.ones((2, 128, 256), bf), jnp.array([8, 8]))
  with pytest.raises(ValueError, match="local groups"):
    mgpu.gmm(x, jnp.ones((3, 64, 256), bf), jnp.array([8, 8]))
  with pytest.raises(ValueError, match="integers"):
    mgpu.gmm(x, jnp.ones((2, 64, 256), bf), jnp.array([8.0, 8.0]))
  with pytest.raises(ValueError, match="dout"):
    mgpu.tgmm(x, jnp.ones((8, 128), bf), jnp.array([8, 8]), num_local_groups=2)
  with pytest.raises(ValueError, match="num_local_groups"):
    mgpu.tgmm(x, jnp.ones((16, 128), bf), jnp.array([8, 8]), num_local_groups=3)


# ------------------------------------------------------------------ lowering for CUDA
# The options for skewed group sizes: dW's (exact_start, largest_first) and the forward's
# group_aligned are on by default and the tests also run them off (JAX's block-aligned
# windows); half_tiles measured no faster on the H200, is off by default, and tested on.
_SKEW_FWD = mgpu_tiling.FwdTiling(group_aligned=True, half_tiles=True)
_BLOCK_FWD = mgpu_tiling.FwdTiling(group_aligned=False)
_SWIZZLED_EPI = mgpu_tiling.FwdTiling(epi_swizzle=True)
_PINGPONG = mgpu_tiling.FwdTiling(pingpong=True, stages=3)
_MULTICAST = mgpu_tiling.FwdTiling(pingpong=True, multicast=True, stages=3, grid_block_n=32)
_BLOCK_TGMM = dict(exact_start=False, largest_first=False)


def _lower(fn, *shapes):
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("transpose,offset,num_local,out_dtype", [
    (False, 0, 8, jnp.bfloat16),
    (True, 0, 8, jnp.bfloat16),
    (False, 4, 4, jnp.float32),
])
def test_gmm_lowers_to_mosaic_gpu(transpose, offset, num_local, out_dtype):
  m, k, n, bf = 1000, 256, 512, jnp.bfloat16
  w = (num_local, n, k) if transpose else (num_local, k, n)
  text = _lower(lambda x, w, gs: mgpu.gmm(x, w, gs, group_offset=offset, transpose_rhs=transpose,
                                           out_dtype=out_dtype),
                ((m, k), bf), (w, bf), ((8,), jnp.int32))
  assert "mosaic_gpu" in text


_CHAIN_FWD = mgpu_tiling.FwdTiling(stages=4, grid_block_n=16, chain=True)


@pytest.mark.parametrize("transpose,tiling", [
    (False, _SKEW_FWD), (True, _SKEW_FWD), (False, _CHAIN_FWD), (True, _CHAIN_FWD),
    (False, _SWIZZLED_EPI), (True, _SWIZZLED_EPI), (False, _PINGPONG), (True, _PINGPONG),
    (False, dataclasses.replace(_PINGPONG, epi_swizzle=True)),
    (False, _MULTICAST), (True, _MULTICAST)])
def test_gmm_lowers_at_deepseek_shapes(transpose, tiling):
  # Group-aligned windows and the half-height MMA branch, or chained tiles, at the up-proj
  # (and its dlhs) shape.
  w = (32, 2048, 7168) if transpose else (32, 7168, 2048)
  text = _lower(lambda x, w, gs: mgpu.gmm(x, w, gs, transpose_rhs=transpose, tiling=tiling),
                ((4096, 7168), jnp.bfloat16), (w, jnp.bfloat16), ((32,), jnp.int32))
  assert "mosaic_gpu" in text


def test_profile_dir_turns_on_the_device_profiler():
  # Lowering a profiled kernel needs a CUDA backend (its trace buffer), and the interpreter
  # ignores profiling: the GPU run is the check. Here: jax accepts the parameters we build.
  on, off = mgpu_kernels.compiler_params("/runs/r1/prof"), mgpu_kernels.compiler_params(None)
  assert (on.profile_dir, on.profile_space > 0, on.profile_bounds_check) == ("/runs/r1/prof", True, True)
  assert (off.profile_dir, off.profile_space) == ("", 0)


def test_profile_trace_is_sized_to_the_shared_memory_the_tiling_leaves():
  # On the H200, 4096 ranges per warpgroup (48 KiB per trace of 3) beside a 4-stage forward
  # tiling asked for 426048 B of shared memory (limit 232448) and the kernel did not build.
  t3, t4 = mgpu_tiling.FwdTiling(stages=3), mgpu_tiling.FwdTiling(stages=4)
  wgs = mgpu_kernels.NUM_WARPGROUPS
  ranges = mgpu_kernels.profile_ranges(t3.smem_bytes(), wgs)
  assert 1000 < ranges and t3.smem_bytes() + 16 * wgs * ranges <= mgpu_tiling.SMEM_LIMIT_BYTES
  with pytest.raises(ValueError, match="too little for a trace"):
    mgpu_kernels.compiler_params("/tmp/p", t4.smem_bytes(), wgs)


def test_tgmm_lowers_to_mosaic_gpu():
  text = _lower(lambda x, d, gs: mgpu.tgmm(x, d, gs, group_offset=2, num_local_groups=4),
                ((1000, 256), jnp.bfloat16), ((1000, 512), jnp.bfloat16), ((8,), jnp.int32))
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("block_aligned", [False, True])
def test_warp_specialized_tgmm_lowers_at_deepseek_shape(block_aligned):
  # 3 stages of (64x128 + 64x256) bf16 + a 128x256 output tile fit Hopper's shared memory.
  tiling = mgpu_tiling.TgmmTiling(warp_specialized=True, stages=3,
                                  **(_BLOCK_TGMM if block_aligned else {}))
  text = _lower(lambda x, d, s, e: mgpu_tgmm.transposed_grouped_matmul(
      x, d, s, e, tiling=tiling, out_dtype=jnp.bfloat16),
      ((4096, 7168), jnp.bfloat16), ((4096, 2048), jnp.bfloat16), ((32,), jnp.int32),
      ((32,), jnp.int32))
  assert "mosaic_gpu" in text


# ------------------------------------------------------------------ kernels, interpreted on CPU
# Pallas' Mosaic-GPU interpret mode simulates threads, SMEM, TMA and barriers on the CPU, so
# the kernels' numbers (group_offset, zero rows, partial tiles, transposed rhs) are checked
# here too; tiny shapes keep each case to ~30 s. Races/timing are only seen on a GPU.
def _interpret():
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())


def _ref_rows(x, w, starts, ends, m):
  out = np.zeros((m, w.shape[-1]), np.float32)
  for g, (s, e) in enumerate(zip(starts, ends)):
    out[s:e] = np.asarray(x[s:e], np.float32) @ np.asarray(w[g], np.float32)
  return out


@pytest.mark.parametrize("transpose,offset,num_local,out_dtype,tiling", [
    # Ring EP: groups 2..4 local, the rest and padding zero; group-aligned windows (the
    # default: group 2 from row 64, its first row 70 aligned down to 8), then block-aligned.
    (False, 2, 3, jnp.bfloat16, None),
    (False, 2, 3, jnp.bfloat16, _BLOCK_FWD),
    # dlhs form, f32 output; block-aligned, then with 64-row MMAs for the 2- and 1-row tails.
    (True, 0, 6, jnp.float32, _BLOCK_FWD),
    (True, 0, 6, jnp.float32, _SKEW_FWD),
    # The swizzled epilogue buffer, bf16 (64-column rows) and f32 (fit_output: 32 columns).
    (False, 2, 3, jnp.bfloat16, _SWIZZLED_EPI),
    (True, 0, 6, jnp.float32, _SWIZZLED_EPI),
    # Ping-pong tiles (one compute warpgroup each, in turn), bf16; f32 at 2 stages (fit_output).
    (False, 2, 3, jnp.bfloat16, _PINGPONG),
    (True, 0, 6, jnp.float32, _PINGPONG),
])
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_gmm_kernel_interpreted(transpose, offset, num_local, out_dtype, tiling):
  m, k, n = 301, 256, 256
  sizes = [70, 0, 130, 1, 0, 90]  # 10 padding rows at the end
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (num_local, k, n)) / 16).astype(jnp.bfloat16)
  rhs = jnp.swapaxes(w, 1, 2) if transpose else w
  gs = jnp.asarray(sizes, jnp.int32)
  with _interpret():
    out = mgpu.gmm(x, rhs, gs, group_offset=offset, transpose_rhs=transpose, out_dtype=out_dtype,
                   tiling=tiling)
  ends = np.cumsum(sizes)[offset:offset + num_local]
  starts = ends - np.asarray(sizes[offset:offset + num_local])
  ref = _ref_rows(x, w, starts, ends, m)
  out = np.asarray(out, np.float32)
  assert out.dtype == np.float32 and not np.isnan(out).any()
  outside = np.ones(m, bool)
  for s, e in zip(starts, ends):
    outside[s:e] = False
  assert (out[outside] == 0).all()
  np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


def _check_few_sms_interpreted(monkeypatch, num_sms, tiling, transpose, k, n, seed):
  """mgpu.gmm on num_sms simulated SMs under the race detector, against the reference."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp
  from jax.experimental.pallas import mosaic_gpu as plgpu

  monkeypatch.setattr(mgpu_kernels, "num_sms", lambda: num_sms)
  m, sizes = 301, [70, 0, 130, 1, 0, 90]
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (5, k, n)) / 16).astype(jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  interp.reset_gpu_interpret_mode_state()
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
    out = mgpu.gmm(x, jnp.swapaxes(w, 1, 2) if transpose else w, gs, group_offset=1,
                   transpose_rhs=transpose, tiling=tiling)
    out = np.asarray(jax.block_until_ready(out), np.float32)
  assert not interp.get_races().races_found
  ends = np.cumsum(sizes)[1:]
  starts = ends - np.asarray(sizes[1:])
  np.testing.assert_allclose(out, _ref_rows(x, w, starts, ends, m), rtol=2e-2, atol=2e-2)
  assert (out[:70] == 0).all() and (out[291:] == 0).all()


@pytest.mark.parametrize("num_sms,stages,transpose", [(2, 2, False), (7, 2, True), (5, 4, False)])
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_chained_gmm_kernel_interpreted(monkeypatch, num_sms, stages, transpose):
  # Few simulated SMs, so that each runs a chain of several tiles (2 SMs: START, STEADY...,
  # STOP), or one tile alone (7 SMs), between ZERO and SKIP items; the race detector watches
  # the memory warpgroup loading the next tile while the compute ones store this one.
  tiling = mgpu_tiling.FwdTiling(stages=stages, chain=True, grid_block_n=1)
  _check_few_sms_interpreted(monkeypatch, num_sms, tiling, transpose, k=256, n=512, seed=3)


@pytest.mark.parametrize("num_sms,stages,transpose", [(2, 2, False), (3, 3, True), (1, 2, False)])
def test_pingpong_gmm_kernel_interpreted(monkeypatch, num_sms, stages, transpose):
  # Few simulated SMs, so that both compute warpgroups take several tiles in turn and their
  # rings wrap mid-tile (K=320: 5 steps on rings of 2 or 3 slots), with ZERO and SKIP items
  # between; one SM: a single block runs every tile. The race detector watches the memory
  # warpgroup refill a slot while the other warpgroup stores its tile.
  tiling = mgpu_tiling.FwdTiling(pingpong=True, stages=stages, grid_block_n=1)
  _check_few_sms_interpreted(monkeypatch, num_sms, tiling, transpose, k=320, n=256, seed=4)


@pytest.mark.parametrize("num_sms,stages,transpose", [(2, 2, False), (4, 3, True)])
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_multicast_pingpong_gmm_kernel_interpreted(monkeypatch, request, num_sms, stages, transpose):
  # Clusters of two SMs on neighbouring column tiles, each loading half of every lhs slot
  # into both; a slot is refilled only once both SMs' warpgroups released it. A cluster's six
  # warpgroups must run at once: in a process with the CPU threads for them (conftest).
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  tiling = mgpu_tiling.FwdTiling(pingpong=True, multicast=True, stages=stages, grid_block_n=2)
  _check_few_sms_interpreted(monkeypatch, num_sms, tiling, transpose, k=320, n=512, seed=5)


def test_pingpong_tiling_is_one_warpgroup_wide_with_two_rings():
  t = mgpu_tiling.FwdTiling(pingpong=True, stages=3)
  assert t.cta_n == t.block_n == 128
  # Two rings of 3 slots of (128x64 + 64x128) bf16, and the 2 x 128x64 bf16 epilogue buffer.
  assert t.smem_bytes() == 2 * 3 * 32768 + 32768 <= mgpu_tiling.SMEM_LIMIT_BYTES
  t.validate(2048, 7168)  # N a multiple of 128 suffices
  assert t.fit_output(4).stages == 2
  with pytest.raises(ValueError, match="multiple of block_n=128"):
    t.validate(2048, 7100)
  with pytest.raises(ValueError, match="pingpong runs its own pipeline"):
    dataclasses.replace(t, chain=True).validate(2048, 7168)
  with pytest.raises(ValueError, match="pingpong needs stages >= 2"):
    dataclasses.replace(t, stages=1).validate(2048, 7168)
  # multicast pairs column tiles (N a multiple of 256), and only the ping-pong kernel has it.
  mc = dataclasses.replace(t, multicast=True)
  assert mc.n_multiple == 256 and mc.smem_bytes() == t.smem_bytes()
  mc.validate(2048, 7168)
  with pytest.raises(ValueError, match="multiple of 2\\*block_n=256"):
    mc.validate(2048, 7168 - 128)
  with pytest.raises(ValueError, match="multicast is an option of the pingpong kernel"):
    mgpu_tiling.FwdTiling(multicast=True).validate(2048, 7168)


def test_table_chain_falls_back_unchained_where_k_steps_do_not_divide(monkeypatch):
  # K=320 is 5 steps of 64: no 4-stage chain; a table (not explicit) tiling runs unchained.
  monkeypatch.setattr(mgpu_tiling, "DEFAULTS",
                      {**mgpu_tiling.DEFAULTS, "fwd": mgpu_tiling.FwdTiling(stages=4, chain=True)})
  text = _lower(lambda x, w, gs: mgpu.gmm(x, w, gs), ((256, 320), jnp.bfloat16),
                ((2, 320, 256), jnp.bfloat16), ((2,), jnp.int32))
  assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match="multiple of stages"):
    _lower(lambda x, w, gs: mgpu.gmm(x, w, gs, tiling=mgpu_tiling.FwdTiling(stages=4, chain=True)),
           ((256, 320), jnp.bfloat16), ((2, 320, 256), jnp.bfloat16), ((2,), jnp.int32))


@pytest.mark.parametrize("warp_specialized,block_aligned", [(False, False), (True, False),
                                                            (False, True), (True, True)])
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_tgmm_kernel_interpreted(warp_specialized, block_aligned):
  m, k, n = 300, 128, 256
  sizes = [100, 0, 170, 30]
  kx, kd = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  d = jax.random.normal(kd, (m, n), jnp.bfloat16)
  # Rows of the groups that are not local (0 here) hold NaN in the operand each kernel masks
  # at group boundaries (lhs by default, dout when warp-specialized): a multiply by the mask
  # would let NaN * 0 into dW; the kernels select.
  foreign_M = (jnp.arange(m) < sizes[0])[:, None]
  if warp_specialized:
    d = jnp.where(foreign_M, jnp.nan, d).astype(d.dtype)
  else:
    x = jnp.where(foreign_M, jnp.nan, x).astype(x.dtype)
  gs = jnp.asarray(sizes, jnp.int32)
  # Defaults: windows from each group's first row (100 -> 96), largest group (170) first.
  tiling = mgpu_tiling.TgmmTiling(**(dict(warp_specialized=True, stages=3) if warp_specialized else {}),
                                  **(_BLOCK_TGMM if block_aligned else {}))
  with _interpret():
    dw = mgpu.tgmm(x, d, gs, group_offset=1, num_local_groups=3, tiling=tiling)
  ends = np.cumsum(sizes)
  starts = ends - np.asarray(sizes)
  for i, g in enumerate(range(1, 4)):
    s, e = starts[g], ends[g]
    ref = np.asarray(x[s:e], np.float32).T @ np.asarray(d[s:e], np.float32)
    assert np.isfinite(np.asarray(dw[i], np.float32)).all(), f"group {g}: NaN from foreign rows"
    np.testing.assert_allclose(np.asarray(dw[i], np.float32), ref, rtol=2e-2, atol=0.3)


@pytest.mark.parametrize("kernel", ["gmm", "tgmm_ws"])
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_warp_specialized_kernels_have_no_races_interpreted(kernel):
  # The interpreter's race detector tracks every SMEM/GMEM access of the simulated
  # warpgroups and TMA engine. get_races is not re-exported publicly (jax 0.11.2, pinned).
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp
  from jax.experimental.pallas import mosaic_gpu as plgpu

  m, k, n = 200, 128, 256
  gs = jnp.asarray([60, 0, 100, 30], jnp.int32)
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  interp.reset_gpu_interpret_mode_state()
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
    # With the skew options on, the code paths are a superset of the block-aligned ones' (a
    # second, half-height MMA branch; a remapped tile order).
    if kernel == "gmm":
      w = jax.random.normal(jax.random.key(1), (2, k, n), jnp.bfloat16)
      out = mgpu.gmm(x, w, gs, group_offset=1, tiling=_SKEW_FWD)
    else:
      d = jax.random.normal(jax.random.key(1), (m, n), jnp.bfloat16)
      tiling = mgpu_tiling.TgmmTiling(warp_specialized=True, stages=3)
      out = mgpu.tgmm(x, d, gs, group_offset=1, num_local_groups=2, tiling=tiling)
    jax.block_until_ready(out)
  assert not interp.get_races().races_found
