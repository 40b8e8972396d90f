"""The planner's core: compile a run's train step for its real GPU count and read memory, collectives and an
estimated step time off the compiled program (`python -m MaxText.plan`, MaxText/plan/__main__.py, is its command line)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from MaxText.config import parallelism
from MaxText.console import progress
from MaxText import hardware
from MaxText.plan import account, analytic_comms, aot, bubble, hlo_inventory, schedule, step_report
from MaxText import config as fork_config

DEFAULT_TIMEOUT_S = 1800
HEARTBEAT_S = 60.0  # in a log, a line naming the compile's phase this often (--heartbeat); a terminal's is rewritten in place
# How much lower a compile-only plan's memory has read than the same tree compiled on the GPU itself:
# the 128 x H100 recipe, 65.55 GiB compile-only against 71.11 GiB mocked on an H200 scheduled against the
# H100's memory (+8.5%), 1,024 x H100 +6.8%, the 128 x H200 recipe +7.0%, the 1-GPU proxy +0.4%
# (2026-12-01; BENCHMARKS.md "Compile proofs (mocked topology)"). A compile-only verdict inside this margin is marginal.
COMPILE_ONLY_SHORTFALL = 0.09
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def log(msg: str) -> None:
  print(f"[plan] {msg}", flush=True)


def num_gpus_of(run: fork_config.RunConfig) -> int:
  """recipe_num_gpus, else a mesh written out in full; PlanError naming the key otherwise."""
  if run.fork.recipe_num_gpus:
    return run.fork.recipe_num_gpus
  axes = {**parallelism.mesh_axes(run.upstream, "ici_"), **parallelism.mesh_axes(run.upstream, "dcn_")}
  if any(v == -1 for v in axes.values()):
    raise aot.PlanError("recipe_num_gpus is unset and the mesh has a -1 axis: set recipe_num_gpus=N to plan for N GPUs")
  return math.prod(axes.values())


def check_layout(run: fork_config.RunConfig, num_gpus: int) -> None:
  """The launcher's own checks (mesh product, experts over EP) for the planned devices."""
  nodes = max(1, num_gpus // run.fork.gpus_per_node)
  parallelism.check_topology(run.upstream, num_gpus, num_gpus, nodes)


# Keys a CPU compile cannot keep, with what stands in and why.
def cpu_substitutes(run: fork_config.RunConfig) -> dict[str, Any]:
  """Overrides that make a GPU config compile on simulated CPU devices (printed as such)."""
  up, out = run.upstream, {"hardware": "cpu"}
  if str(up.get("attention", "autoselected")).startswith("cudnn"):
    out["attention"] = "dot_product"  # cuDNN flash attention has no CPU kernel
  if run.fork.moe_gmm_backend in ("mgpu", "te", "tokamax"):
    out["moe_gmm_backend"] = "xla"  # GPU kernels; xla is the CPU stand-in
  if up.get("use_tokamax_gmm"):
    out["use_tokamax_gmm"] = False
  # dcn_* axes stay: plan() names num_slices, and patches/cpu_slices.py makes each gpus_per_node consecutive
  # simulated devices a node, so the mesh is laid out as on the cluster (DCN-major axes, a two-level dispatch's
  # node groups where they will be).
  return {k: v for k, v in out.items() if up.get(k) != v}


def gpu_target_substitutes(run: fork_config.RunConfig, stand_in: bool = False) -> dict[str, Any]:
  """A host callback needs a GPU runtime to lower, which a compile-only device has not: expert-load logging
  is one, and is left out of the plan (for measurements only). The dispatch overflow check has none (it is
  reduced in the step and read by the host after it, MaxText/moe/overflow.py): the plan compiles the run's program.
  stand_in (gpu_target.KERNEL_STAND_INS): the Blackwell grouped GEMM (te, or tokamax's sm100 kernel) compiles as
  auto's Hopper kernels on the stand-in's sm_90a devices, and moe_fp8=mxfp8 as bf16 (the estimate costs the routed
  GEMMs at the MXFP8 rate)."""
  out: dict[str, Any] = {}
  if run.fork.moe_log_expert_load:
    out["moe_log_expert_load"] = False
  if stand_in and run.fork.moe_gmm_backend in ("te", "tokamax"):
    out["moe_gmm_backend"] = "auto"
  if stand_in and run.fork.moe_fp8 == "mxfp8":  # TE quantizes inside its GEMM: the program around it is bf16's
    out["moe_fp8"] = "none"
  return out


def uses_grouped_gemm_kernels(run: fork_config.RunConfig) -> bool:
  """The step's routed experts run our grouped GEMMs: our block, or upstream's with moe_gmm_backend or tokamax."""
  up = run.upstream
  if int(up.get("num_experts", 1) or 1) <= 1:
    return False
  return run.fork.moe_block == "ours" or run.fork.moe_gmm_backend != "upstream" or bool(up.get("use_tokamax_gmm"))


_FATAL = re.compile(r"^(F\d{4} |\*\*\* |.*Check failed|.*Fatal Python error|terminate called|.*what\(\):|"
                    r".*(RESOURCE_EXHAUSTED|INTERNAL|Out of memory))")


def _crash_reason(log: str) -> str:
  """The lines that say why a compile process died (absl's F-lines, a failed CHECK, an uncaught C++
  exception), else its last lines: an abort's last lines are the stack trace, which says nothing."""
  lines = log.strip().splitlines()
  fatal = [line.strip() for line in lines if _FATAL.match(line)]
  return " | ".join(fatal[:3] or lines[-3:])[-700:]


def mock_memory_limit(run: fork_config.RunConfig, topology: aot.Topology) -> str:
  """On a GPU with more memory than the target's, the XLA flag that schedules against the target's memory."""
  if topology.platform != "gpu":
    return ""
  from MaxText.plan import gpu_target  # pylint: disable=import-outside-toplevel

  gpu_key, _ = target_gpu(run, topology)
  target_bytes = gpu_target.device_memory_size(gpu_key) or int(hardware.GPUS[gpu_key].hbm_bytes.value)
  flag = aot.memory_limit_flag(target_bytes, aot.local_gpu_memory_bytes())
  if flag:
    log(f"scheduling against {hardware.GPUS[gpu_key].name}'s {target_bytes / 2**30:.1f} GiB, not this GPU's: {flag}")
  return flag


def devices_text(topology: aot.Topology) -> str:
  """What a compile is for, in the heartbeat's words."""
  n = topology.num_devices
  return {"gpu_target": f"{n} x {topology.target_gpu}",
          "gpu": f"{n} GPUs (mock {topology.mock_spec})" if topology.mock_spec else f"{n} local GPUs",
          "cpu": f"{n} simulated CPU devices"}[topology.platform]


def compile_in_child(args: list[str], topology: aot.Topology, timeout_s: float, hlo_path: str | None,
                     xla_flags: str = "", heartbeat_s: float = HEARTBEAT_S) -> dict[str, Any]:
  """One compile in a fresh process: its result, or PlanError naming what ran out. While it runs, a status line
  with the phase the child last wrote to its phase file (MaxText/plan/aot.py child_main): rewritten in place on a
  terminal, in a log a line every heartbeat_s."""
  with tempfile.TemporaryDirectory(prefix="maxtext-plan-") as tmp:
    request, result, log_path = Path(tmp, "request.json"), Path(tmp, "result.json"), Path(tmp, "child.log")
    phase_path = Path(tmp, "phase")
    # Outputs (compile cache, dumps) go to the temporary directory, never the user's run directory.
    request.write_text(json.dumps({
        # dump_hlo: XLA's memory-usage report, for the largest buffers (into tmp, like every output),
        # unless the user's XLA_FLAGS already dump somewhere: then the report is read there.
        "args": [*args, f"base_output_directory={tmp}/out", "run_name=plan", "skip_jax_distributed_system=true",
                 *([] if "--xla_dump_to" in os.environ.get("XLA_FLAGS", "") else ["dump_hlo=true"])],
        "topology": topology.__dict__, "hlo_path": hlo_path, "xla_flags": xla_flags, "phase_path": str(phase_path),
    }))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as child_log:
      proc = subprocess.Popen([sys.executable, "-m", "MaxText.plan.aot", str(request), str(result)], stdout=child_log,
                              stderr=subprocess.STDOUT, env=env, start_new_session=True)

      status = progress.StatusLine("[plan] ", log_every_s=heartbeat_s)

      def beat(elapsed: float) -> None:
        status.update(f"compiling for {devices_text(topology)} ({progress.read_phase(phase_path)}): "
                      f"{progress.fmt_seconds(elapsed)} elapsed")

      try:
        period_s = status.period_s if heartbeat_s > 0 else 0
        rc = progress.wait_beating(lambda t: proc.wait(timeout=t), timeout_s, period_s, beat)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise aot.PlanError(f"compile ran past --timeout {timeout_s:.0f} s: raise --timeout, or plan fewer "
                            "layers (base_num_decoder_layers) to see the trend") from None
      except BaseException:  # Ctrl-C or SIGTERM (MaxText/plan/__main__.py Stopped): the child, in its own session,
        os.killpg(proc.pid, signal.SIGKILL)  # never saw it; it goes before its folder does
        proc.wait()
        raise
      finally:
        status.close()
    if rc == -signal.SIGKILL or rc == 137:
      raise aot.PlanError("compile was killed (host out of memory?): free host memory, or plan with scan_layers=true "
                          "and fewer devices per compile")
    if rc != 0 or not result.exists():
      raise aot.PlanError(f"compile process failed (exit {rc}): {_crash_reason(log_path.read_text(errors='replace'))}")
    return json.loads(result.read_text())


def target_gpu(run: fork_config.RunConfig, topology: aot.Topology) -> tuple[str, str]:
  """(GPU key, where it came from): target_gpu, else this machine's GPU, else h200 for the estimate."""
  if run.fork.target_gpu:
    return run.fork.target_gpu, "target_gpu"
  if topology.platform == "gpu":
    try:
      name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                            text=True, timeout=30, check=False).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
      name = ""
    if hardware.gpu_from_device_name(name):
      return hardware.gpu_from_device_name(name), f"this machine's GPU ({name.strip()})"
  return "h200", "no target_gpu set: H200 figures for the estimate only"


def mem_fraction(env_xla: dict[str, str]) -> hardware.Figure:
  value = env_xla.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  if value:
    return hardware.Figure(float(value), "XLA_PYTHON_CLIENT_MEM_FRACTION the run sets (presets or environment)")
  return hardware.DEFAULT_MEM_FRACTION


def analytic_cross_check(run: fork_config.RunConfig, num_gpus: int) -> dict[str, Any] | None:
  """The arithmetic estimate (MaxText/plan/analytic_memory.py), for configs that spell out a DeepSeek-V3 model."""
  from MaxText.plan import analytic_memory  # pylint: disable=import-outside-toplevel

  c = {"per_device_batch_size": 1, "max_target_length": 4096, **run.upstream}
  try:
    _, est, lines = analytic_memory.estimate(c, num_gpus)
  except (KeyError, TypeError):
    return None
  return {"device_total_bytes": est.device_total, "host_offloaded_bytes": est.host_offloaded, "lines": lines}


def layout_comms(child: dict[str, Any], gpus_per_node: int, collectives: list[dict[str, Any]] | None = None,
                 notes: list[str] = ()) -> dict[str, Any] | None:
  """The layout's arithmetic of the collectives (MaxText/plan/analytic_comms.py), beside the compiled rows where
  there are any; None where the child could not read the layout (its error is kept)."""
  layout = child.get("layout")
  if not layout or "error" in layout:
    return {"error": layout["error"]} if layout else None
  rows = analytic_comms.expected(layout, child["mesh"], gpus_per_node)
  if collectives is None:
    return {"layout": layout, "table": rows, "padding": []}
  table = analytic_comms.compare(rows, collectives, layout, list(notes))
  return {"layout": layout, "table": table, "padding": analytic_comms.padding_lines(table, layout)}


def build_report(run, num_gpus, topology, child, substitutes, hlo_text: str) -> dict[str, Any]:
  """The plan as data: what was compiled, memory, verdict, collectives, estimate, constants."""
  from MaxText.config import environment  # pylint: disable=import-outside-toplevel

  gpu_key, gpu_from = target_gpu(run, topology)
  gpu = hardware.GPUS[gpu_key]
  prepared_env = environment.run_environment(run, {}, None)
  fraction = mem_fraction({**prepared_env})
  model_flops, recompute = child["model_tflops_per_device"] * 1e12, child.get("recompute_flops", 0.0)
  # The walk runs upstream's pipeline loop by its trip count, the bubble's iterations included (every stage computes
  # at every iteration): the bubble is inside the path, and the term the schedule would add on top stays 0.
  # MaxText/plan/bubble.py reports it, checked against the compiled loop.
  bubble_fraction = 0.0
  module = schedule.parse(hlo_text, child.get("stack_frames"))
  fp8 = run.fork.moe_fp8 != "none"
  terms = schedule.estimate(module, gpu, child["mesh"], child["nodes"], fp8_experts=fp8,
                            counted_flops=model_flops + recompute, routed_flops=child.get("routed_expert_flops", 0.0),
                            bubble_fraction=bubble_fraction)
  # The rows count what the walk walked: the same loop trips (hlo_inventory.loop_trips), the same branches.
  inventory = hlo_inventory.inventory(hlo_text, child["mesh"], child["nodes"], branches=terms.branches)
  pipeline = bubble.report(child.get("pipeline_schedule"), inventory["pipeline_loops"], inventory["hlo_dot_flops"],
                           terms.path_s, child.get("pipelined_layers_share", 1.0))
  usable = gpu.hbm_bytes.value * fraction.value
  memory = child["memory"]
  verdict = None
  if topology.compiles_for_gpu:
    verdict = {"fits": memory["device_total"] <= usable, "device_bytes": memory["device_total"], "usable_bytes": usable,
               "marginal": topology.platform == "gpu_target"
               and memory["device_total"] * (1 + COMPILE_ONLY_SHORTFALL) > usable >= memory["device_total"]}
  rows = account.rows(inventory["collectives"], terms.rows, gpu)
  estimate = step_report.report(terms, model_flops, recompute, bubble_fraction)
  estimate["sensitivity"] = step_report.sensitivity(module, gpu, child["mesh"], child["nodes"], terms, model_flops, fp8,
                                                    model_flops + recompute, bubble_fraction)
  constants = {f"{gpu_key}.{k}": {"value": f.value, "source": f.source} for k, f in gpu.figures().items()}
  constants["mem_fraction"] = {"value": fraction.value, "source": fraction.source}
  return {
      "config": str(run.config_path), "num_gpus": num_gpus, "gpus_per_node": run.fork.gpus_per_node,
      "platform": topology.platform, "mock_topology": topology.mock_spec, "cpu_substitutes": substitutes,
      "target_gpu": {"key": gpu_key, "name": gpu.name, "from": gpu_from},
      "mesh": child["mesh"], "compile_seconds": child["compile_seconds"], "verdict": verdict,
      "pgle_ops": (child.get("layout") or {}).get("pgle_ops"),
      # A CPU compile's buffers are not the GPU's: kept under another name.
      ("memory" if topology.compiles_for_gpu else "cpu_memory"): memory,
      "nodes": child["nodes"], "collectives": rows, "inter_node_bytes": inventory["inter_node_bytes"],
      "layout_comms": layout_comms(child, run.fork.gpus_per_node, rows, inventory["inventory_notes"]),
      "inventory_notes": inventory["inventory_notes"],
      "account": account.check(rows, terms.rows, estimate, account.microbatches(
          module.comps, module.entry, (child.get("layout") or {}).get("microbatches")), pipeline),
      "largest_buffers": child.get("largest_buffers", []),
      "pipeline": pipeline,
      "estimate": estimate,
      "constants": constants, "analytic_memory": analytic_cross_check(run, num_gpus), "xla_flags": child["xla_flags"],
  }


def lowered_report(run, num_gpus, topology, child, substitutes) -> dict[str, Any]:
  """A CPU plan past aot.MAX_CPU_DEVICES: the step traced and lowered (every sharding checked), not compiled."""
  return {
      "config": str(run.config_path), "num_gpus": num_gpus, "gpus_per_node": run.fork.gpus_per_node,
      "platform": topology.platform, "mock_topology": None, "cpu_substitutes": substitutes, "lowered_only": True,
      "mesh": child["mesh"], "compile_seconds": child["compile_seconds"], "verdict": None,
      "analytic_memory": analytic_cross_check(run, num_gpus), "xla_flags": child["xla_flags"],
      "layout_comms": layout_comms(child, run.fork.gpus_per_node),
  }


def _gib(x: float) -> str:
  """Bytes in the largest binary unit that keeps them >= 1."""
  for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(x) >= scale:
      return f"{x / scale:8.2f} {unit}"
  return f"{x:8.0f} B  "


def print_report(r: dict[str, Any]) -> None:
  mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
  where = f"mocked GPU topology {r['mock_topology']}" if r["mock_topology"] else f"{r['platform']}, real devices"
  if r["platform"] == "cpu":
    where = f"{r['num_gpus']} simulated CPU devices"
  elif r["platform"] == "gpu_target":
    where = f"compile-only {r['target_gpu']['name']} devices (XLA's GPU compiler, no GPU used)"
  verb = "lowered" if r.get("lowered_only") else "compiled"
  print(f"\n== plan: {r['config']}\n{r['num_gpus']} GPUs ({r['gpus_per_node']} per node), mesh {mesh}; "
        f"{verb} on {where} in {r['compile_seconds']:.1f} s")
  if r.get("kernel_stand_in"):
    print(f"  compiled for compute capability {r['kernel_stand_in']['compute_capability']}: {r['kernel_stand_in']['why']}")
  if r.get("pgle_ops"):
    print(f"  scheduled with the planner's costs as XLA's profile ({r['pgle_ops']} ops; the `pgle` preset: a run "
          "profiles its first steps, MaxText/plan/pgle.py)")
  for k, v in r["cpu_substitutes"].items():
    print(f"  {'CPU stand-in' if r['platform'] == 'cpu' else 'set for the compile'}: {k}={v}")
  if r.get("lowered_only"):
    print(f"  lowered only (more than {aot.MAX_CPU_DEVICES} simulated CPU devices): every parameter, optimizer and "
          "batch sharding fits its array's shape.\n  Memory, collectives and the step estimate need the compile: "
          "plan on a machine with one GPU (mocked topology).")
    a = r["analytic_memory"]
    if a:
      print(f"  analytic memory {_gib(a['device_total_bytes'])} per GPU (MaxText/plan/analytic_memory.py; no compiler "
            "temporaries)")
    print_layout_comms(r.get("layout_comms"))
    return
  print(f"target: {r['target_gpu']['name']} ({r['target_gpu']['from']})")
  m = r.get("memory", {})
  gpu_compile = r["platform"] in ("gpu", "gpu_target")
  print("\nmemory per device (compiler):" if gpu_compile else
        "\nmemory per device: GPU memory needs a GPU compile (a CPU compile reports CPU buffers, not shown)")
  if gpu_compile:
    for key in ("arguments", "outputs", "temporaries", "aliases", "generated_code", "device_total", "host_offloaded"):
      print(f"  {key:15s} {_gib(m[key])}")
    v = r["verdict"]
    print(f"  verdict         {'FITS' if v['fits'] else 'DOES NOT FIT'}: {v['device_bytes'] / GiB:.2f} GiB of "
          f"{v['usable_bytes'] / GiB:.2f} GiB usable (HBM x mem fraction)")
    if v.get("marginal"):
      print(f"                  marginal: compile-only plans have read up to {COMPILE_ONLY_SHORTFALL:.0%} low against "
            "the GPU's own compile; confirm with --mock on a GPU, or leave more room")
  a = r["analytic_memory"]
  if a:
    print(f"  analytic check  {_gib(a['device_total_bytes'])} (MaxText/plan/analytic_memory.py; no compiler temporaries)")
  if r.get("largest_buffers") and gpu_compile:
    print("  largest buffers (XLA's memory-usage report: slice size, values sharing it over the step):")
    for b in r["largest_buffers"]:
      print(f"    {b['size']:>10} {b['values']:4d} values  {b['shapes'][:150]}")
  print("\ncollectives per step (per device):")
  print(f"  {'kind':19s} {'axes':18s} {'link':6s} {'group':>5s} {'count':>7s} {'bytes':>12s} {'wire':>12s} "
        f"{'inter-node':>12s} {'est ms':>8s} {'exposed':>8s}")
  for c in r["collectives"]:
    print(f"  {c['kind']:19s} {','.join(c['axes']) or '-':18s} {c['link']:6s} {c['group_size']:5d} {c['count']:7d} "
          f"{_gib(c['bytes'])} {_gib(c['wire_bytes'])} {_gib(c.get('inter_node_bytes', 0.0))} "
          f"{c['seconds'] * 1e3:8.3f} {c['exposed_s'] * 1e3:8.3f}")
  print(f"  inter-node bytes per step per device: {_gib(r.get('inter_node_bytes', 0.0)).strip()} (hlo_inventory.py: "
        "what a device exchanges with other nodes)")
  for note in r["inventory_notes"]:
    print(f"  note: {note}")
  print_layout_comms(r.get("layout_comms"))
  p = r.get("pipeline")
  if p:
    print(f"\npipeline: {p['stages']} stages x {p['repeats']} repeats, {p['microbatches']} microbatches: "
          f"{p['iterations']} iterations, bubble {p['bubble_fraction']:.1%} (delay x (stages - 1) / iterations)")
    print(f"  compiled pipeline loops ({len(p['compiled_loops'])}): {bubble.verdict(p)}"
          f"{' (' + p['note'] + ')' if p['note'] else ''}; pipelined share of the compute "
          f"{p['pipelined_share']:.1%} ({p['pipelined_share_from']}); bubble {p['bubble_s'] * 1e3:.3f} ms of the step "
          "(in the path: the loop runs its iterations)")
  print()
  for line in step_report.lines(r["estimate"]):
    print(line)
  checked = r["account"]
  print(f"one account (MaxText/plan/account.py): {'holds' if checked['ok'] else 'VIOLATED'}; {checked['lines'][0]}")
  for line in checked["violations"]:
    print(f"  violated: {line}")
  print("constants:")
  for k, c in r["constants"].items():
    print(f"  {k:28s} {c['value']:.4g}  ({c['source']})")


def print_layout_comms(c: dict[str, Any] | None) -> None:
  """The layout's arithmetic beside the compiler's rows: wire bytes per device a step, the ratio, and a flagged
  row's cause (MaxText/plan/analytic_comms.py)."""
  if not c:
    return
  if "error" in c:
    print(f"\nthe layout's arithmetic of the collectives could not be read: {c['error']}")
    return
  compiled = any("compiled_wire_bytes" in row for row in c["table"])
  print("\ncollectives by the layout's arithmetic (MaxText/plan/analytic_comms.py)"
        + (", beside the compiler's" if compiled else "") + ", wire bytes per device a step:")
  link = {True: "ib", False: "nvlink", None: "any"}
  for row in c["table"]:
    line = f"  {row['kind']:19s} {','.join(row['axes']) or '-':18s} {link[row['crosses_nodes']]:6s} {_gib(row['wire_bytes'])}"
    if compiled:
      ratio = f"{row['ratio']:7.3g}" if row["ratio"] is not None else "      -"
      line += f"  compiled {_gib(row['compiled_wire_bytes'])} {ratio}"
    cause = row.get("cause")
    print(line + (f"  OFF: {cause}" if cause else f"  {'; '.join(row['what'])}"))
  for line in c["padding"]:
    print(f"  {line}")


def write_json(report: dict[str, Any], path: str) -> None:
  """Whole or not at all: written beside, then renamed over."""
  target = Path(path)
  target.parent.mkdir(parents=True, exist_ok=True)
  tmp = target.with_name(target.name + ".tmp")
  tmp.write_text(json.dumps(report, indent=2, default=str))
  tmp.rename(target)


def plan(args: list[str], timeout_s: float = DEFAULT_TIMEOUT_S, hlo_path: str | None = None,
         local_gpus: int | None = None, mode: str = "auto", heartbeat_s: float = HEARTBEAT_S) -> dict[str, Any]:
  """Checks, compiles (child process) and returns the report; ConfigError on bad input."""
  run = fork_config.load(args)
  num_gpus = num_gpus_of(run)
  check_layout(run, num_gpus)
  local = aot.local_gpu_count() if local_gpus is None else local_gpus
  topology = aot.choose_topology(num_gpus, run.fork.gpus_per_node, local, run.fork.target_gpu, mode)
  if run.fork.moe_fp8 != "none" and (gpu := hardware.GPUS[target_gpu(run, topology)[0]]).fp8_recipe != run.fork.moe_fp8:
    # Before compiling: config_checks refuses it on this GPU at run time (blockwise: sm_90a e4m3 wgmma; mxfp8: TE on
    # Blackwell's block-scaled tensor cores).
    why = "the blockwise kernels are Hopper's" if run.fork.moe_fp8 == "blockwise" else "MXFP8 needs a Blackwell GPU"
    raise fork_config.ConfigError(f"moe_fp8={run.fork.moe_fp8}: the {gpu.name} cannot run it ({why}); "
                                  f"use moe_fp8={gpu.fp8_recipe or 'none'}" + (" or none" if gpu.fp8_recipe else ""))
  from MaxText.plan import gpu_target  # pylint: disable=import-outside-toplevel

  if mode == "auto" and run.fork.target_gpu and topology.platform != "gpu_target":
    log(f"not compiling for compile-only {run.fork.target_gpu} devices: {gpu_target.unavailable_reason(run.fork.target_gpu)}")
  stand_in = topology.platform == "gpu_target" and gpu_target.kernel_stand_in(topology.target_gpu,
                                                                               uses_grouped_gemm_kernels(run))
  if stand_in:
    topology = dataclasses.replace(topology, compute_capability=stand_in[0])
    log(f"{topology.target_gpu}: {stand_in[1]}")
  substitutes = {"cpu": cpu_substitutes, "gpu_target": lambda r: gpu_target_substitutes(r, bool(stand_in))}.get(
      topology.platform, lambda _: {})(run)
  if topology.nodes > 1 and "num_slices" not in run.explicit:
    # What upstream would count from the devices' slice_index on the cluster; named so the mock needs none
    # (and simulated CPU devices, which have none, are grouped into nodes by patches/cpu_slices.py).
    substitutes["num_slices"] = topology.nodes
  child_args = [*args, f"recipe_num_gpus={num_gpus}", *(f"{k}={json.dumps(v)}" for k, v in substitutes.items())]
  where = {"gpu_target": f"compile-only {topology.target_gpu} devices, no GPU used",
           "gpu": f"this machine's GPU, mock {topology.mock_spec}" if topology.mock_spec else "this machine's GPU",
           "cpu": "simulated CPU devices"}[topology.platform]
  log(f"compiling for {num_gpus} devices on {where}")
  with tempfile.TemporaryDirectory(prefix="maxtext-plan-hlo-") as kept:  # the estimate reads the scheduled HLO
    step_hlo = Path(hlo_path or Path(kept, "step.hlo"))
    child = compile_in_child(child_args, topology, timeout_s, str(step_hlo), mock_memory_limit(run, topology),
                             heartbeat_s)
    hlo_text = step_hlo.read_text() if step_hlo.exists() else ""
  if "config_error" in child:
    raise fork_config.ConfigError(child["config_error"])
  if "compile_error" in child:
    hint = "; XLA:CPU cannot compile it, plan on a GPU" if "XLA:CPU" in child["compile_error"] else ""
    raise aot.PlanError(f"the compiler rejected {run.config_path.name}: {child['compile_error']}{hint}")
  from MaxText.plan import summary  # pylint: disable=import-outside-toplevel

  if child.get("lowered_only"):
    report = lowered_report(run, num_gpus, topology, child, substitutes)
  else:
    report = build_report(run, num_gpus, topology, child, substitutes, hlo_text)
  if stand_in:
    report["kernel_stand_in"] = {"compute_capability": stand_in[0], "why": stand_in[1]}
  report["recipe"] = summary.recipe_facts(run, child["mesh"])  # every axis, the precision: what a header states
  return report
