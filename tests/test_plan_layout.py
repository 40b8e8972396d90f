"""What the plan reports beside the walk's step: the sensitivity line (MaxText/plan/step_report.py) on hand-written
scheduled HLO, at the round rates of tests/test_plan_account.py."""

from __future__ import annotations

import textwrap

import pytest

from MaxText.plan import schedule, step_report
from test_plan_account import GPU

SPREAD = """\
    HloModule m, is_scheduled=true

    ENTRY %main (w: f32[64,512], v: f32[64,64]) -> f32[256,512] {
      %w = f32[64,512]{1,0} parameter(0)
      %v = f32[64,64]{1,0} parameter(1)
      %ags = (f32[64,512]{1,0}, f32[256,512]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
      %agd = f32[256,512]{1,0} all-gather-done(%ags)
      %inside = f32[64,64]{1,0} all-to-all(%v), channel_id=2, replica_groups={{0,1},{2,3}}, dimensions={1}
      %across = f32[64,64]{1,0} all-to-all(%inside), channel_id=3, replica_groups={{0,2},{1,3}}, dimensions={1}
      ROOT %r = f32[256,512]{1,0} bitcast(%agd)
    }
    """


def test_the_sensitivity_line_walks_the_step_again_at_each_changed_constant():
  """InfiniBand x0.5 / x2 moves the gather across nodes and the all-to-all across them; all-to-all across nodes x0.5
  the one across, inside a node x0.5 the one inside."""
  module = schedule.parse(textwrap.dedent(SPREAD))
  nodes = [0, 0, 1, 1]
  terms = schedule.estimate(module, GPU, {"fsdp": 4}, nodes)
  gather = 256 * 512 * 4 * 3 / 4 / 2 / 1e7  # over InfiniBand, at its 2 members' NICs on a node together; exposed
  inside, across = 64 * 64 * 4 / 2 / 1e9, 64 * 64 * 4 / 2 / 1e7  # pairs: half of each on the wire
  assert terms.step_s == pytest.approx(gather + inside + across)
  rows = step_report.sensitivity(module, GPU, {"fsdp": 4}, nodes, terms, model_flops=1e12)
  steps = {r["label"]: r["step_s"] for r in rows}
  assert steps == pytest.approx({
      "as planned": gather + inside + across,
      "IB x0.5": 2 * gather + inside + 2 * across, "IB x2": gather / 2 + inside + across / 2,
      "all-to-all across nodes x0.5": gather + inside + 2 * across,
      "all-to-all inside a node x0.5": gather + 2 * inside + across})
  assert rows[1]["tflops_per_gpu"] == pytest.approx(1.0 / steps["IB x0.5"])
  e = {**step_report.report(terms, 1e12, 0.0), "sensitivity": rows}
  line = [l for l in step_report.lines(e) if "sensitivity" in l][0]
  assert line.startswith("  sensitivity: as planned ") and "IB x0.5" in line and line.endswith("(step, TFLOP/s/GPU)")


# --- the layout's arithmetic of the collectives (MaxText/plan/analytic_comms.py) ---------------------------------

MESH = {"data": 2, "stage": 1, "fsdp": 4, "expert": 8}
LAYOUT = {
    "groups": [{"routed": True, "elements": 10**6, "axes": ["fsdp", "expert"]},
               {"routed": False, "elements": 10**5, "axes": ["fsdp", "expert"]},
               {"routed": False, "elements": 10**3, "axes": ["fsdp"]}],  # a router kernel: fsdp only
    "dtype": "bfloat16", "grad_dtype": "float32", "microbatches": 3, "tokens": 64, "emb_dim": 128, "top_k": 4,
    "num_experts": 32, "moe_layers": 2, "dispatch": "a2a_padded", "capacity_factor": 1.5,
    "hierarchical_capacity_factor": 1.5, "node_limit": 0, "ep_nodes": 1, "recompute": True, "pipeline": None,
}
# By hand, per device a step (wire bytes):
GATHER_FSDP = 2 * 3 * (10**6 * 2 / 8) * 3 / 4 + 2 * 3 * (10**3 * 2) * 3 / 4  # routed (experts stay split) + router
GATHER_FSDP_EXPERT = 2 * 3 * (10**5 * 2) * 31 / 32
SCATTER_FSDP = 3 * (10**6 * 2 / 8) / 4 * 3 + 3 * (10**3 * 2) / 4 * 3
SCATTER_FSDP_EXPERT = 3 * (10**5 * 2) / 32 * 31
DATA_ROUTED, DATA_OTHER = 10**6 * 4 / 32, 10**5 * 4 / 32 + 10**3 * 4 / 4  # f32 shards, 2 x (2 - 1) / 2 of each
PASSES = 6 * 2 * 3  # dispatch, combine, their transposes and the recompute's two; 2 MoE layers; 3 microbatches
A2A_PADDED = PASSES * 8 * 48 * 256 * 7 / 8  # C = ceil(1.5 x 64 x 4 / 8) = 48 rows per peer of 128 bf16
A2A_DROPLESS = PASSES * 64 * 4 * 256 * 7 / 8


def _by_key(rows):
  return {(r["kind"], tuple(r["axes"]), r["crosses_nodes"]): r for r in rows}


def test_the_arithmetic_of_an_hsdp_ep_layout_by_hand():
  from MaxText.plan import analytic_comms

  rows = _by_key(analytic_comms.expected(LAYOUT, MESH))
  assert rows[("all-gather", ("fsdp",), None)]["wire_bytes"] == pytest.approx(GATHER_FSDP)
  assert rows[("all-gather", ("fsdp", "expert"), None)]["wire_bytes"] == pytest.approx(GATHER_FSDP_EXPERT)
  assert rows[("reduce-scatter", ("fsdp",), None)]["wire_bytes"] == pytest.approx(SCATTER_FSDP)
  assert rows[("reduce-scatter", ("fsdp", "expert"), None)]["wire_bytes"] == pytest.approx(SCATTER_FSDP_EXPERT)
  assert rows[("all-reduce", ("data",), None)]["wire_bytes"] == pytest.approx(DATA_ROUTED + DATA_OTHER)
  a2a = rows[("all-to-all", ("expert",), None)]
  assert (a2a["wire_bytes"], a2a["dropless_wire_bytes"]) == (pytest.approx(A2A_PADDED), pytest.approx(A2A_DROPLESS))
  assert len(rows) == 6
  # Weights outside the layer scan (embedding, output head) are gathered once a microbatch: kept for the backward.
  outside = {**LAYOUT, "groups": [{"routed": False, "elements": 10**5, "axes": ["fsdp", "expert"], "scanned": False}]}
  rows = _by_key(analytic_comms.expected(outside, MESH))
  assert rows[("all-gather", ("fsdp", "expert"), None)]["wire_bytes"] == pytest.approx(GATHER_FSDP_EXPERT / 2)
  assert rows[("reduce-scatter", ("fsdp", "expert"), None)]["wire_bytes"] == pytest.approx(SCATTER_FSDP_EXPERT)


def test_a_two_level_dispatch_pads_each_stage_by_its_own_capacity():
  """16-way EP over 2 nodes of 8, top-8 of 64 experts: stage 1 sends a (token, node) row to each of P = min(8, 2) = 2
  nodes, C1 = min(T, ceil(1.5 T P / N)) = T: no padding; stage 2 C2 = ceil(1.5 T K / L) = 96 slots a peer, 1.5x."""
  from MaxText.plan import analytic_comms

  layout = {**LAYOUT, "groups": [], "top_k": 8, "num_experts": 64, "moe_layers": 1, "microbatches": 1,
            "recompute": False, "dispatch": "hierarchical", "ep_nodes": 2}
  rows = _by_key(analytic_comms.expected(layout, {"fsdp": 1, "expert": 16}))
  between, inside = rows[("all-to-all", ("expert",), True)], rows[("all-to-all", ("expert",), False)]
  assert between["wire_bytes"] == pytest.approx(between["dropless_wire_bytes"]) == pytest.approx(4 * 64 * 2 * 256 / 2)
  assert inside["dropless_wire_bytes"] == pytest.approx(4 * 64 * 8 * 256 * 7 / 8)
  assert inside["wire_bytes"] == pytest.approx(4 * 8 * 96 * 256 * 7 / 8)


def test_kept_dispatched_rows_take_the_recomputes_dispatch_out_of_the_arithmetic():
  """Under remat the recompute re-runs the dispatch's exchange unless its rows are kept (moe_x_sorted: device or
  offload): a2a_padded 6 -> 5 passes a layer, hierarchical between nodes 5 -> 4 and inside 6 -> 5."""
  from MaxText.plan import analytic_comms

  def passes(backend, kept):
    layout = {**LAYOUT, "groups": [], "top_k": 8, "num_experts": 64, "moe_layers": 1, "microbatches": 1,
              "recompute": True, "dispatch_kept": kept, "dispatch": backend, "ep_nodes": 2}
    rows = _by_key(analytic_comms.expected(layout, {"fsdp": 1, "expert": 16}))
    return {key[2]: row["wire_bytes"] for key, row in rows.items() if key[0] == "all-to-all"}

  flat, flat_kept = passes("a2a_padded", False), passes("a2a_padded", True)
  assert list(flat_kept.values()) == pytest.approx([w * 5 / 6 for w in flat.values()])
  two, two_kept = passes("hierarchical", False), passes("hierarchical", True)
  assert two_kept[True] == pytest.approx(two[True] * 4 / 5) and two_kept[False] == pytest.approx(two[False] * 5 / 6)


def test_each_row_off_by_more_than_1_5x_carries_its_cause():
  from MaxText.plan import analytic_comms

  def compiled(kind, axes, wire, crosses=True, count=1):
    return {"kind": kind, "axes": list(axes), "crosses_nodes": crosses, "wire_bytes": wire, "count": count}

  collectives = [
      compiled("all-gather", ["fsdp"], 1.6 * GATHER_FSDP),  # some gathered a third time for the recompute
      compiled("all-gather", ["fsdp", "expert"], GATHER_FSDP_EXPERT),
      compiled("reduce-scatter", ["fsdp"], 1000.0),  # the routed experts' gradient is all-reduced instead:
      compiled("all-reduce", ["data", "fsdp"], 4 * SCATTER_FSDP, count=6),
      compiled("reduce-scatter", ["fsdp", "expert"], SCATTER_FSDP_EXPERT),
      compiled("all-reduce", ["data"], 3 * DATA_OTHER),  # the rest reduced every microbatch
      compiled("all-to-all", ["expert"], 2 * A2A_DROPLESS, crosses=False),  # the padded buffer at capacity 2
      compiled("all-to-all", ["data", "fsdp"], 100.0),  # small, named by nothing: not listed
      compiled("collective-permute", ["fsdp"], 2e6),
  ]
  layout = {**LAYOUT, "capacity_factor": 2.0}
  table = analytic_comms.compare(analytic_comms.expected(layout, MESH), collectives, layout)
  causes = {(r["kind"], tuple(r["axes"])): r["cause"] for r in table}
  assert causes[("all-gather", ("fsdp",))].startswith("remat recompute")
  assert causes[("all-gather", ("fsdp", "expert"))] is None and causes[("reduce-scatter", ("fsdp", "expert"))] is None
  assert causes[("reduce-scatter", ("fsdp",))] == "reduced whole: this gradient is all-reduced over data,fsdp instead"
  assert causes[("all-reduce", ("data", "fsdp"))].startswith(
      "reduced whole: an all-reduce over data,fsdp in place of the reduce-scatter over fsdp and the data all-reduce")
  assert causes[("all-reduce", ("data",))].startswith("microbatches: reduced in each of the 3 microbatches")
  assert causes[("all-to-all", ("expert",))] == "padding: the capacity-padded buffer, 2x the dropless minimum"
  assert causes[("collective-permute", ("fsdp",))] == "unexplained"
  # An all-reduce over fsdp beside a reduce-scatter the program does run is no gradient reduced whole.
  scattered = [dict(c, wire_bytes=SCATTER_FSDP) if c["kind"] == "reduce-scatter" and c["axes"] == ["fsdp"] else c
               for c in collectives]
  table = analytic_comms.compare(analytic_comms.expected(layout, MESH), scattered, layout)
  assert {(r["kind"], tuple(r["axes"])): r["cause"] for r in table}[("all-reduce", ("data", "fsdp"))] == "unexplained"
  assert ("all-to-all", ("data", "fsdp")) not in causes
  assert analytic_comms.padding_lines(table, layout) == [
      "dispatch (a2a_padded): the compiler moves 3.938 MiB, the capacity-padded buffer 3.938 MiB, the dropless minimum "
      "1.969 MiB (2x the minimum)"]


def test_the_layout_is_read_from_the_abstract_state_not_the_program():
  """Routed experts: a leading dimension of num_experts split over `expert`; RNG keys are no parameters."""
  import types

  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  from maxtext.common.common_types import DecoderBlockType

  from MaxText.plan import analytic_comms

  leaf = lambda shape, spec, dtype=jnp.float32: types.SimpleNamespace(  # noqa: E731
      shape=shape, ndim=len(shape), dtype=dtype, sharding=types.SimpleNamespace(spec=spec))
  state = {"model": {"decoder": {"moe_layers": {"wi_0": leaf((32, 2, 128, 64), P("expert", None, "fsdp", None)),
                                                "gate": leaf((128, 2, 32), P("fsdp", None, None)),
                                                "wq": leaf((128, 2, 256), P(("fsdp", "expert"), None, None))},
                                 "norm": leaf((128,), P(None))},
                     "token_embedder": leaf((1000, 128), P(None, ("fsdp", "expert"))), "rng": leaf((3,), P(), jnp.uint32)}}
  config = types.SimpleNamespace(
      num_experts=32, dtype=jnp.bfloat16, grad_dtype=jnp.float32, gradient_accumulation_steps=3,
      per_device_batch_size=2, max_target_length=32, emb_dim=128, num_experts_per_tok=4, mtp_num_layers=1,
      decoder_block=DecoderBlockType.DEEPSEEK, num_decoder_layers=3, first_num_dense_layers=1, topk_routing_group=2,
      dcn_expert_parallelism=1, remat_policy="full", ici_pipeline_parallelism=1, dcn_pipeline_parallelism=1,
      scan_layers=True)
  fork = types.SimpleNamespace(moe_block="ours", moe_dispatch_backend="auto", moe_a2a_padded_capacity_factor=1.5,
                               moe_hierarchical_capacity_factor=2.0, moe_node_limited_routing=False)
  layout = analytic_comms.layout_of(config, fork, state, MESH, "gpu")
  assert sorted((g["routed"], tuple(g["axes"]), g["scanned"], g["elements"]) for g in layout["groups"]) == [
      (False, (), False, 128), (False, ("fsdp",), True, 128 * 2 * 32), (False, ("fsdp", "expert"), False, 1000 * 128),
      (False, ("fsdp", "expert"), True, 128 * 2 * 256), (True, ("fsdp", "expert"), True, 32 * 2 * 128 * 64)]
  assert (layout["dtype"], layout["grad_dtype"], layout["microbatches"], layout["tokens"]) == ("bfloat16", "float32", 3, 64)
  assert (layout["dispatch"], layout["moe_layers"], layout["node_limit"], layout["recompute"]) == ("a2a_padded", 3, 0, True)


def test_a_data_all_reduce_in_every_microbatch_in_the_compute_dtype_is_named_not_unexplained():
  """The 1,024 x H100 recipe's fp32 gradients are all-reduced over data in each of its 15 microbatches in bf16:
  7.4x the arithmetic's once-a-step fp32 reduction, which neither 'microbatches' (15x) nor 'dtype' (2x) reached."""
  from MaxText.plan import analytic_comms

  layout = {**LAYOUT, "microbatches": 15, "dtype": "bfloat16", "grad_dtype": "float32"}
  rows = analytic_comms.expected(layout, MESH)
  data = next(r for r in rows if r["kind"] == "all-reduce" and r["axes"] == ["data"] if r["wire_bytes"])
  compiled = [{"kind": "all-reduce", "axes": ["data"], "crosses_nodes": True, "wire_bytes": 7.5 * data["wire_bytes"],
               "count": 886}]
  (row,) = [r for r in analytic_comms.compare(rows, compiled, layout) if r["kind"] == "all-reduce" and r["axes"] == ["data"]]
  assert row["cause"].startswith("microbatches: reduced in each of the 15 microbatches in bfloat16, the arithmetic once")
  assert "886 all-reduces" in row["cause"]


def test_an_embedding_kept_on_its_vocab_shards_is_named_not_unexplained():
  """Kimi-K2's proxy on 8 GPUs, EP 8 (the plan of 4af13c5): its gradient reduce-scatter over expert moved 3,275 MiB
  where the arithmetic, which reduce-scatters every weight whole, says 5,235: the difference is one [vocab, emb]
  table, the embedding's, whose lookup and scatter-add stay on its vocab shard."""
  from MaxText.plan import analytic_comms

  groups = [{"routed": False, "elements": 787808256, "axes": ["expert"], "scanned": True},
            {"routed": False, "elements": 2348810240, "axes": ["expert"], "scanned": False},
            {"routed": True, "elements": 33822867456, "axes": ["expert"], "scanned": True}]
  layout = {**LAYOUT, "groups": groups, "microbatches": 1}
  row = {"kind": "reduce-scatter", "axes": ["expert"], "wire_bytes": 5234.8 * 2**20,
         "compiled_wire_bytes": 3274.8 * 2**20, "compiled_count": 9, "ratio": 3274.8 / 5234.8}
  cause = analytic_comms._cause(row, [row], layout, [])  # pylint: disable=protected-access
  assert cause.startswith("the embedding stays on its vocab shards") and "1.914 GiB" in cause
  assert analytic_comms._cause(dict(row, compiled_wire_bytes=1000.0 * 2**20, ratio=0.19), [row], layout, []) == "unexplained"  # pylint: disable=protected-access
