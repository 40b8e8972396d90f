"""Expert parallelism across nodes: dcn_expert_parallelism x ici_expert_parallelism on simulated CPU devices.

Block level (tests/ep_nodes_check.py, in subprocesses: the device count is fixed before JAX starts): every EP
dispatch backend that runs on CPU on 8 devices laid out as 2 "nodes" x 4 and 16 as 4 x 4, as upstream lays a
multi-node mesh out (patches/cpu_slices.py), against one device and the float32 dense reference: loss and every
gradient. The two-level backend (MaxText/moe/dispatch/hierarchical.py): its plan under node-limited routing, its
overflow contract, the FP8 dispatch through it, GPU kernel typing, and its exchanges' groups in the compiled HLO.
Entry level: `python -m MaxText.train` with dcn_expert_parallelism on CPU, and a checkpoint resumed on another
EP split.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import config_error_line, require_gpu_plan, run_rejected, run_train
from MaxText import config as fork_config
from MaxText.plan import gpu_target

HERE = Path(__file__).resolve().parent


def _check(devices: int, case: str) -> list[dict]:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, str(HERE / "ep_nodes_check.py"), str(devices), case], cwd=HERE.parent,
                        env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _assert_matches(rows):
  for r in rows:
    assert r["loss_err"] < 1e-4 and r["grad_err"] < 1e-4, r  # against `local` on one device
    assert r["dense_loss_err"] < 1e-4 and r["dense_grad_err"] < 1e-4, r  # against the dense einsum reference
    assert not r["overflow"], r


def test_two_level_dispatch_on_two_nodes_of_four_quick():
  """The fast tier's share (one JAX start on 8 devices): hierarchical on dcn 2 x ici 4 with node-limited routing
  against one device and the dense reference; its plan sends each token to the M = 1 node of its experts (2
  without the limit); its gradient traces with the FP8 GPU kernels on fsdp 2 x expert 2 inside 2 nodes."""
  match, free, limited, typing = _check(8, "quick")
  assert (match["backend"], match["layout"], match["node_limit"]) == ("hierarchical", "expert2x4", 1)
  _assert_matches([match])
  assert free["rows_equal_expert_nodes"] and free["max_rows_per_token"] == 2
  assert limited["rows_equal_expert_nodes"] and limited["max_rows_per_token"] == 1
  assert typing["error"] == "", typing


@pytest.mark.slow  # several simulated devices, a compile per backend, layout and routing
@pytest.mark.parametrize("devices", [8, 16])
def test_every_cpu_backend_across_nodes_matches_one_device_and_the_dense_reference(devices):
  """ring, a2a_padded and hierarchical; top-8 of 16 experts with and without node-limited routing; on 8 devices
  expert 2 x 4 and 2 x (fsdp 2, expert 2), on 16 expert 4 x 4 and (fsdp 2, expert 2) x 4; on 8, a2a_padded and
  hierarchical with the tokens in 2 overlap chunks too."""
  rows = _check(devices, f"match{devices}")
  assert len(rows) == (14 if devices == 8 else 12) and {r["backend"] for r in rows} == {"ring", "a2a_padded",
                                                                                        "hierarchical"}
  assert {r["chunks"] for r in rows} == ({1, 2} if devices == 8 else {1})
  assert {r["node_limit"] for r in rows} == ({None, 1} if devices == 8 else {None, 1, 2})
  _assert_matches(rows)


@pytest.mark.slow
def test_node_limited_routing_sends_each_token_to_at_most_m_nodes():
  """On hierarchical's dispatch plan: the (token, node) rows a token sends over the node axis are the nodes its
  experts sit on, at most M = topk_routing_group when the routing groups are the nodes; without the limit the
  same tokens reach every node. One process of 16 devices plans both layouts, 2 nodes x 4 (on 8 of them, as a
  process of 8 would) and 4 x 4."""
  rows = _check(16, "nodes_per_token")
  assert [(r["layout"], r["node_limit"]) for r in rows] == [("expert2x4", None), ("expert2x4", 1), ("expert4x4", None),
                                                            ("expert4x4", 2)], rows
  for r in rows:
    assert r["rows_equal_expert_nodes"], r
    if r["node_limit"]:
      assert r["max_rows_per_token"] == r["node_limit"], r
    else:
      assert r["max_rows_per_token"] == r["nodes"] > 1, r  # what the limit removes


def test_hierarchical_overflow_is_flagged_on_the_device_with_no_host_callback_or_all_reduce():
  """Every token to node 0's first rank, bound too small: the shards that sent past a buffer flag it, unreduced
  (the train step reduces every layer's once, MaxText/moe/overflow.py). The compiled block has no host callback and
  no all-reduce: the overflow check added a callback per layer call and, to word its message, two all-reduces
  over the expert axis besides the flag's own."""
  (row,) = _check(8, "overflow")
  assert row["shards"] == 8 and 0 < row["shards_flagged"] < 8, row  # the senders to node 0's first rank
  assert row["callbacks"] == 0 and row["all_reduces"] == 0, row


@pytest.mark.slow
def test_the_default_capacity_factor_holds_twice_a_balanced_share():
  """A fixed routing that sends one peer (a2a_padded), and one local rank of a node (hierarchical), twice its
  balanced share: capacity factor 1 overflows; the dispatchers' default, 2, does not, and matches the float32
  dense reference in loss and every gradient."""
  rows = _check(8, "default_capacity")
  assert [r["backend"] for r in rows] == ["a2a_padded", "hierarchical"]
  for r in rows:
    assert r["overflow_f1"] and not r["overflow_default"] and r["capacity_factor"] == 2.0, r
    assert r["loss_rel_err"] < 1e-5 and r["grad_err"] < 1e-5, r


@pytest.mark.slow
def test_fp8_dispatch_through_the_two_level_exchange_matches_one_device():
  rows = _check(8, "fp8")
  assert [(r["layout"], r["chunks"]) for r in rows] == [("expert2x4", 1), ("expert2x4", 2)]  # 2: overlap chunks
  for row in rows:
    assert row["loss_err"] < 1e-4 and row["x_and_router_grad_err"] < 1e-4 and not row["overflow"], row
  assert rows[0]["expert_grad_rel_err"] < 1e-6, rows  # every group's rows in one grouped GEMM: exact
  assert 0 < rows[1]["expert_grad_rel_err"] < 0.06, rows  # two chunks' tiles: within FP8's error (as test_ep.py)


@pytest.mark.slow
def test_gpu_kernel_typing_traces_through_the_two_level_exchange():
  rows = _check(8, "kernel_typing")
  assert len(rows) == 4 and [r for r in rows if r["error"]] == []


@pytest.mark.slow
@pytest.mark.parametrize("devices", [8, 16])
def test_the_node_exchange_crosses_nodes_and_the_local_one_does_not(devices):
  """The compiled block's all-to-alls, read by the planner's inventory with nodes of consecutive devices: a2a_padded's
  one exchange spans every node; hierarchical's are two rows of the expert axis, one between nodes (a group per
  local rank, one member per node, every byte inter-node) and one inside them (no inter-node byte), and fewer
  inter-node bytes in all."""
  flat, two_level = _check(devices, "inventory")
  nodes = 2 if devices == 8 else 4
  (a2a,) = flat["all_to_all"]
  assert a2a["crosses_nodes"] and a2a["group_size"] == devices
  assert a2a["inter_node_bytes"] == pytest.approx(a2a["wire_bytes"] * (devices - 4) / (devices - 1))
  across, inside = sorted(two_level["all_to_all"], key=lambda r: not r["crosses_nodes"])
  assert across["crosses_nodes"] and across["group_size"] == nodes and across["inter_node_bytes"] == across["wire_bytes"]
  assert not inside["crosses_nodes"] and inside["group_size"] == 4 and inside["inter_node_bytes"] == 0
  assert across["inter_node_bytes"] < a2a["inter_node_bytes"] / 2


# --- config -------------------------------------------------------------------------------------------------

TWO_NODES = ("moe_block=ours", "num_slices=2", "dcn_expert_parallelism=2", "ici_expert_parallelism=4",
             "ici_fsdp_parallelism=1")


def test_node_limited_routing_ties_the_groups_to_the_ep_nodes():
  """The routing groups are the EP nodes (more groups than nodes would limit groups, not nodes), M divides K (a node
  is scored by its top K/M), and upstream's block, which scores a group by its top 2, only where K/M = 2."""
  run = fork_config.load(["configs/deepseek3-tiny.yml", *TWO_NODES, "moe_node_limited_routing=true",
                          "n_routing_groups=-1", "topk_routing_group=1"])
  assert run.upstream["n_routing_groups"] == 2  # unset: one group per node

  def refused(*keys):
    with pytest.raises(fork_config.ConfigError) as e:
      fork_config.load(["configs/deepseek3-tiny.yml", *TWO_NODES, "moe_node_limited_routing=true", *keys])
    assert "\n" not in str(e.value)
    return str(e.value)

  msg = refused()  # the model's 4 groups on 2 nodes
  assert "'n_routing_groups' = 4 (" in msg and "configs/models/deepseek3-tiny.yml)" in msg and "'dcn_expert_parallelism' = 2" in msg
  assert "must equal dcn_expert_parallelism" in msg
  msg = refused("dcn_expert_parallelism=4", "ici_expert_parallelism=2", "num_slices=4", "n_routing_groups=2",
                "topk_routing_group=1")
  assert "'n_routing_groups' = 2 (command line)" in msg and "'dcn_expert_parallelism' = 4 (command line)" in msg
  msg = refused("dcn_expert_parallelism=4", "ici_expert_parallelism=2", "num_slices=4", "n_routing_groups=-1",
                "topk_routing_group=3")
  assert "'num_experts_per_tok' = 4 (" in msg
  assert "'topk_routing_group' = 3 (command line)" in msg and "M must divide K" in msg
  msg = refused("moe_block=upstream", "n_routing_groups=-1", "topk_routing_group=1")
  assert "'moe_block' = 'upstream' (command line)" in msg and "top K/M = 4/1" in msg
  run = fork_config.load(["configs/deepseek3-tiny.yml", *TWO_NODES, "moe_node_limited_routing=true",
                          "moe_block=upstream", "n_routing_groups=-1", "topk_routing_group=2"])  # K/M = 2: the same
  assert run.upstream["n_routing_groups"] == 2
  assert "moe_router=deepseek_v3" in refused("moe_router=upstream", "n_routing_groups=-1", "topk_routing_group=-1",
                                             "routed_bias_update_rate=0.0")
  assert "the nodes a token's experts" in refused("n_routing_groups=-1", "topk_routing_group=-1")


@pytest.mark.slow  # a run's start in a child, 20 s: the slow tier (scripts/test.sh --all, CI) runs it
def test_overlap_chunks_that_do_not_divide_the_tokens_stop_with_one_line_and_exit_2(tmp_path):
  """Checked on upstream's resolved config, before anything compiles (the node-limit mismatch above is refused
  while our keys load, as the other key clashes are)."""
  result = run_rejected(tmp_path, "configs/deepseek3-tiny.yml", *TWO_NODES, "moe_ep_overlap_chunks=3", run_name="bad",
                        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  lines = [line for line in result.stderr.splitlines() if line.startswith("maxtext-moe: config error:")]
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
  assert ("config key 'moe_ep_overlap_chunks' = 3 (as set): must divide the tokens per device, per_device_batch_size "
          "x max_target_length = 256") in lines[0]


@pytest.mark.parametrize("key,value,why", [
    ("moe_hierarchical_capacity_factor", "inf", "Input should be a finite number"),  # was an OverflowError at trace
    ("moe_ep_overlap_chunks", "256", "Input should be less than or equal to 8"),  # was a compile of over 5 minutes
])
def test_unbounded_ep_keys_stop_with_one_line_and_exit_2(key, value, why):
  line = config_error_line("configs/deepseek3-tiny.yml", *TWO_NODES, "moe_dispatch_backend=hierarchical",
                           f"{key}={value}")
  assert f"config key '{key}' = " in line and value in line and why in line


# --- training runs ------------------------------------------------------------------------------------------

EIGHT_CPUS = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
# One MoE layer (3 dense + 1), 64 tokens a sequence, 8 sequences, float32; 2 routing groups of 4 experts, one kept
# per token, top-2: on 2 nodes, node-limited routing to M = 1 node, whose score (the top K/M = 2) is the
# group-limited one, so the routing is the same on every layout.
COMMON = ("moe_block=ours", "dtype=float32", "base_num_decoder_layers=4", "max_target_length=64",
          "num_experts_per_tok=2", "n_routing_groups=2", "topk_routing_group=1", "learning_rate_schedule_steps=6",
          "checkpoint_period=3",
          # Buffers at the EP size: this routing (2 of one group's 4 experts) passes the default's 2x a balanced
          # share (the run stops at step 0, exit 8), and a run that dropped rows would not be the one-device run's.
          "moe_a2a_padded_capacity_factor=8", "moe_hierarchical_capacity_factor=8")
ONE_NODE_OF_8 = ("per_device_batch_size=1", "ici_expert_parallelism=8", "ici_fsdp_parallelism=1", "moe_dispatch_backend=a2a_padded")
TWO_NODES_OF_4 = ("per_device_batch_size=1", "num_slices=2", "dcn_expert_parallelism=2", "ici_expert_parallelism=4", "ici_fsdp_parallelism=1",
                  "moe_dispatch_backend=hierarchical", "moe_node_limited_routing=true")


def _grad_norms(run_dir: Path) -> dict[int, float]:
  """Each step's raw gradient norm from the run directory's event files (a resumed run adds one)."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # pylint: disable=import-outside-toplevel

  norms: dict[int, float] = {}
  for events in sorted(glob.glob(str(run_dir / "tensorboard" / "**" / "events.out.tfevents.*"), recursive=True)):
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    norms.update({e.step: e.value for e in acc.Scalars("learning/raw_grad_norm")})
  assert norms, run_dir
  return norms


def _close(got: dict[int, float], want: dict[int, float], what: str = "loss") -> None:
  """float32 everywhere and the same weights and data: another mesh changes only the order of float32 reductions,
  so each step's value agrees to 1e-5 relative (as tests/test_pipeline.py), far below a step's change (> 1%) and
  what a wrong dispatch in one MoE layer moves."""
  assert sorted(got) and set(got) <= set(want), (what, got, want)
  for step, value in got.items():
    assert abs(value - want[step]) <= 1e-5 * abs(want[step]), (what, step, got, want)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """The reference the runs below are held to: the same global batch of 8 sequences on one device, 6 steps (the
  learning-rate schedule's length in COMMON, so its first 3 steps are a 3-step run's)."""
  one = run_train(tmp_path_factory.mktemp("one"), *COMMON, "per_device_batch_size=8", "steps=6",
                  "enable_checkpointing=false", run_name="one")
  assert one.returncode == 0, one.stderr[-3000:]
  assert one.losses()[2] < one.losses()[0]  # it trains
  return one


@pytest.mark.slow
def test_a_checkpoint_of_two_nodes_of_four_resumes_on_one_node_of_eight(tmp_path, one_device):
  """EP 8 as DCN 2 x ICI 4 (the two-level dispatch, node-limited routing) for 3 steps, resumed as ICI 8 (flat
  a2a_padded) for 3 more: the losses and gradient norms of one unbroken run on one device."""
  first = run_train(tmp_path, *COMMON, *TWO_NODES_OF_4, "steps=3", run_name="split", env=EIGHT_CPUS)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "(dispatch hierarchical, gmm xla, EP 8 = 2 nodes x 4)" in first.stdout
  first_losses = first.losses()
  second = run_train(tmp_path, *COMMON, *ONE_NODE_OF_8, "steps=6", run_name="split", env=EIGHT_CPUS)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resuming from checkpoint step 2" in second.stdout and "(dispatch a2a_padded, gmm xla, EP 8)" in second.stdout
  assert sorted(first_losses) == [0, 1, 2] and sorted(second.losses()) == [3, 4, 5]
  _close({**first_losses, **second.losses()}, one_device.losses())
  norms = _grad_norms(second.run_dir)  # both runs' event files
  assert sorted(norms) == list(range(6)), norms
  _close(norms, _grad_norms(one_device.run_dir), "gradient norm")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ring", "a2a_padded", "hierarchical"])
def test_training_on_two_nodes_of_four_matches_one_device(tmp_path, one_device, backend):
  """`python -m MaxText.train` with dcn_expert_parallelism=2 x ici_expert_parallelism=4 on 8 CPU devices against
  one device, same global batch of 8 sequences."""
  run = run_train(tmp_path, *COMMON, *TWO_NODES_OF_4[:5], f"moe_dispatch_backend={backend}", "steps=3",
                  "enable_checkpointing=false", run_name="nodes", env=EIGHT_CPUS)
  assert run.returncode == 0, run.stderr[-3000:]
  assert f"(dispatch {backend}, gmm xla, EP 8" in run.stdout
  assert sorted(run.losses()) == [0, 1, 2]
  _close(run.losses(), one_device.losses())
  _close(_grad_norms(run.run_dir), _grad_norms(one_device.run_dir), "gradient norm")


# --- the exchange beside the grouped GEMMs (compile-only H200s) ---------------------------------------------


@pytest.mark.slow
def test_overlap_chunks_put_the_exchange_beside_the_grouped_gemms_on_the_h200_schedule():
  """The block (mgpu's Mosaic GEMMs, EP 8 = 2 nodes x 4, the EP recipes' XLA flags) compiled for compile-only H200s;
  MaxText/plan/overlap.py reads the schedule. In one pass almost nothing runs beside the exchanges: the only
  independent work is the dispatch's own gathers. In two chunks, one chunk's row exchanges run beside the other's
  grouped GEMMs: about half the all-to-all bytes. Not every all-to-all: the first chunk's dispatch has no GEMM
  before it, the last chunk's combine none after it, and XLA's cost model prices a GEMM custom call at almost
  nothing, so it fills many windows with the gathers instead (BENCHMARKS.md, "Dispatch and expert parallelism")."""
  require_gpu_plan("h200")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  rows = {}
  for backend in ("hierarchical", "a2a_padded"):
    proc = subprocess.run([sys.executable, str(HERE / "ep_overlap_check.py"), backend, "1", "2"], cwd=HERE.parent,
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in proc.stdout.splitlines():
      if line.startswith("{"):
        r = json.loads(line)
        rows[(r["backend"], r["chunks"])] = r
  share = {k: r["bytes_beside_gemm"] / r["bytes"] for k, r in rows.items()}
  assert all(r["mosaic"] > 0 for r in rows.values())  # the grouped GEMMs are our Mosaic kernels
  assert share[("hierarchical", 1)] < 0.05 and share[("hierarchical", 2)] > 0.4, share
  # 2 chunks double 1 chunk's share: 0.5 against 0.25, to float32 rounding of the byte counts
  assert share[("a2a_padded", 2)] >= 1.99 * share[("a2a_padded", 1)] > 0, share
  assert rows[("hierarchical", 2)]["async_beside_gemm"] > rows[("hierarchical", 1)]["async_beside_gemm"], rows


@pytest.mark.slow
def test_overlap_chunks_change_nothing_without_ep(tmp_path):
  """One device (EP 1): the train step's program with moe_ep_overlap_chunks=2 is the one without, op for op, so the
  one-H200 proxy cannot change (patches/routed_moe.py applies the chunks only under EP). Under EP 2 the key changes
  the program: the check is not vacuous."""
  def lowered(*args, devices=1):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run([sys.executable, str(HERE / "lower_train_step.py"), "configs/deepseek3-tiny.yml", "steps=1",
                           "enable_checkpointing=false", f"base_output_directory={tmp_path}", "moe_block=ours",
                           "moe_gmm_backend=xla", "base_num_decoder_layers=4", "max_target_length=64", *args],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout

  assert lowered("moe_ep_overlap_chunks=2") == lowered("moe_ep_overlap_chunks=1")
  ep = ("ici_expert_parallelism=2", "ici_fsdp_parallelism=1", "moe_dispatch_backend=a2a_padded")
  assert lowered(*ep, "moe_ep_overlap_chunks=2", devices=2) != lowered(*ep, "moe_ep_overlap_chunks=1", devices=2)
