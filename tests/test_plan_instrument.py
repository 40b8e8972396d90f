"""The planner's instruments checked where the rows and the walk would agree on a shared error: loop counts from the
while's real init, the routed experts' FLOPs a step, the bytes of an async all-reduce, the sensitivity line, the rate
of a group across nodes, the two-level dispatch's exchanges, and the exit code of a violated account. Hand-written
HLO at the round rates of tests/test_plan_account.py."""

from __future__ import annotations

import textwrap
import types

import pytest

from MaxText import hardware
from MaxText.plan import flops

# --- the routed experts' FLOPs: every microbatch of the step -----------------------------------------------------


def test_routed_expert_flops_count_every_microbatch(monkeypatch):
  """per_device_batch_size is one microbatch's: a step of 3 microbatches runs the routed GEMMs 3 times, and MaxText's
  count (which multiplies by them) holds the output head 3 times, so the recompute leaves out 3 heads."""
  from maxtext.utils import maxtext_utils

  monkeypatch.setattr(maxtext_utils, "calculate_tflops_training_per_device", lambda c, log=False: (600.0, 0, 0))
  cfg = dict(per_device_batch_size=2, max_target_length=10, emb_dim=4, vocab_size=1000, num_experts=8,
             num_experts_per_tok=2, moe_mlp_dim=5, num_decoder_layers=3, first_num_dense_layers=1)
  forward_one = 2 * 20 * 2 * 3 * 4 * 5 * 2  # tokens x top-k x 3 GEMMs x D x F x 2 MoE layers, one microbatch
  one = types.SimpleNamespace(remat_policy="full", gradient_accumulation_steps=1, **cfg)
  three = types.SimpleNamespace(remat_policy="full", gradient_accumulation_steps=3, **cfg)
  assert flops.routed_expert_flops(one) == 4 * forward_one
  assert flops.routed_expert_flops(three) == 3 * 4 * forward_one
  head_one = 2 * 20 * 4 * 1000 * 3
  assert flops.recompute_flops(three)[0] == (600e12 - 3 * head_one) / 3
  kept = types.SimpleNamespace(remat_policy="custom", moe_mlpwi_0="offload", moe_mlpwi_1="device",
                               gradient_accumulation_steps=3, **cfg)
  assert flops.recompute_flops(kept)[0] == (600e12 - 3 * head_one) / 3 - 3 * forward_one


# --- an async all-reduce's bytes: its transfer once ------------------------------------------------------------

ALL_REDUCES = """\
    HloModule m, is_scheduled=true

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    ENTRY %main (x: f32[256,256], y: f32[64,64], z: f32[128]) -> f32[256,256] {
      %x = f32[256,256]{1,0} parameter(0)
      %y = f32[64,64]{1,0} parameter(1)
      %z = f32[128]{0} parameter(2)
      %one = (f32[256,256]{1,0}, f32[256,256]{1,0}, u32[], u32[]) all-reduce-start(%x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
      %one_done = f32[256,256]{1,0} all-reduce-done(%one)
      %two = (f32[64,64]{1,0}, f32[128]{0}) all-reduce-start(%y, %z), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
      %two_done = (f32[64,64]{1,0}, f32[128]{0}) all-reduce-done(%two)
      ROOT %r = f32[256,256]{1,0} bitcast(%one_done)
    }
    """


def test_an_async_all_reduce_counts_its_transfer_once():
  """all-reduce-start printed with its operand and its result (and sync flags) moves the result once; printed with
  its results alone (two arrays reduced together), both arrays are the transfer."""
  from test_plan_account import MESH, _both

  terms, rows, checked, _ = _both(ALL_REDUCES)
  assert MESH == {"fsdp": 4}  # both groups vary along fsdp: one row
  row = rows["all-reduce"]
  assert row["count"] == 2 and row["bytes"] == 256 * 256 * 4 + 64 * 64 * 4 + 128 * 4
  wire = 2 * 256 * 256 * 4 * 3 / 4 + 2 * (64 * 64 * 4 + 128 * 4) / 2  # 2 R (n - 1) / n, n = 4 and 2
  assert row["wire_bytes"] == pytest.approx(wire)
  assert terms.collectives_s == pytest.approx(wire / 1e9)
  assert checked["ok"], checked["violations"]


SCALAR_ALL_REDUCE = """\
    HloModule m, is_scheduled=true

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    ENTRY %main (v: f32[32], s: f32[]) -> f32[32] {
      %v = f32[32]{0} parameter(0)
      %s = f32[] parameter(1)
      %three = (f32[32]{0}, f32[], f32[32]{0}, f32[], u32[], u32[]) all-reduce-start(%v, %s), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
      %three_done = (f32[32]{0}, f32[]) all-reduce-done(%three)
      ROOT %r = f32[32]{0} get-tuple-element(%three_done), index=0
    }
    """


def test_an_async_all_reduce_with_a_scalar_operand_counts_its_transfer_once():
  """Operands then results, one of them a scalar (a loss, a norm): the results are the transfer, 32 floats and one
  (before: the scalars left out of the comparison, the pair read as results alone and counted twice)."""
  from test_plan_account import _both

  _, rows, checked, _ = _both(SCALAR_ALL_REDUCE)
  assert rows["all-reduce"]["count"] == 1 and rows["all-reduce"]["bytes"] == 32 * 4 + 4
  assert checked["ok"], checked["violations"]


# --- the sensitivity line: each variant scales the link it names, one way ------------------------------------------

LINKS = [(kind, across) for kind in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
                                      "collective-permute") for across in (False, True)]


@pytest.mark.parametrize("gpu_key", ["h100", "h200", "b200"])
def test_each_sensitivity_variant_scales_the_link_it_names_one_way(gpu_key):
  """Per variant, every collective's rate against the plan's: the variant's factor on the collectives it names, 1 on
  every other (an all-to-all variant never speeds one link while it slows the other)."""
  from MaxText.plan import step_report

  gpu = hardware.GPUS[gpu_key]
  a2a = ("all-to-all", "ragged-all-to-all")
  named = {"IB x0.5": (0.5, lambda kind, across: across), "IB x2": (2.0, lambda kind, across: across),
           "all-to-all across nodes x0.5": (0.5, lambda kind, across: across and kind in a2a),
           "all-to-all inside a node x0.5": (0.5, lambda kind, across: not across and kind in a2a)}
  assert [label for label, _ in step_report.VARIANTS] == list(named)
  for label, change in step_report.VARIANTS:
    factor, names = named[label]
    changed = change(gpu)
    for kind, across in LINKS:
      ratio = hardware.link_bytes(changed, kind, across).value / hardware.link_bytes(gpu, kind, across).value
      assert ratio == pytest.approx(factor if names(kind, across) else 1.0), (label, kind, across)


# --- the microbatch loop: trips from the while's real init, checked against the config ------------------------

# A step of 10 microbatches as XLA leaves it: the first and the last peeled into ENTRY (each a layer scan of 4
# trips gathering a weight), the loop over the other 8 entering at copy(constant 1) with i < 9 and no init from XLA.
PEELED = """\
    HloModule m, is_scheduled=true

    %scan_body (p: (s32[], f32[64,512])) -> (s32[], f32[64,512]) {
      %p = (s32[], f32[64,512]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %w = f32[64,512]{1,0} get-tuple-element(%p), index=1
      %ags = (f32[64,512]{1,0}, f32[256,512]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
      %agd = f32[256,512]{1,0} all-gather-done(%ags)
      ROOT %t = (s32[], f32[64,512]{1,0}) tuple(%i, %w)
    }

    %scan_cond (p: (s32[], f32[64,512])) -> pred[] {
      %p = (s32[], f32[64,512]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %n = s32[] constant(4)
      ROOT %c = pred[] compare(%i, %n), direction=LT
    }

    %mb_body (q: (s32[], f32[64,512])) -> (s32[], f32[64,512]) {
      %q = (s32[], f32[64,512]{1,0}) parameter(0)
      %scan = (s32[], f32[64,512]{1,0}) while(%q), condition=%scan_cond, body=%scan_body, backend_config={"known_trip_count":{"n":"4"}}
      ROOT %r = (s32[], f32[64,512]{1,0}) copy(%scan)
    }

    %mb_cond (q: (s32[], f32[64,512])) -> pred[] {
      %q = (s32[], f32[64,512]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%q), index=0
      %n = s32[] constant(9)
      ROOT %c = pred[] compare(%i, %n), direction=LT
    }

    ENTRY %main (w: f32[64,512]) -> f32[64,512] {
      %w = f32[64,512]{1,0} parameter(0)
      %zero = s32[] constant(0)
      %t0 = (s32[], f32[64,512]{1,0}) tuple(%zero, %w)
      %first = (s32[], f32[64,512]{1,0}) while(%t0), condition=%scan_cond, body=%scan_body, backend_config={"known_trip_count":{"n":"4"}}
      %one = s32[] constant(1)
      %i1 = s32[] copy(%one)
      %w1 = f32[64,512]{1,0} get-tuple-element(%first), index=1
      %t1 = (s32[], f32[64,512]{1,0}) tuple(%i1, %w1)
      %mb = (s32[], f32[64,512]{1,0}) while(%t1), condition=%mb_cond, body=%mb_body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
      %last = (s32[], f32[64,512]{1,0}) while(%mb), condition=%scan_cond, body=%scan_body, backend_config={"known_trip_count":{"n":"4"}}
      ROOT %out = f32[64,512]{1,0} get-tuple-element(%last), index=1
    }
    """


def test_the_microbatch_loop_counts_from_its_init_and_adds_up_to_the_config():
  """8 trips (1..8, the init followed through its copy), not 9 (init 0 assumed): 10 microbatches walked with the two
  peeled, the rows and the walk alike; the account holds for gradient_accumulation_steps 10 and names the loop for 11."""
  from test_plan_account import _both

  from MaxText.plan import account, hlo_inventory, step_report

  text = textwrap.dedent(PEELED)
  terms, rows, checked, inv = _both(text)
  assert rows["all-gather"]["count"] == rows["all-gather"]["walk_count"] == 4 * (8 + 2)
  assert any("while loop mb:" in n and "init 1 from the while's init" in n and "counted 8 times" in n
             for n in inv["inventory_notes"])
  comps, entry = hlo_inventory.parse_module(text)
  loops = account.microbatches(comps, entry, 10)
  assert loops == {"expected": 10, "loop": "mb", "trips": 8, "per_trip": 1, "peeled": 2, "walked": 10}
  estimate = step_report.report(terms, 1.0, 0.0)
  ok = account.check(list(rows.values()), terms.rows, estimate, loops)
  assert ok["ok"] and any("10 microbatches walked" in line for line in ok["lines"])
  wrong = account.check(list(rows.values()), terms.rows, estimate, account.microbatches(comps, entry, 11))
  assert not wrong["ok"] and wrong["violations"] == [
      "microbatch loop mb: 8 trips + 2 peeled = 10 microbatches walked, gradient_accumulation_steps 11"]
  assert account.microbatches(comps, entry, 1) is None  # one microbatch: nothing to check


def test_a_double_buffered_microbatch_loop_counts_two_microbatches_a_trip():
  """XLA's double buffering unrolls the gradient-accumulation loop's body twice (two layer scans a trip, its
  induction variable stepping by 2): 4 trips of 2 and the 2 peeled are the config's 10 (before: 4 + 1 = 5 walked,
  a violation of a correct program)."""
  from MaxText.plan import account, hlo_inventory

  text = textwrap.dedent(PEELED).replace(
      "  ROOT %r = (s32[], f32[64,512]{1,0}) copy(%scan)\n",
      '  %scan2 = (s32[], f32[64,512]{1,0}) while(%scan), condition=%scan_cond, body=%scan_body, '
      'backend_config={"known_trip_count":{"n":"4"}}\n  ROOT %r = (s32[], f32[64,512]{1,0}) copy(%scan2)\n')
  text = text.replace('body=%mb_body, backend_config={"known_induction_variable":{"tuple_index":"0"}}',
                      'body=%mb_body, backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"1","step":"2"}}')
  assert text.count("while(") == 5
  comps, entry = hlo_inventory.parse_module(text)
  loops = account.microbatches(comps, entry, 10)
  assert loops == {"expected": 10, "loop": "mb", "trips": 4, "per_trip": 2, "peeled": 2, "walked": 10}
  lines, violations = account._loop_lines(loops, None)  # pylint: disable=protected-access
  assert violations == [] and lines == ["microbatch loop mb: 4 trips x 2 (double-buffered) + 2 peeled = 10 "
                                        "microbatches walked, gradient_accumulation_steps 10"]


def test_a_pipeline_loop_without_a_trip_count_is_not_checked_rather_than_violated():
  """One compiled pipeline loop with XLA's trip count, which agrees with the schedule, and one without: nothing holds
  the second to the schedule, so the account says "not checked" (before: a violation, exit 9)."""
  from MaxText.plan import account, bubble

  sched = {"iterations": 11}
  both = bubble.cross_check(sched, [{"trip_count": 11, "step": 1}, {"trip_count": None, "step": 1}])
  assert both["agrees"] and both["unchecked"] and bubble.verdict(both) == "not checked"
  lines, violations = account._loop_lines(None, both)  # pylint: disable=protected-access
  assert violations == [] and lines == ["pipeline not checked: a compiled pipeline loop has no known trip count "
                                        "(XLA's backend_config): cannot check the schedule's 11"]
  wrong = bubble.cross_check(sched, [{"trip_count": 10, "step": 1}, {"trip_count": None, "step": 1}])
  assert bubble.verdict(wrong) == "DISAGREE"  # a known count that misses is a violation whatever the rest
  assert account._loop_lines(None, wrong)[1] == [  # pylint: disable=protected-access
      "pipeline: compiled pipeline loops cover [10] iterations, the schedule 11"]


def test_a_pipeline_whose_compiled_loops_disagree_with_its_schedule_violates_the_account():
  from test_plan_account import _both

  from MaxText.plan import account, step_report

  terms, rows, _, _ = _both(textwrap.dedent(PEELED))
  estimate = step_report.report(terms, 1.0, 0.0)
  pipeline = {"compiled_trip_counts": [10], "agrees": False, "note": "compiled pipeline loops cover [10] iterations, the schedule 11"}
  checked = account.check(list(rows.values()), terms.rows, estimate, None, pipeline)
  assert checked["violations"] == ["pipeline: compiled pipeline loops cover [10] iterations, the schedule 11"]
  unknown = {**pipeline, "compiled_trip_counts": []}  # no trip count to check: the bubble's note says so
  assert account.check(list(rows.values()), terms.rows, estimate, None, unknown)["ok"]


# --- the exit code of a violated account ---------------------------------------------------------------------

@pytest.mark.parametrize("violations, code", [([], 0), (["microbatch loop mb: 8 trips + 2 peeled = 10 microbatches "
                                                         "walked, gradient_accumulation_steps 11"], 9)])
def test_a_violated_account_exits_9_after_the_report_and_json(violations, code, tmp_path, monkeypatch, capsys):
  from MaxText.plan import __main__ as plan_cli
  from MaxText.plan import planner

  report = {"account": {"ok": not violations, "lines": [], "violations": violations}}
  monkeypatch.setattr(planner, "plan", lambda *a, **k: report)
  monkeypatch.setattr(planner, "print_report", lambda r: print("the report"))
  out = tmp_path / "plan.json"
  assert plan_cli.main(["configs/deepseek3-tiny.yml", "--json", str(out)]) == code == (9 if violations else 0)
  assert plan_cli.EXIT_CODES[9].startswith("planned, but the one account is violated")
  captured = capsys.readouterr()
  assert "the report" in captured.out and out.exists()  # printed and written whole either way
  assert captured.err == (f"maxtext-moe: plan invariant violated (1): {violations[0]}\n" if violations else "")


# --- the two-level dispatch's exchanges between nodes under remat ------------------------------------------------

def test_a_two_level_dispatch_under_remat_exchanges_5_times_between_nodes_and_6_inside():
  """Remat re-runs the dispatch's exchanges; the combine's between nodes feeds `collect`, whose backward keeps only
  its maps, so the recompute drops it (5), while inside a node `weighted_collect` keeps its rows (6). 16-way EP over
  2 nodes, top-8 of 64 experts, T = 64, D = 128 bf16: C1 = T, C2 = ceil(1.5 T K / 8) = 96."""
  from MaxText.plan import analytic_comms
  from test_plan_layout import LAYOUT, _by_key

  layout = {**LAYOUT, "groups": [], "top_k": 8, "num_experts": 64, "moe_layers": 3, "microbatches": 2,
            "recompute": True, "dispatch": "hierarchical", "ep_nodes": 2}
  rows = _by_key(analytic_comms.expected(layout, {"fsdp": 1, "expert": 16}))
  between, inside = rows[("all-to-all", ("expert",), True)], rows[("all-to-all", ("expert",), False)]
  assert between["wire_bytes"] == pytest.approx(5 * 3 * 2 * 2 * 64 * 256 / 2)
  assert inside["wire_bytes"] == pytest.approx(6 * 3 * 2 * 8 * 96 * 256 * 7 / 8)
  assert "5 passes" in between["what"][0] and "6 passes" in inside["what"][0]


# --- a group across nodes: a ring at its members' NICs on a node together --------------------------------------

ACROSS = """\
    HloModule m, is_scheduled=true

    ENTRY %main (w: f32[64,512], v: f32[64,64]) -> f32[64,512] {
      %w = f32[64,512]{1,0} parameter(0)
      %v = f32[64,64]{1,0} parameter(1)
      %eight = f32[1024,512]{1,0} all-gather(%w), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}, dimensions={0}
      %one = f32[128,512]{1,0} all-gather(%w), channel_id=2, replica_groups={{0,8},{1,9},{2,10},{3,11},{4,12},{5,13},{6,14},{7,15}}, dimensions={0}
      %a2a = f32[64,64]{1,0} all-to-all(%v), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}, dimensions={1}
      ROOT %r = f32[64,512]{1,0} bitcast(%w)
    }
    """


def test_a_ring_across_nodes_runs_at_its_members_nics_on_a_node():
  """16 GPUs on 2 nodes of 8 (one NIC each, 10 MB/s here): the gather over all 16 (8 members a node) moves a member's
  wire bytes over the node's 8 NICs together, at 8x one NIC's rate; the gather over pairs across nodes (1 a node) and
  the all-to-all (each member's own bytes over its own NIC) at one NIC's. The rows and the walk alike."""
  from test_plan_account import GPU

  from MaxText.plan import account, hlo_inventory, schedule, step_report

  text, mesh, nodes = textwrap.dedent(ACROSS), {"data": 2, "fsdp": 8}, [i // 8 for i in range(16)]
  terms = schedule.estimate(text, GPU, mesh, nodes)
  inv = hlo_inventory.inventory(text, mesh, nodes, branches=terms.branches)
  rows = {(r["kind"], tuple(r["axes"])): r for r in account.rows(inv["collectives"], terms.rows, GPU)}
  eight, one = rows[("all-gather", ("data", "fsdp"))], rows[("all-gather", ("data",))]
  a2a = rows[("all-to-all", ("data", "fsdp"))]
  assert eight["crosses_nodes"] and one["crosses_nodes"] and a2a["crosses_nodes"]
  assert eight["wire_bytes"] == pytest.approx(1024 * 512 * 4 * 15 / 16)
  assert eight["seconds"] == pytest.approx(1024 * 512 * 4 * 15 / 16 / 8 / 1e7)
  assert one["seconds"] == pytest.approx(128 * 512 * 4 / 2 / 1e7)
  assert a2a["seconds"] == pytest.approx(64 * 64 * 4 * 15 / 16 / 1e7)
  assert terms.collectives_s == pytest.approx(eight["seconds"] + one["seconds"] + a2a["seconds"])
  checked = account.check(list(rows.values()), terms.rows, step_report.report(terms, 1.0, 0.0))
  assert checked["ok"], checked["violations"]
