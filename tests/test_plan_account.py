"""One account of every transfer (MaxText/plan/account.py): the collective rows (hlo_inventory.py) and the
schedule's walk (schedule.py) count the same transfers with the same trip counts, on hand-written scheduled HLO.

Rates are round figures (a GEMM at 10 GFLOP/s, NVLink at 1 GB/s, InfiniBand at 10 MB/s), as tests/test_schedule.py.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from MaxText import hardware
from MaxText.hardware import Figure
from MaxText.plan import account, hlo_inventory, schedule, step_report

GPU = dataclasses.replace(
    hardware.GPUS["h200"], gemm_flops=Figure(1e10, "test"), attention_flops=Figure(0.5e10, "test"),
    hbm_bandwidth=Figure(1e9, "test"), nvlink_bytes=Figure(1e9, "test"), ib_bytes=Figure(1e7, "test"),
    a2a_nvlink_bytes=Figure(1e9, "test"), fp8_grouped_flops=Figure(2e10, "test"), host_bytes=Figure(0.25e9, "test"))
MESH = {"fsdp": 4}
ONE_NODE = [0, 0, 0, 0]
DOT_S = 2 * 256 * 256 * 512 / 1e10  # one f32[256,512] x [512,256] dot
GATHER_S = 4 * 64 * 512 * 4 * 3 / 4 / 1e9  # all-gather of f32[256,512] over 4 devices: 3/4 of it on the wire
REDUCE_S = 2 * 256 * 256 * 4 * 3 / 4 / 1e9  # all-reduce of f32[256,256] over 4 devices


def _both(text: str, nodes=ONE_NODE):
  """(the walk's terms, the plan's rows, the account's check) as the planner computes them."""
  text = textwrap.dedent(text)
  terms = schedule.estimate(text, GPU, MESH, nodes)
  inv = hlo_inventory.inventory(text, MESH, nodes, branches=terms.branches)
  rows = account.rows(inv["collectives"], terms.rows, GPU)
  checked = account.check(rows, terms.rows, step_report.report(terms, 1.0, 0.0))
  return terms, {r["kind"]: r for r in rows}, checked, inv


# Outer loop (3 trips) around an inner loop (4 trips): the inner body gathers a weight behind a GEMM, the outer
# body all-reduces once (sync). Trip counts are set per case below.
NESTED = """\
    HloModule m, is_scheduled=true

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    %inner_body (p: (s32[], f32[64,512], f32[256,512], f32[512,256])) -> (s32[], f32[64,512], f32[256,512], f32[512,256]) {
      %p = (s32[], f32[64,512]{1,0}, f32[256,512]{1,0}, f32[512,256]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %w = f32[64,512]{1,0} get-tuple-element(%p), index=1
      %x = f32[256,512]{1,0} get-tuple-element(%p), index=2
      %y = f32[512,256]{1,0} get-tuple-element(%p), index=3
      %ags = (f32[64,512]{1,0}, f32[256,512]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
      %d = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      %agd = f32[256,512]{1,0} all-gather-done(%ags)
      ROOT %t = (s32[], f32[64,512]{1,0}, f32[256,512]{1,0}, f32[512,256]{1,0}) tuple(%i, %w, %x, %y)
    }

    %inner_cond (p: (s32[], f32[64,512], f32[256,512], f32[512,256])) -> pred[] {
      %p = (s32[], f32[64,512]{1,0}, f32[256,512]{1,0}, f32[512,256]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %n = s32[] constant(INNER_BOUND)
      ROOT %c = pred[] compare(%i, %n), direction=LT
    }

    %outer_body (q: (s32[], f32[64,512], f32[256,512], f32[512,256])) -> (s32[], f32[64,512], f32[256,512], f32[512,256]) {
      %q = (s32[], f32[64,512]{1,0}, f32[256,512]{1,0}, f32[512,256]{1,0}) parameter(0)
      %x = f32[256,512]{1,0} get-tuple-element(%q), index=2
      %y = f32[512,256]{1,0} get-tuple-element(%q), index=3
      %inner = (s32[], f32[64,512]{1,0}, f32[256,512]{1,0}, f32[512,256]{1,0}) while(%q), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
      %d = f32[256,256]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      %ar = f32[256,256]{1,0} all-reduce(%d), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
      ROOT %r = (s32[], f32[64,512]{1,0}, f32[256,512]{1,0}, f32[512,256]{1,0}) copy(%inner)
    }

    %outer_cond (q: (s32[], f32[64,512], f32[256,512], f32[512,256])) -> pred[] {
      %q = (s32[], f32[64,512]{1,0}, f32[256,512]{1,0}, f32[512,256]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%q), index=0
      %fused = pred[] fusion(%i), kind=kLoop, calls=%outer_compare
      ROOT %c = pred[] copy(%fused)
    }

    %outer_compare (i: s32[]) -> pred[] {
      %i = s32[] parameter(0)
      %n = s32[] constant(OUTER_BOUND)
      ROOT %c = pred[] compare(%n, %i), direction=GT
    }

    ENTRY %main (w: f32[64,512], x: f32[256,512], y: f32[512,256]) -> f32[256,512] {
      %w = f32[64,512]{1,0} parameter(0)
      %x = f32[256,512]{1,0} parameter(1)
      %y = f32[512,256]{1,0} parameter(2)
      %zero = s32[] constant(0)
      %init = (s32[], f32[64,512]{1,0}, f32[256,512]{1,0}, f32[512,256]{1,0}) tuple(%zero, %w, %x, %y)
      %outer = (s32[], f32[64,512]{1,0}, f32[256,512]{1,0}, f32[512,256]{1,0}) while(%init), condition=%outer_cond, body=%outer_body, OUTER_CONFIG
      ROOT %out = f32[256,512]{1,0} get-tuple-element(%outer), index=2
    }
    """


def _nested(outer_config: str, outer_bound: int = 9, inner_bound: int = 4) -> str:
  return (NESTED.replace("OUTER_CONFIG", outer_config).replace("OUTER_BOUND", str(outer_bound))
          .replace("INNER_BOUND", str(inner_bound)))


@pytest.mark.parametrize("config, trips", [
    ('backend_config={"known_trip_count":{"n":"3"}}', 3),
    # XLA peeled the first trip (the gradient-accumulation loop of the 1,024 x H100 EP 64 plan): i runs 1..8
    ('backend_config={"known_induction_variable":{"tuple_index":"0"},"dynamic_variables":[{"tuple_index":"0","init":"1","step":"1"}]}', 8),
    ('backend_config={"known_init_step":{"init":"0","step":"2"}}', 5),  # double-buffered: i = 0, 2, .., 8
    ('metadata={op_name="no trip count"}', 9),  # the condition's bound alone: init 0, step 1
])
def test_nested_loops_count_the_same_transfers_in_the_rows_and_the_walk(config, trips):
  terms, rows, checked, inv = _both(_nested(config))
  assert rows["all-gather"]["count"] == rows["all-gather"]["walk_count"] == 4 * trips
  assert rows["all-reduce"]["count"] == rows["all-reduce"]["walk_count"] == trips
  assert rows["all-gather"]["seconds"] == pytest.approx(4 * trips * GATHER_S)
  assert terms.collectives_s == pytest.approx(trips * (4 * GATHER_S + REDUCE_S))
  assert terms.gemm_s == pytest.approx(trips * 5 * DOT_S)
  assert checked["ok"], checked["violations"]
  if trips == 3:
    assert not inv["inventory_notes"] and not terms.notes
  else:  # a trip count XLA did not give: the loop's name and the bound, the same note in both halves
    note = [n for n in inv["inventory_notes"] if n.startswith("while loop outer:")]
    assert len(note) == 1 and f"counted {trips} times" in note[0] and "outer_cond" in note[0]
    assert note == [n for n in terms.notes if n.startswith("while loop outer:")]


def test_a_loop_whose_bound_cannot_be_read_counts_once_in_both_halves():
  terms, rows, checked, inv = _both(_nested("metadata={}").replace("direction=GT", "direction=NE"))
  assert rows["all-gather"]["count"] == rows["all-gather"]["walk_count"] == 4
  assert checked["ok"], checked["violations"]
  assert any("while loop outer" in n and "counted once" in n for n in inv["inventory_notes"])


def test_a_gather_started_in_one_trip_and_awaited_in_the_next_is_one_transfer_a_trip_in_both():
  from test_schedule import PIPELINED_GATHER  # pylint: disable=import-outside-toplevel

  terms, rows, checked, _ = _both(PIPELINED_GATHER)
  assert rows["all-gather"]["count"] == rows["all-gather"]["walk_count"] == 5  # the prologue's and one a trip
  assert rows["all-gather"]["exposed_s"] == pytest.approx(GATHER_S)
  assert checked["ok"], checked["violations"]


CONDITIONAL = """\
    HloModule m, is_scheduled=true

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    %reduce_it (x: f32[256,256], y: f32[512,256]) -> f32[256,256] {
      %x = f32[256,256]{1,0} parameter(0)
      %y = f32[512,256]{1,0} parameter(1)
      ROOT %ar = f32[256,256]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
    }

    %gather_it (x: f32[256,256], y: f32[512,256]) -> f32[256,256] {
      %x = f32[256,256]{1,0} parameter(0)
      %y = f32[512,256]{1,0} parameter(1)
      %s = f32[64,256]{1,0} slice(%x), slice={[0:64], [0:256]}
      ROOT %ag = f32[256,256]{1,0} all-gather(%s), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
    }

    ENTRY %main (i: s32[], x: f32[256,256], y: f32[512,256]) -> f32[256,256] {
      %i = s32[] parameter(0)
      %x = f32[256,256]{1,0} parameter(1)
      %y = f32[512,256]{1,0} parameter(2)
      ROOT %c = f32[256,256]{1,0} conditional(%i, %x, %y), branch_computations={%gather_it, %reduce_it}
    }
    """


def test_a_conditional_counts_the_branch_the_walk_took_in_both_halves():
  terms, rows, checked, inv = _both(CONDITIONAL)
  assert terms.branches == {"c": ["reduce_it"]}  # its all-reduce (2 x 3/4 of 256 KiB) outlasts the gather's
  assert set(rows) == {"all-reduce"} and rows["all-reduce"]["count"] == rows["all-reduce"]["walk_count"] == 1
  assert checked["ok"], checked["violations"]
  everything = hlo_inventory.inventory(textwrap.dedent(CONDITIONAL), MESH, ONE_NODE)  # without the walk's choice
  assert {r["kind"] for r in everything["collectives"]} == {"all-reduce", "all-gather"}
  assert everything["inventory_notes"] == ["conditional c: every branch counted (an upper bound)"]


QUEUED = """\
    HloModule m, is_scheduled=true

    ENTRY %main (w: f32[64,512], v: f32[64,64], x: f32[256,512], y: f32[512,256]) -> f32[256,512] {
      %w = f32[64,512]{1,0} parameter(0)
      %v = f32[64,64]{1,0} parameter(1)
      %x = f32[256,512]{1,0} parameter(2)
      %y = f32[512,256]{1,0} parameter(3)
      %big = (f32[64,512]{1,0}, f32[256,512]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
      %small = (f32[64,64]{1,0}, f32[64,64]{1,0}) all-to-all-start(%v), channel_id=2, replica_groups=[1,4]<=[4], dimensions={1}
      %small_done = f32[64,64]{1,0} all-to-all-done(%small)
      %big_done = f32[256,512]{1,0} all-gather-done(%big)
      ROOT %r = f32[256,512]{1,0} bitcast(%big_done)
    }
    """


def test_a_wait_behind_a_queued_transfer_is_charged_to_the_transfer_the_link_moves():
  """The small all-to-all queues behind the big all-gather on the node's link; waiting for it waits for both,
  and each row is exposed for its own transfer only (d090e34 charged the whole wait to the all-to-all)."""
  terms, rows, checked, _ = _both(QUEUED)
  a2a_s = 64 * 64 * 4 * 3 / 4 / 1e9
  assert rows["all-to-all"]["seconds"] == pytest.approx(a2a_s)
  assert rows["all-to-all"]["exposed_s"] == pytest.approx(a2a_s)
  assert rows["all-gather"]["exposed_s"] == pytest.approx(GATHER_S)
  assert terms.exposed_s == pytest.approx(GATHER_S + a2a_s) == terms.step_s
  assert checked["ok"], checked["violations"]


def test_the_check_names_each_broken_invariant():
  row = {"kind": "all-gather", "axes": ["fsdp"], "crosses_nodes": True, "link": "ib", "count": 1, "wire_bytes": 1.0,
         "seconds": 2.0, "exposed_s": 3.0, "walk_seconds": 26.0, "walk_count": 13}
  estimate = {"collectives_s": 26.0, "exposed_collectives_s": 3.0, "step_s": 40.0, "serial_step_s": 30.0}
  walk_rows = {("all-gather", ("fsdp",), True): [26.0, 3.0, 13], ("all-to-all", ("expert",), False): [1.0, 0.0, 2]}
  checked = account.check([row], walk_rows, estimate)
  assert not checked["ok"]
  assert checked["violations"] == [
      "all-gather over fsdp (ib): exposed 3 s > its transfers' 2 s",
      "all-gather over fsdp (ib): the walk counts 13 transfers, 26 s; the rows 1, 2 s",
      "all-to-all over expert: walked 2 times, in no row",
      "the rows' transfers 2 s, the walk's 26 s",
      "step 40 s > nothing overlapped 30 s"]
