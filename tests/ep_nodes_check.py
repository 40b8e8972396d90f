"""Expert parallelism across "nodes" on simulated CPU devices, against one device and the float32 dense reference.

Run by tests/test_ep_nodes.py in a subprocess (the device count is fixed before JAX starts):
`python tests/ep_nodes_check.py DEVICES CASE` prints one JSON line per check. On a host with 8 GPUs,
`python tests/ep_nodes_check.py 8 gpu` runs a2a_padded and hierarchical on them as 2 "nodes" of 4 against one
device and the dense reference (float32, highest precision) and prints PASS/FAIL per case.

Meshes are laid out as upstream lays a multi-node run out (patches/cpu_slices.py: an ICI mesh per node
of consecutive devices, tiled over the DCN shape, so each axis is DCN-major), and named by
"dcn x ici": expert2x4 is dcn_expert 2 x ici_expert 4 on 8 devices.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={int(sys.argv[1]) if len(sys.argv) > 1 else 8}")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from MaxText.moe import block, dispatch, routing  # noqa: E402
from MaxText.plan import hlo_inventory  # noqa: E402
from moe_reference import dense_ffn, make_params  # noqa: E402
from patches import cpu_slices  # noqa: E402

EXPERTS, TOP_K = 16, 8
# name: (mesh axes, DCN shape, ICI shape); nodes = product of the DCN shape.
LAYOUTS = {
    "expert2x4": (("expert",), (2,), (4,)),  # 8 devices: EP 8 = 2 nodes x 4
    "expert2x(fsdp2,expert2)": (("fsdp", "expert"), (1, 2), (2, 2)),  # 8: FSDP inside the node, EP 4 = 2 x 2
    "expert4x4": (("expert",), (4,), (4,)),  # 16 devices: EP 16 = 4 nodes x 4
    "(fsdp2,expert2)x4": (("fsdp", "expert"), (2, 2), (1, 4)),  # 16: FSDP across nodes too, EP 8 = 2 x 4
}


def layout(name):
  axes, dcn, ici = LAYOUTS[name]
  devices = cpu_slices.hybrid_device_mesh(ici, dcn, jax.devices()[: math.prod(dcn) * math.prod(ici)])
  mesh = jax.sharding.Mesh(devices, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  per_node = math.prod(ici)
  return mesh, dcn[axes.index("expert")], [d.id // per_node for d in mesh.devices.flat]


def router_cfg(nodes: int, node_limit: int | None, top_k: int = TOP_K):
  """V3's router (the bias only selects); with node_limit, its groups are the EP nodes: each token's experts on at
  most node_limit nodes (moe_node_limited_routing)."""
  if not node_limit:
    return routing.RouterConfig(num_experts=EXPERTS, top_k=top_k, routed_scaling_factor=2.5)
  return routing.node_limited(routing.RouterConfig(num_experts=EXPERTS, top_k=top_k, routed_scaling_factor=2.5,
                                                   n_groups=nodes, topk_groups=node_limit))


def on_mesh(backend, name, **options):
  mesh, nodes, node_of = layout(name)
  ep = mesh.shape["expert"]
  if backend == "hierarchical":
    options = {"nodes": nodes, **options}
  disp = dispatch.make(backend, num_experts=EXPERTS, axis_name="expert", ep_size=ep, **options)
  return disp, block.Sharding(mesh=mesh, token_axes=mesh.axis_names, expert_axis="expert"), node_of


def params(tokens):
  x, router, ex = make_params(jax.random.key(0), tokens=tokens, experts=EXPERTS)
  bias = jax.random.normal(jax.random.key(3), (EXPERTS,)) * 0.3  # selection only: spreads the choices
  return x, block.Router(router.kernel_DE, bias), ex


def loss_fn(cfg, disp, sharding, probe):
  def loss(x, kernel, bias, ex):
    y, _, overflow = block.moe_block(x, block.Router(kernel, bias), ex, cfg, disp, sharding)
    return jnp.sum(y.astype(jnp.float32) * probe), overflow
  return loss


def dense_loss(cfg, probe):
  """The float32 dense reference: every token through every expert by einsums, its top-k picked by a one-hot."""
  def loss(x, kernel, bias, ex):
    r = routing.route(x, kernel, bias, cfg.router)
    return jnp.sum(dense_ffn(x, r.ids_TK, r.weights_TK, ex) * probe), jnp.bool_(False)
  return loss


def value_and_grads(loss, x, router, ex):
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3), has_aux=True))
  (val, overflow), grads = f(x, router.kernel_DE, router.bias_E, ex)
  return float(val), grads, bool(overflow)


def max_err(a, b):
  return max(float(np.max(np.abs(np.asarray(u, np.float32) - np.asarray(v, np.float32))))
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# (tokens, nodes, node_limit) -> (one device's (loss, grads), the dense reference's): the rows of a case that share
# them (every backend and layout of one device count) compile them once, not once a row.
_REFERENCES: dict[tuple, tuple] = {}


def references(cfg, tokens: int, nodes: int, node_limit: int | None):
  key = (tokens, nodes, node_limit)
  if key not in _REFERENCES:
    x, router, ex = params(tokens)
    probe = jax.random.normal(jax.random.key(5), x.shape)
    one_val, one_grads, _ = value_and_grads(loss_fn(cfg, dispatch.make("local", num_experts=EXPERTS), None, probe),
                                            x, router, ex)
    ref_val, ref_grads, _ = value_and_grads(dense_loss(cfg, probe), x, router, ex)
    _REFERENCES[key] = (one_val, one_grads), (ref_val, ref_grads)
  return _REFERENCES[key]


def compare(backend, name, node_limit, tokens_per_device=4, chunks=1, **options):
  """One backend on a layout vs `local` on one device and vs the dense reference: loss and every gradient.
  chunks: the block's overlap chunks on the mesh (moe_ep_overlap_chunks)."""
  mesh, nodes, _ = layout(name)
  tokens = tokens_per_device * mesh.size
  cfg = block.BlockConfig(router=router_cfg(nodes, node_limit), dtype=jnp.float32)
  x, router, ex = params(tokens)
  probe = jax.random.normal(jax.random.key(5), x.shape)
  (one_val, one_grads), (ref_val, ref_grads) = references(cfg, tokens, nodes, node_limit)
  disp, sharding, _ = on_mesh(backend, name, **options)
  val, grads, overflow = value_and_grads(loss_fn(dataclasses.replace(cfg, overlap_chunks=chunks), disp, sharding,
                                                 probe), x, router, ex)
  return {"backend": backend, "layout": name, "node_limit": node_limit, "chunks": chunks, "loss_err": abs(val - one_val),
          "grad_err": max_err(grads, one_grads), "dense_loss_err": abs(val - ref_val),
          "dense_grad_err": max_err(grads, ref_grads), "overflow": overflow}


def nodes_per_token(name, node_limit):
  """From the hierarchical dispatch plan: how many (token, node) rows each token sends over the node axis."""
  mesh, nodes, _ = layout(name)
  cfg = router_cfg(nodes, node_limit)
  disp, sharding, _ = on_mesh("hierarchical", name, capacity_factor=float(mesh.shape["expert"]))
  x, router, _ = params(32 * mesh.size)
  ids_TK = routing.route(x, router.kernel_DE, router.bias_E, cfg).ids_TK
  tok = P(sharding.token_axes)

  def plan(x_TD, ids):
    _, meta = disp.dispatch(x_TD, ids)
    return jnp.sum(meta.dst1_TN < meta.dst1_TN.shape[1] * meta.capacity1, axis=1)

  rows_T = jax.jit(jax.shard_map(plan, mesh=mesh, in_specs=(tok, tok), out_specs=tok))(x, ids_TK)
  expert_nodes_T = jnp.sum(jnp.any((ids_TK // (EXPERTS // nodes))[:, :, None] == jnp.arange(nodes), axis=1), axis=1)
  return {"layout": name, "nodes": nodes, "node_limit": node_limit, "max_rows_per_token": int(rows_T.max()),
          "mean_rows_per_token": float(rows_T.mean()), "rows_equal_expert_nodes": bool((rows_T == expert_nodes_T).all())}


def inventory(backend, name, node_limit, **options):
  """The compiled block (forward and backward) on CPU through the planner's inventory: the all-to-alls by
  whether their groups cross nodes (node = consecutive device ids), and inter-node bytes."""
  mesh, nodes, node_of = layout(name)
  cfg = block.BlockConfig(router=router_cfg(nodes, node_limit), dtype=jnp.bfloat16)
  disp, sharding, _ = on_mesh(backend, name, **options)
  x, router, ex = params(64 * mesh.size)
  loss = lambda x, k, b, e: jnp.sum(block.moe_block(x, block.Router(k, b), e, cfg, disp, sharding)[0])  # noqa: E731
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 3))).lower(x, router.kernel_DE, router.bias_E, ex).compile().as_text()
  inv = hlo_inventory.inventory(hlo, dict(mesh.shape), node_of)
  a2a = [r for r in inv["collectives"] if r["kind"] == "all-to-all"]
  return {"backend": backend, "layout": name, "node_limit": node_limit, "all_to_all": a2a,
          "inter_node_bytes": inv["inter_node_bytes"]}


def compare_fp8(name, node_limit, chunks=1):
  """moe_fp8=blockwise's CPU form (xla_fp8, tokens and the combine's cotangent quantized before they move) through
  the hierarchical dispatch vs one device: an expert-only mesh brings every group's rows to one shard, so the
  quantized tiles, and with them loss and every gradient, are the one device's. In overlap chunks an expert's
  rows meet in two grouped GEMMs, so dW's 128-row tiles are cut from each chunk's: the expert gradients are another
  quantization of the same sum (as on an FSDP mesh, tests/test_ep.py), the rest the one device's."""
  mesh, nodes, _ = layout(name)
  cfg = block.BlockConfig(router=router_cfg(nodes, node_limit), gmm_backend="xla_fp8", dtype=jnp.float32,
                          fp8_dispatch=True)
  mesh_cfg = dataclasses.replace(cfg, overlap_chunks=chunks)
  x, router, ex = params(4 * mesh.size)
  probe = jax.random.normal(jax.random.key(5), x.shape)
  one_val, one_grads, _ = value_and_grads(loss_fn(cfg, dispatch.make("local", num_experts=EXPERTS), None, probe),
                                          x, router, ex)
  disp, sharding, _ = on_mesh("hierarchical", name, capacity_factor=float(mesh.shape["expert"]))
  val, grads, overflow = value_and_grads(loss_fn(mesh_cfg, disp, sharding, probe), x, router, ex)
  norm = lambda t: float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in jax.tree.leaves(t))))  # noqa: E731
  expert_rel = norm(jax.tree.map(lambda a, b: a - b, grads[2], one_grads[2])) / norm(one_grads[2])
  return {"backend": "hierarchical", "gmm": "xla_fp8", "layout": name, "chunks": chunks, "loss_err": abs(val - one_val),
          "x_and_router_grad_err": max_err(grads[:2], one_grads[:2]), "expert_grad_rel_err": expert_rel,
          "overflow": overflow}


def trace_with_kernel_typing(gmm_backend, name):
  """The block's gradient traced with a GPU grouped GEMM (its Pallas outputs typed varying over nothing): every
  custom VJP's cotangent must be typed like its primal ("manual axis types do not match" otherwise)."""
  from MaxText.moe.gmm.mgpu import bf16 as mgpu  # pylint: disable=import-outside-toplevel

  mgpu.unavailable_reason = lambda: None  # traced only, never run
  mesh, nodes, _ = layout(name)
  cfg = block.BlockConfig(router=router_cfg(nodes, nodes // 2), gmm_backend=gmm_backend, dtype=jnp.bfloat16,
                          fp8_dispatch=gmm_backend == "mgpu_fp8")
  disp, sharding, _ = on_mesh("hierarchical", name)
  x, router, ex = params(4 * mesh.size)
  loss = lambda x, k, e: jnp.sum(block.moe_block(x, block.Router(k, None), e, cfg, disp, sharding)[0].astype(  # noqa: E731
      jnp.float32))
  try:
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(x, router.kernel_DE, ex)
    return ""
  except Exception as e:  # pylint: disable=broad-exception-caught
    return f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"


def capacity_routing(tokens_per_shard: int = 8):
  """x, router, experts and a V3 router config whose routing is fixed: hidden 16 = one dimension per expert, router
  kernel 10 x identity, so a token with x = 1 on experts a and b scores sigmoid(10) there and 0.5 elsewhere, and picks
  exactly (a, b). Every shard's 8 tokens: token j's first choice is expert 2j (peer j of 8 under a2a_padded, 2 slots
  a peer balanced); tokens 1-3 take expert 1 second, so peer 0 receives 4 slots from each shard: 2x its balanced
  share. Capacity factor 1 holds 2 and overflows, 2 (the default) holds 4 exactly. On 2 nodes x 4 (hierarchical)
  the same routing puts 8 slots on node 0's first rank from each stage-2 sender against 4 balanced: the same."""
  second = [3, 1, 1, 1, 5, 7, 9, 11]
  pairs = [(2 * j, second[j]) for j in range(tokens_per_shard)]
  shards = 8
  x_TD = np.zeros((tokens_per_shard * shards, EXPERTS), np.float32)
  for t in range(x_TD.shape[0]):
    x_TD[t, list(pairs[t % tokens_per_shard])] = 1.0
  _, _, ex = make_params(jax.random.key(0), tokens=1, hidden=EXPERTS, experts=EXPERTS)
  router = block.Router(jnp.eye(EXPERTS) * 10.0, jnp.zeros((EXPERTS,)))
  cfg = block.BlockConfig(router=routing.RouterConfig(num_experts=EXPERTS, top_k=2, routed_scaling_factor=2.5),
                          dtype=jnp.float32)
  return jnp.asarray(x_TD), router, ex, cfg


def default_capacity(backend, name):
  """The routing above at capacity factor 1 (overflows) and at the dispatcher's default (2): whether it overflowed,
  and at the default, loss and every gradient against the float32 dense reference."""
  x, router, ex, cfg = capacity_routing()
  probe = jax.random.normal(jax.random.key(5), x.shape)
  ref_val, ref_grads, _ = value_and_grads(dense_loss(cfg, probe), x, router, ex)
  out = {"backend": backend, "layout": name}
  for label, options in (("f1", {"capacity_factor": 1.0}), ("default", {})):
    disp, sharding, _ = on_mesh(backend, name, **options)
    val, grads, overflow = value_and_grads(loss_fn(cfg, disp, sharding, probe), x, router, ex)
    out[f"overflow_{label}"] = overflow
    if label == "default":
      out.update(capacity_factor=disp.capacity_factor, loss_rel_err=abs(val - ref_val) / abs(ref_val),
                 grad_err=max_err(grads, ref_grads))
  return out


def main(case: str):
  if case in ("match8", "match16", "match8_quick", "match16_quick"):
    names = [n for n in LAYOUTS if layout_size(n) == int(case[5:7].rstrip("_"))]
    quick = case.endswith("quick")
    for name in names[:1] if quick else names:
      for backend in ("hierarchical",) if quick else ("ring", "a2a_padded", "hierarchical"):
        opts = {} if backend == "ring" else {"capacity_factor": float(layout(name)[0].shape["expert"])}
        for node_limit in ((layout(name)[1] // 2,) if quick else (None, layout(name)[1] // 2)):
          print(json.dumps(compare(backend, name, node_limit, **opts)), flush=True)
    if not quick and case == "match8":  # the tokens in 2 overlap chunks, each dispatched and combined on its own
      for backend in ("a2a_padded", "hierarchical"):
        print(json.dumps(compare(backend, "expert2x4", 1, chunks=2, capacity_factor=8.0)), flush=True)
  elif case == "quick":  # the fast tier's share, one JAX start: a match, the plan's nodes, one GPU kernel typing
    print(json.dumps(compare("hierarchical", "expert2x4", 1, capacity_factor=8.0)), flush=True)
    for node_limit in (None, 1):
      print(json.dumps(nodes_per_token("expert2x4", node_limit)), flush=True)
    name = "expert2x(fsdp2,expert2)"
    print(json.dumps({"gmm": "mgpu_fp8", "layout": name, "error": trace_with_kernel_typing("mgpu_fp8", name)}),
          flush=True)
  elif case == "nodes_per_token":
    for name in ("expert2x4", "expert4x4") if jax.device_count() >= 16 else ("expert2x4",):
      nodes = layout(name)[1]
      for node_limit in (None, nodes // 2):
        print(json.dumps(nodes_per_token(name, node_limit)), flush=True)
  elif case == "inventory":
    name = "expert4x4" if jax.device_count() >= 16 else "expert2x4"
    nodes = layout(name)[1]
    for backend in ("a2a_padded", "hierarchical"):
      print(json.dumps(inventory(backend, name, nodes // 2)), flush=True)
  elif case == "fp8":
    for name in [n for n in LAYOUTS if layout_size(n) == jax.device_count() and "fsdp" not in n]:
      for chunks in (1, 2):
        print(json.dumps(compare_fp8(name, layout(name)[1] // 2, chunks)), flush=True)
  elif case == "kernel_typing":
    for name in [n for n in LAYOUTS if layout_size(n) == jax.device_count()]:
      for gmm_backend in ("mgpu", "mgpu_fp8"):
        print(json.dumps({"gmm": gmm_backend, "layout": name, "error": trace_with_kernel_typing(gmm_backend, name)}),
              flush=True)
  elif case == "gpu":  # on an 8-GPU host: its GPUs as 2 "nodes" of 4 (the node exchange over NVLink here)
    jax.config.update("jax_default_matmul_precision", "highest")
    print(f"devices: {jax.devices()}", flush=True)
    for backend in ("a2a_padded", "hierarchical"):
      for node_limit, chunks in ((None, 1), (1, 1), (1, 2)):
        try:
          r = compare(backend, "expert2x4", node_limit, chunks=chunks, capacity_factor=8.0)
          ok = max(r["loss_err"], r["grad_err"], r["dense_loss_err"], r["dense_grad_err"]) < 1e-3 and not r["overflow"]
          print(f"{'PASS' if ok else 'FAIL'} {backend} expert2x4 node_limit={node_limit} chunks={chunks} "
                f"{json.dumps(r)}", flush=True)
        except Exception as e:  # pylint: disable=broad-exception-caught
          print(f"FAIL {backend} expert2x4 node_limit={node_limit} chunks={chunks} {type(e).__name__}: "
                f"{str(e)[:300]}", flush=True)
  elif case == "default_capacity":
    for backend, name in (("a2a_padded", "expert2x4"), ("hierarchical", "expert2x4")):
      print(json.dumps(default_capacity(backend, name)), flush=True)
  elif case == "overflow":  # every token to expert 0's node, bound too small: flagged on the device
    name = "expert2x4"
    mesh, nodes, _ = layout(name)
    cfg = block.BlockConfig(router=router_cfg(nodes, None, top_k=2), dtype=jnp.float32)
    x, router, ex = params(4 * mesh.size)
    skewed = router.bias_E.at[0].set(100.0).at[1].set(100.0)  # both choices on node 0's first rank
    disp, sharding, _ = on_mesh("hierarchical", name, capacity_factor=1.0)
    flags = lambda x, k, b, e: block.moe_block_with_buffer(x, block.Router(k, b), e, cfg, disp, sharding)[2]  # noqa: E731
    flagged = np.asarray(jax.jit(flags)(x, router.kernel_DE, skewed, ex))
    # The block's output alone, compiled: what the dispatch adds to every layer call besides its exchanges.
    out = lambda x, k, b, e: block.moe_block_with_buffer(x, block.Router(k, b), e, cfg, disp, sharding)[0]  # noqa: E731
    hlo = jax.jit(out).lower(x, router.kernel_DE, skewed, ex).compile().as_text()
    print(json.dumps({"shards_flagged": int(flagged.sum()), "shards": int(flagged.size),
                      "callbacks": len(re.findall(r"callback", hlo)),
                      "all_reduces": len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))}), flush=True)
  else:
    raise SystemExit(f"unknown case {case}")


def layout_size(name):
  _, dcn, ici = LAYOUTS[name]
  return math.prod(dcn) * math.prod(ici)


if __name__ == "__main__":
  main(sys.argv[2])
