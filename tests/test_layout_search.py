"""`python -m MaxText.plan <recipe> --search-layouts` (MaxText/plan/layout_search.py, layout_cost.py): the layouts it
enumerates for 1,024 GPUs at the 671B model's shapes are legal meshes, its arithmetic matches a hand-computed
one-layer case, the real loader's refusals are dropped with their reasons, and its best layout for the 1,024 x
H100 recipe is not the shipped FSDP-64 one."""

from __future__ import annotations

import collections
import dataclasses
import json
import math

import pytest

from conftest import REPO
from MaxText.config import parallelism
from MaxText import hardware
from MaxText.plan import layout_cost, layout_search
from MaxText.plan.layout_cost import Layout, Shape

RECIPE = "configs/recipes/deepseek3-671b-1024xh100.yml"


@pytest.fixture(scope="module")
def recipe():
  """The recipe through the real loader (its model's shapes, FLOPs and compiled plan), and its layouts ranked."""
  run, shape = layout_search.shape_of([RECIPE])
  own = layout_search.run_layout(run)
  layouts, refused = layout_search.enumerate_layouts(shape, own, fp8="blockwise")
  return run, shape, own, layouts, refused


def test_every_enumerated_layout_is_a_legal_mesh_for_1024_gpus_at_671b(recipe):
  run, shape, own, layouts, refused = recipe
  assert shape.gpus == 1024 and shape.gpus_per_node == 8 and shape.c["num_experts"] == 256
  assert own in layouts  # the shipped layout competes
  for l in layouts:
    keys = layout_search.overrides(shape, l)
    # the launcher's own check: the mesh multiplies to the GPUs (ICI a node, DCN the 128 nodes) and EP splits experts
    parallelism.check_topology({**run.upstream, **keys}, 1024, 1024, 128)
    ep = keys["ici_expert_parallelism"] * keys["dcn_expert_parallelism"]
    assert 8 <= ep <= 64 and 256 % ep == 0
    assert shape.c["kv_lora_rank"] % (l.fsdp * ep) == 0 and l.fsdp * ep <= 512
    assert not (l.zero1 and l.fsdp > 1) and not (l.zero1 and l.data == 1)
    assert l.batch * l.accum == 15  # the recipe's global batch, 15 sequences a GPU a step
    if l.stages > 1:
      assert l.stages * l.repeats <= 58 and l.pipeline_micro % l.stages == 0
      assert (l.batch * l.stages) % l.pipeline_micro == 0  # whole sequences a pipeline microbatch
      assert "attention" not in keys  # the recipe's cuDNN attention, in the stages too (patches/cudnn_mla_vmap.py)
    if l.node_limited:
      assert l.ep_nodes == shape.c["n_routing_groups"] == 8
  # Megatron's class is in it: PP8 over nodes x EP64 across 8 nodes, two-level dispatch, node-limited routing
  assert any(l.stages == 8 and l.ep_nodes == 8 and l.node_limited for l in layouts)
  # and the rules refused what they should: EP x FSDP past kv_lora_rank, ZeRO-1 with FSDP, node limits off the nodes
  assert {k.split(" (")[0] for k in refused} >= {"fsdp x expert does not divide kv_lora_rank",
                                                  "ZeRO-1 with FSDP", "node-limited routing needs n_routing_groups = dcn_expert_parallelism"}


def _tiny_shape(**changes) -> Shape:
  """One MoE layer, no MTP, two GPUs a node: round numbers the arithmetic can be done by hand against."""
  c = {"base_emb_dim": 128, "base_num_query_heads": 2, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
       "q_lora_rank": 16, "kv_lora_rank": 16, "v_head_dim": 8, "base_num_decoder_layers": 1,
       "first_num_dense_layers": 0, "base_moe_mlp_dim": 64, "base_mlp_dim": 256, "num_experts": 4,
       "num_experts_per_tok": 2, "shared_experts": 0, "vocab_size": 64, "mtp_num_layers": 0, "max_target_length": 32,
       "num_vocab_tiling": 1, "n_routing_groups": -1, "weight_dtype": "float32", "grad_dtype": "float32",
       "mu_dtype": "bfloat16", "dtype": "bfloat16"}
  base = Shape(c=c, gpus=4, gpus_per_node=2, gpu=hardware.GPUS["h100"], usable_bytes=1e12, model_flops=6.48e12,
               attention_flops=0.0, recompute_flops={"run": 0.0}, routed_flops={"run": 0.0}, offloaded={"run": False},
               memory_bound_s=0.0, memory_bound_from="", memory_factor=1.0, capacity_factor=1.5,
               hierarchical_capacity_factor=2.0, node_limit=0)
  return dataclasses.replace(base, **changes)


def test_the_closed_forms_on_one_layer_by_hand():
  """EP 2 inside each of 2 nodes, FSDP 2 across them, batch 1 of 32 tokens, 2 microbatches."""
  s, l = _tiny_shape(), Layout(fsdp=2, batch=1, accum=2)
  routed = 4 * 3 * 128 * 64  # E x (wi_0, wi_1, wo) x D x F
  links = layout_cost.links(s, l)
  # The routed experts: a GPU's 2 experts gathered over fsdp (2, one a node: one NIC, 50 GB/s), twice a microbatch,
  # and their gradient reduce-scattered once: 3 transfers x 2 microbatches of half the gathered bf16 bytes.
  routed_wire = 3 * 2 * (routed / 2) * 2 * (1 / 2)
  # The rest of the layer (MLA, norms, the router) over fsdp x expert: 4 GPUs, 2 a node, at their 2 NICs.
  other = layout_cost._per_layer(s)["moe_other"]
  other_wire = 3 * 2 * other * 2 * 3 / 4
  embedding = 2 * 64 * 128 + 128  # embedding, head, final norm: gathered once and reduce-scattered once
  emb_wire = 2 * 2 * embedding * 2 * 3 / 4
  assert links["IB"].wire_bytes == pytest.approx(routed_wire + other_wire + emb_wire)
  assert links["IB"].seconds == pytest.approx(routed_wire / 50e9 + (other_wire + emb_wire) / 100e9)
  # a2a_padded inside the node: C = ceil(1.5 x 32 tokens x 2 / 2 peers) = 48 rows a peer, 2 peers, 6 passes
  # (dispatch, combine, their transposes, the recompute's two) x 2 microbatches, half of it leaves the GPU, at the
  # measured 150 GB/s of an all-to-all inside a node
  a2a = 6 * 2 * (2 * 48) * 128 * 2 / 2
  assert links["NVLink a2a"].wire_bytes == pytest.approx(a2a)
  assert links["NVLink a2a"].seconds == pytest.approx(a2a / 150e9)
  # One data-parallel replica more: the fp32 gradient, a GPU's quarter of every weight, all-reduced once a step
  total = routed + other + embedding
  with_data = layout_cost.links(_tiny_shape(gpus=8), dataclasses.replace(l, data=2))
  assert with_data["IB"].wire_bytes - links["IB"].wire_bytes == pytest.approx(2 * 4 * total / 4 * 1 / 2)
  # The step: the compute (6.48 TFLOP at the 648 TF/s GEMM rate: 10 ms) and every link, nothing overlapped
  e = layout_cost.estimate(s, l)
  assert e.compute_s == pytest.approx(0.01)
  assert e.step_s == pytest.approx(0.01 + sum(x.seconds for x in links.values()))
  assert e.tflops_per_gpu == pytest.approx(6.48 / e.step_s)
  # Memory: a quarter of every weight a GPU in fp32 weights and gradient, bf16 mu, fp32 nu; the layer's input (32
  # tokens of 128, bf16); the MoE working set, the largest (2 B x 32 tokens x top-2 x (3 x 128 + 5 x 64)); two
  # layers' gathered weights in bf16 (the GPU's 2 experts and the rest of the layer)
  states = total / 4 * (4 + 4 + 2 + 4)
  expected = states + 32 * 128 * 2 + 2 * 32 * 2 * (3 * 128 + 5 * 64) + 2 * (routed / 2 + other) * 2
  assert layout_cost.memory(s, l)[0] == pytest.approx(expected)


def test_the_pipeline_bubble_and_its_stage_permutes_by_hand():
  """2 MoE layers in 2 stages over the 2 nodes (one layer a stage, 1 repeat), 2 microbatches of a GPU's 2 sequences:
  R M + S - 1 = 3 iterations, a third of them bubble."""
  s = _tiny_shape(c={**_tiny_shape().c, "base_num_decoder_layers": 2}, attention_flops=1e12)
  l = Layout(stages=2, repeats=1, pipeline_micro=2, batch=2, accum=1)
  assert layout_cost.iterations(l) == 3 and layout_cost.bubble(l) == pytest.approx(1 / 3)
  # Across nodes: every iteration a stage sends a microbatch's activations (T S / M = 64 tokens of 128, bf16) to
  # the next, forward and backward; and the weights outside the pipeline (embedding, head, norm: split over the
  # node's 2 GPUs) have their fp32 gradient all-reduced over the 2 stages, which run them as data parallelism.
  permute = 2 * 3 * 64 * 128 * 2
  embedding = 2 * 64 * 128 + 128
  links = layout_cost.links(s, l)
  assert links["IB"].wire_bytes == pytest.approx(permute + 2 * 4 * embedding / 2 / 2)
  assert links["IB"].seconds == pytest.approx(links["IB"].wire_bytes / 50e9)
  e = layout_cost.estimate(s, l)
  # cuDNN attention in the stages, as outside them: its 1 TFLOP of the 6.48 at cuDNN's rate, the rest at the GEMM
  # rate, and no scores through HBM (dot_product's full S x S scores were priced here before cuDNN ran in stages)
  h100 = hardware.GPUS["h100"]
  compute = 5.48e12 / h100.gemm_flops.value + 1e12 / h100.attention_flops.value
  assert e.compute_s == pytest.approx(compute) and e.memory_bound_s == 0.0
  assert e.compute_s == pytest.approx(layout_cost.estimate(s, Layout(fsdp=2, batch=2, accum=1)).compute_s)
  # all of this toy's layers are pipelined: its work stretched by 1 / (1 - 1/3), half again
  assert e.bubble_s == pytest.approx(compute * 0.5)


def test_a_layout_the_loader_refuses_is_dropped_with_its_reason(recipe):
  run, shape, own, layouts, _ = recipe
  legal = Layout(ep_nodes=8, fsdp=8, data=2, batch=1, accum=15, dispatch="hierarchical", node_limited=True,
                 hierarchical_capacity=1.5)
  # node-limited routing over 4 EP nodes while the model keeps 8 routing groups: moe_keys.py refuses it
  off_nodes = dataclasses.replace(legal, ep_nodes=4, fsdp=16)
  ranked = [layout_search.Ranked(l, layout_cost.estimate(shape, l), layout_search.overrides(shape, l))
            for l in (off_nodes, legal)]
  refused = collections.Counter()
  passed = layout_search.loader_pass([RECIPE], 1024, ranked, top=2, refused=refused)
  assert [r.layout for r in passed] == [legal]
  assert "n_routing_groups must equal dcn_expert_parallelism" in ranked[0].refused
  assert sum(refused.values()) == 1 and "n_routing_groups" in next(iter(refused))


def test_the_best_layout_for_1024_h100s_pipelines_or_spreads_ep_over_nodes(recipe):
  """Not FSDP 64 x EP 8 (in a node) x data 2, the recipe's layout before the search re-laid it: by the arithmetic,
  its routed experts' gathers over 64 nodes cost 6,744 GiB a GPU a step at one NIC's 50 GB/s."""
  run, shape, own, layouts, refused = recipe
  ranked, over = layout_search.rank(shape, layouts)
  best = layout_search.loader_pass([RECIPE], 1024, ranked, top=1, refused=refused)[0]
  assert best.layout.stages > 1 or best.layout.ep_nodes > 1
  fsdp_over_nodes = dataclasses.replace(own, ep_nodes=1, fsdp=64, data=2, dispatch="a2a_padded", node_limited=False,
                                        hierarchical_capacity=0.0, fp8="")
  before = layout_cost.estimate(shape, fsdp_over_nodes)
  assert best.estimate.tflops_per_gpu > 1.5 * before.tflops_per_gpu
  shipped = layout_cost.estimate(shape, own)  # the re-laid recipe: EP 64 over 8 nodes
  assert shipped.fits and own.ep_nodes == 8 and shipped.tflops_per_gpu > 1.5 * before.tflops_per_gpu
  planned = json.loads((REPO / "configs/recipes/plans/deepseek3-671b-1024xh100.json").read_text())["memory"]["device_gib"]
  assert math.isclose(shipped.memory_bytes * shipped.memory_factor / 2**30, planned, rel_tol=1e-3)  # its compiled plan


def _plan_report(tflops: float, violations: tuple[str, ...] = ()) -> dict:
  """A compiled plan's report as the search reads it: the figures and the account (MaxText/plan/account.py)."""
  return {"verdict": {"fits": True}, "memory": {"device_total": 3 * 2**30},
          "estimate": {"step_s": 6.48 / tflops, "tflops_per_gpu": tflops},
          "account": {"ok": not violations, "lines": [], "violations": list(violations)}}


def test_compiled_layouts_whose_account_is_violated_are_marked_left_out_of_the_best_and_exit_9(monkeypatch,
                                                                                               capsys):
  """--search-layouts --compile 3 on the hand-sized shape: the compiler's best by TF/s has a violated account. It is
  marked, the best compiled is the next, and the search exits 9 as a single plan does (before: ranked, exit 0)."""
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.plan import __main__ as plan_cli  # pylint: disable=import-outside-toplevel
  from MaxText.plan import planner  # pylint: disable=import-outside-toplevel

  tiny = str(REPO / "configs/deepseek3-tiny.yml")
  run = fork_config.load([tiny])
  monkeypatch.setattr(layout_search, "shape_of", lambda args: (run, _tiny_shape()))
  monkeypatch.setattr(layout_search, "loader_pass", lambda args, n, ranked, top, refused: ranked[:top])
  wrong = "microbatch loop mb: 8 trips + 2 peeled = 10 microbatches walked, gradient_accumulation_steps 11"
  reports = iter([_plan_report(300.0), _plan_report(500.0, (wrong,)), _plan_report(400.0)])
  monkeypatch.setattr(planner, "plan", lambda *a, **k: next(reports))
  assert plan_cli.main([tiny, "--search-layouts", "--top", "3", "--compile", "3"]) == 9
  out, err = capsys.readouterr()
  compiled = [l for l in out.splitlines() if "| compiler" in l]
  assert len(compiled) == 3 and f"ACCOUNT VIOLATED (1): {wrong}" in compiled[1]
  assert "ACCOUNT VIOLATED" not in compiled[0] + compiled[2]
  assert "best compiled (1 left out: account violated): 3 at 400.0 TF/s" in out
  assert err == (f"maxtext-moe: plan invariant violated in 1 of 3 compiled layouts (left out of the best): 2: "
                 f"{wrong}\n")
  reports = iter([_plan_report(300.0), _plan_report(500.0), _plan_report(400.0)])
  assert plan_cli.main([tiny, "--search-layouts", "--top", "3", "--compile", "3"]) == 0
  out, err = capsys.readouterr()
  assert "best compiled: 2 at 500.0 TF/s" in out and err == ""
