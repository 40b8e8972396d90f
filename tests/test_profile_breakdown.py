"""tools/profile_breakdown.py: the classifier table, the HLO reader, and a real traced tiny run."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO, run_train

_spec = importlib.util.spec_from_file_location("profile_breakdown", REPO / "tools" / "profile_breakdown.py")
pb = importlib.util.module_from_spec(_spec)
sys.modules["profile_breakdown"] = pb
_spec.loader.exec_module(pb)


@pytest.mark.parametrize(
    "descriptor, frames, expected",
    [
        # our named scopes (MaxText/moe/block.py), forward and backward
        ("jit(train_step)/jvp()/while/body/eval_jaxpr/gmm/dot_general", (), "gmm"),
        ("jit(train_step)/transpose(jvp())/while/body/checkpoint/rematted_computation/gmm_dlhs/dot", (), "gmm"),
        ("jit(train_step)/jvp()/while/body/eval_jaxpr/dispatch/jit(searchsorted)/while", (), "dispatch_combine"),
        ("jit(train_step)/transpose(jvp())/while/body/combine/mul", (), "dispatch_combine"),
        ("jit(train_step)/jvp()/while/body/route/top_k", (), "route"),
        # upstream's scopes and ops
        ("jit(train_step)/jvp()/sort_activations/gather", (), "dispatch_combine"),
        ("jit(train_step)/jvp()/weight_sum/reduce_sum", (), "dispatch_combine"),
        ("jit(train_step)/jvp()/ragged_dot_general", (), "gmm"),
        ("jit(train_step)/jvp()/wi_0/dot_general", (), "gmm"),
        ("jit(train_step)/jvp()/ragged_all_to_all", (), "dispatch_combine"),
        ("all-to-all.3", (), "dispatch_combine"),
        # kernels: custom-call targets and GPU kernel names
        ("jit(train_step)/jvp()/dot_product_attention __cudnn$fmhaSoftmax", (), "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_knob_7", (), "attention"),
        ("flash_fprop_kernel", (), "attention"),
        # cuDNN's Hopper attention kernels carry "wgmma": not a grouped GEMM
        ("sm90_flash_bprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0", (), "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_wgmma_kernel", (), None),
        ("jit(train_step)/x mosaic_gpu", (), "gmm"),
        ("jit(train_step)/jvp()/btkgd,bskd->bkgts/dot_general", (), "attention"),
        # nameless backward ops decided by their source frames, innermost first
        ("jit(train_step)/transpose(jvp())/transpose", ("maxtext/layers/attention_op.py:AttentionOp.qk_product",
                                                         "maxtext/layers/attention_mla.py:MLA.__call__"), "attention"),
        ("jit(train_step)/transpose(jvp())/transpose", ("MaxText/moe/gmm/__init__.py:gmm",
                                                         "MaxText/moe/block.py:expert_ffn"), "gmm"),
        ("jit(train_step)/jvp()/gather", ("maxtext/layers/moe.py:RoutedMoE.permute",), "dispatch_combine"),
        ("jit(train_step)/jvp()/mul", ("maxtext/layers/moe.py:RoutedMoE.unpermute",), "dispatch_combine"),
        ("jit(train_step)/jvp()/top_k", ("maxtext/layers/moe.py:RoutedMoE.get_topk",), "route"),
        ("jit(train_step)/jvp()/dot", ("maxtext/layers/moe.py:RoutedMoE.sparse_matmul.<locals>.gmm",), "gmm"),
        # the rest: projections, dense MLP, optimizer, output head
        ("jit(train_step)/transpose(jvp())/transpose", ("maxtext/layers/linears.py:_compute_dot_general_nnx",
                                                         "maxtext/layers/linears.py:MlpBlock.__call__"), None),
        ("jit(train_step)/jit(tree_bias_correction)/div", (), None),
        ("jit(train_step)/mul", ("maxtext/layers/attention_mla.py:MLA.mla_query_projection",), None),
        # no false hits: "wo" only as a whole scope, "transpose" is not "permute"
        ("jit(train_step)/word/two/transpose", (), None),
    ],
)
def test_classifier_table(descriptor, frames, expected):
  assert pb.classify(descriptor, frames) == expected


_HLO = """HloModule jit_train_step, is_scheduled=true

FileNames
1 "/x/site-packages/maxtext/layers/attention_op.py"
2 "/repo/MaxText/moe/block.py"

FunctionNames
1 "AttentionOp.qk_product"
2 "expert_ffn"

FileLocations
1 {file_name_id=1 function_name_id=1 line=3122 end_line=3122 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=90 end_line=90 column=1 end_column=2}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %multiply.1 = f32[4]{0} multiply(%param_0, %param_0), metadata={op_name="jit(train_step)/combine/mul"}
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %multiply_fusion = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_computation
  %dot.7 = f32[4]{0} multiply(%multiply_fusion, %p), metadata={op_name="jit(train_step)/transpose(jvp())/transpose" stack_frame_id=2}
  %cc = f32[4]{0} custom-call(%dot.7), custom_call_target="__cudnn$fmhaSoftmax"
  %while.3 = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, metadata={op_name="jit(train_step)/while"}
  ROOT %copy.1 = f32[4]{0} copy(%cc)
}
"""


def test_parse_hlo_resolves_fusions_frames_and_targets():
  ops = pb.parse_hlo(_HLO)
  assert ops["multiply_fusion"].descriptor == "jit(train_step)/combine/mul"  # from the fused root
  assert ops["dot.7"].frames[0] == "maxtext/layers/attention_op.py:AttentionOp.qk_product"
  assert pb.classify(ops["dot.7"].descriptor, ops["dot.7"].frames) == "attention"
  assert "__cudnn$fmhaSoftmax" in ops["cc"].descriptor
  assert ops["while.3"].opcode == "while" and "while" in pb.CONTROL_FLOW
  # no metadata of its own: takes its operand's (the attention custom call)
  assert ops["copy.1"].inherited and pb.classify(ops["copy.1"].descriptor, ops["copy.1"].frames) == "attention"
  assert not ops["dot.7"].inherited


def test_summarize_falls_back_to_annotation_then_kernel_name():
  """GPU-shaped events (no dump entry): the runtime's op_name annotation, then
  the kernel name decide; other modules and control flow are kept out."""
  ev = pb.OpEvent
  events = [
      ev("sm90_xmma_gemm", "fusion.1", "jit_train_step", 1, 4_000_000, "while/body/gmm/dot_general"),
      ev("nccl_AllToAll_kernel", None, "jit_train_step", 1, 1_000_000),
      ev("cudnn_generated_fort_native_sdpa_sm90", "custom-call.3", "jit_train_step", 1, 2_000_000),
      ev("loop_add_fusion", "add.9", "jit_train_step", 1, 2_000_000, "while/body/add"),
      ev("MemcpyD2D", None, "jit_train_step", 1, 1_000_000),
      ev("while.5", "while.5", "jit_train_step", 1, 9_000_000),  # spans its body: skipped
      ev("loop_rng", "rng.1", "jit_raw_generate_synthetic_data", 2, 5_000_000),
  ]
  step_map = {"while.5": pb.HloOp("while", "jit(train_step)/while", ())}
  out = pb.summarize(events, step_map, steps=2)
  ms = {c: v["ms_per_step"] for c, v in out["categories"].items()}
  assert ms == {"gmm": 2.0, "dispatch_combine": 0.5, "route": 0.0, "attention": 1.0, "rest": 1.0,
                "unattributed": 0.5}
  assert out["total_ms_per_step"] == 5.0
  assert out["other_modules_ms_per_step"] == {"jit_raw_generate_synthetic_data": 2.5}
  assert out["top_unattributed"] == [["MemcpyD2D", 0.5]]


def test_summarize_picks_the_dump_of_the_events_program():
  """Two compilations of jit_train_step can reuse instruction names: the event's program id decides."""
  events = [pb.OpEvent("fusion.1", "fusion.1", "jit_train_step", 1, 1_000_000, "", 7),
            pb.OpEvent("fusion.1", "fusion.1", "jit_train_step", 1, 3_000_000, "", 8)]
  by_program = {7: {"fusion.1": pb.HloOp("fusion", "jit(train_step)/gmm/dot", ())},
                8: {"fusion.1": pb.HloOp("fusion", "jit(train_step)/combine/mul", ())}}
  out = pb.summarize(events, by_program[8], steps=1, by_program=by_program)
  assert out["categories"]["gmm"]["ms_per_step"] == 1.0
  assert out["categories"]["dispatch_combine"]["ms_per_step"] == 3.0


@pytest.mark.slow
def test_traced_tiny_run_breaks_down_the_step(tmp_path):
  """A real profiled tiny run (our MoE block on CPU): every category the brief
  names gets time, the categories add up to the total, little is unattributed."""
  run_dir = tmp_path / "outputs" / "prof"
  result = run_train(
      tmp_path, "configs/deepseek3-tiny.yml", "moe_block=ours", "steps=6", "enable_checkpointing=false",
      "profiler=xplane", "skip_first_n_steps_for_profiler=2", "profiler_steps=3", "dump_hlo=true",
      run_name="prof",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  out = pb.breakdown(run_dir)
  assert out["hlo_dump_found"] and out["device"] == "cpu"
  assert out["steps"] == 3  # distinct executions of the step module in the trace
  assert out["events_with_hlo_metadata"] > 0.5 * out["events"]  # the dump matched the trace's ops
  cats = out["categories"]
  for name in ("gmm", "dispatch_combine", "attention", "route"):
    assert cats[name]["ms_per_step"] > 0, (name, pb.format_breakdown(out))
  total = sum(c["ms_per_step"] for c in cats.values())
  assert total == pytest.approx(out["total_ms_per_step"], rel=0.01)
  assert cats["unattributed"]["share"] < 0.10, pb.format_breakdown(out)
  assert out["top_rest"], "the top ops of rest are listed so misclassification shows"
  text = pb.format_breakdown(out, title="ours")
  assert "gmm" in text and "dispatch_combine" in text and "unattributed" in text
  # The step's largest buffers come from XLA's memory-usage report in the same dump.
  sizes = [b["bytes"] for b in out["largest_buffers"]]
  assert len(sizes) == 5 and sizes == sorted(sizes, reverse=True) and sizes[0] > 0
  assert all("[" in b["shapes"] for b in out["largest_buffers"])
  assert "largest buffers" in text


def test_bench_train_reports_loss_gap_to_upstream():
  """bench_train's loss section: per-step losses, and each variant's largest gap to the first
  upstream variant over their common steps (a failed variant has no losses and is left out)."""
  from conftest import load_script
  bt = load_script("bench_train", "tools/bench_train.py")
  rows = [{"variant": "ours", "losses": {"0": 10.0, "1": 9.0, "2": 8.5}},
          {"variant": "upstream_tokamax", "losses": {"0": 10.0, "1": 9.02, "2": 8.49}},
          {"variant": "upstream_ragged", "error": "out of memory"}]
  text = bt.format_losses(rows)
  assert "max |loss - upstream_tokamax| over 3 steps, ours: 0.0200" in text
  # the last tenth (here one step) relative: (8.5 - 8.49) / 8.49
  assert ("(loss - upstream_tokamax) / upstream_tokamax over the last 1 steps, ours: mean +0.118%, "
          "largest |.| 0.118%") in text
  assert "upstream_ragged" not in text
  assert text.splitlines()[0].split() == ["loss", "by", "step", "ours", "upstream_tokamax"]


def test_bench_train_table_takes_tokens_per_second_from_the_run():
  """tok/s/dev is MaxText's own figure from summary.json, not batch arithmetic from a flag
  (which went stale whenever a variant changed the batch); a failed run keeps its row."""
  from conftest import load_script
  bt = load_script("bench_train", "tools/bench_train.py")
  rows = [{"variant": "ours", "median_step_time_s": 1.5, "median_tflops_per_device": 478.2,
           "median_tokens_per_s_per_device": 22156.0, "peak_device_memory_gib": 100.3, "dropless": True},
          {"variant": "ours_b12", "error": "out of memory", "dropless": True}]
  lines = bt.format_table(rows, peak=650.0, tokens_per_step=16384).splitlines()
  assert lines[2].split()[:6] == ["ours", "1.500", "478.2", "0.736", "0.484", "22156"]
  assert lines[3].split()[0] == "ours_b12" and lines[3].endswith("out of memory")
