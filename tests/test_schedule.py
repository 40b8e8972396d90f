"""The step estimate that reads the schedule (MaxText/plan/schedule.py), on hand-written scheduled HLO.

Rates are set to round figures (a GEMM at 10 GFLOP/s, HBM at 1 GB/s, NVLink at 1 GB/s, InfiniBand at 10 MB/s)
so that every expected term is arithmetic on the snippet's shapes. The planner's use of it on a real compile
for compile-only H100s is tests/test_gpu_target.py's.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from MaxText import hardware
from MaxText.hardware import Figure
from MaxText.plan import op_cost, schedule

GPU = dataclasses.replace(
    hardware.GPUS["h200"], gemm_flops=Figure(1e10, "test"), attention_flops=Figure(0.5e10, "test"),
    hbm_bandwidth=Figure(1e9, "test"), nvlink_bytes=Figure(1e9, "test"), ib_bytes=Figure(1e7, "test"),
    a2a_nvlink_bytes=Figure(1e9, "test"), fp8_grouped_flops=Figure(2e10, "test"), host_bytes=Figure(0.25e9, "test"))
MESH = {"fsdp": 4}
ONE_NODE = [0, 0, 0, 0]
DOT_S = 2 * 256 * 256 * 512 / 1e10  # one f32[256,512] x [512,256] dot
GATHER_S = 4 * 64 * 512 * 4 * 3 / 4 / 1e9  # all-gather of f32[256,512] over 4 devices: 3/4 of it on the wire
SLOWED = 0.2 / 0.8  # a kernel beside an NCCL transfer runs at 80% (hardware.COLLECTIVE_SM_SHARE): +25% of that time


def _estimate(text: str, **kwargs) -> schedule.StepTerms:
  kwargs.setdefault("mesh_shape", MESH)
  kwargs.setdefault("nodes", ONE_NODE)
  return schedule.estimate(textwrap.dedent(text), GPU, **kwargs)


def _gather_module(between: str, after: str) -> str:
  return f"""\
      HloModule m, is_scheduled=true

      ENTRY %main (w: f32[64,512], x: f32[256,512], y: f32[512,256]) -> f32[256,512] {{
        %w = f32[64,512]{{1,0}} parameter(0)
        %x = f32[256,512]{{1,0}} parameter(1)
        %y = f32[512,256]{{1,0}} parameter(2)
        %ags = (f32[64,512]{{1,0}}, f32[256,512]{{1,0}}) all-gather-start(%w), channel_id=1, replica_groups=[1,4]<=[4], dimensions={{0}}, use_global_device_ids=true
        {between}
        %agd = f32[256,512]{{1,0}} all-gather-done(%ags)
        {after}
        ROOT %r = f32[256,512]{{1,0}} bitcast(%agd)
      }}
      """


DOT = "%d = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def test_an_all_gather_with_a_gemm_between_start_and_done_is_overlapped():
  t = _estimate(_gather_module(between=DOT, after=""))
  assert DOT_S > GATHER_S  # the GEMM is long enough to hide it
  assert (t.gemm_s, t.collectives_s, t.exposed_s) == (pytest.approx(DOT_S), pytest.approx(GATHER_S), 0.0)
  assert t.overlapped_s == pytest.approx(GATHER_S)
  # The GEMM shares the SMs with NCCL for the gather's time: no free lunch.
  assert t.contention_s == pytest.approx(GATHER_S * SLOWED)
  assert t.step_s == pytest.approx(DOT_S + GATHER_S * SLOWED)
  assert t.rows[("all-gather", ("fsdp",), False)] == pytest.approx([GATHER_S, 0.0, 1])


def test_an_all_gather_with_nothing_between_is_exposed():
  t = _estimate(_gather_module(between="", after=DOT))
  assert (t.exposed_s, t.overlapped_s) == (pytest.approx(GATHER_S), pytest.approx(0.0))
  assert t.step_s == pytest.approx(DOT_S + GATHER_S)


def test_a_transfer_longer_than_the_work_between_is_exposed_for_the_difference():
  # Crosses nodes: InfiniBand, 100x slower a NIC, and each node's two members send over their two NICs.
  t = _estimate(_gather_module(between=DOT, after=""), nodes=[0, 0, 1, 1])
  over_ib = 100 * GATHER_S / 2
  assert t.collectives_s == pytest.approx(over_ib) and over_ib > DOT_S
  # The GEMM runs beside the transfer throughout, at 80%: the transfer hides 1.25 x its FLOPs' time.
  assert t.exposed_s == pytest.approx(over_ib - DOT_S * (1 + SLOWED)) and t.step_s == pytest.approx(over_ib)


def test_a_sync_collective_blocks_the_stream():
  text = """\
      HloModule m

      %add (a: f32[], b: f32[]) -> f32[] {
        %a = f32[] parameter(0)
        %b = f32[] parameter(1)
        ROOT %s = f32[] add(%a, %b)
      }

      ENTRY %main (x: f32[256,512], y: f32[512,256]) -> f32[256,256] {
        %x = f32[256,512]{1,0} parameter(0)
        %y = f32[512,256]{1,0} parameter(1)
        %d = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ROOT %ar = f32[256,256]{1,0} all-reduce(%d), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
      }
      """
  t = _estimate(text)
  reduce_s = 2 * 256 * 256 * 4 * 3 / 4 / 1e9
  assert (t.collectives_s, t.exposed_s) == (pytest.approx(reduce_s), pytest.approx(reduce_s))
  assert t.step_s == pytest.approx(DOT_S + reduce_s)


LOOP = """\
    HloModule m, is_scheduled=true

    %body (p: (s32[], f32[256,512], f32[512,256])) -> (s32[], f32[256,512], f32[512,256]) {
      %p = (s32[], f32[256,512]{1,0}, f32[512,256]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %x = f32[256,512]{1,0} get-tuple-element(%p), index=1
      %y = f32[512,256]{1,0} get-tuple-element(%p), index=2
      %d = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      %one = s32[] constant(1)
      %next = s32[] add(%i, %one)
      ROOT %t = (s32[], f32[256,512]{1,0}, f32[512,256]{1,0}) tuple(%next, %x, %y)
    }

    %cond (p: (s32[], f32[256,512], f32[512,256])) -> pred[] {
      %p = (s32[], f32[256,512]{1,0}, f32[512,256]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %n = s32[] constant(7)
      ROOT %c = pred[] compare(%i, %n), direction=LT
    }

    ENTRY %main (x: f32[256,512], y: f32[512,256]) -> f32[256,512] {
      %x = f32[256,512]{1,0} parameter(0)
      %y = f32[512,256]{1,0} parameter(1)
      %zero = s32[] constant(0)
      %init = (s32[], f32[256,512]{1,0}, f32[512,256]{1,0}) tuple(%zero, %x, %y)
      %loop = (s32[], f32[256,512]{1,0}, f32[512,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
      ROOT %out = f32[256,512]{1,0} get-tuple-element(%loop), index=1
    }
    """


def test_a_while_loop_runs_its_body_trip_count_times():
  t = _estimate(LOOP)
  add_bytes = 3 * 4  # the counter's s32 add: two operands and its result, 5 times
  assert t.gemm_s == pytest.approx(5 * DOT_S) and t.counts["gemm_flops"] == 5 * 2 * 256 * 256 * 512
  assert t.memory_s == pytest.approx(5 * add_bytes / 1e9) and t.counts["kernels"] == 10
  assert t.step_s == pytest.approx(t.gemm_s + t.memory_s)
  assert not t.notes


def test_a_loop_without_known_trip_count_takes_its_conditions_bound():
  t = _estimate(LOOP.replace(', backend_config={"known_trip_count":{"n":"5"}}', ""))
  assert t.gemm_s == pytest.approx(7 * DOT_S) and t.notes == [
      "while loop loop: no known trip count; its condition cond bounds the induction variable at 7 (init 0 from the "
      "while's init, step 1): counted 7 times"]
  t = _estimate(LOOP.replace(', backend_config={"known_trip_count":{"n":"5"}}', "").replace("direction=LT", "direction=NE"))
  assert t.gemm_s == pytest.approx(DOT_S) and "counted once" in t.notes[0]


PIPELINED_GATHER = """\
    HloModule m, is_scheduled=true

    %body (p: (s32[], (f32[64,512], f32[256,512]), f32[256,512], f32[512,256])) -> (s32[], (f32[64,512], f32[256,512]), f32[256,512], f32[512,256]) {
      %p = (s32[], (f32[64,512]{1,0}, f32[256,512]{1,0}), f32[256,512]{1,0}, f32[512,256]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %carried = (f32[64,512]{1,0}, f32[256,512]{1,0}) get-tuple-element(%p), index=1
      %x = f32[256,512]{1,0} get-tuple-element(%p), index=2
      %y = f32[512,256]{1,0} get-tuple-element(%p), index=3
      %w = f32[256,512]{1,0} all-gather-done(%carried)
      %slice = f32[64,512]{1,0} slice(%w), slice={[0:64], [0:512]}
      %ags = (f32[64,512]{1,0}, f32[256,512]{1,0}) all-gather-start(%slice), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
      %d = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      ROOT %t = (s32[], (f32[64,512]{1,0}, f32[256,512]{1,0}), f32[256,512]{1,0}, f32[512,256]{1,0}) tuple(%i, %ags, %x, %y)
    }

    %cond (p: (s32[], (f32[64,512], f32[256,512]), f32[256,512], f32[512,256])) -> pred[] {
      %p = (s32[], (f32[64,512]{1,0}, f32[256,512]{1,0}), f32[256,512]{1,0}, f32[512,256]{1,0}) parameter(0)
      ROOT %c = pred[] constant(true)
    }

    ENTRY %main (w: f32[64,512], x: f32[256,512], y: f32[512,256]) -> f32[256,512] {
      %w = f32[64,512]{1,0} parameter(0)
      %x = f32[256,512]{1,0} parameter(1)
      %y = f32[512,256]{1,0} parameter(2)
      %zero = s32[] constant(0)
      %first = (f32[64,512]{1,0}, f32[256,512]{1,0}) all-gather-start(%w), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
      %init = (s32[], (f32[64,512]{1,0}, f32[256,512]{1,0}), f32[256,512]{1,0}, f32[512,256]{1,0}) tuple(%zero, %first, %x, %y)
      %loop = (s32[], (f32[64,512]{1,0}, f32[256,512]{1,0}), f32[256,512]{1,0}, f32[512,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
      %last = (f32[64,512]{1,0}, f32[256,512]{1,0}) get-tuple-element(%loop), index=1
      ROOT %out = f32[256,512]{1,0} all-gather-done(%last)
    }
    """


def test_a_gather_started_in_one_trip_and_awaited_in_the_next_is_pipelined():
  """XLA's collective pipelining: the next layer's weights are gathered during this layer's GEMM. Only the
  gather started before the loop, awaited first thing in trip 1, is exposed."""
  text = PIPELINED_GATHER
  t = _estimate(text)
  slice_s = 2 * 64 * 512 * 4 / 1e9  # each trip's slice: read and written
  assert t.collectives_s == pytest.approx(5 * GATHER_S)  # the prologue's and one per trip
  assert t.exposed_s == pytest.approx(GATHER_S) and not t.notes
  assert t.contention_s == pytest.approx(4 * GATHER_S * SLOWED)  # each trip's work beside the next trip's gather
  assert t.step_s == pytest.approx(GATHER_S + 4 * (slice_s + DOT_S) + t.contention_s)
  assert t.rows[("all-gather", ("fsdp",), False)][2] == 5


def test_a_conditional_takes_its_slowest_branch():
  text = """\
      HloModule m

      %cheap (x: f32[256,512], y: f32[512,256]) -> f32[256,512] {
        %x = f32[256,512]{1,0} parameter(0)
        %y = f32[512,256]{1,0} parameter(1)
        ROOT %n = f32[256,512]{1,0} negate(%x)
      }

      %costly (x: f32[256,512], y: f32[512,256]) -> f32[256,256] {
        %x = f32[256,512]{1,0} parameter(0)
        %y = f32[512,256]{1,0} parameter(1)
        ROOT %d = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      }

      ENTRY %main (i: s32[], x: f32[256,512], y: f32[512,256]) -> f32[256,256] {
        %i = s32[] parameter(0)
        %x = f32[256,512]{1,0} parameter(1)
        %y = f32[512,256]{1,0} parameter(2)
        ROOT %c = f32[256,256]{1,0} conditional(%i, %x, %y), branch_computations={%cheap, %costly}
      }
      """
  t = _estimate(text)
  assert DOT_S > 2 * 256 * 512 * 4 / 1e9
  assert (t.gemm_s, t.memory_s, t.step_s) == (pytest.approx(DOT_S), 0.0, pytest.approx(DOT_S))


def test_a_fusion_reads_its_operands_and_writes_its_output_at_hbm_rate():
  """An elementwise fusion moves its operands and output; one that slices a parameter reads the slice; one
  that updates a buffer in place writes the update only."""
  text = """\
      HloModule m, is_scheduled=true

      %add2 (a: f32[1024], b: f32[1024]) -> f32[1024] {
        %a = f32[1024]{0} parameter(0)
        %b = f32[1024]{0} parameter(1)
        ROOT %s = f32[1024]{0} add(%a, %b)
      }

      %take (big: f32[64,1024], k: s32[]) -> f32[1,1024] {
        %big = f32[64,1024]{1,0} parameter(0)
        %k = s32[] parameter(1)
        %zero = s32[] constant(0)
        %ds = f32[1,1024]{1,0} dynamic-slice(%big, %k, %zero), dynamic_slice_sizes={1,1024}
        ROOT %e = f32[1,1024]{1,0} exponential(%ds)
      }

      %put (buf: f32[64,1024], row: f32[1,1024], k: s32[]) -> f32[64,1024] {
        %buf = f32[64,1024]{1,0} parameter(0)
        %row = f32[1,1024]{1,0} parameter(1)
        %k = s32[] parameter(2)
        %zero = s32[] constant(0)
        %n = f32[1,1024]{1,0} negate(%row)
        ROOT %dus = f32[64,1024]{1,0} dynamic-update-slice(%buf, %n, %k, %zero)
      }

      ENTRY %main (a: f32[1024], b: f32[1024], big: f32[64,1024], k: s32[]) -> f32[64,1024] {
        %a = f32[1024]{0} parameter(0)
        %b = f32[1024]{0} parameter(1)
        %big = f32[64,1024]{1,0} parameter(2)
        %k = s32[] parameter(3)
        %sum = f32[1024]{0} fusion(%a, %b), kind=kLoop, calls=%add2
        %row = f32[1,1024]{1,0} fusion(%big, %k), kind=kLoop, calls=%take
        ROOT %out = f32[64,1024]{1,0} fusion(%big, %row, %k), kind=kLoop, calls=%put
      }
      """
  t = _estimate(text)
  expected = 3 * 4096 + (4096 + 4 + 4096) + (4096 + 4 + 4096)
  assert t.counts["memory_bytes"] == expected and t.counts["kernels"] == 3
  assert t.memory_s == pytest.approx(expected / 1e9) and t.step_s == pytest.approx(expected / 1e9)
  assert t.gemm_s == 0 and t.collectives_s == 0


def test_a_gemm_that_moves_more_than_it_computes_runs_at_hbm_rate():
  """The roofline: a dot with a short contraction (attention written as dots: QK^T over a 64-wide head writes
  S x S scores) takes its bytes at the HBM rate where they outlast its FLOPs at the GEMM rate."""
  text = """\
      HloModule m, is_scheduled=true

      ENTRY %main (x: f32[256,8], y: f32[8,256]) -> f32[256,256] {
        %x = f32[256,8]{1,0} parameter(0)
        %y = f32[8,256]{1,0} parameter(1)
        ROOT %scores = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      }
      """
  t = _estimate(text)
  flops, moved = 2 * 256 * 256 * 8, 4 * (256 * 8 + 8 * 256 + 256 * 256)
  assert moved / 1e9 > flops / 1e10  # 272 us of bytes against 105 us of FLOPs at the test's rates
  assert t.counts["gemm_flops"] == flops and t.gemm_s == pytest.approx(moved / 1e9)
  assert t.step_s == pytest.approx(moved / 1e9) and t.memory_s == 0


def test_grouped_gemm_and_attention_flops_from_their_shapes():
  gmm = op_cost.grouped_gemm_flops([[("s32", (32,))], [("bf16", (1024, 256))], [("bf16", (8, 256, 128))]],
                                    [("bf16", (1024, 128))])
  tgmm = op_cost.grouped_gemm_flops([[("bf16", (1024, 128))], [("bf16", (1024, 256))]], [("bf16", (8, 128, 256))])
  fp8_tgmm = op_cost.grouped_gemm_flops([[("f8e4m3fn", (12, 256, 128))], [("f32", (12, 256))],
                                          [("f8e4m3fn", (12, 128, 128))], [("f32", (12, 128))]], [("bf16", (8, 256, 128))])
  quantize = op_cost.grouped_gemm_flops([[("bf16", (512, 128))]], [("f8e4m3fn", (512, 128)), ("f32", (1, 512))])
  assert (gmm, tgmm, fp8_tgmm, quantize) == (2 * 1024 * 256 * 128, 2 * 1024 * 128 * 256, 2 * 12 * 128 * 256 * 128, 0)
  # Under upstream's pipeline the kernels run in the stages' vmap: a leading stage dimension on every data array (1
  # on a device; its stage's slice), and the group sizes' too. They were counted 0 (the 1,024 x H100 PP2 plan's
  # routed GEMMs: 195 T of ~10,000).
  vmapped = lambda arr: [(d, (b, *s)) for d, s in arr]  # noqa: E731
  for b in (1, 2):
    assert op_cost.grouped_gemm_flops([vmapped([("s32", (32,))]), vmapped([("bf16", (1024, 256))]),
                                       vmapped([("bf16", (8, 256, 128))])], vmapped([("bf16", (1024, 128))])) == b * gmm
    assert op_cost.grouped_gemm_flops([vmapped([("bf16", (1024, 128))]), vmapped([("bf16", (1024, 256))])],
                                      vmapped([("bf16", (8, 128, 256))])) == b * tgmm
    assert op_cost.grouped_gemm_flops([vmapped([("f8e4m3fn", (12, 256, 128))]), vmapped([("f32", (12, 256))]),
                                       vmapped([("f8e4m3fn", (12, 128, 128))]), vmapped([("f32", (12, 128))])],
                                      vmapped([("bf16", (8, 256, 128))])) == b * fp8_tgmm
    assert op_cost.grouped_gemm_flops([vmapped([("bf16", (512, 128))])],
                                      vmapped([("f8e4m3fn", (512, 128)), ("f32", (1, 512))])) == 0
  attention = """\
      HloModule m

      ENTRY %main (q: bf16[2,64,4,32], k: bf16[2,64,4,32], v: bf16[2,64,4,16]) -> bf16[2,4,64,16] {
        %q = bf16[2,64,4,32]{3,2,1,0} parameter(0)
        %k = bf16[2,64,4,32]{3,2,1,0} parameter(1)
        %v = bf16[2,64,4,16]{3,2,1,0} parameter(2)
        %f = (bf16[2,4,64,16]{3,2,1,0}, f32[2,4,64]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "64", "64"]}, "mask_type": "CAUSAL"}}
        %o = bf16[2,4,64,16]{3,2,1,0} get-tuple-element(%f), index=0
        ROOT %g = (bf16[2,64,4,32]{3,2,1,0}, bf16[2,64,4,32]{3,2,1,0}, bf16[2,64,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "64", "64"]}, "mask_type": "NO_MASK"}}
      }
      """
  t = _estimate(attention)
  scores = 2 * 4 * 64 * 64
  assert t.counts["attention_flops"] == 2 * scores * (32 + 16) / 2 + 2 * scores * (3 * 32 + 2 * 16)
  assert t.attention_s == pytest.approx(t.counts["attention_flops"] / 0.5e10) and t.gemm_s == 0


def test_bubble_and_fp8_and_opaque_kernels():
  """A pipeline's bubble fraction b adds path b / (1 - b); FP8 experts put our grouped GEMMs at the FP8 rate;
  a custom call the walk cannot read brings MaxText's FLOPs beyond the HLO's, at the GEMM rate."""
  mosaic = """\
      HloModule m

      ENTRY %main (x: bf16[1024,256], w: bf16[8,256,128], s: s32[8]) -> bf16[1024,128] {
        %x = bf16[1024,256]{1,0} parameter(0)
        %w = bf16[8,256,128]{2,1,0} parameter(1)
        %s = s32[8]{0} parameter(2)
        ROOT %g = bf16[1024,128]{1,0} custom-call(%s, %x, %w), custom_call_target="mosaic_gpu_v2"
      }
      """
  flops = 2 * 1024 * 256 * 128
  t = _estimate(mosaic, bubble_fraction=0.25)
  assert t.gemm_s == pytest.approx(flops / 1e10) and t.bubble_s == pytest.approx(t.path_s / 3)
  assert t.step_s == pytest.approx(t.path_s * 4 / 3)
  t = _estimate(mosaic, fp8_experts=True)
  assert (t.gemm_s, t.fp8_gemm_s, t.counts["fp8_flops"]) == (0.0, pytest.approx(flops / 2e10), flops)
  opaque = mosaic.replace("mosaic_gpu_v2", "__gpu$xla.gpu.triton")
  t = _estimate(opaque, counted_flops=flops)
  assert t.hidden_flops_s == pytest.approx(flops / 1e10) and t.gemm_s == 0 and "__gpu$xla.gpu.triton" in t.notes[0]
  assert _estimate(mosaic, counted_flops=2 * flops).hidden_flops_s == 0  # every kernel read: the HLO's count stands
  with pytest.raises(ValueError, match="bubble_fraction"):
    _estimate(mosaic, bubble_fraction=1.0)
  with pytest.raises(ValueError, match="moe_fp8"):
    schedule.estimate(textwrap.dedent(mosaic), dataclasses.replace(hardware.GPUS["b200"], fp8_grouped_flops=None), MESH,
                      ONE_NODE, fp8_experts=True)


def test_the_honesty_check_reads_the_plan_and_bench_train_and_judges_at_the_tolerance():
  """tools/estimate_check.py: the planner's JSON estimate against bench_train.py's median step (its own keys)."""
  from conftest import load_script

  load_script("profile_breakdown", "tools/profile_breakdown.py")
  load_script("bench_train", "tools/bench_train.py")
  check = load_script("estimate_check", "tools/estimate_check.py")
  plan = {"estimate": {"step_s": 0.85}, "memory": {"device_total": 82 * 2**30}}
  bench = {"rows": [{"variant": "ours", "median_step_time_s": 0.774, "peak_device_memory_gib": 82.1}]}
  passed, line = check.verdict(plan, bench, 0.10)
  assert passed and line.startswith("PASS: estimated 850.0 ms / measured 774.0 ms (ours, median) = 1.098")
  assert "memory 82.00 GiB (compiler) / 82.10 GiB (peak)" in line
  passed, line = check.verdict({**plan, "estimate": {"step_s": 0.68}}, bench, 0.10)
  assert not passed and line.startswith("FAIL") and "= 0.879" in line  # the estimate before this module: 0.88


def test_padded_grouped_gemm_buffers_are_scaled_to_the_routed_rows_and_host_copies_go_over_pcie():
  """a2a_padded's receive buffer holds the worst case: our kernels multiply only the rows the group sizes hold,
  so the grouped GEMMs come down to the routed experts' count. An async fusion writing into host memory (S(5),
  the layer scan's offloaded activations) is a PCIe copy beside the stream, hidden by the GEMM after it."""
  text = """\
      HloModule m, is_scheduled=true

      %offload (buf: f32[8,1024], row: f32[1,1024], k: s32[]) -> f32[8,1024] {
        %buf = f32[8,1024]{1,0:S(5)} parameter(0)
        %row = f32[1,1024]{1,0} parameter(1)
        %k = s32[] parameter(2)
        %zero = s32[] constant(0)
        ROOT %dus = f32[8,1024]{1,0:S(5)} dynamic-update-slice(%buf, %row, %k, %zero)
      }

      ENTRY %main (x: bf16[1024,256], w: bf16[8,256,128], s: s32[8], buf: f32[8,1024], row: f32[1,1024], k: s32[]) -> f32[8,1024] {
        %x = bf16[1024,256]{1,0} parameter(0)
        %w = bf16[8,256,128]{2,1,0} parameter(1)
        %s = s32[8]{0} parameter(2)
        %buf = f32[8,1024]{1,0:S(5)} parameter(3)
        %row = f32[1,1024]{1,0} parameter(4)
        %k = s32[] parameter(5)
        %put = ((f32[8,1024]{1,0:S(5)}, f32[1,1024]{1,0}, s32[]), f32[8,1024]{1,0:S(5)}, u32[]) fusion-start(%buf, %row, %k), kind=kLoop, calls=%offload
        %g = bf16[1024,128]{1,0} custom-call(%s, %x, %w), custom_call_target="mosaic_gpu_v2"
        ROOT %done = f32[8,1024]{1,0:S(5)} fusion-done(%put)
      }
      """
  flops = 2 * 1024 * 256 * 128
  t = _estimate(text, routed_flops=flops / 2)
  assert t.counts["grouped_flops"] == flops / 2 and t.gemm_s == pytest.approx(flops / 2 / 1e10)
  assert t.notes == ["our grouped GEMMs' shapes hold 2x the routed experts' FLOPs (padded buffers): scaled to their "
                     f"{flops / 2e12:.4g} T"]
  assert (t.offload_s, t.offload_exposed_s, t.memory_s) == (pytest.approx(4096 / 0.25e9), 0.0, 0.0)
  assert t.rows[("host-offload", (), False)][2] == 1 and t.collectives_s == 0
  assert t.step_s == pytest.approx(flops / 2 / 1e10)
  assert _estimate(text, routed_flops=2 * flops).counts["grouped_flops"] == flops  # never scaled up
