"""What a layout costs by arithmetic alone, no compile: memory per GPU, wire bytes and seconds per link a step,
compute, and an estimated step and TFLOP/s/GPU. MaxText/plan/layout_search.py ranks its candidates by it.

A layout (`Layout`) is a DeepSeek-style mesh over nodes of `gpus_per_node` GPUs: every GPU of a node on `expert`
(ici_expert_parallelism = the node), pipeline stages, more EP, FSDP and data (HSDP) replicas over nodes (DCN).
Per GPU and step, T = per_device_batch_size x max_target_length tokens a microbatch, A microbatches:

  memory       weights, gradients, AdamW mu (mu_dtype) and nu (weight_dtype, as upstream keeps it) over
               fsdp x expert (x stage for the pipelined layers); ZeRO-1 (shard_optimizer_over_data) splits mu
               and nu over data too and adds the bf16 copy upstream gathers; the remat checkpoints (each layer's
               input; in a pipeline every iteration's, R M + S - 1 of T S / M tokens, and upstream's stage and
               circular buffers, 2 T S); the largest transient (analytic_memory's MoE / MLA / logits working
               sets; cuDNN attention keeps no scores, in pipeline stages too: patches/cudnn_mla_vmap.py) and two
               layers' gathered weights in bf16 (this layer's and the prefetched next)
  FSDP         each weight group all-gathered over its FSDP-like axes (the routed experts over fsdp, the rest
               over fsdp x expert) twice a layer run (forward, the backward's recompute) and reduce-scattered
               once, in the compute dtype (analytic_comms' forms); a pipeline gathers its stage's layer at every
               iteration, bubble included (upstream's default, pipeline_fsdp_ag_once off)
  data         the gradient all-reduced once a step over the replicas (data; and stage for the layers outside
               the pipeline, which every stage runs on its share of the batch); ZeRO-1: its reduce-scatter and
               the bf16 weights' all-gather, the same wire
  EP, pipeline analytic_comms.expected's own rows: dispatch and combine (4 passes a MoE layer run, 6 under
               remat, 5 between nodes for hierarchical) for the dispatch backend's buffers, hierarchical's
               stage 1 carrying a token to min(K, N, M) nodes, not K experts; moe_fp8 sends the passes towards
               the experts in e4m3 (1 + 4/128 B a value, MaxText/moe/fp8_dispatch.py); the stage permutes
  compute      MaxText's FLOPs a GPU a step plus the remat recompute (flops.recompute_flops) at the measured
               GEMM rate, cuDNN attention at its rate (in pipeline stages too), the routed experts at the FP8
               rate under moe_fp8; the pipelined layers' share / (1 - bubble), bubble = (S - 1) / (R M + S - 1)
  memory-bound the recipe's compiled plan's (configs/recipes/plans/), the same for every layout; 0 without one
  fits         the arithmetic x the compiler's bytes over the arithmetic's for the run's own layout (its compiled
               plan's; 1.39-2.82 on the six 671B recipes: XLA's gathered float32 layers, the gradient
               accumulator, the dispatch's padded buffers, and what XLA prefetches where HBM has room, which
               the arithmetic does not count) <= HBM x the run's XLA_PYTHON_CLIENT_MEM_FRACTION

Links (MaxText/hardware.py): a ring over a group inside a node at NVLink's rate, across nodes at its members' NICs on a
node together; an all-to-all at the measured 150 GB/s inside a node, across nodes at one NIC's rate; a permute
across nodes at one NIC's. Nothing overlaps (conservative: the shipped recipes' compiled plans expose 80-95% of
their collectives): step = compute + memory-bound + host offload copies + every link's seconds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from MaxText import hardware
from MaxText.plan import analytic_comms, analytic_memory

ACT = 2  # bytes of a bf16 activation or gathered weight
FP8_ROW = 1 + 4 / 128  # bytes a value of an e4m3 row with its f32 scale per 128 (MaxText/moe/fp8_dispatch.py)


@dataclasses.dataclass(frozen=True)
class Layout:
  """One candidate. ICI: every GPU of a node on `expert`; the rest over nodes (DCN)."""

  stages: int = 1  # S, dcn_pipeline_parallelism
  repeats: int = 1  # R, num_pipeline_repeats: one layer a stage a repeat, S x R MoE layers pipelined
  pipeline_micro: int = 1  # M, num_pipeline_microbatches
  ep_nodes: int = 1  # dcn_expert_parallelism
  fsdp: int = 1  # dcn_fsdp_parallelism
  data: int = 1  # dcn_data_parallelism
  zero1: bool = False  # shard_optimizer_over_data
  batch: int = 1  # per_device_batch_size, one microbatch
  accum: int = 1  # gradient_accumulation_steps
  remat: str = "run"  # "run": the run's own remat policy; "full"
  fp8: str = ""  # moe_fp8: "blockwise" or "mxfp8" ("": bf16 experts)
  dispatch: str = "a2a_padded"  # a2a_padded or hierarchical
  node_limited: bool = False  # moe_node_limited_routing
  hierarchical_capacity: float = 0.0  # moe_hierarchical_capacity_factor (0: the run's)


@dataclasses.dataclass(frozen=True)
class Shape:
  """The model, batch and machine a search ranks layouts for (layout_search.shape_of reads them from the config)."""

  c: dict[str, Any]  # analytic_memory's keys (the model's dimensions, dtypes)
  gpus: int
  gpus_per_node: int
  gpu: hardware.Gpu
  usable_bytes: float  # HBM x the run's XLA_PYTHON_CLIENT_MEM_FRACTION
  model_flops: float  # MaxText's count a GPU a step (the TFLOP/s figure's numerator), at the run's batch
  attention_flops: float  # of which causal attention (forward + backward)
  recompute_flops: dict[str, float]  # by remat ("run", "full"): what the backward re-runs
  routed_flops: dict[str, float]  # by remat: the routed experts' GEMMs, recompute included
  offloaded: dict[str, bool]  # by remat: the layer inputs in host memory
  memory_bound_s: float
  memory_bound_from: str
  memory_factor: float  # the compiler's bytes over the arithmetic's for the run's own layout (1: no compiled plan)
  capacity_factor: float  # a2a_padded's
  hierarchical_capacity_factor: float
  node_limit: int  # topk_routing_group, M of node-limited routing

  @property
  def nodes(self) -> int:
    return self.gpus // self.gpus_per_node


def _per_layer(s: Shape) -> dict[str, float]:
  """Elements of one layer's weights by kind."""
  p, c = analytic_memory.count_params(s.c), s.c
  moe = c["base_num_decoder_layers"] - c["first_num_dense_layers"]
  attn = p.attention / c["base_num_decoder_layers"]
  return {"routed": p.routed_experts / moe, "moe_other": attn + p.shared_and_router / moe,
          "dense": attn + p.dense_mlp / max(1, c["first_num_dense_layers"]), "embedding": p.embedding,
          "mtp": p.mtp, "mtp_routed": int(c.get("mtp_num_layers", 0)) * p.routed_experts / moe}


def pipelined_layers(l: Layout) -> int:
  return l.stages * l.repeats if l.stages > 1 else 0


def iterations(l: Layout) -> int:
  """Pipeline iterations a microbatch (upstream's R M + S - 1, delay 1)."""
  return l.repeats * l.pipeline_micro + l.stages - 1 if l.stages > 1 else 0


def bubble(l: Layout) -> float:
  return (l.stages - 1) / iterations(l) if l.stages > 1 else 0.0


def memory(s: Shape, l: Layout) -> tuple[float, list[str]]:
  """HBM bytes a GPU and the lines of arithmetic behind them."""
  c, per = s.c, _per_layer(s)
  w, g = analytic_memory.BYTES[c["weight_dtype"]], analytic_memory.BYTES[c["grad_dtype"]]
  mu = analytic_memory.BYTES[c.get("mu_dtype") or c["weight_dtype"]]
  ep, d, seq = s.gpus_per_node * l.ep_nodes, c["base_emb_dim"], c["max_target_length"]
  total = analytic_memory.count_params(c).total
  pipelined = pipelined_layers(l) * (per["routed"] + per["moe_other"])
  params = pipelined / (l.stages * l.fsdp * ep) + (total - pipelined) / (l.fsdp * ep)
  opt_split = l.data if l.zero1 else 1
  states = params * (w + g + (mu + w) / opt_split + (ACT if l.zero1 else 0))
  t = l.batch * seq
  layers = c["base_num_decoder_layers"] + int(c.get("mtp_num_layers", 0))
  offloaded = s.offloaded[l.remat]
  if l.stages > 1:
    t_micro = t * l.stages / l.pipeline_micro
    kept = (iterations(l) * t_micro + (layers - pipelined_layers(l)) * t) * d * ACT
    buffers = 2 * t * l.stages * d * ACT  # upstream's state_io and circular storage
  else:
    t_micro, kept, buffers = t, layers * t * d * ACT, 0.0
  host = kept if offloaded else 0.0
  kept = 0.0 if offloaded else kept
  work = analytic_memory.estimate({**c, "per_device_batch_size": max(t, t_micro) / seq}, s.gpus)[1].transient
  gathered = 2 * (per["routed"] / ep + per["moe_other"]) * ACT
  out = states + kept + buffers + work + gathered
  gb = lambda x: f"{x / 2**30:.1f}"  # noqa: E731
  lines = [f"states {gb(states)} GiB ({params / 1e9:.3f}B params a GPU x {w}+{g}+({mu}+{w})/{opt_split}"
           f"{'+2 (ZeRO-1 bf16 copy)' if l.zero1 else ''} B)",
           f"checkpoints {gb(kept)} GiB{f' (+{gb(host)} GiB in host memory)' if host else ''}, pipeline buffers "
           f"{gb(buffers)}, working set {gb(work)}, gathered layers {gb(gathered)}",
           f"total {gb(out)} GiB of {gb(s.usable_bytes)} usable"]
  return out, lines


@dataclasses.dataclass
class Link:
  """Seconds a step on one kind of link, and the wire bytes behind them."""

  seconds: float = 0.0
  wire_bytes: float = 0.0
  what: list[str] = dataclasses.field(default_factory=list)


LINKS = ("NVLink", "NVLink a2a", "IB", "IB a2a")


def _add(links: dict[str, Link], name: str, wire: float, rate: float, what: str) -> None:
  if wire > 0:
    links[name].seconds += wire / rate
    links[name].wire_bytes += wire
    links[name].what.append(f"{what}: {wire / 2**30:.1f} GiB at {rate / 1e9:.0f} GB/s")


def _ring(s: Shape, links: dict[str, Link], wire: float, members_a_node: int, crosses: bool, what: str) -> None:
  """A ring collective: across nodes at its members' NICs on a node together, else NVLink."""
  if crosses:
    _add(links, "IB", wire, members_a_node * s.gpu.ib_bytes.value, what)
  else:
    _add(links, "NVLink", wire, s.gpu.nvlink_bytes.value, what)


def _fsdp(s: Shape, l: Layout, links: dict[str, Link]) -> None:
  """Each weight group's gathers (2 a layer run) and reduce-scatters (1), and the data all-reduce once a step."""
  per, c = _per_layer(s), s.c
  ep = s.gpus_per_node * l.ep_nodes
  moe_outside = c["base_num_decoder_layers"] - c["first_num_dense_layers"] - pipelined_layers(l)
  runs_in = iterations(l) * l.accum  # a stage's layer runs a step, bubble included
  # (what, elements a transfer moves, transfers a step, over fsdp x expert rather than fsdp alone): a layer in the
  # scan (or a pipeline iteration) is gathered twice a run and its gradient reduce-scattered once; the embedding
  # and head, outside the scan, once each (kept for the backward)
  groups = [
      ("routed, pipelined", per["routed"] / ep, 3 * runs_in, False),
      ("other, pipelined", per["moe_other"], 3 * runs_in, True),
      ("routed, outside", per["routed"] / ep, 3 * moe_outside * l.accum, False),
      ("other, outside", per["moe_other"], 3 * moe_outside * l.accum, True),
      ("dense layers", per["dense"], 3 * c["first_num_dense_layers"] * l.accum, True),
      ("MTP routed", per["mtp_routed"] / ep, 3 * l.accum, False),
      ("MTP other", per["mtp"] - per["mtp_routed"], 3 * l.accum, True),
      ("embedding and head", per["embedding"], 2 * l.accum, True),
  ]
  for name, elements, moves, with_expert in groups:
    n = l.fsdp * (ep if with_expert else 1)
    if n > 1 and moves:
      wire = moves * elements * ACT * (n - 1) / n
      crosses = l.fsdp > 1 or (with_expert and l.ep_nodes > 1)
      _ring(s, links, wire, s.gpus_per_node if with_expert else 1, crosses, f"FSDP {name}")
  g = analytic_memory.BYTES[c["grad_dtype"]]
  total = analytic_memory.count_params(c).total
  inside = pipelined_layers(l) * (per["routed"] + per["moe_other"])
  for name, elements, replicas in (("pipelined", inside / (l.stages * l.fsdp * ep), l.data),
                                   ("outside the pipeline", (total - inside) / (l.fsdp * ep), l.data * l.stages)):
    if replicas > 1 and elements:
      wire = (g + ACT if l.zero1 else 2 * g) * elements * (replicas - 1) / replicas
      _ring(s, links, wire, 1, True, f"{'ZeRO-1 reduce-scatter + gather' if l.zero1 else 'all-reduce'} {name}")


def _expected_layout(s: Shape, l: Layout, tokens: float, moe_runs: int, pipeline) -> dict[str, Any]:
  c = s.c
  return {"groups": [], "dtype": "bfloat16", "grad_dtype": c["grad_dtype"], "microbatches": l.accum,
          "tokens": tokens, "emb_dim": c["base_emb_dim"], "top_k": c["num_experts_per_tok"],
          "num_experts": c["num_experts"], "moe_layers": moe_runs, "dispatch": l.dispatch,
          "capacity_factor": s.capacity_factor,
          "hierarchical_capacity_factor": l.hierarchical_capacity or s.hierarchical_capacity_factor,
          "node_limit": s.node_limit if l.node_limited else 0, "ep_nodes": l.ep_nodes, "recompute": True,
          "pipeline": pipeline}


def _fp8_share(row: dict[str, Any], l: Layout) -> float:
  """Bytes a bf16 value costs, averaged over the passes: those towards the experts go in e4m3 under moe_fp8=blockwise
  (MaxText/moe/fp8_dispatch.py; under mxfp8 Transformer Engine quantizes inside its GEMM: the exchanges stay bf16)."""
  if l.fp8 != "blockwise" or row["kind"] not in ("all-to-all", "ragged-all-to-all"):
    return 1.0
  passes = 5 if row["crosses_nodes"] and l.dispatch == "hierarchical" else 6
  towards = 3  # the dispatch, the combine's transpose, the recompute's dispatch
  return (towards * FP8_ROW + (passes - towards) * ACT) / (passes * ACT)


def _exchanges(s: Shape, l: Layout, links: dict[str, Link]) -> None:
  """EP dispatch / combine and the stage permutes, from analytic_comms.expected (the same forms as the plan's)."""
  c = s.c
  ep = s.gpus_per_node * l.ep_nodes
  mesh = {"expert": ep, "stage": l.stages}
  t = l.batch * c["max_target_length"]
  moe_outside = (c["base_num_decoder_layers"] - c["first_num_dense_layers"] - pipelined_layers(l)
                 + int(c.get("mtp_num_layers", 0)))
  rows = analytic_comms.expected(_expected_layout(s, l, t, moe_outside, None if l.stages == 1 else {
      "stages": l.stages, "microbatches": l.pipeline_micro, "iterations": iterations(l)}), mesh)
  if l.stages > 1:  # every iteration runs one MoE layer on T S / M tokens, the bubble's on zeros
    rows += analytic_comms.expected(_expected_layout(s, l, t * l.stages / l.pipeline_micro, iterations(l), None), mesh)
  for row in rows:
    wire = row["wire_bytes"] * _fp8_share(row, l)
    crosses = row["crosses_nodes"] if row["crosses_nodes"] is not None else l.ep_nodes > 1
    if row["kind"] == "collective-permute":
      crosses = True  # stages are over nodes
    if row["kind"] == "all-to-all":
      rate = (s.gpu.ib_bytes.value * (s.gpu.a2a_ib_share.value if s.gpu.a2a_ib_share else 1.0) if crosses
              else hardware.link_bytes(s.gpu, "all-to-all", False).value)
      _add(links, "IB a2a" if crosses else "NVLink a2a", wire, rate, f"{l.dispatch} {row['what'][0]}")
    else:
      _add(links, "IB" if crosses else "NVLink", wire, hardware.link_bytes(s.gpu, row["kind"], crosses).value,
           f"{row['kind']} {row['what'][0]}")


def links(s: Shape, l: Layout) -> dict[str, Link]:
  out = {name: Link() for name in LINKS}
  _fsdp(s, l, out)
  _exchanges(s, l, out)
  return out


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A layout's arithmetic: seconds a step by term, memory, and the TFLOP/s/GPU it comes to."""

  compute_s: float
  memory_bound_s: float
  offload_s: float
  bubble_s: float  # the part of compute and memory-bound work the bubble adds (in both already)
  links: dict[str, Link]
  memory_bytes: float
  memory_lines: list[str]
  usable_bytes: float
  step_s: float
  tflops_per_gpu: float

  memory_factor: float

  @property
  def fits(self) -> bool:
    return self.memory_bytes * self.memory_factor <= self.usable_bytes


def estimate(s: Shape, l: Layout) -> Estimate:
  c, gpu = s.c, s.gpu
  recompute, routed = s.recompute_flops[l.remat], s.routed_flops[l.remat]
  attention = s.attention_flops * (4 / 3 if recompute else 1)  # the recompute runs its forward again
  gemm = s.model_flops + recompute - attention - (routed if l.fp8 else 0.0)
  compute = gemm / gpu.gemm_flops.value + (routed / gpu.fp8_grouped_flops.value if l.fp8 else 0.0)
  compute += attention / gpu.attention_flops.value  # cuDNN's, in pipeline stages too (patches/cudnn_mla_vmap.py)
  memory_bound = s.memory_bound_s
  share = pipelined_layers(l) / (c["base_num_decoder_layers"] + int(c.get("mtp_num_layers", 0)))
  stretch = share * bubble(l) / (1 - bubble(l))  # the pipelined share's bubble iterations
  bubble_s = (compute + memory_bound) * stretch
  mem, lines = memory(s, l)
  offload = 0.0
  if s.offloaded[l.remat]:  # the layer inputs out in the forward and back for the backward, over PCIe
    layers = c["base_num_decoder_layers"] + int(c.get("mtp_num_layers", 0))
    offload = 2 * layers * l.batch * l.accum * c["max_target_length"] * c["base_emb_dim"] * ACT / gpu.host_bytes.value
  per_link = links(s, l)
  step = compute + memory_bound + bubble_s + offload + sum(x.seconds for x in per_link.values())
  return Estimate(compute, memory_bound, offload, bubble_s, per_link, mem, lines, s.usable_bytes, step,
                  s.model_flops / step / 1e12, s.memory_factor)
