"""The planner (MaxText/plan/planner.py, aot.py, hlo_inventory.py) on simulated CPU devices.

The inventory is checked against hand-computed figures: a known FSDP all-gather
compiled on 4 simulated devices, and HLO snippets in each replica-group
spelling XLA prints. Bad input stops before compiling with one line, exit 2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, SUBPROCESS_PYTHONPATH, run_train
from MaxText.config import parallelism
from MaxText import hardware
from MaxText.plan import aot, flops, gpu_target, hlo_inventory, memory_report, planner as plan
from MaxText import config as fork_config

MESH_2x4 = {"data": 1, "fsdp": 2, "expert": 4}


def _plan_cli(*args: str, timeout: int = 600, xla_flags: str | None = None) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
  return subprocess.run([sys.executable, "-m", "MaxText.plan", *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)


# --- the HLO reader, on hand-written modules -------------------------------------------

HLO = textwrap.dedent("""\
    HloModule m

    %body (p: (s32[], f32[16,8])) -> (s32[], f32[16,8]) {
      %p = (s32[], f32[16,8]{1,0}) parameter(0)
      %w = f32[2,8]{1,0} constant({...})
      %ag = f32[16,8]{1,0} all-gather(%w), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true
      %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%w), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
      %agd = f32[16,8]{1,0} all-gather-done(%ags)
      %cps = (f32[2,8]{1,0}, f32[2,8]{1,0}, u32[], u32[]) collective-permute-start(%w), channel_id=6, source_target_pairs={{0,4},{4,0}}
      %cpd = f32[2,8]{1,0} collective-permute-done(%cps)
      %a2a = bf16[64,4]{1,0} all-to-all(%w), channel_id=2, replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}
      ROOT %t = (s32[], f32[16,8]{1,0}) tuple(%p, %ag)
    }

    %cond (p: (s32[], f32[16,8])) -> pred[] {
      %p = (s32[], f32[16,8]{1,0}) parameter(0)
      ROOT %c = pred[] constant(true)
    }

    ENTRY %main (x: f32[4,8], y: f32[8,3]) -> f32[4,3] {
      %x = f32[4,8]{1,0} parameter(0)
      %y = f32[8,3]{1,0} parameter(1)
      %d = f32[4,3]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      %ar = f32[4,3]{1,0} all-reduce(%d), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
      %rs = f32[1,3]{1,0} reduce-scatter(%d), channel_id=4, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
      %rss = ((f32[4,3]{1,0}), f32[1,3]{1,0}) reduce-scatter-start(%d), channel_id=7, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
      %rsd = f32[1,3]{1,0} reduce-scatter-done(%rss)
      %init = (s32[], f32[16,8]{1,0}) tuple(%x, %x)
      %loop = (s32[], f32[16,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
      ROOT %r = f32[4,3]{1,0} copy(%ar)
    }
    """)


def _rows(inv):
  return {(r["kind"], tuple(r["axes"])): r for r in inv["collectives"]}


def test_inventory_reads_every_replica_group_spelling_and_multiplies_loops():
  """2 x 4 devices (fsdp 2 x expert 4), nodes of 4: fsdp crosses nodes, expert does not."""
  inv = hlo_inventory.inventory(HLO, MESH_2x4, nodes=[0, 0, 0, 0, 1, 1, 1, 1])
  rows = _rows(inv)
  # iota [2,4]<=[4,2]T(1,0): groups {0,2,4,6},{1,3,5,7} -> the expert axis and fsdp? no: coords (f,e) = divmod(i,4)
  # 0,2,4,6 -> (0,0),(0,2),(1,0),(1,2): both axes vary.
  ag = rows[("all-gather", ("fsdp", "expert"))]
  assert (ag["count"], ag["bytes"], ag["group_size"]) == (5, 5 * 16 * 8 * 4, 4)  # 5 trips of a 512 B result
  assert ag["wire_bytes"] == pytest.approx(5 * 512 * 3 / 4)
  assert ag["crosses_nodes"]
  a2a = rows[("all-to-all", ("expert",))]  # mesh['a'=2,'b'=4] {'b'}: groups of 4 consecutive ids
  assert (a2a["count"], a2a["bytes"], a2a["crosses_nodes"]) == (5, 5 * 64 * 4 * 2, False)
  ar = rows[("all-reduce", ("fsdp", "expert"))]
  assert (ar["count"], ar["bytes"], ar["wire_bytes"]) == (1, 48, pytest.approx(2 * 48 * 7 / 8))
  rs = rows[("reduce-scatter", ("fsdp",))]  # {0,4}: same expert, both fsdp rows
  assert (rs["bytes"], rs["wire_bytes"], rs["crosses_nodes"]) == (2 * 12, 12, True)
  rss = rows[("reduce-scatter", ("expert",))]  # async: (operand, result); the operand is 4 results, not counted
  assert (rss["count"], rss["bytes"], rss["wire_bytes"], rss["crosses_nodes"]) == (1, 4 * 12, 3 * 12, False)
  ags = rows[("all-gather", ("expert",))]  # async: (operand, result) tuple; [2,4]<=[8] is 4 consecutive ids
  assert (ags["count"], ags["bytes"], ags["crosses_nodes"]) == (5, 5 * 512, False)
  cp = rows[("collective-permute", ("fsdp",))]
  assert (cp["count"], cp["bytes"], cp["wire_bytes"], cp["crosses_nodes"]) == (5, 5 * 64, 5 * 64, True)
  assert inv["hlo_dot_flops"] == 2 * 4 * 3 * 8
  assert inv["inventory_notes"] == []
  # Inter-node bytes: the share of each member's wire bytes exchanged with other nodes' members.
  assert ag["inter_node_bytes"] == pytest.approx(ag["wire_bytes"] * 2 / 3)  # {0,2,4,6}: 2 of 3 others off-node
  assert ar["inter_node_bytes"] == pytest.approx(ar["wire_bytes"] * 4 / 7)
  assert (rs["inter_node_bytes"], cp["inter_node_bytes"]) == (rs["wire_bytes"], cp["wire_bytes"])  # pairs across
  assert a2a["inter_node_bytes"] == rss["inter_node_bytes"] == ags["inter_node_bytes"] == 0  # inside a node
  assert inv["inter_node_bytes"] == pytest.approx(5 * 512 / 2 + 48 + 12 + 5 * 64)


def test_off_node_share_is_linear_in_the_group_and_matches_the_pairwise_count():
  """A 1,024-GPU all-to-all group reads each member's node once (a pairwise count read it a million times)."""

  class CountedNodes(list):
    reads = 0

    def __getitem__(self, i):
      CountedNodes.reads += 1
      return list.__getitem__(self, i)

  nodes = CountedNodes([i // 8 for i in range(1024)])
  assert hlo_inventory.off_node_share("all-to-all", [list(range(1024))], nodes) == pytest.approx(1016 / 1023)
  assert CountedNodes.reads <= 2 * 1024
  groups, few_nodes = [[0, 1, 2, 5], [3, 4], [6]], [0, 0, 1, 1, 2]  # member 5 and 6 past `nodes`: one unknown node
  node = lambda i: few_nodes[i] if i < len(few_nodes) else -1  # noqa: E731
  pairwise = [sum(node(j) != node(i) for j in g) / (len(g) - 1) for g in groups if len(g) > 1 for i in g]
  assert hlo_inventory.off_node_share("all-gather", groups, few_nodes) == pytest.approx(sum(pairwise) / len(pairwise))


def test_inventory_flags_a_loop_without_trip_count():
  inv = hlo_inventory.inventory(HLO.replace(', backend_config={"known_trip_count":{"n":"5"}}', ""), MESH_2x4, [0] * 8)
  assert _rows(inv)[("all-gather", ("fsdp", "expert"))]["count"] == 1
  assert any("trip count" in n for n in inv["inventory_notes"])


def test_fsdp_all_gather_of_a_known_weight_on_4_simulated_devices():
  """A [32, 16] f32 weight sharded over fsdp=4 and gathered once: 2,048 B, 1,536 B on the wire per device."""
  code = textwrap.dedent("""\
      import json, jax, jax.numpy as jnp
      from jax.sharding import NamedSharding, PartitionSpec as P
      from MaxText.plan import aot, hlo_inventory
      aot.configure_backend(aot.Topology("cpu", 4, 8, 0))
      mesh = jax.make_mesh((4,), ("fsdp",))
      w = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
      x = jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
      v = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
      rep = NamedSharding(mesh, P())
      f = jax.jit(lambda w, x, v: (2 * w, x @ v), out_shardings=(rep, rep))  # w gathered; one replicated dot
      hlo = f.lower(w, x, v).compile().as_text()
      print(json.dumps(hlo_inventory.inventory(hlo, dict(mesh.shape), aot.device_nodes(mesh, aot.Topology("cpu", 4, 2, 0)))))
      """)
  env = {**os.environ, "PYTHONPATH": SUBPROCESS_PYTHONPATH}
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  inv = json.loads(out.stdout.strip().splitlines()[-1])
  assert [(r["kind"], r["axes"], r["count"]) for r in inv["collectives"]] == [("all-gather", ["fsdp"], 1)]
  row = inv["collectives"][0]
  assert (row["bytes"], row["wire_bytes"], row["group_size"]) == (32 * 16 * 4, 32 * 16 * 4 * 3 / 4, 4)
  assert row["crosses_nodes"]  # gpus_per_node=2: devices 0-1 and 2-3 on two nodes
  assert inv["hlo_dot_flops"] == 2 * 8 * 16 * 32


# --- topology and estimate ---------------------------------------------------------------


def test_mock_topology_is_nodes_x_hosts_x_local_gpus():
  assert aot.choose_topology(128, 8, 1).mock_spec == "16 x 8 x 1"
  assert aot.choose_topology(1024, 8, 2).mock_spec == "128 x 4 x 2"
  assert aot.choose_topology(2, 8, 1).mock_spec == "1 x 2 x 1"
  assert aot.choose_topology(1, 8, 1).mock_spec is None  # the real device
  assert aot.choose_topology(4, 8, 0).platform == "cpu" and not aot.choose_topology(4, 8, 0).lower_only
  assert aot.choose_topology(128, 8, 0).lower_only  # past 64 simulated devices: lowered, not compiled
  with pytest.raises(aot.PlanError, match="CUDA_VISIBLE_DEVICES"):
    aot.choose_topology(8, 8, 3)


def test_a_mock_on_a_larger_gpu_schedules_against_the_targets_memory(monkeypatch):
  """--mock for an H100 recipe on an H200: XLA's memory limit (95% of the device) becomes 95% of the H100's."""
  h100, h200 = gpu_target.device_memory_size("h100"), gpu_target.device_memory_size("h200")
  assert aot.memory_limit_flag(h100, h200) == "--xla_gpu_memory_limit_slop_factor=53"  # 95 * 79.1 / 139.8 GiB
  assert aot.memory_limit_flag(h200, h200) == aot.memory_limit_flag(h200, None) == ""  # its own GPU: XLA's default
  run = fork_config.load([str(REPO / "configs/recipes/deepseek3-671b-128xh100.yml")])
  monkeypatch.setattr(aot, "local_gpu_memory_bytes", lambda: h200)
  assert plan.mock_memory_limit(run, aot.Topology("gpu", 128, 8, 1)).endswith("=53")
  assert plan.mock_memory_limit(run, aot.Topology("gpu_target", 128, 8, 0, target_gpu="h100")) == ""


def test_links_are_nvlink_in_the_node_infiniband_across_and_measured_per_kind():
  gpu = hardware.GPUS["h200"]
  assert hardware.link_bytes(gpu, "all-gather", False) is gpu.nvlink_bytes
  assert hardware.link_bytes(gpu, "all-to-all", True) is gpu.ib_bytes
  assert hardware.link_bytes(gpu, "all-to-all", False) is gpu.a2a_nvlink_bytes
  assert hardware.link_bytes(gpu, "ragged-all-to-all", False) is gpu.ragged_a2a_bytes
  for key, g in hardware.GPUS.items():  # every rate the schedule's estimate divides by, each with its source
    for name in ("gemm_flops", "attention_flops", "hbm_bandwidth", "nvlink_bytes", "ib_bytes", "host_bytes"):
      assert getattr(g, name).value > 0 and getattr(g, name).source, (key, name)


def test_recompute_term_follows_the_remat_policy(monkeypatch):
  """Full remat re-runs the layers' forward (a third of all but the head); custom with the expert
  up-projections kept skips the routed GEMMs; policies that save matmuls add nothing."""
  import types

  from maxtext.utils import maxtext_utils

  monkeypatch.setattr(maxtext_utils, "calculate_tflops_training_per_device", lambda c, log=False: (600.0, 0, 0))
  cfg = dict(per_device_batch_size=2, max_target_length=10, emb_dim=4, vocab_size=1000, num_experts=8,
             num_experts_per_tok=2, moe_mlp_dim=5, num_decoder_layers=3, first_num_dense_layers=1)
  head = 2 * 20 * 4 * 1000 * 3
  full, _ = flops.recompute_flops(types.SimpleNamespace(remat_policy="full", **cfg))
  assert full == (600e12 - head) / 3
  routed = 2 * 20 * 2 * 3 * 4 * 5 * 2
  custom, note = flops.recompute_flops(types.SimpleNamespace(remat_policy="custom", moe_mlpwi_0="offload",
                                                                moe_mlpwi_1="device", **cfg))
  assert custom == full - routed and "routed experts" in note
  remat_all, _ = flops.recompute_flops(types.SimpleNamespace(remat_policy="custom", moe_mlpwi_0="remat",
                                                                moe_mlpwi_1="offload", **cfg))
  assert remat_all == full
  assert flops.recompute_flops(types.SimpleNamespace(remat_policy="minimal", **cfg))[0] == 0.0


def test_routed_expert_flops_and_the_fp8_rate_held_to_its_measurement(monkeypatch):
  """moe_fp8's GEMMs: the routed experts' (forward, dlhs, dW, and the forward again where remat recomputes it);
  the FP8 grouped rate (tests/test_schedule.py costs our grouped GEMMs at it) gives back what was measured."""
  import types

  from maxtext.utils import maxtext_utils

  monkeypatch.setattr(maxtext_utils, "calculate_tflops_training_per_device", lambda c, log=False: (600.0, 0, 0))
  cfg = dict(per_device_batch_size=2, max_target_length=10, emb_dim=4, vocab_size=1000, num_experts=8,
             num_experts_per_tok=2, moe_mlp_dim=5, num_decoder_layers=3, first_num_dense_layers=1)
  forward = 2 * 20 * 2 * 3 * 4 * 5 * 2
  assert flops.routed_expert_flops(types.SimpleNamespace(remat_policy="full", **cfg)) == 4 * forward
  assert flops.routed_expert_flops(types.SimpleNamespace(remat_policy="minimal", **cfg)) == 3 * forward
  kept = types.SimpleNamespace(remat_policy="custom", moe_mlpwi_0="offload", moe_mlpwi_1="device", **cfg)
  assert flops.routed_expert_flops(kept) == 3 * forward
  assert flops.routed_expert_flops(types.SimpleNamespace(remat_policy="full", **{**cfg, "num_experts": 1})) == 0.0
  # an MTP module is one MoE layer more, as upstream's count takes it (before: left out, 1/58 of V3's routed GEMMs)
  mtp = types.SimpleNamespace(remat_policy="minimal", mtp_num_layers=1, **cfg)
  assert flops.routed_expert_flops(mtp) == 3 * forward * 3 / 2
  h200 = hardware.GPUS["h200"]
  # Held to the measurement (BENCHMARKS.md "Planner accuracy", b891976): the 1xH200 proxy's 138.5 T of routed GEMMs
  # per step saved 58.0 ms in FP8 (0.7666 -> 0.7086 s per step).
  routed = 138.5e12
  assert 0.053 < routed / h200.gemm_flops.value - routed / h200.fp8_grouped_flops.value < 0.063
  b200 = hardware.GPUS["b200"]  # MXFP8 through TE: the datasheet's FP8/bf16 ratio on the bf16 rate, not measured
  assert (h200.fp8_recipe, b200.fp8_recipe) == ("blockwise", "mxfp8")
  assert b200.fp8_grouped_flops.value == pytest.approx(2 * b200.gemm_flops.value)
  assert "not measured" in b200.fp8_grouped_flops.source


# --- bad input: one line naming the key, exit 2, nothing compiled ----------------------------


@pytest.mark.parametrize("args, key", [
    (["recipe_num_gpus=4", "ici_fsdp_parallelism=3"], "does not match 4 device"),
    (["recipe_num_gpus=3", "ici_fsdp_parallelism=1", "ici_expert_parallelism=3"], "num_experts=8"),
    (["recipe_num_gpus=4", "target_gpu=a100"], "target_gpu"),
    (["recipe_num_gpus=4", "target_gpu=b200", "moe_block=ours", "moe_fp8=blockwise"], "moe_fp8=blockwise: the B200"),
    (["recipe_num_gpus=4", "target_gpu=h200", "moe_block=ours", "moe_fp8=mxfp8"], "MXFP8 needs a Blackwell GPU"),
    (["recipe_num_gpus=4", "--heartbeat", "soon"], "--heartbeat soon: give seconds"),
], ids=["mesh", "experts-over-ep", "target", "fp8-off-hopper", "mxfp8-off-blackwell", "heartbeat"])
def test_bad_input_is_one_line_and_exit_2(args, key):
  out = _plan_cli("configs/deepseek3-tiny.yml", *args, timeout=120)
  assert out.returncode == 2, out.stderr[-1000:]
  assert key in out.stderr
  assert len([line for line in out.stderr.splitlines() if line.startswith("maxtext-moe:")]) == 1
  assert "compiling" not in out.stdout


@pytest.mark.slow
def test_config_upstream_rejects_is_one_line_and_exit_2():
  out = _plan_cli("configs/deepseek3-tiny.yml", "recipe_num_gpus=1", "num_experts_per_tok=16")
  assert out.returncode == 2, out.stderr[-1000:]
  assert out.stderr.strip().startswith("maxtext-moe: plan error:") or "config error" in out.stderr
  assert len(out.stderr.strip().splitlines()[-1]) < 1200


def test_indivisible_sharding_message_names_the_array_dimension_and_split():
  error = ("One of pjit arguments with pytree key path state['model']['wkv_b']['kernel'].value was given the sharding "
           "NamedSharding(mesh=Mesh('fsdp': 128, 'expert': 8), spec=P(('fsdp', 'expert'), None), memory_kind=device) "
           "implies that array axis 0 is partitioned 1024 times, but the dimension size is 512 (full shape: (512, 8), "
           "per-dimension tiling factors: (1024, 1) should evenly divide the shape).")
  msg = aot.indivisible_message(error)
  assert msg.startswith("state['model']['wkv_b']['kernel'].value (512, 8): dimension 0 (512) cannot be split 1024 ways")
  assert "dcn_data_parallelism" in msg and aot.indivisible_message("another error") is None


@pytest.mark.slow
def test_a_mesh_a_parameter_cannot_split_over_is_one_line_on_cpu_past_64_devices():
  """128 simulated devices: lowered, not compiled; the tiny model cannot split its narrow arrays 128 ways."""
  out = _plan_cli("configs/deepseek3-tiny.yml", "recipe_num_gpus=128", "ici_fsdp_parallelism=8", "dcn_fsdp_parallelism=16",
                  timeout=300)
  assert out.returncode == 2, out.stderr[-1000:]
  line = [ln for ln in out.stderr.splitlines() if ln.startswith("maxtext-moe:")]
  assert len(line) == 1 and "cannot be split 128 ways" in line[0], out.stderr[-1000:]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "configs" / "recipes").glob("deepseek3-671b-*x*.yml")))
def test_every_recipe_lowers_for_its_real_gpu_count_on_cpu(recipe):
  """Every shipped recipe's shardings fit its arrays at its real device count (up to 1,024 simulated CPU devices,
  lowered, not compiled): the check that caught 1,024 x FSDP-EP over a 512-wide MLA dimension."""
  out = _plan_cli(f"configs/recipes/{recipe}", "--cpu", timeout=600)
  assert out.returncode == 0, out.stderr[-1500:]
  assert "lowered on" in out.stdout or "compiled on" in out.stdout


# --- one real plan ------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_plan_on_4_simulated_devices(tmp_path):
  """The tiny DeepSeek-V3 on 2 nodes of 2, FSDP in and across nodes (fsdp=4 = dcn 2 x ici 2):
  FSDP all-gathers inside the layer scan, some crossing nodes; the JSON whole."""
  path = tmp_path / "plan" / "tiny.json"
  out = _plan_cli("configs/deepseek3-tiny.yml", "recipe_num_gpus=4", "ici_fsdp_parallelism=2", "dcn_fsdp_parallelism=2",
                  "gpus_per_node=2", "per_device_batch_size=1", "max_target_length=32", "--json", str(path),
                  "--heartbeat", "1")
  assert out.returncode == 0, out.stderr[-2000:]
  # A heartbeat each second names the phase the compile process last reported, in the order they come.
  phases = re.findall(r"^\[plan\] compiling for 4 simulated CPU devices \(([a-zA-Z ]+)\): \w+ elapsed$", out.stdout, re.M)
  order = ["starting", "loading the config", "starting upstream", "building the abstract state", "tracing", "lowering",
           "compiling", "reading the HLO"]
  assert "compiling" in phases and set(phases) <= set(order), phases
  assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases), phases
  assert "GPU memory needs a GPU compile" in out.stdout
  assert "CPU stand-in: num_slices=2" in out.stdout  # dcn_fsdp_parallelism=2 kept: two nodes of consecutive devices
  report = json.loads(path.read_text())
  assert not path.with_name("tiny.json.tmp").exists()
  assert report["mesh"]["fsdp"] == 4 and report["platform"] == "cpu" and report["verdict"] is None
  gathers = [r for r in report["collectives"] if r["kind"] == "all-gather"]
  assert gathers and all(r["axes"] == ["fsdp"] for r in gathers)
  # Every weight is gathered at least once per step: at least the bf16 parameters' bytes.
  assert sum(r["bytes"] for r in gathers) >= 2 * 100_000
  assert any(r["crosses_nodes"] for r in gathers)  # 4 devices, 2 per node
  assert report["estimate"]["step_s"] > 0 and report["estimate"]["model_tflops_per_device"] > 0
  # XLA's memory-usage report, read from the compile's dump (printed for GPU compiles only).
  assert report["largest_buffers"] and all(b["bytes"] > 0 and "[" in b["shapes"] for b in report["largest_buffers"])
  assert not (REPO / "outputs" / "plan").exists()  # the compile wrote only under a temporary directory


def test_search_tries_one_knob_at_a_time_within_the_gpu_count():
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.plan import search as plan_search  # pylint: disable=import-outside-toplevel

  run = fork_config.load(["configs/deepseek3-tiny.yml", "recipe_num_gpus=8", "gpus_per_node=4",
                          "ici_fsdp_parallelism=4", "dcn_fsdp_parallelism=2", "per_device_batch_size=2"])
  cands = plan_search.candidates(run, 8)
  assert cands[0] == {}  # the run as given comes first
  now = {**parallelism.mesh_axes(run.upstream, "ici_"), **parallelism.mesh_axes(run.upstream, "dcn_")}
  meshes = [{**now, **c} for c in cands if any(k.endswith("_parallelism") for k in c)]  # a candidate names changes only
  eps = sorted(c["ici_expert_parallelism"] * c["dcn_expert_parallelism"] for c in meshes)
  assert eps == [1, 2, 4, 8]  # 8 experts: EP 2, 4 (in node), 8 (2 across nodes); EP 1 is the HSDP layout
  for c in meshes:  # every mesh multiplies to the GPU count, 4 per node
    ici = c["ici_expert_parallelism"] * c["ici_fsdp_parallelism"] * c["ici_data_parallelism"]
    assert ici == 4 and ici * c["dcn_expert_parallelism"] * c["dcn_fsdp_parallelism"] * c["dcn_data_parallelism"] == 8
  assert {"dcn_data_parallelism": 2, "dcn_fsdp_parallelism": 1}.items() <= next(
      c for c in meshes if c["ici_expert_parallelism"] == 1).items()  # FSDP in node, data across
  assert plan_search.OFFLOAD in cands
  assert {"per_device_batch_size": 1.0} in cands and {"per_device_batch_size": 4.0} in cands
  assert not any("moe_ep_overlap_chunks" in c for c in cands)  # this run has no EP: nothing to overlap
  on_ep = fork_config.load(["configs/deepseek3-tiny.yml", "recipe_num_gpus=8", "ici_expert_parallelism=8",
                            "per_device_batch_size=2"])
  assert [c for c in plan_search.candidates(on_ep, 8) if "moe_ep_overlap_chunks" in c] == [
      {"moe_ep_overlap_chunks": 2}, {"moe_ep_overlap_chunks": 4}]


def test_search_says_which_candidate_of_how_many_with_an_eta(monkeypatch, capsys):
  """The loop's lines, each candidate's compile replaced by a refusal (each real one is a full compile)."""
  from MaxText.plan import search as plan_search  # pylint: disable=import-outside-toplevel

  args = ["configs/deepseek3-tiny.yml", "recipe_num_gpus=8", "gpus_per_node=4", "ici_fsdp_parallelism=4",
          "dcn_fsdp_parallelism=2"]
  total = len(plan_search.candidates(fork_config.load(args), 8))

  def refuse(*_args, **_kwargs):
    raise aot.PlanError("refused here")

  monkeypatch.setattr(plan, "plan", refuse)
  assert plan_search.main(args, 60, None, heartbeat_s=0) == 2  # nothing fits
  lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan] search: ")]
  assert len(lines) == total > 3
  assert lines[0] == f"[plan] search: candidate 1 of {total}: (as given)"
  for k, line in enumerate(lines[1:], start=2):
    assert re.fullmatch(rf"\[plan\] search: candidate {k} of {total}: .+ \(ETA \w+, \w+ a candidate so far\)", line), line


def test_a_gpu_recipe_on_cpu_swaps_only_gpu_pieces_and_keeps_its_nodes():
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel

  run = fork_config.load(["configs/recipes/deepseek3-671b-128xh100.yml"])
  assert plan.num_gpus_of(run) == 128
  plan.check_layout(run, 128)  # 8 in node x 16 nodes
  assert plan.cpu_substitutes(run) == {
      "hardware": "cpu", "attention": "dot_product",  # moe_gmm_backend auto: xla on CPU by itself
  }  # dcn_fsdp_parallelism=16 stays: plan() names num_slices=16, patches/cpu_slices.py makes the nodes


def test_a_compile_past_its_timeout_names_the_knob():
  out = _plan_cli("configs/deepseek3-tiny.yml", "recipe_num_gpus=1", "--timeout", "1", timeout=120)
  assert out.returncode == 2, out.stderr[-1000:]
  assert "ran past --timeout 1 s" in out.stderr and "raise --timeout" in out.stderr


def test_cublas_gemm_custom_calls_count_their_flops():
  """GPU HLO: the GEMM is a custom-call whose dimension numbers sit in its backend config."""
  hlo = textwrap.dedent("""\
      HloModule g

      ENTRY %main (a: bf16[3,64,128], b: bf16[3,128,32]) -> bf16[3,64,32] {
        %a = bf16[3,64,128]{2,1,0} parameter(0)
        %b = bf16[3,128,32]{2,1,0} parameter(1)
        %g = (bf16[3,64,32]{2,1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]}}}
        ROOT %r = bf16[3,64,32]{2,1,0} get-tuple-element(%g), index=0
      }
      """)
  assert hlo_inventory.inventory(hlo, {"data": 1}, [0])["hlo_dot_flops"] == 2 * 3 * 64 * 32 * 128


def _program(path) -> str:
  """An optimized HLO dump without its debug info (source locations, stack frames)."""
  text = re.sub(r", metadata=\{[^}]*\}", "", path.read_text())
  return "\n".join(line for line in text.splitlines() if line.startswith(("%", "ENTRY", "  ")))


@pytest.mark.slow
def test_the_plan_compiles_the_program_the_trainer_runs(tmp_path):
  """The trainer's optimized train step (dump_hlo=true) and the planner's are the same HLO."""
  args = ["configs/deepseek3-tiny.yml", "steps=1", "enable_checkpointing=false", "per_device_batch_size=1",
          "max_target_length=32"]
  trained = run_train(tmp_path, *args, "dump_hlo=true")
  assert trained.returncode == 0, trained.stderr[-2000:]
  dump = tmp_path / "plan_dump"
  out = _plan_cli(*args, "recipe_num_gpus=1", xla_flags=f"--xla_dump_to={dump} --xla_dump_hlo_module_re=jit_train_step")
  assert out.returncode == 0, out.stderr[-2000:]
  (ours,) = dump.glob("*jit_train_step.cpu_after_optimizations.txt")
  (theirs,) = (trained.run_dir / "xla_dump").glob("*jit_train_step.cpu_after_optimizations.txt")
  assert len(_program(ours)) > 100_000
  assert _program(ours) == _program(theirs)


def test_largest_buffers_are_the_device_memory_spaces(tmp_path):
  """XLA's memory-usage report lists host memory (offloaded activations) in its own section: not HBM."""
  (tmp_path / "m.jit_train_step.sm_9.0a_gpu_after_optimizations-memory-usage-report.txt").write_text(
      "Memory Space: default (color=0)\nTotal bytes: 3221225472 (3.00GiB)\n"
      "  cumulative_size;       size;       offset; used_by_n_values; shapes_list\n"
      "    2.00GiB( 67%);    2.00GiB;            0;                2; 2×bf16[1024,1048576]\n"
      "    3.00GiB(100%);    1.00GiB;   2147483648;                1; bf16[512,1048576]\n"
      "Memory Space: cmem (color=5)\nTotal bytes: 93415538688 (87.00GiB)\n"
      "   87.00GiB(100%);   87.00GiB;            0;                8; 8×bf16[58,393216,2048]\n")
  rows = memory_report.largest_buffers(tmp_path)
  assert [r["size"] for r in rows] == ["2.00GiB", "1.00GiB"] and rows[0]["values"] == 2
