"""`python -m MaxText.plan <config> [key=value ...] --search`: other layouts in the same GPU count.

From the given run, one knob at a time (each candidate is a full compile, so the
neighbours of a sensible recipe, not the whole product):
  EP size        every ici/dcn expert split of an EP that divides the experts and the GPUs
  FSDP placement across nodes: fsdp (one FSDP group over all GPUs) or data
                 (FSDP inside the node, data parallel across: HSDP)
  remat          full recompute; custom with the routed experts' up-projections
                 offloaded to host (the host_offload preset's keys)
  EP overlap     moe_ep_overlap_chunks 2 and 4 under EP: each shard's tokens dispatched in chunks, one chunk's
                 exchange beside another's expert GEMMs (an exchange exposed whole is most of a one-node
                 family recipe's step: configs/recipes/plans/qwen3-30b-a3b-8xh100.json)
  batch          per_device_batch_size halved and doubled
Those that fit are ranked by estimated TFLOP/s/GPU (MaxText's count, so runs of
different batch compare by throughput), and the best few are printed as the
key=value lines `python -m MaxText.train` takes. A plan whose account is violated
(MaxText/plan/account.py) is marked in the table, never ranked, and the search
then exits 9 (a single plan's code) with one line naming it.
"""

from __future__ import annotations

import json
from typing import Any

from MaxText import config as fork_config
from MaxText.config import parallelism
from MaxText.console import progress
from MaxText.plan import account
from MaxText.plan import planner as plan

BEST = 3
OFFLOAD = {"remat_policy": "custom", "decoder_layer_input": "device", "moe_mlpwi_0": "offload", "moe_mlpwi_1": "offload"}


def _mesh(num_gpus: int, gpus_per_node: int, ep: int, across: str) -> dict[str, int]:
  """ici/dcn keys for EP `ep` (inside the node first), the rest FSDP in node and `across` over nodes."""
  per_node = min(num_gpus, gpus_per_node)
  nodes = num_gpus // per_node
  ici_ep = min(ep, per_node)
  dcn_ep = ep // ici_ep
  keys = {f"{p}_{a}_parallelism": 1 for p in ("ici", "dcn") for a in ("data", "fsdp", "expert")}
  keys.update(ici_expert_parallelism=ici_ep, ici_fsdp_parallelism=per_node // ici_ep, dcn_expert_parallelism=dcn_ep)
  keys[f"dcn_{across}_parallelism"] = nodes // dcn_ep
  return keys


def candidates(run: fork_config.RunConfig, num_gpus: int) -> list[dict[str, Any]]:
  """The run itself first, then its one-knob neighbours (duplicates and impossible meshes left out)."""
  up = run.upstream
  experts = int(up.get("num_experts", 1))
  gpn = run.fork.gpus_per_node
  out: list[dict[str, Any]] = [{}]
  now = {**parallelism.mesh_axes(up, "ici_"), **parallelism.mesh_axes(up, "dcn_")}

  def changed(mesh: dict[str, int]) -> dict[str, int]:  # only the keys that differ from the run's
    return {k: v for k, v in mesh.items() if now.get(k) != v}
  ep_now = parallelism.mesh_axes(up, "ici_")["ici_expert_parallelism"] * parallelism.mesh_axes(up, "dcn_")["dcn_expert_parallelism"]
  ep_now = max(ep_now, 1)
  across_now = "data" if parallelism.mesh_axes(up, "dcn_")["dcn_data_parallelism"] > 1 else "fsdp"
  for ep in (e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256) if e <= num_gpus and num_gpus % e == 0):
    if experts > 1 and experts % ep == 0 and ep != ep_now and (ep <= gpn or ep % gpn == 0):
      out.append(changed(_mesh(num_gpus, gpn, ep, across_now)))
  if num_gpus > gpn:
    out.append(changed(_mesh(num_gpus, gpn, min(ep_now, gpn), "data" if across_now == "fsdp" else "fsdp")))
  if up.get("remat_policy", "full") != "full":
    out.append({"remat_policy": "full"})
  if any(up.get(k) != v for k, v in OFFLOAD.items()):
    out.append(dict(OFFLOAD))
  batch = float(up.get("per_device_batch_size", 1))
  tokens = batch * int(up.get("max_target_length", 1))
  if ep_now > 1:
    out += [{"moe_ep_overlap_chunks": c} for c in (2, 4)
            if c != run.fork.moe_ep_overlap_chunks and tokens == int(tokens) and int(tokens) % c == 0]
  out += [{"per_device_batch_size": b} for b in (batch / 2, batch * 2) if b >= 1 and b == int(b)]
  return out


def _args(overrides: dict[str, Any]) -> list[str]:
  return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()]


def main(args: list[str], timeout_s: float, json_path: str | None, heartbeat_s: float = plan.HEARTBEAT_S) -> int:
  run = fork_config.load(args)
  num_gpus = plan.num_gpus_of(run)
  results = []
  layouts = candidates(run, num_gpus)
  eta = progress.Eta(len(layouts))
  for overrides in layouts:
    label = " ".join(_args(overrides)) or "(as given)"
    plan.log(f"search: {eta.start(label)}")
    try:
      report = plan.plan([*args, *_args(overrides)], timeout_s, heartbeat_s=heartbeat_s)
    except ValueError as e:  # a layout the checks or the compiler refuse: reported, not ranked
      results.append({"overrides": overrides, "error": str(e)})
      plan.log(f"  refused: {e}")
      continue
    finally:
      eta.done()
    results.append({"overrides": overrides, "report": report})
  print(f"\n== search: {run.config_path.name}, {num_gpus} GPUs")
  print(f"  {'layout':60s} {'GiB/GPU':>8s} {'fits':>5s} {'step ms':>9s} {'TFLOP/s':>8s}")
  ranked, bad = [], []
  for r in results:
    label = " ".join(_args(r["overrides"])) or "(as given)"
    if "error" in r:
      print(f"  {label:60s} refused: {r['error'][:100]}")
      continue
    rep = r["report"]
    if rep.get("lowered_only"):
      print(f"  {label:60s} lowered only: shardings valid; rank it on a machine with a GPU")
      continue
    fits = rep["verdict"]["fits"] if rep["verdict"] else None
    gib = rep["memory"]["device_total"] / plan.GiB if rep["verdict"] else float("nan")  # CPU: no GPU figure
    est = rep["estimate"]
    violated = account.violations_of(rep)
    mark = f"  ACCOUNT VIOLATED ({len(violated)}): {violated[0]}" if violated else ""
    print(f"  {label:60s} {gib:8.1f} {str(fits):>5s} {est['step_s'] * 1e3:9.2f} {est['tflops_per_gpu']:8.1f}{mark}")
    if violated:  # its figures are not to be trusted: not ranked
      bad.append((label, violated))
    elif fits is not False:
      ranked.append((est["tflops_per_gpu"], label, r["overrides"]))
  ranked.sort(key=lambda t: -t[0])
  if not any(r.get("report", {}).get("verdict") for r in results):
    print("  (no GPU: 'fits' is unknown, ranked by estimate alone)")
  print(f"\nbest {min(BEST, len(ranked))} (python -m MaxText.train {run.config_path} <args> ...)"
        f"{f', {len(bad)} left out: account violated' if bad else ''}:")
  for tflops, _, overrides in ranked[:BEST]:
    print(f"  {tflops:7.1f} TFLOP/s/GPU  {' '.join(_args(overrides)) or '(as given)'}")
  if json_path:
    plan.write_json({"search": results}, json_path)
  if bad:
    label, violated = bad[0]
    return account.refuse_violated(len(bad), f"{len(results)} layouts", label, violated[0])
  return 0 if ranked else 2
