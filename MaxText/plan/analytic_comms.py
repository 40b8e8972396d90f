"""What each collective should move a step, from the layout alone, beside what the compiler's program moves.

As MaxText/plan/analytic_memory.py does for memory: the arithmetic from the config, the mesh and the parameters'
shapes and shardings (what the config's logical rules give them; `layout_of` reads them), never the compiled
program. Per device and step, in wire bytes (what a device sends, the figure link bandwidth divides; buffer bytes
as hlo_inventory.py counts them):

  FSDP / HSDP gathers   each parameter group, all-gathered over its FSDP-like axes (those it is sharded over, less
                        `expert` for the routed experts, whose experts stay split): the gathered result R =
                        elements x compute-dtype bytes / the other axes' sizes, wire R (n - 1) / n; twice a
                        microbatch for the layer scan's weights (the forward, the backward with its recompute),
                        once for those outside it (embedding, output head, final norm: kept for the backward)
  gradient reduce-scatter  over the same axes, once a microbatch: result r = R / n, wire r (n - 1)
  gradient all-reduce   over the data axes (HSDP's replicas), once a step on the accumulated, sharded gradient in
                        grad_dtype: wire 2 g (d - 1) / d
  EP dispatch + combine the all-to-all over `expert`, per MoE layer and microbatch: 4 passes (dispatch, combine and
                        their transposes) + 2 where remat recomputes the layer's forward (remat_policy full or
                        custom), + 1 where the dispatched rows are kept (moe_x_sorted: device or offload: the
                        recompute reads them, MaxText/moe/block.py); hierarchical's stage 1 + 1 (its combine's
                        exchange is not recomputed: 5), + 0 with the rows kept. The dropless minimum sends T K rows of D (T tokens a device, top-K); a2a_padded's
                        buffer n C rows, C = ceil(f T K / n); hierarchical's stage 1 (between nodes) N C1 rows against
                        T P (P = min(K, N, M) nodes a token), stage 2 (inside a node) L C2 rows against T K;
                        ragged_a2a sends the minimum. Wire (m - 1) / m of the rows, m the exchange's group.
  pipeline permutes     a microbatch's activations (T S / M tokens of D) to the next stage, every iteration of the
                        forward and the backward (R M + delay (S - 1) iterations each)
  microbatches          everything a microbatch does, gradient_accumulation_steps times

  rows = expected(layout, mesh_shape, gpus_per_node)
  table = compare(rows, compiled_collectives, microbatches)  # side by side, ratio, flag and cause

A row off by more than 1.5x is flagged with its cause where one is recognized: padding (the compiled bytes are
the capacity-padded buffer's), microbatches (reduced every microbatch where the arithmetic reduces once a step),
remat recompute (a gather repeated for the recompute), dtype (moved in float32, the arithmetic in the compute
dtype), reduced whole (an all-reduce over the data and FSDP axes in place of the reduce-scatter and the data
all-reduce), loop counting (a loop XLA gave no trip count), or "unexplained".
"""

from __future__ import annotations

import math
from typing import Any

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OFF_BY = 1.5  # a row whose compiled bytes differ from the arithmetic by more is flagged
SMALL = 0.005  # compiled rows below this share of the step's wire bytes, with no arithmetic: metadata, losses, norms
NOT_GATHERED = {"tensor", "tensor_sequence", "tensor_transpose", "stage", "autoregressive", "data", "diloco"}
RowKey = tuple[str, tuple[str, ...], Any]  # (kind, mesh axes, crosses nodes: True / False / None for either)


def _in_mesh_order(axes, mesh_shape: dict[str, int]) -> tuple[str, ...]:
  return tuple(a for a in mesh_shape if a in set(axes) and mesh_shape[a] > 1)


def _row(rows: dict, key: RowKey, what: str, wire: float, minimum: float | None = None, part: str = "") -> None:
  """Adds to a row; `part`: the FSDP axes of the group a data all-reduce is for (compare's "reduced whole")."""
  row = rows.setdefault(key, {"kind": key[0], "axes": list(key[1]), "crosses_nodes": key[2], "wire_bytes": 0.0,
                              "what": [], "parts": {}})
  row["wire_bytes"] += wire
  row["parts"][part] = row["parts"].get(part, 0.0) + wire
  if minimum is not None:
    row["dropless_wire_bytes"] = row.get("dropless_wire_bytes", 0.0) + minimum
  if what not in row["what"]:
    row["what"].append(what)


def expected(layout: dict[str, Any], mesh_shape: dict[str, int], gpus_per_node: int = 8) -> list[dict[str, Any]]:
  """The arithmetic's rows (the module docstring), each with the lines of arithmetic behind it.

  layout: "groups" ([{"routed": bool, "elements": int, "axes": [mesh axes it is sharded over], "scanned": bool: in
  the layer scan (default True)}]), "dtype",
  "grad_dtype", "microbatches", "tokens" (T a microbatch a device), "emb_dim", "top_k", "moe_layers",
  "dispatch" (the resolved backend), "capacity_factor", "hierarchical_capacity_factor", "node_limit" (M, 0:
  none), "ep_nodes" (N), "recompute" (bool), "pipeline" (None or {"stages", "microbatches", "iterations"}).
  """
  size = lambda axes: math.prod(mesh_shape.get(a, 1) for a in axes)  # noqa: E731
  b, g, micro = BYTES[layout["dtype"]], BYTES[layout["grad_dtype"]], layout["microbatches"]
  data_axes = _in_mesh_order([a for a in ("data", "diloco") if a in mesh_shape], mesh_shape)
  rows: dict[RowKey, dict] = {}
  for group in layout["groups"]:
    sharded = _in_mesh_order(group["axes"], mesh_shape)
    gathered = _in_mesh_order([a for a in sharded if a not in NOT_GATHERED and not (group["routed"] and a == "expert")],
                              mesh_shape)
    name = "the routed experts" if group["routed"] else "the other weights"
    if not group.get("scanned", True):
      name = "the weights outside the layer scan"
    n, gathers = size(gathered), 2 if group.get("scanned", True) else 1
    if n > 1:
      result = group["elements"] * b / size(a for a in sharded if a not in gathered)
      _row(rows, ("all-gather", gathered, None), f"{name} gathered, {gathers} a microbatch x {micro}",
           gathers * micro * result * (n - 1) / n)
      _row(rows, ("reduce-scatter", gathered, None), f"the gradient of {name}, 1 a microbatch x {micro}",
           micro * result / n * (n - 1))
    d = size(data_axes)
    if d > 1:
      shard = group["elements"] * g / size(sharded)
      _row(rows, ("all-reduce", data_axes, None), f"the gradient of {name} over the replicas, once a step",
           2 * shard * (d - 1) / d, part=",".join(gathered))
  _dispatch(rows, layout, mesh_shape)
  _pipeline(rows, layout, mesh_shape, b)
  return list(rows.values())


def _dispatch(rows: dict, layout: dict[str, Any], mesh_shape: dict[str, int]) -> None:
  n = mesh_shape.get("expert", 1)
  backend = layout["dispatch"]
  if n <= 1 or backend in ("local", "te_ncclep"):
    return
  t, k, row = layout["tokens"], layout["top_k"], layout["emb_dim"] * BYTES[layout["dtype"]]
  # Remat's recompute re-runs the combine's exchange and, unless the dispatched rows are kept, the dispatch's.
  redispatch = layout["recompute"] and not layout.get("dispatch_kept", False)
  per_layer = 4 + layout["recompute"] + redispatch
  passes = per_layer * layout["moe_layers"] * layout["microbatches"]
  what = f"{backend}: {per_layer} passes x {layout['moe_layers']} MoE layers x {layout['microbatches']} microbatches"
  if backend == "hierarchical":
    # Between nodes, remat's recompute re-runs the dispatch's exchange but not the combine's: the combine's last
    # exchange feeds `collect`, whose backward needs only its maps (MaxText/moe/dispatch/hierarchical.py), so XLA
    # drops it: 5 passes. Inside a node the combine's exchange feeds `weighted_collect`, which keeps its rows for
    # the weights' gradient: recomputed, 6 as a2a_padded.
    between = 4 + redispatch
    passes1 = between * layout["moe_layers"] * layout["microbatches"]
    big_n = max(1, layout["ep_nodes"])
    local = n // big_n
    p = min(k, big_n, layout["node_limit"] or big_n)
    f = layout["hierarchical_capacity_factor"]
    c1 = min(t, math.ceil(f * t * p / big_n))
    c2 = min(big_n * c1 * min(k, layout["num_experts"] // n), math.ceil(f * t * k / local))
    if big_n > 1:
      _row(rows, ("all-to-all", ("expert",), True), f"{what.replace(f'{per_layer} passes', f'{between} passes')}, "
           "stage 1 (between nodes)", passes1 * big_n * c1 * row * (big_n - 1) / big_n,
           passes1 * t * p * row * (big_n - 1) / big_n)
    if local > 1:
      _row(rows, ("all-to-all", ("expert",), False), f"{what}, stage 2 (inside a node)",
           passes * local * c2 * row * (local - 1) / local, passes * t * k * row * (local - 1) / local)
    return
  minimum = passes * t * k * row * (n - 1) / n
  if backend == "a2a_padded":
    c = min(t * k, math.ceil(layout["capacity_factor"] * t * k / n))
    _row(rows, ("all-to-all", ("expert",), None), what, passes * n * c * row * (n - 1) / n, minimum)
  else:  # ragged_a2a sends each peer's rows exactly; ring passes every shard's tokens round (n - 1 hops of T rows)
    kind = "ragged-all-to-all" if backend == "ragged_a2a" else "collective-permute"
    wire = minimum if backend == "ragged_a2a" else passes * (n - 1) * t * row
    _row(rows, (kind, ("expert",), None), what, wire, minimum)


def _pipeline(rows: dict, layout: dict[str, Any], mesh_shape: dict[str, int], b: float) -> None:
  p = layout.get("pipeline")
  if not p or mesh_shape.get("stage", 1) <= 1:
    return
  activations = layout["tokens"] * p["stages"] / p["microbatches"] * layout["emb_dim"] * b
  _row(rows, ("collective-permute", ("stage",), None),
       f"a microbatch's activations, {p['iterations']} iterations forward and backward x {layout['microbatches']}",
       2 * p["iterations"] * layout["microbatches"] * activations)


def _matches(key: RowKey, compiled: dict[str, Any]) -> bool:
  return (compiled["kind"], tuple(compiled["axes"])) == key[:2] and key[2] in (None, compiled["crosses_nodes"])


def compare(rows: list[dict[str, Any]], collectives: list[dict[str, Any]], layout: dict[str, Any],
            loop_notes: list[str] = ()) -> list[dict[str, Any]]:
  """Each arithmetic row beside the compiled rows it names (summed), and each compiled row no arithmetic names:
  wire bytes both ways, the ratio, and a cause where off by more than OFF_BY (the module docstring)."""
  total = sum(c["wire_bytes"] for c in collectives) or 1.0
  used: set[int] = set()
  out = []
  for row in rows:
    key = (row["kind"], tuple(row["axes"]), row["crosses_nodes"])
    hits = [i for i, c in enumerate(collectives) if _matches(key, c)]
    used |= set(hits)
    out.append({**row, "compiled_wire_bytes": sum(collectives[i]["wire_bytes"] for i in hits),
                "compiled_count": sum(collectives[i]["count"] for i in hits)})
  for i, c in enumerate(collectives):
    if i not in used and c["wire_bytes"] >= SMALL * total:
      out.append({"kind": c["kind"], "axes": list(c["axes"]), "crosses_nodes": c["crosses_nodes"], "wire_bytes": 0.0,
                  "what": [], "parts": {}, "compiled_wire_bytes": c["wire_bytes"], "compiled_count": c["count"]})
  for row in out:
    row["ratio"] = row["compiled_wire_bytes"] / row["wire_bytes"] if row["wire_bytes"] else None
    row["cause"] = _cause(row, out, layout, loop_notes)
  return out


def _near(ratio: float | None, target: float) -> bool:
  return ratio is not None and target / OFF_BY <= ratio <= target * OFF_BY


def _cause(row: dict[str, Any], rows: list[dict[str, Any]], layout: dict[str, Any], loop_notes) -> str | None:
  """None where within OFF_BY of the arithmetic; else the named cause, or "unexplained"."""
  ratio, micro, dropless = row["ratio"], layout["microbatches"], row.get("dropless_wire_bytes")
  if dropless:  # the dispatch: within reach of the dropless minimum, or of the padded buffer it sends
    if _near(row["compiled_wire_bytes"] / dropless, 1.0):
      return None
    if _near(ratio, 1.0):
      return f"padding: the capacity-padded buffer, {row['wire_bytes'] / dropless:.3g}x the dropless minimum"
  elif _near(ratio, 1.0):
    return None
  whole = _reduced_whole(rows)
  if row["kind"] == "reduce-scatter" and tuple(row["axes"]) in whole and row["compiled_wire_bytes"] < row["wire_bytes"] / OFF_BY:
    return f"reduced whole: this gradient is all-reduced over {','.join(whole[tuple(row['axes'])]['axes'])} instead"
  if row["kind"] == "all-reduce" and not row["wire_bytes"] and _fsdp_axes(row) in whole:
    fsdp = _fsdp_axes(row)
    replaced = sum(r["wire_bytes"] for r in rows if r["kind"] == "reduce-scatter" and tuple(r["axes"]) == fsdp)
    replaced += sum(r["parts"].get(",".join(fsdp), 0.0) for r in rows if r["kind"] == "all-reduce" and r["wire_bytes"])
    return (f"reduced whole: an all-reduce over {','.join(row['axes'])} in place of the reduce-scatter over "
            f"{','.join(fsdp)}{' and the data all-reduce' if len(fsdp) < len(row['axes']) else ''}, "
            f"{row['compiled_wire_bytes'] / replaced:.3g}x their {_size(replaced)} in {row['compiled_count']} "
            "all-reduces a step (an all-reduce sends twice a reduce-scatter's bytes)")
  absorbed = sum(row.get("parts", {}).get(",".join(a), 0.0) for a in whole) if row["kind"] == "all-reduce" else 0.0
  rest = row["wire_bytes"] - absorbed
  # The compute dtype's bytes over the gradient's: a gradient reduced inside the microbatch loop moves in the
  # compute dtype (bf16) where the arithmetic's once-a-step reduction moves the accumulated grad_dtype (fp32).
  narrower = _itemsize(layout.get("dtype")) / _itemsize(layout.get("grad_dtype"))
  for factor, how in ((micro, ""), (micro * narrower, f" in {layout.get('dtype')}")):
    if micro > 1 and row["kind"] == "all-reduce" and rest > 0 and _near(row["compiled_wire_bytes"] / rest, factor):
      return (f"microbatches: reduced in each of the {micro} microbatches{how}, the arithmetic once a step "
              f"({_size(row['compiled_wire_bytes'])} in {row['compiled_count']} all-reduces against {_size(rest)})"
              + (f"; {_size(absorbed)} of it reduced whole (above)" if absorbed else ""))
  if row["kind"] == "all-gather" and ratio is not None and OFF_BY < ratio <= 1.75:
    return "remat recompute: gathered again for the backward's recompute (3 a microbatch, the arithmetic 2)"
  if row["kind"] in ("all-gather", "reduce-scatter", "all-reduce") and ratio is not None and 1.75 < ratio <= 2.5:
    return "dtype: moved in float32, the arithmetic in the compute dtype"
  if row["kind"] == "all-reduce" and row["wire_bytes"] == 0 and "data" in row["axes"] and len(row["axes"]) > 1:
    fsdp = tuple(a for a in row["axes"] if a != "data")
    scattered = [r for r in rows if r["kind"] == "reduce-scatter" and tuple(r["axes"]) == fsdp and r["wire_bytes"]]
    if scattered and scattered[0]["compiled_wire_bytes"] < scattered[0]["wire_bytes"] / OFF_BY:
      return (f"reduced whole: an all-reduce over {','.join(row['axes'])} in place of the reduce-scatter over "
              f"{','.join(fsdp)} ({scattered[0]['wire_bytes'] / 2**30:.4g} GiB by the arithmetic) and the data "
              "all-reduce")
  if row["kind"] in ("all-gather", "reduce-scatter") and ratio is not None and ratio < 1 / OFF_BY:
    table = _one_vocab_table_wire(row, layout)
    if table and _near(row["compiled_wire_bytes"] / (row["wire_bytes"] - table), 1.0):
      return (f"the embedding stays on its vocab shards: its lookup and gradient run where the table lies (activations "
              f"reduced instead), the arithmetic moves the table whole ({_size(table)} of {_size(row['wire_bytes'])})")
  if any("counted once" in n for n in loop_notes):
    return "loop counting: a loop without a known trip count or readable bound, counted once"
  return "unexplained"


def _one_vocab_table_wire(row: dict[str, Any], layout: dict[str, Any]) -> float:
  """The share of a gather's or gradient reduce-scatter's arithmetic that one [vocab, emb] table makes (the
  weights outside the layer scan: the embedding and the output head, one table each), or 0."""
  groups = [g for g in layout.get("groups", []) if not g["routed"] and tuple(g["axes"]) == tuple(row["axes"])]
  outside = sum(g["elements"] for g in groups if not g.get("scanned", True))
  total = sum(g["elements"] for g in groups)
  return row["wire_bytes"] * (outside / 2) / total if outside and total else 0.0


def _itemsize(dtype: str | None) -> float:
  return {"bfloat16": 2, "float16": 2, "float32": 4}.get(dtype or "", 4)


def _fsdp_axes(row: dict[str, Any]) -> tuple[str, ...]:
  return tuple(a for a in row["axes"] if a not in ("data", "diloco"))


def _reduced_whole(rows: list[dict[str, Any]]) -> dict[tuple[str, ...], dict[str, Any]]:
  """Compiled all-reduces that no arithmetic names over FSDP axes A (and data axes, or none) where the arithmetic
  reduce-scatters a gradient over A and the program does not, by A: that gradient reduced whole."""
  scattered = {tuple(r["axes"]) for r in rows if r["kind"] == "reduce-scatter" and r["wire_bytes"]
               and r.get("compiled_wire_bytes", 0.0) < r["wire_bytes"] / OFF_BY}
  return {_fsdp_axes(r): r for r in rows
          if r["kind"] == "all-reduce" and not r["wire_bytes"] and _fsdp_axes(r) in scattered}


def _size(x: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if x >= scale:
      return f"{x / scale:.4g} {unit}"
  return f"{x:.0f} B"


def padding_lines(table: list[dict[str, Any]], layout: dict[str, Any]) -> list[str]:
  """The dispatch's bytes on the wire against the dropless minimum, per exchange of the dispatch backend."""
  out = []
  for row in table:
    if row.get("dropless_wire_bytes"):
      where = {True: " between nodes", False: " inside nodes", None: ""}[row["crosses_nodes"]]
      moved = f"the compiler moves {_size(row['compiled_wire_bytes'])}, " if "compiled_wire_bytes" in row else ""
      ratio = row.get("compiled_wire_bytes", row["wire_bytes"]) / row["dropless_wire_bytes"]
      out.append(f"dispatch ({layout['dispatch']}{where}): {moved}the capacity-padded buffer {_size(row['wire_bytes'])}, "
                 f"the dropless minimum {_size(row['dropless_wire_bytes'])} ({ratio:.3g}x the minimum)")
  return out


def layout_of(config: Any, fork: Any, state: Any, mesh_shape: dict[str, int], platform: str) -> dict[str, Any]:
  """`expected`'s layout from upstream's config, our fork's keys and the abstract train state (its leaves carry
  their shapes and the shardings the config's logical rules give them): no compiled program is read."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  from MaxText.plan import bubble  # pylint: disable=import-outside-toplevel

  num_experts = int(getattr(config, "num_experts", 1))
  groups: dict[tuple[bool, tuple[str, ...], bool], int] = {}
  model = state["model"] if "model" in state else state.params
  scan = bool(getattr(config, "scan_layers", True))
  for path, leaf in jax.tree_util.tree_leaves_with_path(model):
    spec = getattr(getattr(leaf, "sharding", None), "spec", None)
    if spec is None or not jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):
      continue  # RNG counters and keys
    per_dim = [list(d) if isinstance(d, (tuple, list)) else [d] for d in spec]
    routed = num_experts > 1 and leaf.ndim >= 3 and leaf.shape[0] == num_experts and "expert" in per_dim[0]
    scanned = scan and "layers" in jax.tree_util.keystr(path)  # upstream's decoder: dense_layers, moe_layers, layers
    key = (routed, _in_mesh_order([a for d in per_dim for a in d if a], mesh_shape), scanned)
    groups[key] = groups.get(key, 0) + math.prod(leaf.shape)
  ep = mesh_shape.get("expert", 1)
  backend = fork.moe_dispatch_backend if fork.moe_block == "ours" else "upstream"
  if backend == "auto":  # MaxText/moe/dispatch.resolve's rule, for the platform compiled for
    backend = "local" if ep == 1 else ("ring" if platform == "cpu" else "a2a_padded")
  moe_layers = maxtext_utils.get_dense_moe_layers(config)[1] if num_experts > 1 else 0
  return {
      "groups": [{"routed": r, "elements": n, "axes": list(a), "scanned": sc} for (r, a, sc), n in groups.items()],
      "dtype": str(np.dtype(config.dtype)), "grad_dtype": str(np.dtype(config.grad_dtype)),
      "microbatches": int(config.gradient_accumulation_steps),
      "tokens": int(config.per_device_batch_size * config.max_target_length), "emb_dim": int(config.emb_dim),
      "top_k": int(getattr(config, "num_experts_per_tok", 1)), "num_experts": num_experts,
      "moe_layers": int(moe_layers + (int(getattr(config, "mtp_num_layers", 0)) if moe_layers else 0)),
      "dispatch": backend, "capacity_factor": float(fork.moe_a2a_padded_capacity_factor),
      "hierarchical_capacity_factor": float(fork.moe_hierarchical_capacity_factor),
      "node_limit": int(config.topk_routing_group) if fork.moe_node_limited_routing else 0,
      "ep_nodes": int(config.dcn_expert_parallelism),
      "recompute": str(getattr(config, "remat_policy", "full")) in ("full", "custom"),
      "dispatch_kept": str(getattr(config, "remat_policy", "full")) == "custom"
      and str(getattr(config, "moe_x_sorted", "remat")) in ("device", "offload"),
      "pipeline": bubble.schedule(config),
  }
