"""The planner's instruments checked where the rows and the walk would agree on a shared error: loop counts from the
while's real init, the routed experts' FLOPs a step, the bytes of an async all-reduce, the sensitivity line, the rate
of a group across nodes, the two-level dispatch's exchanges, and the exit code of a violated account. Hand-written
HLO at the round rates of tests/test_plan_account.py."""

from __future__ import annotations

import types

import pytest

from MaxText.plan import hardware

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
  assert hardware.routed_expert_flops(one) == 4 * forward_one
  assert hardware.routed_expert_flops(three) == 3 * 4 * forward_one
  head_one = 2 * 20 * 4 * 1000 * 3
  assert hardware.recompute_flops(three)[0] == (600e12 - 3 * head_one) / 3
  kept = types.SimpleNamespace(remat_policy="custom", moe_mlpwi_0="offload", moe_mlpwi_1="device",
                               gradient_accumulation_steps=3, **cfg)
  assert hardware.recompute_flops(kept)[0] == (600e12 - 3 * head_one) / 3 - 3 * forward_one


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
