"""te_ncclep: the missing-TE error, then the adapter against a stand-in TE.

Transformer Engine is not installed where these run, so `transformer_engine.jax.ep`
is replaced by a stand-in with the signatures of the released TE 2.20.2
(transformer_engine/jax/ep.py and sharding.py in its wheel; on the H200 the adapter's
api_mismatch against the real module is None: tools/te_ep_probe.py, docs/container.md
"Transformer Engine, measured"): global view, P
ranks of T/P tokens each (ep innermost), every rank's receive buffer
expert-major with zones padded to the alignment and listed in token_counts,
rows within a zone in an order of TE's choosing (the stand-in reverses them so
that nothing may depend on it), weights 0 on padding, routing state in a uint8
handle, combine an unweighted scatter-sum. The stand-in is plain jnp, so its
gradients are the contract's VJPs (dispatch: summed over a token's rows, and
per (t, k) for the weights; combine: each row gets its token's cotangent).

What this cannot show: that the real TE behaves like the stand-in (layouts,
padding, NCCL EP's kernels, its VJPs, its custom partitioning), which needs TE
on >= 2 SM90 GPUs and NCCL >= 2.30.4. On one GPU the real TE refuses bootstrap
(tools/te_ep_probe.py), as test_bootstrap_on_one_device_is_refused_in_one_line checks here.

`python tests/test_te_ncclep.py block` runs the block-level check on 4 simulated
CPU devices (the device count is fixed before JAX starts); test_block_* runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import types

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from MaxText.moe import block, dispatch, routing  # noqa: E402
from MaxText.moe.dispatch import te_ncclep  # noqa: E402
from moe_reference import dense_ffn, make_params  # noqa: E402

TE_MODULES = ("transformer_engine", "transformer_engine.jax", "transformer_engine.jax.ep",
              "transformer_engine.jax.sharding")


# --- the stand-in: TE's documented contract, on one device, global view ---------------------------


def stand_in_te(*, ep_size: int, num_ep_groups: int, with_total_recv: bool, calls: list) -> dict:
  """Modules for sys.modules. calls records every TE call (at trace time, so avals)."""
  sharding_mod = types.ModuleType("transformer_engine.jax.sharding")
  ep_mod = types.ModuleType("transformer_engine.jax.ep")
  state = {"resource": None, "boot": None}

  @dataclasses.dataclass(frozen=True)
  class MeshResource:  # 2.20.2's fields, in its order
    dp_resource: str | None = None
    tp_resource: str | None = None
    tpsp_resource: str | None = None
    fsdp_resource: str | None = None
    pp_resource: str | None = None
    cp_resource: str | None = None
    ep_resource: str | None = None

  @contextlib.contextmanager
  def global_shard_guard(resource):
    old, state["resource"] = state["resource"], resource
    try:
      yield
    finally:
      state["resource"] = old

  sharding_mod.MeshResource, sharding_mod.global_shard_guard = MeshResource, global_shard_guard
  sharding_mod.global_mesh_resource = lambda: state["resource"] or MeshResource()

  @dataclasses.dataclass(frozen=True)
  class EpLayerConfig:
    top_k: int
    dispatch_output_per_expert_alignment: int = 0

  def ep_bootstrap(world_size, rank, num_experts, max_tokens_per_rank, recv_capacity_per_rank, hidden_dim,
                   max_token_dtype=jnp.bfloat16, max_num_sms=0, drop_on_overflow=False):
    assert state["resource"] is not None and state["resource"].ep_resource, "TE: MeshResource.ep_resource unset"
    devices = ep_size * num_ep_groups  # 2.20.2: None means the active mesh's size; an explicit value must match
    if (world_size if world_size is not None else devices) != devices or devices < 2:
      raise ValueError(f"ep_bootstrap: world_size={world_size} must equal the mesh's {devices} devices, >= 2")
    assert num_experts % ep_size == 0 and jnp.dtype(max_token_dtype) == jnp.bfloat16
    calls.append({"op": "bootstrap", "world_size": world_size, "rank": rank})
    state["boot"] = dict(num_experts=num_experts, max_tokens=max_tokens_per_rank, capacity=recv_capacity_per_rank,
                         hidden=hidden_dim)

  def ep_dispatch(cfg, topk_idx, tokens, topk_weights, recv_capacity_per_rank):
    boot, num_ranks = state["boot"], ep_size * num_ep_groups
    (num_tokens, top_k), hidden = topk_idx.shape, tokens.shape[-1]
    assert isinstance(cfg, EpLayerConfig) and cfg.top_k == top_k
    assert jnp.issubdtype(topk_idx.dtype, jnp.integer) and jnp.dtype(tokens.dtype).itemsize <= 2  # bf16 wire
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
      raise TypeError("ep_dispatch: topk_weights must be a floating dtype")
    assert type(recv_capacity_per_rank) is int and recv_capacity_per_rank == boot["capacity"]  # static, = bootstrap
    assert hidden == boot["hidden"] and num_tokens % num_ranks == 0 and num_tokens // num_ranks <= boot["max_tokens"]
    calls.append({"op": "dispatch", "top_k": cfg.top_k, "alignment": cfg.dispatch_output_per_expert_alignment,
                  "ids": (topk_idx.shape, str(topk_idx.dtype)), "tokens": (tokens.shape, str(tokens.dtype)),
                  "weights": (topk_weights.shape, str(topk_weights.dtype)), "capacity": recv_capacity_per_rank})
    rows, align, local = recv_capacity_per_rank, max(cfg.dispatch_output_per_expert_alignment, 1), \
        boot["num_experts"] // ep_size
    slots = num_tokens * top_k
    s = jnp.arange(slots)
    t, e = s // top_k, topk_idx.reshape(-1)
    dest = (t // (num_tokens // num_ranks)) // ep_size * ep_size + e // local  # same EP group, owner of e
    zone = dest * local + e % local
    sizes_PG = (-(-jnp.zeros(num_ranks * local, jnp.int32).at[zone].add(1) // align) * align).reshape(num_ranks, local)
    order = jnp.argsort(zone * slots + (slots - 1 - s))  # zone-major, slots reversed inside a zone
    zone_sorted = zone[order]
    pos = jnp.zeros(slots, jnp.int32).at[order].set(s - jnp.searchsorted(zone_sorted, zone_sorted, side="left"))
    row = (jnp.cumsum(sizes_PG, axis=1) - sizes_PG).reshape(-1)[zone] + pos
    flat = jnp.where(row < rows, dest * rows + row, num_ranks * rows)  # past R: dropped
    recv_PRD = jnp.zeros((num_ranks * rows, hidden), tokens.dtype).at[flat].add(tokens[t], mode="drop")
    recv_w_PR = jnp.zeros(num_ranks * rows, jnp.float32).at[flat].add(topk_weights.reshape(-1), mode="drop")
    src_PR = jnp.full(num_ranks * rows, slots, jnp.int32).at[flat].set(s, mode="drop").reshape(num_ranks, rows)
    handle_PN = jax.lax.bitcast_convert_type(src_PR, jnp.uint8).reshape(num_ranks, rows * 4)
    out = (recv_PRD.reshape(num_ranks, rows, hidden), recv_w_PR.reshape(num_ranks, rows), handle_PN, sizes_PG)
    return (*out, sizes_PG.sum(1, keepdims=True)) if with_total_recv else out

  def ep_combine(cfg, handle_mem, token_counts, expert_out, num_local_tokens, out_sharding=None):
    num_ranks, rows, hidden = expert_out.shape
    assert num_ranks == ep_size * num_ep_groups and handle_mem.dtype == jnp.uint8 and token_counts.dtype == jnp.int32
    assert type(num_local_tokens) is int, "TE: num_local_tokens is static"
    calls.append({"op": "combine", "top_k": cfg.top_k, "expert_out": (expert_out.shape, str(expert_out.dtype)),
                  "handle": handle_mem.shape, "counts": token_counts.shape, "num_local_tokens": num_local_tokens})
    src = jax.lax.bitcast_convert_type(handle_mem.reshape(num_ranks, rows, 4), jnp.int32).reshape(-1)
    t = jnp.where(src < num_local_tokens * cfg.top_k, src // cfg.top_k, num_local_tokens)
    y_TD = jnp.zeros((num_local_tokens, hidden), jnp.float32).at[t].add(
        expert_out.reshape(-1, hidden).astype(jnp.float32), mode="drop")
    return y_TD.astype(expert_out.dtype)  # unweighted: the caller weighted the rows

  ep_mod.EpLayerConfig, ep_mod.ep_bootstrap, ep_mod.ep_dispatch, ep_mod.ep_combine = \
      EpLayerConfig, ep_bootstrap, ep_dispatch, ep_combine
  root, jax_pkg = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.jax")
  root.__version__ = "2.20.2"
  root.jax, jax_pkg.ep, jax_pkg.sharding = jax_pkg, ep_mod, sharding_mod
  return dict(zip(TE_MODULES, (root, jax_pkg, ep_mod, sharding_mod)))


def _guard(modules, axis="expert"):
  sh = modules["transformer_engine.jax.sharding"]
  return sh.global_shard_guard(sh.MeshResource(dp_resource="data", ep_resource=axis))


def _install(setitem, **kw):
  """The stand-in in sys.modules (undone by monkeypatch); returns (modules, recorded calls)."""
  calls = []
  modules = stand_in_te(calls=calls, **kw)
  for name, module in modules.items():
    setitem(sys.modules, name, module)
  return modules, calls


# --- shared computations ------------------------------------------------------------------------


def _cfg(top_k):
  return block.BlockConfig(router=routing.RouterConfig(num_experts=8, top_k=top_k, routed_scaling_factor=2.5),
                           dtype=jnp.bfloat16)


def _routed(tokens, top_k, skewed=False):
  x, router, ex = make_params(jax.random.key(0), tokens=tokens)
  bias = jnp.zeros((8,)).at[5].set(100.0) if skewed else router.bias_E  # skewed: every token picks expert 5
  r = routing.route(x, router.kernel_DE, bias, _cfg(top_k).router)
  return x.astype(jnp.bfloat16), r.ids_TK, r.weights_TK, ex


def _per_rank_ffn(x_PRD, meta, ex, cfg, ep_size):
  """The block's per-shard step, one rank at a time (rank p holds expert shard p % ep)."""
  local = meta.num_local_experts
  ys = []
  for p in range(x_PRD.shape[0]):
    j = p % ep_size
    ex_p = jax.tree.map(lambda w, j=j: w[j * local:(j + 1) * local], ex)
    ys.append(block.expert_ffn(x_PRD[p], jax.tree.map(lambda a, p=p: a[p:p + 1], meta), ex_p, cfg))
  return jnp.stack(ys)


def _out_and_grads(f, probe, *args):
  """f's output and the gradients of <f, probe> for every argument, flat (bf16 grads as float32)."""
  out, pullback = jax.vjp(f, *args)
  return [out, *jax.tree.leaves(pullback(probe))]


def _rel_err(got, want):
  got, want = (np.asarray(a, np.float32) for a in (got, want))
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


# --- without TE ---------------------------------------------------------------------------------


def test_without_te_every_entry_point_names_transformer_engine(monkeypatch):
  monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails, as on every machine we have
  reason = dispatch.unavailable_reason("te_ncclep")
  assert "transformer_engine.jax.ep does not import" in reason and "pip install" in reason
  with pytest.raises(RuntimeError, match="'te_ncclep' is unavailable.*transformer_engine"):
    dispatch.resolve("te_ncclep", ep_size=4)
  with pytest.raises(RuntimeError, match="transformer_engine.jax.ep does not import.*pip install"):
    dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=4, recv_capacity_per_rank=64)


def test_with_te_importable_the_reason_is_the_platform_and_options_are_checked(monkeypatch):
  _install(monkeypatch.setitem, ep_size=2, num_ep_groups=1, with_total_recv=False)
  assert "CUDA GPUs" in dispatch.unavailable_reason("te_ncclep")  # honest on CPU: TE found, still cannot run
  with pytest.raises(ValueError, match="recv_capacity_per_rank"):
    dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=2)
  with pytest.raises(ValueError, match="size >= 2"):
    dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=1, recv_capacity_per_rank=64)
  with pytest.raises(ValueError, match="power of two"):
    dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=2, recv_capacity_per_rank=64, alignment=3)


# --- with the stand-in, in this process (global view needs no devices) ---------------------------

CASES = {  # name: (ep_size, num_ep_groups, top_k, alignment, with_total_recv, skewed)
    "ep2x2-top2": (2, 2, 2, 0, False, False),
    "ep4-top3-aligned4": (4, 1, 3, 4, True, False),
    "ep4-top1-one-expert": (4, 1, 1, 2, True, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_dispatch_gmm_combine_matches_local_and_dense_forward_and_grads(monkeypatch, case):
  """dispatch -> grouped GEMM (xla) per rank -> combine equals the `local` backend
  (both bfloat16) and the float32 dense reference; gradients for the tokens,
  the routing weights and every expert weight."""
  ep, groups, top_k, align, total, skewed = CASES[case]
  modules, calls = _install(monkeypatch.setitem, ep_size=ep, num_ep_groups=groups, with_total_recv=total)
  tokens, cfg = 16, _cfg(top_k)
  x, ids, w, ex = _routed(tokens, top_k, skewed)
  ranks, per_rank = ep * groups, tokens // (ep * groups)
  capacity = te_ncclep.dropless_recv_capacity(tokens_per_rank=per_rank, top_k=top_k, ep_size=ep,
                                              num_local_experts=8 // ep, alignment=align)
  with _guard(modules):
    te_ncclep.bootstrap(num_experts=8, max_tokens_per_rank=per_rank, recv_capacity_per_rank=capacity, hidden_dim=8)
    disp = dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=ep, recv_capacity_per_rank=capacity,
                         alignment=align)
    local = dispatch.make("local", num_experts=8)
    probe = jax.random.normal(jax.random.key(5), x.shape)

    def te_out(x, w, ex):
      x_PRD, meta = disp.dispatch(x, ids, w)
      assert x_PRD.shape == (ranks, capacity, 8)
      return disp.combine(_per_rank_ffn(x_PRD, meta, ex, cfg, ep), w, meta).astype(jnp.float32)

    got = _out_and_grads(te_out, probe, x, w, ex)

  def local_out(x, w, ex):
    x_MD, meta = local.dispatch(x, ids)
    return local.combine(block.expert_ffn(x_MD, meta, ex, cfg), w, meta).astype(jnp.float32)

  def dense_out(x, w, ex):
    return dense_ffn(x.astype(jnp.float32), ids, w, ex)

  for ref, tol in ((local_out, 1e-2), (dense_out, 2e-2)):
    errs = [_rel_err(g, r) for g, r in zip(got, _out_and_grads(ref, probe, x, w, ex))]
    assert max(errs) < tol, (case, ref.__name__, errs)
  assert [c["op"] for c in calls] == ["bootstrap", "dispatch", "combine"]  # traced once, outside any per-rank loop


def test_te_calls_get_global_shapes_static_capacity_and_bf16_tokens(monkeypatch):
  """Argument plumbing: what the adapter hands TE, and what its meta holds."""
  modules, calls = _install(monkeypatch.setitem, ep_size=2, num_ep_groups=2, with_total_recv=True)
  x, ids, w, _ = _routed(16, 3)
  with _guard(modules):
    te_ncclep.bootstrap(num_experts=8, max_tokens_per_rank=4, recv_capacity_per_rank=48, hidden_dim=8)
    disp = dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=2, recv_capacity_per_rank=48,
                         alignment=8)
    x_PRD, meta = jax.jit(disp.dispatch)(x, ids, w.astype(jnp.bfloat16))
    y_TD = jax.jit(disp.combine)(x_PRD, w, meta)
  boot, disp_call, comb = calls
  assert boot == {"op": "bootstrap", "world_size": None, "rank": 0}  # TE counts the mesh's devices itself
  assert disp_call == {"op": "dispatch", "top_k": 3, "alignment": 8, "ids": ((16, 3), "int32"),
                       "tokens": ((16, 8), "bfloat16"), "weights": ((16, 3), "float32"), "capacity": 48}
  assert comb == {"op": "combine", "top_k": 3, "expert_out": ((4, 48, 8), "bfloat16"), "handle": (4, 192),
                  "counts": (4, 4), "num_local_tokens": 16}
  assert meta.num_local_experts == 4 and meta.top_k == 3 and meta.num_tokens == 16
  assert meta.recv_weights_PR.shape == (4, 48) and meta.group_sizes_PG.shape == (4, 4)
  sizes = np.asarray(meta.group_sizes_PG)
  assert np.all(sizes % 8 == 0) and not np.any(np.asarray(meta.overflow_P))  # zones padded to the alignment
  weights_on_rows = np.asarray(meta.recv_weights_PR)
  assert np.count_nonzero(weights_on_rows) == 16 * 3  # every (t, k) slot once; padding rows weigh 0
  # identity experts: each token comes home as sum_k w[t, k] * x[t]
  want = np.asarray(x, np.float32) * np.asarray(w, np.float32).sum(-1, keepdims=True)
  assert _rel_err(y_TD, want) < 1e-2
  with pytest.raises(ValueError, match="per shard"):
    _ = meta.group_sizes_G  # P = 4 here: only a shard's view has one rank's sizes


def test_overflow_is_flagged_when_te_reports_received_rows(monkeypatch):
  """Every token to expert 5 (rank 1 of 2): 16 rows for a capacity of 8."""
  for with_total_recv, flagged in ((True, [False, True]), (False, [False, False])):  # older TE: NCCL EP traps
    modules, _ = _install(monkeypatch.setitem, ep_size=2, num_ep_groups=1, with_total_recv=with_total_recv)
    x, ids, w, _ = _routed(16, 1, skewed=True)
    with _guard(modules):
      te_ncclep.bootstrap(num_experts=8, max_tokens_per_rank=8, recv_capacity_per_rank=8, hidden_dim=8)
      disp = dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=2, recv_capacity_per_rank=8,
                           alignment=0)
      _, meta = disp.dispatch(x, ids, w)
    assert np.asarray(meta.overflow_P).tolist() == flagged


def test_refuses_float32_tokens_and_a_foreign_ep_resource(monkeypatch):
  modules, _ = _install(monkeypatch.setitem, ep_size=2, num_ep_groups=1, with_total_recv=False)
  x, ids, w, _ = _routed(8, 2)
  disp = dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=2, recv_capacity_per_rank=16)
  with pytest.raises(ValueError, match="bfloat16 tokens only"):
    disp.dispatch(x.astype(jnp.float32), ids, w)
  with _guard(modules, axis="model"), pytest.raises(ValueError, match="ep_resource is 'model'.*global_shard_guard"):
    disp.dispatch(x, ids, w)


# --- the block, on 4 simulated CPU devices (subprocess) ------------------------------------------


def _block_check():
  """The block with te_ncclep (global view + per-shard GEMMs) vs `local` on one device, bf16."""
  from jax.sharding import AxisType  # pylint: disable=import-outside-toplevel
  out = []
  for mesh_shape, top_k, skewed in (((1, 4), 2, False), ((2, 2), 8, False), ((2, 2), 1, True)):
    groups, ep = mesh_shape
    calls = []
    modules = stand_in_te(ep_size=ep, num_ep_groups=groups, with_total_recv=True, calls=calls)
    sys.modules.update(modules)
    x, router, ex = make_params(jax.random.key(0), tokens=24)
    x, cfg = x.astype(jnp.bfloat16), _cfg(top_k)
    bias = jnp.zeros((8,)).at[5].set(100.0) if skewed else router.bias_E
    probe = jax.random.normal(jax.random.key(5), x.shape)
    mesh = jax.make_mesh(mesh_shape, ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    capacity = te_ncclep.dropless_recv_capacity(tokens_per_rank=6, top_k=top_k, ep_size=ep, num_local_experts=8 // ep,
                                                alignment=4)

    def run(disp, sharding):
      def out_grads_overflow(x, kernel, ex):
        def f(x, kernel, ex):
          y, _, overflow = block.moe_block(x, block.Router(kernel, bias), ex, cfg, disp, sharding)
          return y, overflow
        y, pullback, overflow = jax.vjp(f, x, kernel, ex, has_aux=True)
        return [y, *jax.tree.leaves(pullback(probe.astype(y.dtype)))], overflow
      return jax.jit(out_grads_overflow)(x, router.kernel_DE, ex)

    want, _ = run(dispatch.make("local", num_experts=8), None)
    with jax.set_mesh(mesh), _guard(modules):
      te_ncclep.bootstrap(num_experts=8, max_tokens_per_rank=6, recv_capacity_per_rank=capacity, hidden_dim=8)
      disp = dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=ep, recv_capacity_per_rank=capacity,
                           alignment=4)
      got, overflow = run(disp, block.Sharding(mesh=mesh, token_axes=("data", "expert"), expert_axis="expert"))
    out.append({"mesh": list(mesh_shape), "top_k": top_k, "out_err": _rel_err(got[0], want[0]),
                "grad_err": max(_rel_err(a, b) for a, b in zip(got[1:], want[1:])),
                "overflow": bool(overflow), "calls": [[c["op"], c.get("tokens", c.get("expert_out"))] for c in calls]})
  return out


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_block_global_view_on_four_devices_matches_one_device_forward_and_grads():
  """TE's ops in the global view (the stand-in sees the whole [24, 8] batch and
  returns [P, R, D]), the grouped GEMMs per shard; (1,4) and (2,2) meshes, top-k
  2, 8 and all tokens to one expert; output and gradients for the tokens, the router
  kernel and every expert weight."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "block"], env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert [r["mesh"] for r in rows] == [[1, 4], [2, 2], [2, 2]]
  for r in rows:
    assert r["out_err"] < 1e-2 and r["grad_err"] < 2e-2 and not r["overflow"], r
    ops = [c[0] for c in r["calls"]]
    assert ops.count("dispatch") == 1 and ops.count("combine") == 1, r  # traced once: one call per block
    assert [24, 8] in [c[1][0] for c in r["calls"] if c[0] == "dispatch"], r  # the global batch, not a shard


if __name__ == "__main__":
  assert sys.argv[1:] == ["block"], sys.argv
  for row in _block_check():
    print(json.dumps(row), flush=True)


@pytest.mark.parametrize("later_api", ["ep_make_handle", "weighted_combine"])
def test_a_te_with_the_later_ep_api_is_refused_not_guessed(monkeypatch, later_api):
  """A TE whose EP API is the later one (EpHandle; ep_combine weighting rows itself) would get
  rows this adapter already weighted: a wrong sum with no error. It must be refused by name."""
  modules, _ = _install(monkeypatch.setitem, ep_size=2, num_ep_groups=1, with_total_recv=False)
  ep_mod = modules["transformer_engine.jax.ep"]
  if later_api == "ep_make_handle":
    monkeypatch.setattr(ep_mod, "ep_make_handle", lambda *a, **k: None, raising=False)
    want = "EpHandle API"
  else:
    monkeypatch.setattr(ep_mod, "ep_combine",
                        lambda handle, handle_mem, recv_topk_weights, expert_out, num_local_tokens: None)
    want = "takes routing weights"
  assert want in dispatch.unavailable_reason("te_ncclep")
  with pytest.raises(RuntimeError, match=want):
    dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=2, recv_capacity_per_rank=64)


def test_bootstrap_on_one_device_is_refused_in_one_line(monkeypatch):
  """TE 2.20.2 refuses an EP world of one device; the adapter says which backend and why."""
  modules, _ = _install(monkeypatch.setitem, ep_size=1, num_ep_groups=1, with_total_recv=True)
  with _guard(modules), pytest.raises(RuntimeError, match=r"'te_ncclep': Transformer Engine's ep_bootstrap refused"):
    te_ncclep.bootstrap(num_experts=8, max_tokens_per_rank=4, recv_capacity_per_rank=48, hidden_dim=8)


@pytest.mark.parametrize("version", ["2.19.0", "2.21.0", "2.200.1"])
def test_a_te_release_it_was_not_checked_against_is_refused_by_name(monkeypatch, version):
  """The same API shape in another release is still refused: the guard names the supported series."""
  modules, _ = _install(monkeypatch.setitem, ep_size=2, num_ep_groups=1, with_total_recv=False)
  monkeypatch.setattr(modules["transformer_engine"], "__version__", version)
  want = f"te_ncclep supports Transformer Engine 2.20.x; {version} is installed"
  assert want in dispatch.unavailable_reason("te_ncclep")
  with pytest.raises(RuntimeError, match=want):
    dispatch.make("te_ncclep", num_experts=8, axis_name="expert", ep_size=2, recv_capacity_per_rank=64)
