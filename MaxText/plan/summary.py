"""A plan's summary (a few KB of JSON, committed beside the recipes) and the lines a recipe's header states from it.

  facts = summary.recipe_facts(run, mesh)          # the planner puts these in its report ("recipe")
  s = summary.of(report, commit="4c65362", date="2026-12-05")
  lines = summary.header_lines(s, "configs/recipes/plans/deepseek3-671b-128xh100.json")

configs/recipes/plans/<recipe>.json holds each shipped recipe's summary, written by tools/replan_recipes.py from a
real plan; tests/test_recipe_plans.py checks every recipe's header block (between HEADER_BEGIN and HEADER_END) is
exactly `header_lines` of its summary, and each recipe's row in BENCHMARKS.md's system tables is `table_row`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from MaxText.plan import memory_ops

GiB = 2**30
REPO = Path(__file__).resolve().parents[2]
HEADER_BEGIN = "# --- plan: "
HEADER_END = "# --- end of plan ---"
# Mesh axis -> the ici_/dcn_ key's middle word (upstream's names), every axis a recipe can set.
AXES = {"data": "data", "fsdp": "fsdp", "fsdp_transpose": "fsdp_transpose", "expert": "expert", "tensor": "tensor",
        "stage": "pipeline", "context": "context", "sequence": "sequence"}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def config_digest(path: str | Path) -> str:
  """A digest of what a config file sets, its base_config chain merged (comments and layout aside): a recipe
  edited after its plan no longer matches its summary's."""
  import hashlib  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel

  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel

  chain = fork_config.load_yaml_chain(Path(path))
  return hashlib.sha256(json.dumps(chain, sort_keys=True, default=str).encode()).hexdigest()[:16]


def recipe_facts(run: Any, mesh: dict[str, int]) -> dict[str, Any]:
  """What a recipe's header states besides the plan's figures: every axis (ICI x DCN), the precision, the batch,
  the dispatch options. From the run's config and the compiled mesh."""
  from MaxText.config import parallelism  # pylint: disable=import-outside-toplevel

  up = {**parallelism.upstream_base(), **run.upstream}
  axes = {}
  for axis, name in AXES.items():
    if axis in mesh:  # a -1 (upstream: fill to the device count) is what the compiled mesh filled it with
      ici, dcn = int(up.get(f"ici_{name}_parallelism", 1)), int(up.get(f"dcn_{name}_parallelism", 1))
      ici = mesh[axis] // max(1, dcn) if ici == -1 else ici
      axes[axis] = {"ici": ici, "dcn": mesh[axis] // max(1, ici) if dcn == -1 else dcn}
  weights = str(up.get("weight_dtype", "float32"))
  return {
      "config_digest": config_digest(run.config_path),
      "axes": axes,
      "precision": {"weights": weights, "gradients": str(up.get("grad_dtype", weights)),
                    "adam_mu": str(up.get("mu_dtype") or weights), "adam_nu": weights,
                    "compute": str(up.get("dtype", "bfloat16")), "routed_experts": run.fork.moe_fp8},
      "batch": {"per_device_batch_size": up.get("per_device_batch_size"), "max_target_length": up.get("max_target_length"),
                "gradient_accumulation_steps": int(up.get("gradient_accumulation_steps", 1))},
      "dispatch_options": {"a2a_padded_capacity_factor": run.fork.moe_a2a_padded_capacity_factor,
                           "hierarchical_capacity_factor": run.fork.moe_hierarchical_capacity_factor,
                           "node_limited_routing": run.fork.moe_node_limited_routing},
  }


def of(report: dict[str, Any], commit: str, date: str) -> dict[str, Any]:
  """The summary of one plan's report (planner.build_report)."""
  e, facts, v = report["estimate"], report["recipe"], report["verdict"] or {}
  comms = report.get("layout_comms") or {}
  dispatch = (comms.get("layout") or {}).get("dispatch", "?")
  recipe = Path(report["config"])
  return {
      "recipe": str(recipe.relative_to(REPO) if recipe.is_relative_to(REPO) else recipe),
      "planned_at": {"commit": commit, "date": date}, "config_digest": facts["config_digest"],
      "compiled": {"platform": report["platform"], "target_gpu": report["target_gpu"]["name"],
                   "mock_topology": report["mock_topology"], "compile_seconds": round(report["compile_seconds"], 1),
                   "pgle_ops": report.get("pgle_ops")},
      "gpus": report["num_gpus"], "gpus_per_node": report["gpus_per_node"],
      "axes": facts["axes"], "precision": facts["precision"], "batch": facts["batch"],
      "dispatch": {"backend": dispatch, **facts["dispatch_options"]},
      "memory": {"device_gib": round(report["memory"]["device_total"] / GiB, 2),
                 "usable_gib": round(v.get("usable_bytes", 0.0) / GiB, 2), "fits": v.get("fits"),
                 "marginal": v.get("marginal"), "host_offloaded_gib": round(report["memory"]["host_offloaded"] / GiB, 2)},
      "step_s": round(e["step_s"], 4), "tflops_per_gpu": round(e["tflops_per_gpu"], 1),
      "terms_s": {k: round(e.get(k, 0.0), 4) for k in ("compute_s", "memory_s", "contention_s", "collectives_s",
                                                        "exposed_collectives_s", "offload_exposed_s", "bubble_s",
                                                        "serial_step_s")},
      "sensitivity": [{"label": s["label"], "step_s": round(s["step_s"], 4), "tflops_per_gpu": round(s["tflops_per_gpu"], 1)}
                      for s in e.get("sensitivity", [])],
      "memory_ops": [{"op": r["op"], "source": r["source"], "owner": r["owner"], "ms": round(r["seconds"] * 1e3, 2),
                      "gb": round(r["bytes"] / 1e9, 2), "ops": r["ops"]} for r in e.get("memory_ops", [])[:memory_ops.SHOWN]],
      "grouped_gemm_shapes_over_counted": round(e["grouped_shapes_flops"] / e["grouped_flops"], 3) if e["grouped_flops"] else None,
      "account": {"ok": report["account"]["ok"], "violations": report["account"]["violations"]},
      "collectives_off_the_arithmetic": [
          {"kind": r["kind"], "axes": r["axes"], "compiled_gib": round(r["compiled_wire_bytes"] / GiB, 2),
           "arithmetic_gib": round(r["wire_bytes"] / GiB, 2), "cause": r["cause"]}
          for r in comms.get("table", []) if r.get("cause")],
      "dispatch_padding": comms.get("padding", []),
      "notes": sorted(set(report["inventory_notes"] + e["notes"])),
  }


def layout_text(s: dict[str, Any]) -> str:
  """Every axis, ICI x DCN: 'expert 8x1, fsdp 1x16, data 1x1, ...'."""
  return ", ".join(f"{axis} {a['ici']}x{a['dcn']}" for axis, a in s["axes"].items()) + " (ICI x DCN)"


def precision_text(s: dict[str, Any]) -> str:
  p = s["precision"]
  experts = "FP8 (blockwise e4m3)" if p["routed_experts"] != "none" else _SHORT.get(p["compute"], p["compute"])
  return (f"{_SHORT.get(p['weights'], p['weights'])} master weights, {_SHORT.get(p['gradients'], p['gradients'])} "
          f"gradients, AdamW {_SHORT.get(p['adam_mu'], p['adam_mu'])}/{_SHORT.get(p['adam_nu'], p['adam_nu'])}; "
          f"routed experts' GEMMs {experts}")


def dispatch_text(s: dict[str, Any]) -> str:
  d = s["dispatch"]
  extra = {"a2a_padded": f", capacity {d['a2a_padded_capacity_factor']:g}",
           "hierarchical": f", capacity {d['hierarchical_capacity_factor']:g}"
                           + (", node-limited routing" if d["node_limited_routing"] else "")}.get(d["backend"], "")
  return d["backend"] + extra


def batch_text(s: dict[str, Any]) -> str:
  b = s["batch"]
  n = b["gradient_accumulation_steps"]
  return (f"{b['per_device_batch_size']:g} x {b['max_target_length']} tokens a GPU a microbatch, "
          f"{n} microbatch{'es' if n != 1 else ''}")


def header_lines(s: dict[str, Any], path: str) -> list[str]:
  """The recipe header's plan block: what tests/test_recipe_plans.py holds to the summary at `path`."""
  m, t = s["memory"], s["terms_s"]
  verdict = _verdict(m)
  return [
      f"{HEADER_BEGIN}{path}, written by tools/replan_recipes.py (a test holds these lines to it) ---",
      f"# Planned at {s['planned_at']['commit']} ({s['planned_at']['date']}): {s['gpus']} x {s['compiled']['target_gpu']}, "
      f"{'compile-only' if s['compiled']['platform'] == 'gpu_target' else s['compiled']['platform']}; not run",
      f"# Layout: {layout_text(s)}",
      f"# Precision: {precision_text(s)}",
      f"# Batch: {batch_text(s)}; dispatch: {dispatch_text(s)}",
      f"# Memory: {m['device_gib']:.2f} GiB a GPU of {m['usable_gib']:.2f} usable: {verdict}",
      f"# Estimate: step {s['step_s']:.4g} s, {s['tflops_per_gpu']:.1f} TFLOP/s/GPU (collectives "
      f"{t['collectives_s']:.3g} s, {t['exposed_collectives_s']:.3g} s of them exposed)",
      HEADER_END,
  ]


def _verdict(m: dict[str, Any]) -> str:
  if not m["fits"]:
    return "DOES NOT FIT"
  return "fits, marginal (compile-only has read up to 9% low: confirm with --mock)" if m.get("marginal") else "fits"


def short_layout(s: dict[str, Any]) -> str:
  """The axes that split, inside a node and across nodes: 'expert 8 in a node; fsdp 64 x data 2 across nodes'."""
  ici = " x ".join(f"{axis} {a['ici']}" for axis, a in s["axes"].items() if a["ici"] > 1) or "nothing"
  dcn = " x ".join(f"{axis} {a['dcn']}" for axis, a in s["axes"].items() if a["dcn"] > 1)
  return f"{ici} in a node" + (f"; {dcn} across nodes" if dcn else "")


def short_precision(s: dict[str, Any]) -> str:
  p = s["precision"]
  experts = ", FP8 experts" if p["routed_experts"] != "none" else ""
  return f"{_SHORT.get(p['weights'], p['weights'])} master{experts}"


def tokens_per_s_per_gpu(s: dict[str, Any]) -> float:
  b = s["batch"]
  return b["per_device_batch_size"] * b["max_target_length"] * b["gradient_accumulation_steps"] / s["step_s"]


def table_row(s: dict[str, Any], name: str) -> str:
  """A BENCHMARKS.md system table's row (tools/replan_recipes.py --table prints them)."""
  m = s["memory"]
  marginal = ", marginal" if m.get("marginal") else ""
  return (f"| {name} | {short_layout(s)} | {short_precision(s)}; {dispatch_text(s)} | "
          f"{tokens_per_s_per_gpu(s):,.0f} | {s['tflops_per_gpu']:.1f} | "
          f"{m['device_gib']:.2f} of {m['usable_gib']:.2f}{marginal} | {s['step_s']:.4g} s | "
          f"{s['planned_at']['commit']} · {s['planned_at']['date']} |")
