"""`python -m MaxText.plan <config> --search-layouts [--top N] [--compile N]`: the layouts of a run's GPU count,
ranked by arithmetic before anything is compiled.

The class enumerated (MaxText/plan/layout_cost.py's Layout): every GPU of a node on `expert`, and over the nodes
  pipeline      S = 1, 2, 4, 8, 16 stages (dcn_pipeline_parallelism), S x R of the MoE layers pipelined, one a
                stage a repeat (pipeline_parallel_layers, num_pipeline_repeats), M = S j pipeline microbatches
                with j dividing the per-GPU batch (num_pipeline_microbatches; a microbatch holds whole sequences);
                the run's attention (cuDNN's runs in stages with MLA: patches/cudnn_mla_vmap.py)
  EP            8 x k GPUs, k = 1, 2, 4, 8 nodes (dcn_expert_parallelism); across nodes flat (a2a_padded) or
                two-level (moe_dispatch_backend=hierarchical), with or without node-limited routing
  the rest      fsdp x data over the nodes left (every split; data > 1 is HSDP), ZeRO-1 where data > 1
  batch         per_device_batch_size x gradient_accumulation_steps = the run's, so the global batch is kept
  remat         the run's policy, or full
  experts       bf16, or the GPU's moe_fp8 (blockwise on Hopper, mxfp8 on a B200)
Rules the repo knows are applied before any arithmetic, each refusal counted by its reason: the experts split
over EP; fsdp x expert divides MLA's kv_lora_rank (upstream shards it over both: the 671B recipes' IndivisibleError
at 1,024 ways); ZeRO-1 only without FSDP (upstream's types.py); node-limited routing only where the routing groups
are the EP nodes (MaxText/config/moe_keys.py). The rest are ranked by layout_cost.estimate, those that do not fit
dropped; then, best first, each is given to the real config loader (our keys and checks, the launcher's topology
check, the presets, upstream's own validation at the run's device count) until `top` pass, each refusal counted
by its reason. With --compile N the best N are planned for real (MaxText/plan/planner.py) and printed beside
their arithmetic, with the best of them by the compiler; one whose account is violated (MaxText/plan/account.py)
is marked, left out of that best, and the search exits 9 (a single plan's code) with one line naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any, Callable, Iterator

from MaxText import config as fork_config
from MaxText.config import environment, parallelism, xla_presets
from MaxText import hardware
from MaxText.plan import account, flops, layout_cost
from MaxText.plan import planner as plan
from MaxText.plan.layout_cost import Layout, Shape

STAGES = (1, 2, 4, 8, 16)
EP_NODES = (1, 2, 4, 8)
TOP = 10
# Node-limited routing sends a token to M of N nodes, T M / N rows a node when balanced; at hierarchical's default
# buffer (2x that share) a node's buffer is capped at T rows with or without the limit (C1 = min(T, ...),
# MaxText/moe/dispatch/hierarchical.py), so the limit only shortens the wire below 2 N / M: 1.5x at V3's M = 4
# of N = 8. A node sent more than its buffer stops the run after that step (exit 8), never a silent drop.
NODE_LIMITED_CAPACITY = 1.5
VALIDATE_AT_MOST = 200  # loader calls a search may spend (about 0.5 s each) finding `top` that pass
SHAPE_KEYS = ("base_emb_dim", "base_num_query_heads", "qk_nope_head_dim", "qk_rope_head_dim", "q_lora_rank",
              "kv_lora_rank", "v_head_dim", "base_num_decoder_layers", "first_num_dense_layers", "base_moe_mlp_dim",
              "base_mlp_dim", "num_experts", "num_experts_per_tok", "shared_experts", "vocab_size", "mtp_num_layers",
              "max_target_length", "num_vocab_tiling", "n_routing_groups")


class _With:
  """Upstream's config with some attributes replaced (flops.py's FLOP counts read attributes)."""

  def __init__(self, config: Any, **overrides: Any):
    self._config, self._overrides = config, overrides

  def __getattr__(self, name: str) -> Any:
    return self._overrides[name] if name in self._overrides else getattr(self._config, name)


def _validation_keys(num_gpus: int) -> list[str]:
  """Upstream validates at the device count jax sees unless told (types.py get_num_target_devices)."""
  return ["internal_compile=true", f"internal_compile_num_devices={num_gpus}"]


def validate(args: list[str], num_gpus: int) -> tuple[fork_config.RunConfig, Any]:
  """The real loader on a run's arguments: ConfigError (one line naming the key) where any check refuses it."""
  import patches  # pylint: disable=import-outside-toplevel
  from patches import config_errors  # pylint: disable=import-outside-toplevel

  run = fork_config.load([*args, *_validation_keys(num_gpus)])
  plan.check_layout(run, num_gpus)
  run = xla_presets.with_upstream_defaults(run, xla_presets.compose_for(run, {}))
  applied = config_errors.SEAM.applied
  # Upstream's own handler logs a banner, writes /dev/termination-log and may exit; ours lets the error through
  patches.apply_module(config_errors)
  try:
    return run, environment.validate_with_upstream(run)
  finally:
    if not applied:
      patches.undo_module(config_errors)


def compiled_summary(run: fork_config.RunConfig) -> dict[str, Any] | None:
  """The recipe's compiled plan summary, where one is committed (configs/recipes/plans/<recipe>.json)."""
  path = run.config_path.parent / "plans" / f"{run.config_path.stem}.json"
  return json.loads(path.read_text()) if path.is_file() else None


def shape_of(args: list[str]) -> tuple[fork_config.RunConfig, Shape]:
  """The run's model, batch and machine, through the loader (so the run itself must pass it)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  first = fork_config.load(args)
  num_gpus = plan.num_gpus_of(first)
  run, config = validate(args, num_gpus)
  c = {k: getattr(config, k) for k in SHAPE_KEYS}
  c.update(weight_dtype=np.dtype(config.weight_dtype).name, grad_dtype=np.dtype(config.grad_dtype).name,
           mu_dtype=np.dtype(config.mu_dtype).name if config.mu_dtype else None, dtype=np.dtype(config.dtype).name)
  total, _, attention = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
  remats = {"run": config, "full": _With(config, remat_policy="full")}
  if config.remat_policy == "full":
    del remats["full"]  # the run's own
  gpu = hardware.GPUS[run.fork.target_gpu or "h100"]
  fraction = planner_fraction(run)
  compiled = compiled_summary(run)
  memory_s = compiled["terms_s"]["memory_s"] if compiled else 0.0
  memory_from = (f"{memory_s:.1f} s, its compiled plan's, for every layout" if compiled
                 else "not counted (no compiled plan summary beside the config)")
  shape = Shape(
      c=c, gpus=num_gpus, gpus_per_node=run.fork.gpus_per_node, gpu=gpu, usable_bytes=gpu.hbm_bytes.value * fraction,
      model_flops=total * 1e12, attention_flops=attention * 1e12,
      recompute_flops={k: flops.recompute_flops(v)[0] for k, v in remats.items()},
      routed_flops={k: flops.routed_expert_flops(v) for k, v in remats.items()},
      offloaded={"run": config.remat_policy == "custom" and str(getattr(config.decoder_layer_input, "value",
                                                                         config.decoder_layer_input)) == "offload",
                 "full": False},
      memory_bound_s=memory_s, memory_bound_from=memory_from, memory_factor=1.0,
      capacity_factor=run.fork.moe_a2a_padded_capacity_factor,
      hierarchical_capacity_factor=run.fork.moe_hierarchical_capacity_factor,
      node_limit=int(config.topk_routing_group))
  if compiled:  # the compiler's bytes over the arithmetic's, for the run's own layout
    own = layout_cost.memory(shape, run_layout(run))[0]
    shape = dataclasses.replace(shape, memory_factor=compiled["memory"]["device_gib"] * 2**30 / own)
  if shape.recompute_flops.get("full") == shape.recompute_flops["run"] and not shape.offloaded["run"]:
    # the run's policy keeps what full remat keeps (the 671B recipes' custom: the layer inputs on the device)
    shape = dataclasses.replace(shape, recompute_flops={"run": shape.recompute_flops["run"]})
  return run, shape


def planner_fraction(run: fork_config.RunConfig) -> float:
  """The share of HBM jax may take, as the planner reads it (the presets' XLA_PYTHON_CLIENT_MEM_FRACTION)."""
  env = xla_presets.compose_for(run, {}).env
  return plan.mem_fraction(env).value


def run_layout(run: fork_config.RunConfig) -> Layout:
  """The run's own layout read into the class (ICI fsdp, where a run has it, counted with DCN fsdp)."""
  ici, dcn = parallelism.mesh_axes(run.upstream, "ici_"), parallelism.mesh_axes(run.upstream, "dcn_")
  up = run.upstream
  return Layout(stages=dcn["dcn_pipeline_parallelism"], repeats=max(1, int(up.get("num_pipeline_repeats", 1))),
                pipeline_micro=max(1, int(up.get("num_pipeline_microbatches", 1))),
                ep_nodes=dcn["dcn_expert_parallelism"], fsdp=dcn["dcn_fsdp_parallelism"] * ici["ici_fsdp_parallelism"],
                data=dcn["dcn_data_parallelism"], zero1=bool(up.get("shard_optimizer_over_data", False)),
                batch=int(up.get("per_device_batch_size", 1)), accum=int(up.get("gradient_accumulation_steps", 1)),
                fp8="" if run.fork.moe_fp8 == "none" else run.fork.moe_fp8,
                dispatch="hierarchical" if run.fork.moe_dispatch_backend == "hierarchical" else "a2a_padded",
                node_limited=run.fork.moe_node_limited_routing,
                # as the class writes it: node-limited layouts name their capacity, the others take the run's (0)
                hierarchical_capacity=run.fork.moe_hierarchical_capacity_factor if run.fork.moe_node_limited_routing else 0.0)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(s: Shape, run_layout_: Layout, fp8: str = "") -> tuple[list[Layout], collections.Counter]:
  """Every layout of the class (module docstring) and the count of those a known rule refuses, by rule. fp8: the
  moe_fp8 recipe the GPU runs ("": none), tried beside bf16."""
  c, refused, out = s.c, collections.Counter(), []
  moe_layers = c["base_num_decoder_layers"] - c["first_num_dense_layers"]
  sequences = run_layout_.batch * run_layout_.accum  # a GPU a step, kept
  for stages in STAGES:
    if stages > s.nodes or s.nodes % stages or (stages > 1 and moe_layers < stages):
      continue
    repeats = moe_layers // stages if stages > 1 else 1
    for k in EP_NODES:
      if (s.nodes // stages) % k:
        continue
      ep = s.gpus_per_node * k
      if c["num_experts"] % ep:
        refused["the experts do not split over EP"] += 1
        continue
      rest = s.nodes // stages // k
      for fsdp in _divisors(rest):
        data = rest // fsdp
        if c["kv_lora_rank"] % (fsdp * ep):
          refused["fsdp x expert does not divide kv_lora_rank (MLA's wkv_b is split over both)"] += 1
          continue
        for zero1 in ((False, True) if data > 1 else (False,)):
          if zero1 and fsdp > 1:
            refused["ZeRO-1 with FSDP (upstream types.py refuses shard_optimizer_over_data with fsdp > 1)"] += 1
            continue
          for layout in _knobs(s, Layout(stages=stages, repeats=repeats, ep_nodes=k, fsdp=fsdp, data=data,
                                         zero1=zero1), sequences, fp8):
            if layout.node_limited and c["n_routing_groups"] not in (-1, layout.ep_nodes):
              refused["node-limited routing needs n_routing_groups = dcn_expert_parallelism (moe_keys.py)"] += 1
              continue
            out.append(layout)
  return out, refused


def _knobs(s: Shape, base: Layout, sequences: int, fp8: str) -> Iterator[Layout]:
  """The batch split, pipeline microbatches, remat, precision and dispatch of one mesh."""
  for batch in _divisors(sequences):
    micros = [base.stages * j for j in _divisors(batch)] if base.stages > 1 else [1]
    for micro in micros:
      for remat_ in s.recompute_flops:  # "run", and "full" where the run's policy is another
        for precision in (("", fp8) if fp8 else ("",)):
          dispatches = [("a2a_padded", False, 0.0)]
          if base.ep_nodes > 1:
            dispatches += [("hierarchical", False, 0.0), ("hierarchical", True, NODE_LIMITED_CAPACITY)]
          for dispatch, limited, capacity in dispatches:
            yield dataclasses.replace(base, pipeline_micro=micro, batch=batch, accum=sequences // batch,
                                      remat=remat_, fp8=precision, dispatch=dispatch, node_limited=limited,
                                      hierarchical_capacity=capacity)


def overrides(s: Shape, l: Layout) -> dict[str, Any]:
  """The key=value overrides that give a layout (every mesh key written out, the rest only where set)."""
  out: dict[str, Any] = {
      "ici_expert_parallelism": s.gpus_per_node, "ici_fsdp_parallelism": 1, "ici_data_parallelism": 1,
      "dcn_expert_parallelism": l.ep_nodes, "dcn_fsdp_parallelism": l.fsdp, "dcn_data_parallelism": l.data,
      "dcn_pipeline_parallelism": l.stages, "per_device_batch_size": l.batch, "gradient_accumulation_steps": l.accum}
  if l.stages > 1:
    out.update(pipeline_parallel_layers=layout_cost.pipelined_layers(l), num_pipeline_repeats=l.repeats,
               num_pipeline_microbatches=l.pipeline_micro)
  if l.zero1:
    out["shard_optimizer_over_data"] = True
  if l.remat == "full":
    out["remat_policy"] = "full"
  if l.fp8:
    out["moe_fp8"] = l.fp8
  if l.ep_nodes > 1:
    out["moe_dispatch_backend"] = l.dispatch
  if l.node_limited:
    out["moe_node_limited_routing"] = True
  if l.hierarchical_capacity:
    out["moe_hierarchical_capacity_factor"] = l.hierarchical_capacity
  return out


def changed(run: fork_config.RunConfig, keys: dict[str, Any]) -> dict[str, Any]:
  """Only the keys whose value differs from the run's own."""
  merged = {**parallelism.upstream_base(), **run.upstream, **run.fork.model_dump()}
  return {k: v for k, v in keys.items() if merged.get(k) != v}


def args_of(keys: dict[str, Any]) -> list[str]:
  return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in keys.items()]


@dataclasses.dataclass
class Ranked:
  """A layout that fits by the arithmetic, with its estimate, its overrides and the loader's verdict."""

  layout: Layout
  estimate: layout_cost.Estimate
  keys: dict[str, Any]
  refused: str | None = None


def rank(s: Shape, layouts: list[Layout]) -> tuple[list[Ranked], int]:
  """Those that fit, best estimated TFLOP/s/GPU first, and the count that do not fit."""
  fitting, over = [], 0
  for l in layouts:
    e = layout_cost.estimate(s, l)
    if e.fits:
      fitting.append(Ranked(l, e, overrides(s, l)))
    else:
      over += 1
  fitting.sort(key=lambda r: -r.estimate.tflops_per_gpu)
  return fitting, over


def loader_pass(args: list[str], num_gpus: int, ranked: list[Ranked], top: int, refused: collections.Counter,
                check: Callable[[list[str], int], Any] = validate, budget: int = VALIDATE_AT_MOST) -> list[Ranked]:
  """The first `top` the real loader accepts, best first; each refusal counted by its reason (its first words)."""
  passed: list[Ranked] = []
  for r in ranked[:budget]:
    if len(passed) == top:
      break
    try:
      check([*args, *args_of(r.keys)], num_gpus)
    except ValueError as e:  # ConfigError, LaunchError: one line naming the key
      r.refused = str(e)
      refused[f"loader: {_reason(str(e))}"] += 1
      continue
    passed.append(r)
  return passed


def _reason(message: str) -> str:
  """A refusal's reason without the values that differ between candidates."""
  head = message.split(":")[0] if "rejected by upstream" not in message else message.split("rejected by upstream")[1]
  return " ".join(head.split())[:140]


def line(run: fork_config.RunConfig, r: Ranked) -> str:
  e = r.estimate
  link = "  ".join(f"{name} {e.links[name].seconds:.1f}" for name in layout_cost.LINKS)
  keys = " ".join(args_of(changed(run, r.keys))) or "(as given)"
  bubble = f" bubble {layout_cost.bubble(r.layout):.0%}" if r.layout.stages > 1 else ""
  gib = e.memory_bytes / 2**30
  return (f"{e.tflops_per_gpu:6.1f} TF/s  step {e.step_s:7.2f} s  mem {gib:5.1f} GiB (x{e.memory_factor:.2f} = "
          f"{gib * e.memory_factor:5.1f})  "
          f"compute {e.compute_s:.1f}  mem-bound {e.memory_bound_s + e.bubble_s:.1f}{bubble}  {link}  {keys}")


def main(args: list[str], top: int = TOP, compile_n: int = 0, timeout_s: float = plan.DEFAULT_TIMEOUT_S,
         json_path: str | None = None, heartbeat_s: float = plan.HEARTBEAT_S, mode: str = "auto") -> int:
  run, s = shape_of(args)
  own = run_layout(run)
  layouts, refused = enumerate_layouts(s, own, (s.gpu.fp8_recipe or "") if s.gpu.fp8_grouped_flops else "")
  enumerated = len(layouts) + sum(refused.values())
  ranked, over = rank(s, layouts)
  best = loader_pass(args, s.gpus, ranked, max(top, compile_n), refused)
  own_e = layout_cost.estimate(s, own)
  print(f"\n== layouts of {run.config_path.name}: {s.gpus} x {s.gpu.name}, {s.gpus_per_node} a node; "
        f"{enumerated} enumerated, {over} over {s.usable_bytes / 2**30:.1f} GiB, {len(ranked)} ranked")
  for reason, n in refused.most_common():
    print(f"  refused {n:5d}: {reason}")
  print(f"  arithmetic (MaxText/plan/layout_cost.py): nothing overlapped; memory-bound work {s.memory_bound_from}; "
        f"seconds a step per link: {', '.join(layout_cost.LINKS)}")
  print(f"  memory: the arithmetic x {s.memory_factor:.2f} (the compiler's bytes over the arithmetic's for the run's "
        f"own layout) must fit {s.usable_bytes / 2**30:.1f} GiB")
  print(f"  as given  {line(run, Ranked(own, own_e, overrides(s, own)))}")
  if compiled := compiled_summary(run):
    print(f"            its compiled plan: {compiled['tflops_per_gpu']:6.1f} TF/s  step {compiled['step_s']:7.2f} s  "
          f"mem {compiled['memory']['device_gib']:5.1f} GiB")
  for i, r in enumerate(best[:top], 1):
    print(f"  {i:2d}  {line(run, r)}")
  results = [{"overrides": changed(run, r.keys), "tflops_per_gpu": r.estimate.tflops_per_gpu,
              "step_s": r.estimate.step_s, "memory_gib": r.estimate.memory_bytes / 2**30,
              "links_s": {k: v.seconds for k, v in r.estimate.links.items()}} for r in best[:top]]
  violated = compile_best(run, args, best[:compile_n], results, timeout_s, mode, heartbeat_s)
  if json_path:
    plan.write_json({"search_layouts": results, "refused": dict(refused)}, json_path)
  if violated:
    i, first = violated[0]
    return account.refuse_violated(len(violated), f"{min(compile_n, len(best))} compiled layouts", str(i), first)
  return 0 if best else 2


def compile_best(run: fork_config.RunConfig, args: list[str], best: list[Ranked], results: list[dict[str, Any]],
                 timeout_s: float, mode: str, heartbeat_s: float) -> list[tuple[int, str]]:
  """Plans each of `best` for real, printed beside its arithmetic and recorded in results[i]["compiled"]; then the
  best compiled by the compiler's TF/s among those whose account holds. Returns (rank, first violation) of each
  whose account is violated: marked, its figures not trusted, never the best."""
  violated, held = [], []
  for i, r in enumerate(best, 1):
    keys = args_of(changed(run, r.keys))
    plan.log(f"search-layouts: planning {i} of {len(best)}: {' '.join(keys)}")
    try:
      report = plan.plan([*args, *keys], timeout_s, mode=mode, heartbeat_s=heartbeat_s)
    except ValueError as e:
      print(f"  {i:2d}  compiler refused: {e}")
      results[i - 1]["compiled"] = {"error": str(e)}
      continue
    est = report.get("estimate") or {}
    gib = report["memory"]["device_total"] / 2**30 if report.get("verdict") else float("nan")
    wrong = account.violations_of(report)
    mark = f"  ACCOUNT VIOLATED ({len(wrong)}): {wrong[0]}" if wrong else ""
    print(f"  {i:2d}  arithmetic {r.estimate.tflops_per_gpu:6.1f} TF/s {r.estimate.step_s:7.2f} s "
          f"{r.estimate.memory_bytes / 2**30:5.1f} GiB | compiler {est.get('tflops_per_gpu', float('nan')):6.1f} TF/s "
          f"{est.get('step_s', float('nan')):7.2f} s {gib:5.1f} GiB{mark}")
    results[i - 1]["compiled"] = {"tflops_per_gpu": est.get("tflops_per_gpu"), "step_s": est.get("step_s"),
                                  "memory_gib": gib, "violations": wrong}
    if wrong:
      violated.append((i, wrong[0]))
    elif est.get("tflops_per_gpu") is not None and (report.get("verdict") or {}).get("fits") is not False:
      held.append((est["tflops_per_gpu"], i, keys))
  if best:
    tflops, i, keys = max(held, default=(None, None, None))
    print(f"  best compiled{f' ({len(violated)} left out: account violated)' if violated else ''}: "
          + (f"{i} at {tflops:.1f} TF/s  {' '.join(keys) or '(as given)'}" if held else "none"))
  return violated
