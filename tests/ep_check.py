"""EP backends against the one-device block, on simulated CPU devices (or GPUs).

Run by tests/test_ep.py in a subprocess (the device count must be set before
JAX starts): `python tests/ep_check.py CASE` prints one JSON line per check.

On a machine with >= 2 GPUs, `python tests/ep_check.py gpu` checks every EP
backend that can run there (ring, a2a_padded, ragged_a2a) against the
one-device block and prints PASS/FAIL per case (float32, highest precision).
On CPU, ragged_a2a runs with `emulated_ragged_all_to_all` as its exchange.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax.sharding import PartitionSpec as P  # noqa: E402

from MaxText.moe import block, dispatch, routing  # noqa: E402
from MaxText.moe.dispatch import ragged_a2a  # noqa: E402
from moe_reference import make_params  # noqa: E402

TOKENS = 24  # 6 per device


def _cfg(top_k, gmm_backend="xla"):
  return block.BlockConfig(router=routing.RouterConfig(num_experts=8, top_k=top_k, routed_scaling_factor=2.5),
                           gmm_backend=gmm_backend, dtype=jnp.float32)


def _loss_and_grads(cfg, disp, sharding, bias):
  x, router, ex = make_params(jax.random.key(0), tokens=TOKENS)
  probe = jax.random.normal(jax.random.key(5), x.shape)

  def loss(x, kernel, ex):
    y, _, overflow = block.moe_block(x, block.Router(kernel, bias), ex, cfg, disp, sharding)
    return jnp.sum(y * probe), overflow

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (val, overflow), grads = grad_fn(x, router.kernel_DE, ex)
  return val, grads, overflow


def _max_err(a, b):
  return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def emulated_ragged_all_to_all(x_MD, out_RD, in_start_P, send_P, out_offset_P, recv_P, *, axis_name):
  """ragged_all_to_all's semantics from all_to_all, for XLA:CPU (tests only).

  Each peer's slice is padded to M rows in an [n, M, D] block, exchanged with
  a tiled all_to_all, and scattered into out_RD at the offsets the senders
  chose (all_to_all of out_offset_P), recv_P[q] rows from peer q.
  """
  a2a = lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)  # noqa: E731
  i_C = jnp.arange(x_MD.shape[0])
  rows_PC = jnp.where(i_C < send_P[:, None], in_start_P[:, None] + i_C, x_MD.shape[0])  # past the end: zeros
  got_PCD = a2a(x_MD.at[rows_PC].get(mode="fill", fill_value=0))
  at_PC = jnp.where(i_C < recv_P[:, None], a2a(out_offset_P)[:, None] + i_C, out_RD.shape[0])  # past the end: dropped
  return out_RD.at[at_PC.reshape(-1)].set(got_PCD.reshape(-1, x_MD.shape[1]), mode="drop")


def float_psums_over(jaxpr, axis) -> list[str]:
  """Every psum-like eqn over `axis` of a float array, in jaxpr and its sub-jaxprs."""
  found = []
  for eqn in jaxpr.eqns:
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    if "psum" in eqn.primitive.name and axis in (axes if isinstance(axes, tuple) else (axes,)) and any(
        jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars):
      found.append(f"{eqn.primitive.name}{[str(v.aval) for v in eqn.invars]}")
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += float_psums_over(sub, axis)
  return found


def _on_mesh(backend, mesh_shape, axes, **options):
  """(dispatcher, Sharding): tokens split over every axis, experts over "expert" if the mesh has it."""
  mesh = jax.make_mesh(mesh_shape, axes, devices=jax.devices()[: math.prod(mesh_shape)],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  expert_axis = "expert" if "expert" in axes else None
  ep_size = mesh.shape["expert"] if expert_axis else 1
  disp = dispatch.make(backend, num_experts=8, axis_name=expert_axis, ep_size=ep_size, **options)
  return disp, block.Sharding(mesh=mesh, token_axes=axes, expert_axis=expert_axis)


_ONE_DEVICE: dict = {}  # (config, bias) -> the one-device loss and grads, the same for every mesh a case compares


def _one_device(cfg, bias):
  key = (cfg, tuple(np.asarray(bias).tolist()))
  if key not in _ONE_DEVICE:  # compiled once a case, not once a mesh
    _ONE_DEVICE[key] = _loss_and_grads(cfg, dispatch.make("local", num_experts=8), None, bias)
  return _ONE_DEVICE[key]


def compare(backend, mesh_shape, top_k, bias, axes=("data", "expert"), gmm_backend="xla", fp8_dispatch=False,
            **options):
  """A dispatch backend on a mesh vs `local` on one device (the same grouped GEMM): loss and grads.
  fp8_dispatch on both: the tokens, and the combine's cotangent in the backward, quantized before they move."""
  cfg = dataclasses.replace(_cfg(top_k, gmm_backend), fp8_dispatch=fp8_dispatch)
  want_val, want_grads, _ = _one_device(cfg, bias)
  val, grads, overflow = _loss_and_grads(cfg, *_on_mesh(backend, mesh_shape, axes, **options), bias)
  if gmm_backend == "xla_fp8":
    # dW's 128-row tiles are formed from each token shard's rows of a group, so on a mesh the expert
    # weights' gradients are another quantization of the same sum: equal within FP8's error, not exactly.
    x_err, kernel_err = (_max_err(grads[i], want_grads[i]) for i in (0, 1))
    norm = lambda t: float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in jax.tree.leaves(t))))  # noqa: E731
    dw_rel = norm(jax.tree.map(lambda a, b: a - b, grads[2], want_grads[2])) / norm(want_grads[2])
    return {"backend": backend, "gmm": gmm_backend, "fp8_dispatch": fp8_dispatch, "mesh": dict(zip(axes, mesh_shape)),
            "top_k": top_k, "loss_err": abs(float(val - want_val)), "x_and_router_grad_err": max(x_err, kernel_err),
            "expert_grad_rel_err": dw_rel, "overflow": bool(overflow)}
  return {"backend": backend, "gmm": gmm_backend, "mesh": dict(zip(axes, mesh_shape)), "top_k": top_k,
          "loss_err": abs(float(val - want_val)), "grad_err": _max_err(grads, want_grads), "overflow": bool(overflow)}


# Meshes of 4 devices our block must train on: (axes, shape, dispatch backends that run on CPU).
MESHES = (
    (("fsdp",), (4,), ("local",)),
    (("data", "fsdp"), (2, 2), ("local",)),
    (("expert",), (4,), ("ring", "a2a_padded")),
    (("fsdp", "expert"), (2, 2), ("ring", "a2a_padded")),
    (("data", "expert"), (2, 2), ("ring", "a2a_padded")),
)
# The fast tier's subset for FP8 and the GPU kernels' typing: token shards that share weights (data x fsdp: dW
# summed over them) and FSDP with EP, on every CPU dispatch backend; the others run in the slow tier.
QUICK_MESHES = (MESHES[1], MESHES[3])


def trace_with_kernel_typing(gmm_backend, backend, mesh_shape, axes):
  """Traces the block's loss and gradients with a GPU grouped-GEMM backend on CPU: "" or the error.

  Tracing (not running) is enough: JAX checks the varying manual axes of every value, custom-VJP
  cotangents included, while it traces, and the GPU kernels' outputs are typed then as on the GPU.
  """
  from MaxText.moe.gmm.mgpu import bf16 as mgpu  # pylint: disable=import-outside-toplevel

  mgpu.unavailable_reason = lambda: None  # its kernels (and mgpu_fp8's) are only traced here, never run
  # mgpu_fp8 as moe_fp8 configures it: tokens quantized before the dispatch (MaxText/moe/fp8_dispatch.py).
  cfg = dataclasses.replace(_cfg(2), gmm_backend=gmm_backend, dtype=jnp.bfloat16, fp8_dispatch=gmm_backend == "mgpu_fp8")
  disp, sharding = _on_mesh(backend, mesh_shape, axes, **({"capacity_factor": 4.0} if backend == "a2a_padded" else {}))
  x, router, ex = make_params(jax.random.key(0), tokens=TOKENS)

  def loss(x, kernel, ex):
    y, _, _ = block.moe_block(x, block.Router(kernel, None), ex, cfg, disp, sharding)
    return jnp.sum(y.astype(jnp.float32))

  try:
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(x, router.kernel_DE, ex)
    return ""
  except Exception as e:  # pylint: disable=broad-exception-caught
    return f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"


def main(case: str):
  balanced, skewed = jnp.zeros((8,)), jnp.zeros((8,)).at[5].set(100.0)  # skewed: every token picks expert 5
  if case == "match":
    for backend in ("ring", "a2a_padded"):
      for mesh_shape, top_k, bias in (((1, 4), 2, balanced), ((2, 2), 8, balanced), ((1, 4), 1, skewed)):
        opts = {"capacity_factor": 4.0} if backend == "a2a_padded" else {}
        print(json.dumps(compare(backend, mesh_shape, top_k, bias, **opts)), flush=True)
  elif case == "meshes":
    for axes, shape, backends in MESHES:
      for backend in backends:
        opts = {"capacity_factor": 4.0} if backend == "a2a_padded" else {}
        print(json.dumps(compare(backend, shape, 8, balanced, axes=axes, **opts)), flush=True)
  elif case in ("meshes_fp8", "meshes_fp8_quick", "meshes_fp8_dispatch", "meshes_fp8_dispatch_quick"):
    # moe_fp8=blockwise's CPU backend: FP8 on a mesh = on one device, with the tokens quantized after the
    # dispatch or (as moe_fp8 runs) before it
    for axes, shape, backends in MESHES if case in ("meshes_fp8", "meshes_fp8_dispatch") else QUICK_MESHES:
      for backend in backends:
        opts = {"capacity_factor": 4.0} if backend == "a2a_padded" else {}
        print(json.dumps(compare(backend, shape, 8, balanced, axes=axes, gmm_backend="xla_fp8",
                                 fp8_dispatch="dispatch" in case, **opts)), flush=True)
  elif case in ("kernel_typing", "kernel_typing_quick"):
    for axes, shape, backends in MESHES if case == "kernel_typing" else QUICK_MESHES:
      for backend in (*backends, *(("ragged_a2a",) if "expert" in axes else ())):
        for gmm_backend in ("mgpu", "mgpu_fp8"):
          error = trace_with_kernel_typing(gmm_backend, backend, shape, axes)
          print(json.dumps({"gmm": gmm_backend, "backend": backend, "mesh": dict(zip(axes, shape)), "error": error}),
                flush=True)
  elif case == "callbacks":
    # The compiled block's gradient, with and without the FP8 dispatch (whose backward re-traces the
    # dispatcher for its transpose): no host callback, and a2a_padded adds no all-reduce (its overflow is each
    # shard's own flag, reduced once per train step: MaxText/moe/overflow.py). The router's gradient is outside.
    for fp8 in (False, True):
      cfg = dataclasses.replace(_cfg(8, "xla_fp8" if fp8 else "xla"), fp8_dispatch=fp8)
      disp, sharding = _on_mesh("a2a_padded", (4,), ("expert",), capacity_factor=4.0)
      x, router, ex = make_params(jax.random.key(0), tokens=TOKENS)
      out = lambda x, e, c=cfg, d=disp, s=sharding: jnp.sum(  # noqa: E731
          block.moe_block_with_buffer(x, block.Router(router.kernel_DE, None), e, c, d, s)[0])
      hlo = jax.jit(jax.grad(out, argnums=(0, 1))).lower(x, ex).compile().as_text()
      print(json.dumps({"fp8_dispatch": fp8, "callbacks": len(re.findall(r"callback", hlo)),
                        "all_reduces": len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))}), flush=True)
  elif case == "overflow":  # every shard's rows to one peer past its bound: flagged on the device
    print(json.dumps(compare("a2a_padded", (1, 4), 1, skewed, capacity_factor=1.0)), flush=True)
  elif case == "ragged_a2a_cpu":
    # XLA:CPU cannot run it: resolve() must say so; the whole forward+backward
    # must still trace and lower (shapes, offsets, transpose rules).
    out = {}
    try:
      dispatch.resolve("ragged_a2a", ep_size=4)
      out["resolve_raised"] = ""
    except RuntimeError as e:
      out["resolve_raised"] = str(e)
    cfg, (x, router, ex) = _cfg(2), make_params(jax.random.key(0), tokens=TOKENS)
    mesh = jax.make_mesh((1, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    disp = dispatch.make("ragged_a2a", num_experts=8, axis_name="expert", ep_size=4)
    sharding = block.Sharding(mesh=mesh, token_axes=("data", "expert"), expert_axis="expert")
    loss = lambda x, ex: jnp.sum(block.moe_block(x, router, ex, cfg, disp, sharding)[0])  # noqa: E731
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, ex).as_text()
    out["ragged_ops_in_hlo"] = hlo.count("ragged_all_to_all")
    print(json.dumps(out), flush=True)
  elif case == "ragged_a2a_emulated":
    # The emulation on the example in jax.lax.ragged_all_to_all's docstring:
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    args = [[[1, 2, 2], [3, 4, 0]], [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]]]
    operand, *plan = (jnp.array(a, jnp.int32).reshape(-1) for a in args)
    run = lambda x, *p: emulated_ragged_all_to_all(x, jnp.zeros((4, 1), jnp.int32), *p, axis_name="x")  # noqa: E731
    got = jax.shard_map(run, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(operand[:, None], *plan)
    print(json.dumps({"docstring_example": np.asarray(got).reshape(2, 4).tolist()}), flush=True)
    # The ragged_a2a block with its exchanges emulated: the plans and their
    # reverse (the custom VJP) against the one-device loss and gradients.
    for mesh_shape, top_k, bias in (((1, 4), 2, balanced), ((2, 2), 8, balanced), ((1, 4), 1, skewed)):
      print(json.dumps(compare("ragged_a2a", mesh_shape, top_k, bias, exchange_impl=emulated_ragged_all_to_all)),
            flush=True)
  elif case == "ragged_a2a_vma":
    # What the emulation cannot show: the real primitive's typing. Raw
    # ragged_all_to_all into a zeros buffer (the old code) makes autodiff psum
    # float cotangents over the expert axis; ragged_exchange must not.
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    i_P, ones_P = jnp.arange(4, dtype=jnp.int32), jnp.ones(4, jnp.int32)
    plan = ragged_a2a.Plan(i_P, ones_P, i_P, ones_P)  # row p to peer p's row `me`: its own reverse
    raw = lambda x: jax.lax.ragged_all_to_all(x, jnp.zeros(x.shape, x.dtype), *plan, axis_name="expert")  # noqa: E731
    ours = lambda x: ragged_a2a.ragged_exchange(x, 4, plan, plan, "expert")  # noqa: E731
    out = {}
    for name, f in (("raw", raw), ("ours", ours)):
      body = jax.shard_map(lambda x, p, f=f: jnp.sum(f(x) * p)[None], mesh=mesh,  # one partial per device
                           in_specs=(P("expert"), P("expert")), out_specs=P("expert"))
      x, probe = jnp.ones((16, 8)), jnp.arange(16 * 8.0).reshape(16, 8)
      jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(body(x, probe))))(x).jaxpr
      out[name] = float_psums_over(jaxpr, "expert")
    # and the whole block's backward, as dispatched:
    cfg, (x, router, ex) = _cfg(2), make_params(jax.random.key(0), tokens=TOKENS)
    mesh = jax.make_mesh((1, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    disp = dispatch.make("ragged_a2a", num_experts=8, axis_name="expert", ep_size=4)
    sharding = block.Sharding(mesh=mesh, token_axes=("data", "expert"), expert_axis="expert")
    loss = lambda x, ex: jnp.sum(block.moe_block(x, router, ex, cfg, disp, sharding)[0])  # noqa: E731
    out["block"] = float_psums_over(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, ex).jaxpr, "expert")
    print(json.dumps(out), flush=True)
  elif case == "gpu":
    jax.config.update("jax_default_matmul_precision", "highest")
    n = 4 if len(jax.devices()) >= 4 else 2
    print(f"devices: {jax.devices()}", flush=True)
    for backend in ("ring", "a2a_padded", "ragged_a2a"):
      for top_k, bias, name in ((2, balanced, "balanced"), (8, balanced, "top8"), (1, skewed, "one-expert")):
        try:
          r = compare(backend, (1, n), top_k, bias, capacity_factor=float(n)) if backend != "ring" else \
              compare(backend, (1, n), top_k, bias)
          ok = r["loss_err"] < 1e-3 and r["grad_err"] < 1e-3 and not r["overflow"]
          print(f"{'PASS' if ok else 'FAIL'} {backend} EP={n} {name} {json.dumps(r)}", flush=True)
        except Exception as e:  # pylint: disable=broad-exception-caught
          print(f"FAIL {backend} EP={n} {name} {type(e).__name__}: {str(e)[:300]}", flush=True)
  else:
    raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
  main(sys.argv[1])
