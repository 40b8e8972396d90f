"""Where one train step's device time goes: route / dispatch / gmm / combine / attention / rest.

The classification rules live here, once, for both users:
  - the live split (patches/moe_profile.py, `moe_profile_every_n_steps`), which
    reads xprof's own per-HLO-op statistics (its `hlo_stats` tool) of a one-step
    trace: one row per HLO op with its framework op name (the JAX named-scope
    path), its HLO text (custom-call target) and its self time;
  - tools/profile_breakdown.py (offline, from a trace plus an HLO dump), which
    merges dispatch and combine into one `dispatch_combine` column.

  python -m MaxText.moe.time_split TRACE.xplane.pb   # prints the split as JSON (what the live path runs)

xprof builds its op statistics from device planes only: on a CPU trace its
hlo_stats table has no rows (jax 0.11.2, xprof 2.24.2). There the live path
falls back to the trace's own op events (jax.profiler.ProfileData), which carry
the HLO instruction name but no named-scope path, so on CPU nearly all time
lands in "rest". The rules are written for the GPU table.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("route", "dispatch", "gmm", "combine", "attention", "rest")
STEP_MODULE = "jit_train_step"  # XLA's module name for upstream's jitted train_step
STEP_SCOPE = "jit(train_step)"  # the root of its ops' framework op names
# HLO ops whose event spans other ops' events (CPU runs a while loop's body
# inside the while's own event): counting them would count the body twice.
CONTROL_FLOW = frozenset({"while", "conditional", "call", "async-start", "async-done"})


@dataclass(frozen=True)
class Rule:
  """`scopes` match whole components of the op_name path (named scopes);
  `substrings` match anywhere in the lowercased op_name/target/event name;
  `sources` are regexes on one source frame, "path/file.py:function", lowercased."""

  category: str
  scopes: tuple[str, ...] = ()
  substrings: tuple[str, ...] = ()
  sources: tuple[str, ...] = ()


# Order matters: the first rule that matches wins; named scopes and kernel
# names are tried before source frames. Scopes come from our
# MaxText/moe/block.py (route, dispatch, gmm, combine: siblings, never nested)
# and upstream 0.2.5's layers/moe.py (sort_activations = the permute/unpermute
# gathers, weight_sum = the weighted unpermute, wi_0/wi_1/wo = the capacity
# path's expert einsums). Upstream's attention has no named scope and the
# backward of an einsum loses its name (op_name ".../transpose"), so the source
# frames XLA keeps with each op decide those: attention = the attention core
# (layers/attention_op.py: scores, mask, softmax, PV, or the fused kernel); the
# q/k/v/out projections stay in "rest". Upstream's sort_activations is shared
# by permute and unpermute: without a frame it counts as dispatch.
_COMBINE_SCOPES = ("combine", "unpermute", "weight_sum")
RULES: tuple[Rule, ...] = (
    Rule("combine", scopes=_COMBINE_SCOPES),
    # Collectives of expert parallelism outside a combine scope: dispatch, whatever scope they sit in.
    Rule("dispatch", substrings=("all-to-all", "all_to_all", "alltoall", "collective-permute",
                                 "collective_permute", "sendrecv")),
    Rule("gmm", scopes=("gmm", "gmm_dlhs", "gmm_drhs", "wi_0", "wi_1", "wo"),
         # No bare "gmm": it is inside "wgmma", which most Hopper kernel names carry.
         substrings=("ragged_dot", "ragged-dot", "megablox", "tokamax", "/gmm", "grouped_matmul",
                     "grouped_gemm", "mosaic_gpu", "ragged_matmul"),
         sources=(r"maxtext/moe/gmm/", r"layers/moe\.py:.*(gmm|ragged_dot)", r"megablox", r"tokamax")),
    Rule("combine", sources=(r"maxtext/moe/dispatch/.*:.*combine", r"layers/moe\.py:.*(unpermute|weight_sum)")),
    Rule("dispatch", scopes=("dispatch", "sort_activations", "permute"),
         sources=(r"maxtext/moe/dispatch/", r"layers/moe\.py:.*(permute|sort_activations|all_to_all)")),
    Rule("route", scopes=("route",),
         sources=(r"maxtext/moe/routing\.py", r"layers/moe\.py:.*(gatelogit|get_topk|routing|scale_weights)")),
    Rule("attention", scopes=("attention", "self_attention", "attention_op", "dot_product_attention"),
         substrings=("cudnn$fmha", "fmha", "flash", "dot_product_attention", "sdpa", "bkgts", "bkgtd", "splash"),
         sources=(r"layers/attention_op\.py", r"jax/_src/cudnn/fused_attention")),
)


def classify(descriptor: str, frames: tuple[str, ...] = ()) -> str | None:
  """Category of an op (one of CATEGORIES but "rest"); None when no rule matches.

  descriptor: op_name path (plus custom-call target / event name);
  frames: its source frames innermost first, "path/file.py:function".
  """
  lowered = descriptor.lower()
  components = set(re.split(r"[/ ;]", lowered))
  for rule in RULES:
    if components.intersection(rule.scopes) or any(s in lowered for s in rule.substrings):
      return rule.category
  for frame in frames:
    frame = frame.lower()
    for rule in RULES:
      if any(re.search(pattern, frame) for pattern in rule.sources):
        return rule.category
  return None


# ---------------------------------------------------------------- op-stats table


@dataclass(frozen=True)
class OpRow:
  """One HLO op of a profile, summed over its executions.

  program_id: XLA's program id ("" if unknown); module: HLO module name ("" if
  unknown); name: HLO instruction (or kernel/event) name; op_name: its
  framework op name, the named-scope path ("" if unknown); target: custom-call
  target ("" if none); frames: source frames innermost first; self_us: self
  time in microseconds (children excluded)."""

  program_id: str
  module: str
  name: str
  op_name: str
  target: str
  frames: tuple[str, ...]
  self_us: float


def classify_row(row: OpRow) -> str:
  """The op's metadata decides before its name: cuDNN's flash-attention kernels are named
  "..._wgmma_...", and a kernel name is only a fallback."""
  descriptor = f"{row.op_name} {row.target}".strip()
  category = classify(descriptor, row.frames) if descriptor else None
  return category or classify(row.name) or "rest"


def step_rows(rows: list[OpRow], module: str = STEP_MODULE, scope: str = STEP_SCOPE) -> list[OpRow]:
  """Rows of the train step's program(s): the module name where the table has it (CPU events), else any
  program one of whose ops sits under `scope` (xprof's hlo_stats names programs by id only). Ops XLA
  added without metadata belong to their program, so they count too; eval, data and checkpoint
  programs in the same trace do not."""
  programs = {r.program_id for r in rows if r.module == module or r.op_name.startswith(scope)}
  return [r for r in rows if r.program_id in programs]


def split(rows: list[OpRow]) -> dict:
  """{"ms": {category: ms}, "share": {category: fraction}, "total_ms": float, "ops": int} of `rows`."""
  ms = dict.fromkeys(CATEGORIES, 0.0)
  for row in rows:
    ms[classify_row(row)] += row.self_us / 1e3
  total = sum(ms.values())
  return {"ms": ms, "share": {c: (v / total if total else 0.0) for c, v in ms.items()}, "total_ms": total,
          "ops": len(rows)}


def scalars(result: dict, prefix: str = "moe_time/") -> dict[str, float]:
  """moe_time/<category>_ms and _share, and moe_time/total_ms: the TensorBoard scalars."""
  out = {f"{prefix}{c}_ms": result["ms"][c] for c in CATEGORIES}
  out.update({f"{prefix}{c}_share": result["share"][c] for c in CATEGORIES})
  out[f"{prefix}total_ms"] = result["total_ms"]
  return out


def format_line(result: dict, step: int) -> str:
  parts = "  ".join(f"{c} {result['ms'][c]:.2f} ms ({100 * result['share'][c]:.0f}%)" for c in CATEGORIES)
  return f"MoE time split, step {step} ({result['source']}, device op time): {parts}; total {result['total_ms']:.2f} ms"


# ---------------------------------------------------------------- readers

_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_TAG_RE = re.compile(r"<[^>]*>")
_TITLE_RE = re.compile(r'title="([^"]*)"')


def _frames(source_info: str) -> tuple[str, ...]:
  """xprof's source-info cell (HTML: the stack in a title attribute, file:line as text) -> frames."""
  text = html.unescape(str(source_info or ""))
  stack = [line.strip() for m in _TITLE_RE.finditer(text) for line in m.group(1).splitlines() if line.strip()]
  plain = _TAG_RE.sub(" ", text).strip()
  return tuple(stack + ([plain] if plain else []))


def rows_from_hlo_stats(table: dict | list) -> list[OpRow]:
  """xprof's hlo_stats data table (JSON: "cols" with ids, "rows" of {"c": [{"v": ...}]}) -> rows."""
  tables = table if isinstance(table, list) else [table]
  out = []
  for t in tables:
    ids = [c["id"] for c in t.get("cols", [])]
    for r in t.get("rows", []):
      cell = dict(zip(ids, (c.get("v") if isinstance(c, dict) else None for c in r["c"])))
      target = _TARGET_RE.search(str(cell.get("hlo_op_expression") or ""))
      out.append(OpRow(program_id=str(cell.get("program_id") or ""), module="",
                       name=str(cell.get("hlo_op_name") or ""), op_name=str(cell.get("tf_op_name") or ""),
                       target=target.group(1) if target else "", frames=_frames(cell.get("source_info")),
                       self_us=float(cell.get("total_self_time") or 0.0)))
  return out


def xprof_rows(xplane: Path) -> list[OpRow]:
  """Per-HLO-op statistics from xprof's own converter (its hlo_stats tool)."""
  from xprof.convert import raw_to_tool_data  # pylint: disable=import-outside-toplevel

  data, _ = raw_to_tool_data.xspace_to_tool_data([str(xplane)], "hlo_stats", {"use_saved_result": False})
  if not data:
    return []
  return rows_from_hlo_stats(json.loads(data))


_CONTAINERS = ("threadpoollistener", "thunkexecutor")


def trace_rows(xplane: Path) -> list[OpRow]:
  """CPU fallback: the trace's XLA op events (host thread lines, those with an hlo_op stat), one row each.
  No framework op name: only event names can be classified."""
  import warnings  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  warnings.filterwarnings("ignore", message="builtin type", category=DeprecationWarning)
  out = []
  for plane in jax.profiler.ProfileData.from_file(str(xplane)).planes:
    if not plane.name.startswith("/host:CPU"):
      continue
    for line in plane.lines:
      for e in line.events:
        stats = dict(e.stats)
        if "hlo_op" not in stats or e.name.lower().startswith(_CONTAINERS):
          continue
        if str(stats["hlo_op"]).split(".")[0] in CONTROL_FLOW:
          continue  # its body's ops have their own events
        out.append(OpRow(str(stats.get("program_id", "")), str(stats.get("hlo_module", "")), str(stats["hlo_op"]),
                         "", "", (), e.duration_ns / 1e3))
  return out


def split_trace(xplane: Path, top: int = 10) -> dict:
  """The step's split from one trace: xprof's op statistics, else (CPU) the trace's op events; with the
  `top` largest ops left in "rest" ([name, op_name, first frame, ms]) so a misclassification shows."""
  source, rows = "xprof hlo_stats", step_rows(xprof_rows(xplane))
  if not rows:
    source, rows = "trace events, no op names", step_rows(trace_rows(xplane))
  if not rows:
    raise ValueError(f"no op of {STEP_MODULE} in {xplane}")
  rest = sorted((r for r in rows if classify_row(r) == "rest"), key=lambda r: -r.self_us)[:top]
  top_rest = [[r.name, r.op_name[-100:], (r.frames or ("",))[0][-80:], r.self_us / 1e3] for r in rest]
  return {**split(rows), "source": source, "xplane": str(xplane), "top_rest": top_rest}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description="The MoE time split of a one-step trace, as JSON.")
  parser.add_argument("xplane", type=Path)
  parser.add_argument("--top", type=int, default=10, help="largest ops left in rest to list")
  args = parser.parse_args(argv)
  print(json.dumps(split_trace(args.xplane, args.top)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
