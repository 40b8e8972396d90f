"""Planning for GPUs this machine does not have (MaxText/plan/gpu_target.py): XLA's GPU compiler on compile-only
devices built from a shipped target config, no GPU used.

The fast tier checks the pieces that need no CUDA plugin: the shipped target configs, the topology spec,
when the planner picks this path and what it substitutes. The slow tier (CI installs the plugin with
`scripts/bootstrap.sh --gpu-plan`) compiles the tiny model for 16 H100s on two nodes and checks the
compiler's figures against the state's own bytes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, require_gpu_plan
from MaxText import hardware
from MaxText.plan import aot, gpu_target, planner as plan
from MaxText import config as fork_config


def _fields(text: str) -> dict[str, str]:
  return dict(re.findall(r"^\s*(\w+): (.+)$", text, re.M))


def test_the_h100_target_is_the_captured_h200_with_the_h100s_memory():
  h200, h100 = (gpu_target.config_path(g).read_text() for g in ("h200", "h100"))
  a, b = _fields(h200), _fields(h100)
  differ = {k for k in a if a[k] != b.get(k)}
  assert differ == {"memory_bandwidth", "l2_cache_size", "device_memory_size", "name", "model_str", "mem_clock_ghz",
                    "device_description_str"}
  assert int(b["device_memory_size"]) == 84_942_979_072  # what an H100 80 GB reports (79.1 GiB)
  assert int(a["device_memory_size"]) == 150_109_880_320  # read on the workplace H200
  assert a["core_count"] == b["core_count"] == "132"
  assert set(hardware.GPUS) >= {"h100", "h200", "b200"}


def test_the_b200_target_is_blackwells_hardware_with_the_images_software():
  """sm_100a, 148 SMs, 191.5e9 B (XLA's B200 spec); the driver, CUDA and cuDNN of the image the H200 was read on,
  so the compile takes the same cuDNN paths."""
  h200, b200 = (gpu_target.config_path(g).read_text() for g in ("h200", "b200"))
  a, b = _fields(h200), _fields(b200)
  assert (b["core_count"], b["device_memory_size"], b["l2_cache_size"], b["name"]) == (
      "148", "191514411008", "132644864", '"NVIDIA B200"')
  assert re.search(r"cuda_compute_capability \{\s*major: 10\n\s*feature_extension: ACCELERATED_FEATURES", b200)
  assert b["platform_version"] == '"Compute Capability 10.0a"' and "active_links" in b
  for software in ("driver_version", "runtime_version", "compile_time_toolkit_version", "dnn_version", "cub_version"):
    assert a[software] == b[software], software
  assert gpu_target.device_memory_size("b200") == 191_514_411_008 > hardware.GPUS["b200"].hbm_bytes.value


def test_a_kernel_stand_in_reports_hopper_for_blackwell():
  """Our grouped GEMMs do not compile for sm_100a here: a MoE step for a B200 compiles for sm_90a devices with the
  B200's memory and SMs; a step without them, and any Hopper target, compiles as the target."""
  text = gpu_target.config_path("b200").read_text()
  hopper = gpu_target.with_compute_capability(text, "9.0")
  assert re.search(r"cuda_compute_capability \{\s*major: 9\n\s*feature_extension", hopper)
  assert _fields(hopper)["core_count"] == "148" and hopper.count("major: 10") == 0
  assert "minor: 3" in gpu_target.with_compute_capability(text, "10.3")
  assert gpu_target.kernel_stand_in("b200", True)[0] == "9.0"
  assert gpu_target.kernel_stand_in("b200", False) is None and gpu_target.kernel_stand_in("h200", True) is None


def test_one_slice_per_node_and_one_process_per_gpu():
  assert gpu_target.topology_spec(128, 8) == "16x8x1"
  assert gpu_target.topology_spec(1024, 8) == "128x8x1"
  assert gpu_target.topology_spec(4, 8) == "1x4x1"


def test_the_planner_compiles_for_the_target_only_where_it_can(monkeypatch):
  monkeypatch.setattr(gpu_target, "plugin_importable", lambda: True)
  assert aot.choose_topology(128, 8, 0, "h100").platform == "gpu_target"
  assert aot.choose_topology(128, 8, 1, "h100").platform == "gpu_target"  # a local GPU is not the target
  assert aot.choose_topology(128, 8, 1, "h100", mode="mock").platform == "gpu"
  assert aot.choose_topology(128, 8, 1, "h100", mode="cpu").platform == "cpu"
  assert aot.choose_topology(4, 8, 0, None).platform == "cpu"  # no target named
  assert aot.choose_topology(4, 8, 0, "b200").platform == "gpu_target"
  assert aot.choose_topology(4, 8, 0, "gb200").platform == "cpu"  # no target config shipped
  with pytest.raises(aot.PlanError, match="--mock compiles on this machine's GPU"):
    aot.choose_topology(4, 8, 0, "h100", mode="mock")
  monkeypatch.setattr(gpu_target, "plugin_importable", lambda: False)
  assert "bootstrap.sh --gpu-plan" in gpu_target.unavailable_reason("h100")
  assert aot.choose_topology(128, 8, 0, "h100").platform == "cpu"


def test_a_target_the_planner_cannot_compile_for_says_why(monkeypatch, capsys):
  """A recipe names target_gpu, the plugin is missing: the CPU fallback says what to install."""
  monkeypatch.setattr(gpu_target, "plugin_importable", lambda: False)
  monkeypatch.setattr(plan, "compile_in_child", lambda *a, **k: {"config_error": "stop here"})
  with pytest.raises(fork_config.ConfigError, match="stop here"):
    plan.plan(["configs/deepseek3-tiny.yml", "target_gpu=h100", "recipe_num_gpus=4", "ici_fsdp_parallelism=4"],
              local_gpus=0)
  assert "not compiling for compile-only h100 devices: jax's CUDA plugin is not installed: scripts/bootstrap.sh --gpu-plan" \
      in capsys.readouterr().out


@pytest.mark.parametrize("extra, stand_in", [(["moe_block=ours", "moe_gmm_backend=te"], True),
                                             (["moe_block=ours", "moe_fp8=mxfp8"], True),
                                             (["moe_block=upstream"], False)])
def test_a_b200_moe_plan_compiles_hopper_kernels_for_te_and_says_so(monkeypatch, capsys, extra, stand_in):
  seen = {}

  def child(args, topology, *rest, **kw):
    seen.update(args=args, topology=topology)
    return {"config_error": "stop here"}

  monkeypatch.setattr(gpu_target, "plugin_importable", lambda: True)
  monkeypatch.setattr(plan, "compile_in_child", child)
  with pytest.raises(fork_config.ConfigError, match="stop here"):
    plan.plan(["configs/deepseek3-tiny.yml", "target_gpu=b200", "recipe_num_gpus=4", "ici_fsdp_parallelism=4", *extra],
              local_gpus=0)
  out = capsys.readouterr().out
  assert seen["topology"].platform == "gpu_target" and seen["topology"].target_gpu == "b200"
  assert seen["topology"].compute_capability == ("9.0" if stand_in else None)
  assert ('moe_gmm_backend="auto"' in seen["args"]) == ("moe_gmm_backend=te" in extra)
  assert ('moe_fp8="none"' in seen["args"]) == ("moe_fp8=mxfp8" in extra)  # TE quantizes inside: bf16's program
  assert ("Hopper's kernels standing in for TE's grouped GEMM" in out) == stand_in


def test_only_the_expert_load_callback_is_left_out_of_a_gpu_plan():
  """The overflow check has no host callback (MaxText/moe/overflow.py): the plan compiles the run's own program."""
  run = fork_config.load(["configs/deepseek3-tiny.yml", "moe_block=ours", "moe_log_expert_load=true"])
  assert plan.gpu_target_substitutes(run) == {"moe_log_expert_load": False}
  run = fork_config.load(["configs/deepseek3-tiny.yml", "moe_block=ours"])
  assert run.fork.moe_a2a_padded_on_overflow == "error" and plan.gpu_target_substitutes(run) == {}


@pytest.mark.slow
def test_tiny_model_for_16_h100s_on_two_nodes_without_a_gpu(tmp_path):
  """The compiler's argument bytes are the state's: bf16 parameters + AdamW's two moments + the step counter
  split 16 ways, and the batch; FSDP gathers cross the two nodes; the verdict is against the H100's HBM. The
  step estimate read off the scheduled HLO (MaxText/plan/schedule.py) is consistent: no term negative, the
  critical path the stream's work plus the waits, every transfer the inventory counted walked once per trip."""
  require_gpu_plan("h100")
  path = tmp_path / "plan.json"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  out = subprocess.run([sys.executable, "-m", "MaxText.plan", "configs/deepseek3-tiny.yml", "target_gpu=h100",
                        "recipe_num_gpus=16", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2",
                        "dcn_fsdp_parallelism=2", "moe_block=ours", "per_device_batch_size=2", "max_target_length=64",
                        "--json", str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "compile-only H100 SXM 80 GB devices" in out.stdout
  assert "moe_a2a_padded_on_overflow=flag" not in out.stdout  # the run's program: no substitute for the overflow
  r = json.loads(path.read_text())
  assert r["platform"] == "gpu_target" and r["mesh"]["expert"] == 4 and r["mesh"]["fsdp"] == 4
  assert r["verdict"]["fits"] and not r["verdict"]["marginal"] and r["verdict"]["usable_bytes"] == hardware.GPUS["h100"].hbm_bytes.value * 0.75
  kinds = {(c["kind"], tuple(c["axes"])): c for c in r["collectives"]}
  assert any(k == "all-to-all" and "expert" in axes for k, axes in kinds)  # a2a_padded's exchange
  assert any(c["crosses_nodes"] for c in r["collectives"] if c["kind"] == "all-gather")  # dcn fsdp
  assert r["memory"]["arguments"] > 0 and r["memory"]["temporaries"] > 0
  e = r["estimate"]
  assert all(e[k] >= 0 for k in ("gemm_s", "fp8_gemm_s", "attention_s", "hidden_flops_s", "memory_s", "collectives_s",
                                 "exposed_collectives_s", "overlapped_collectives_s", "offload_s", "bubble_s"))
  assert e["gemm_s"] > 0 and e["memory_s"] > 0 and e["memory_bytes"] > 0 and e["kernels"] > 100
  assert e["compute_s"] == pytest.approx(e["gemm_s"] + e["fp8_gemm_s"] + e["attention_s"] + e["hidden_flops_s"])
  assert e["collectives_s"] == pytest.approx(e["exposed_collectives_s"] + e["overlapped_collectives_s"])
  assert e["overlapped_collectives_s"] > 0 and e["exposed_collectives_s"] > 0  # some hidden behind work, some not
  assert e["contention_s"] > 0  # kernels beside the exchange run at (1 - hardware.COLLECTIVE_SM_SHARE) of their rate
  assert e["step_s"] == pytest.approx(e["compute_s"] + e["memory_s"] + e["contention_s"] + e["exposed_collectives_s"]
                                      + e["offload_exposed_s"])  # no bubble
  assert e["step_s"] < e["serial_step_s"] == pytest.approx(e["compute_s"] + e["memory_s"] + e["collectives_s"]
                                                           + e["offload_s"])
  assert sum(c["seconds"] for c in r["collectives"]) == pytest.approx(e["collectives_s"])
  assert sum(c["exposed_s"] for c in r["collectives"]) == pytest.approx(e["exposed_collectives_s"])
  assert all(0 <= c["exposed_s"] <= c["seconds"] * (1 + 1e-9) for c in r["collectives"])
  assert r["account"]["ok"], r["account"]["violations"]  # the rows and the walk: one account (MaxText/plan/account.py)
  assert "one account (MaxText/plan/account.py): holds" in out.stdout
  # The layout's arithmetic beside the compiler's (MaxText/plan/analytic_comms.py): the routed experts' gathers over
  # fsdp to the byte; a2a_padded's exchange is its capacity-2 buffer, twice the dropless minimum; the experts'
  # gradient leaves our block reduce-scattered over fsdp, as the layout needs (it was all-reduced whole before the
  # block took the weights split: tests/test_expert_grad_sharding.py), and no row is "reduced whole".
  table = {(row["kind"], tuple(row["axes"])): row for row in r["layout_comms"]["table"]}
  assert table[("all-gather", ("fsdp",))]["ratio"] == pytest.approx(1.0)
  assert table[("all-to-all", ("expert",))]["ratio"] == pytest.approx(1.0, rel=1e-3)
  assert table[("all-to-all", ("expert",))]["cause"] == "padding: the capacity-padded buffer, 2x the dropless minimum"
  assert ("all-reduce", ("fsdp",)) not in table or table[("all-reduce", ("fsdp",))]["cause"] is None
  assert not any((row["cause"] or "").startswith("reduced whole") for row in table.values()), table
  assert table[("reduce-scatter", ("fsdp",))]["cause"] is None
  assert "collectives by the layout's arithmetic" in out.stdout
  assert e["tflops_per_gpu"] == pytest.approx(e["model_tflops_per_device"] / e["step_s"])
  # a2a_padded's receive buffers hold the worst case (1,024 rows for 512 routed ones here) and the kernels' tiles pad
  # the tiny widths (an expert's 32 to 128): the grouped GEMMs come down to the routed experts' FLOPs.
  assert [n.split(" (")[0] for n in e["notes"]] == ["our grouped GEMMs' shapes hold 16x the routed experts' FLOPs"]
  assert "critical path through the scheduled step" in out.stdout and "memory-bound" in out.stdout


_FP8_ROUND_TRIP = """
import sys
from MaxText.plan import gpu_target
device = gpu_target.enter("h200", 1, 8)[0]
import jax, jax.numpy as jnp
from MaxText.moe.gmm import fp8_quant, xla_fp8
s = jax.sharding.SingleDeviceSharding(device)
arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s)
sizes = jnp.array([100, 156], jnp.int32)
row_tiles = lambda x: fp8_quant.dequantize_row_tiles(*fp8_quant.kept(fp8_quant.quantize_row_tiles(x)))
gmm = lambda x, w: xla_fp8.gmm(x, w, sizes, group_offset=0, transpose_rhs=False, out_dtype=jnp.float32)
tgmm = lambda x, d: xla_fp8.tgmm(x, d, sizes, group_offset=0, num_local_groups=2, out_dtype=jnp.float32)
for name, fn, args in (("row tiles", row_tiles, (arg(256, 512),)), ("xla_fp8 gmm", gmm, (arg(256, 256), arg(2, 256, 256))),
                       ("xla_fp8 tgmm", tgmm, (arg(256, 256), arg(256, 384)))):
  text = jax.jit(fn).lower(*args).compile().as_text()
  print(name, "keeps e4m3" if "f8e4m3fn" in text else "LOST e4m3")
"""


@pytest.mark.slow
def test_the_e4m3_rounding_survives_xlas_gpu_pipeline():
  """The self-test on the H200 (2026-12-02): under jit XLA's GPU pipeline dropped the quantize-then-dequantize
  convert pair as excess precision, so xla_fp8 (the FP8 reference) multiplied unquantized values. Compiled
  for a compile-only H200, the e4m3 converts must still be in the optimized HLO of fp8_quant.kept's round
  trip and of xla_fp8's products (the forward and dlhs form, and dW's)."""
  require_gpu_plan("h200")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  out = subprocess.run([sys.executable, "-c", _FP8_ROUND_TRIP], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.count("keeps e4m3") == 3, out.stdout


@pytest.mark.slow
def test_fp8_experts_compile_for_two_h200s_over_expert_parallelism_without_a_gpu(tmp_path):
  """moe_fp8's Mosaic GPU kernels (forward, dlhs, dW) and FP8 dispatch through XLA's GPU pipeline for sm_90a, two
  devices at EP=2 with a2a_padded: the path CI can compile but never run. The estimate costs the routed GEMMs at
  the FP8 rate."""
  require_gpu_plan("h200")
  path, hlo = tmp_path / "plan.json", tmp_path / "step.hlo"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  out = subprocess.run([sys.executable, "-m", "MaxText.plan", "configs/deepseek3-tiny.yml", "target_gpu=h200",
                        "recipe_num_gpus=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=1", "moe_block=ours",
                        "moe_fp8=blockwise", "per_device_batch_size=2", "max_target_length=64", "--json", str(path),
                        "--hlo", str(hlo)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  r = json.loads(path.read_text())
  assert r["platform"] == "gpu_target" and r["mesh"]["expert"] == 2 and r["verdict"]["fits"]
  assert 0 < r["estimate"]["fp8_flops"] < r["estimate"]["flops_per_device"]
  text = hlo.read_text()
  assert "f8e4m3fn" in text and "mosaic_gpu" in text  # the quantized operands reach our kernels
  # The tokens cross the exchange as packed e4m3 tiles (uint32 words), quantized before it (docs/fp8.md); the
  # SwiGLU output is quantized by the one-pass kernel, not by an XLA fusion of the up-projections' outputs;
  # dW's operands that are gathers of token rows stay XLA's; dlhs quantizes nothing itself: its dout is the
  # combine's moved tiles or the one-pass kernel's, and its weight blocks are the forward's.
  assert any("u32[" in line and ("all-to-all(" in line or "all-to-all-start(" in line) for line in text.splitlines())
  spec = importlib.util.spec_from_file_location("hlo_fp8_passes", REPO / "tests" / "hlo_fp8_passes.py")
  passes = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(passes)
  rows = passes.fp8_fusions(text)
  forward = [(kind, reads) for (kind, _, reads, where) in rows if where == "forward"]
  assert not any("all-to-all" in reads for _, reads in forward), rows
  assert any(kind == "mosaic" for kind, _ in forward), rows
  assert not any("mpmd_map" in reads for kind, reads in forward if kind != "mosaic"), rows
  assert any(where == "gmm_drhs" and kind != "mosaic" for (kind, _, _, where) in rows), rows
  assert not any(where == "gmm_dlhs" and kind != "mosaic" for (kind, _, _, where) in rows), rows
  assert any(c["kind"] == "all-to-all" and "expert" in c["axes"] for c in r["collectives"])


@pytest.mark.slow
def test_the_ep2_proxys_packed_fp8_rows_are_gathered_row_major(tmp_path):
  """The EP=2 proxy with FP8 experts, compiled for two H200s: every gather of the packed uint32 rows writes them
  row-major. Without fp8_dispatch's layout constraint the kernel's transposed scales ([K'/128, M]) had XLA write
  the forward's last gather of the exchanged rows transposed (the compile of 2026-12-03; the tiny model's shapes do
  not show it)."""
  require_gpu_plan("h200")
  hlo = tmp_path / "step.hlo"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  out = subprocess.run([sys.executable, "-m", "MaxText.plan", "configs/bench/proxy-2xh200-ep2.yml", "target_gpu=h200",
                        "moe_block=ours", "moe_fp8=blockwise", "--hlo", str(hlo)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  layouts = re.findall(r"= u32\[\d+,1,\d+\]\{([\d,]+)\} gather\(", hlo.read_text())
  assert len(layouts) >= 6 and set(layouts) == {"2,1,0"}, layouts


@pytest.mark.slow
def test_a_recipe_summary_is_its_plan(tmp_path):
  """A committed recipe summary's memory is what today's code compiles for its GPUs, without a GPU (~70 s). A
  one-node recipe stands for all: the 671B recipes' compiles take 4-13 min each on CI's two cores, and
  `tools/replan_recipes.py` re-plans every recipe (their summaries say at which commit)."""
  require_gpu_plan("h100")
  recipe = REPO / "configs" / "recipes" / "mixtral-8x7b-8xh100.yml"
  stated = json.loads((REPO / "configs" / "recipes" / "plans" / f"{recipe.stem}.json").read_text())["memory"]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  out = subprocess.run([sys.executable, "-m", "MaxText.plan", str(recipe), "--json", str(tmp_path / "p.json")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1100, check=False)  # under pytest's 1200
  assert out.returncode == 0, out.stderr[-2000:]
  r = json.loads((tmp_path / "p.json").read_text())
  assert r["platform"] == "gpu_target" and r["verdict"]["fits"] == stated["fits"]
  assert r["memory"]["device_total"] / 2**30 == pytest.approx(stated["device_gib"], abs=0.01)
