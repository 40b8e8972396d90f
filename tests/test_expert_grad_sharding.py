"""The routed experts enter the block split as they lie on the mesh, and their gradient leaves it reduce-scattered.

Upstream's logical rules split the expert weights over the expert axis and, on their embed dim, over fsdp
(("exp", "embed_moe", "mlp_moe") -> P("expert", "fsdp", None)). The block takes them so (Sharding.wi_spec,
wo_spec) and gathers them inside its shard_map, so that the backward reduce-scatters dW over fsdp and sums the
shard alone over data. Entered whole (P("expert")), dW was all-reduced at its full size over data x fsdp in
every microbatch.

On 8 simulated CPU devices, each test in a pytest process of its own (the device count is fixed before JAX
starts): every dispatch backend that runs on CPU, FP8 experts, and the pipeline's vmap over stages, against the
block on one device (loss and every gradient, float32) and, for the gradient program, on its compiled HLO.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import MANY_CPU_THREADS, REPO, in_own_process
from MaxText.moe import block, dispatch, routing
from moe_reference import assert_close, dense_ffn, make_params

EXPERTS, HIDDEN, MLP, TOP_K = 4, 8, 6, 2
TOKENS = 32  # 4 per device
# Upstream's wi ("exp", "embed_moe", "mlp_moe") and wo ("exp", "mlp_moe", "embed_moe") under its default rules.
WI_SPEC, WO_SPEC = P("expert", "fsdp", None), P("expert", None, "fsdp")
MESH_AXES = ("data", "fsdp", "expert")
# (dispatch backend, (data, fsdp, expert), the backend's own options)
BACKENDS = [
    ("local", (2, 4, 1), {}),
    ("ring", (2, 2, 2), {}),
    ("a2a_padded", (2, 2, 2), {"capacity_factor": 2.0}),
    ("hierarchical", (1, 2, 4), {"nodes": 2, "capacity_factor": 4.0}),
    ("ragged_a2a", (2, 2, 2), {}),  # its exchange emulated by all_to_all (XLA:CPU has no ragged one)
]
# The fast tier runs local and a2a_padded (20 s each, in a process of their own); the slow tier every backend.
CASES = [pytest.param(*case, id=case[0], marks=() if case[0] in ("local", "a2a_padded") else pytest.mark.slow)
         for case in BACKENDS]


def _mesh(shape):
  return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _cfg(gmm_backend="xla", fp8_dispatch=False):
  router = routing.RouterConfig(num_experts=EXPERTS, top_k=TOP_K, routed_scaling_factor=2.5)
  return block.BlockConfig(router=router, gmm_backend=gmm_backend, dtype=jnp.float32, fp8_dispatch=fp8_dispatch)


def _dispatcher(backend, mesh, options):
  if backend == "ragged_a2a":
    # ep_check sets a device count when imported: only once JAX's backend is up with this process's 8 devices.
    assert len(jax.devices()) == 8
    from ep_check import emulated_ragged_all_to_all  # pylint: disable=import-outside-toplevel

    options = {**options, "exchange_impl": emulated_ragged_all_to_all}
  ep = mesh.shape["expert"]
  return dispatch.make(backend, num_experts=EXPERTS, axis_name="expert" if ep > 1 else None, ep_size=ep, **options)


def _sharding(mesh, split=True):
  """Tokens over every axis; the weights split as upstream lays them out (split) or whole but for EP (main's)."""
  ep = mesh.shape["expert"] > 1
  specs = {"wi_spec": WI_SPEC, "wo_spec": WO_SPEC} if split else {}
  if not ep and split:
    specs = {"wi_spec": P(None, "fsdp", None), "wo_spec": P(None, None, "fsdp")}
  return block.Sharding(mesh=mesh, token_axes=MESH_AXES, expert_axis="expert" if ep else None, **specs)


def _params():
  x, router, ex = make_params(jax.random.key(0), tokens=TOKENS, hidden=HIDDEN, experts=EXPERTS, mlp=MLP)
  probe = jax.random.normal(jax.random.key(5), x.shape)
  return x, router.kernel_DE, ex, probe


def _loss(cfg, disp, sharding, probe):
  def loss(x, kernel_DE, ex):
    y, _, overflow = block.moe_block(x, block.Router(kernel_DE, None), ex, cfg, disp, sharding)
    return jnp.sum(y.astype(jnp.float32) * probe), overflow
  return loss


def _grad_fn(loss, sharding=None):
  """jit of (loss, overflow), (dx, dkernel, dExperts); on a mesh the weights and their gradients lie as the
  Sharding says, as the train step's parameters and their gradients do."""
  f = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  if sharding is None:
    return jax.jit(f)
  mesh, exp = sharding.mesh, block._expert_specs(_params()[2], sharding)  # pylint: disable=protected-access
  ex_sharding = jax.tree.map(lambda spec: NamedSharding(mesh, spec), exp)
  rep = NamedSharding(mesh, P())
  return jax.jit(f, in_shardings=(rep, rep, ex_sharding), out_shardings=((rep, rep), (rep, rep, ex_sharding)))


def _one_device(cfg):
  x, kernel, ex, probe = _params()
  return _grad_fn(_loss(cfg, dispatch.make("local", num_experts=EXPERTS), None, probe))(x, kernel, ex)


def _on_mesh(cfg, backend, shape, options, split=True):
  """((loss, overflow), grads) and the compiled gradient program's HLO text."""
  mesh = _mesh(shape)
  sharding = _sharding(mesh, split)
  x, kernel, ex, probe = _params()
  f = _grad_fn(_loss(cfg, _dispatcher(backend, mesh, options), sharding, probe), sharding)
  return f(x, kernel, ex), f.lower(x, kernel, ex).compile().as_text()


def _collectives(hlo: str, op: str) -> list[tuple[str, frozenset[str]]]:
  """(result shape, mesh axes of its replica groups, those of size 1 left out) of each `op` (all-reduce,
  reduce-scatter) in compiled HLO; a combined op gives one entry per tuple element. XLA prints the groups as
  mesh['data'=2,'fsdp'=2,'expert'=2] {'fsdp'}."""
  found = []
  for line in hlo.splitlines():
    m = re.search(rf"= (.*?) {op}(?:-start)?\(.*replica_groups=mesh\[([^]]*)\] \{{([^}}]*)\}}", line)
    if m:
      size = {name: int(n) for name, n in re.findall(r"'(\w+)'=(\d+)", m.group(2))}
      axes = frozenset(a for a in re.findall(r"'(\w+)'", m.group(3)) if size[a] > 1)
      found += [(shape, axes) for shape in re.findall(r"[a-z0-9]+\[[0-9,]*\]", m.group(1))]
  return found


def _dw_shapes(shape, fsdp: int, lead: str = "") -> list[str]:
  """The local experts' dW of w0, w1 and wo, their embed dim split fsdp ways (1: whole, what main all-reduced);
  lead: dims before E (the vmapped stage's "1,")."""
  local, d = EXPERTS // shape[2], HIDDEN // fsdp
  return sorted([f"f32[{lead}{local},{d},{MLP}]", f"f32[{lead}{local},{d},{MLP}]", f"f32[{lead}{local},{MLP},{d}]"])


def assert_dw_reduce_scattered(hlo: str, shape, lead: str = "") -> None:
  """No all-reduce of a whole dW; each dW reduce-scattered over fsdp, then its shard alone summed over data."""
  data, fsdp, _ = shape
  all_reduces, reduce_scatters = _collectives(hlo, "all-reduce"), _collectives(hlo, "reduce-scatter")
  whole, shard = _dw_shapes(shape, 1, lead), _dw_shapes(shape, fsdp, lead)
  assert [(s, axes) for s, axes in all_reduces if s in whole] == [], all_reduces
  assert sorted(s for s, axes in reduce_scatters if axes == {"fsdp"} and s in shard) == shard, reduce_scatters
  if data > 1:
    assert sorted(s for s, axes in all_reduces if axes == {"data"} and s in shard) == shard, all_reduces


@pytest.mark.parametrize("backend, shape, options", CASES)
def test_split_experts_match_one_device_and_reduce_scatter_their_gradient(request, backend, shape, options):
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  cfg = _cfg()
  (want_val, _), want = _one_device(cfg)
  ((val, overflow), got), hlo = _on_mesh(cfg, backend, shape, options)
  assert not overflow
  assert_close(val, want_val, what="loss")
  for name, g, w in zip(("x", "router kernel", "experts"), got, want):
    jax.tree.map(lambda g, w, name=name: assert_close(g, w, what=f"d{name}"), g, w)
  # and against the float32 dense reference, as every block test does
  x, kernel, ex, probe = _params()
  r = routing.route(x, kernel, None, cfg.router)
  assert_close(val, jnp.sum(dense_ffn(x, r.ids_TK, r.weights_TK, ex) * probe), what="dense loss")
  assert_dw_reduce_scattered(hlo, shape)


@pytest.mark.slow  # two processes of 20 s: the slow tier (CI) runs them
@pytest.mark.parametrize("fp8_dispatch", [False, True], ids=["fp8_experts", "fp8_experts_and_dispatch"])
def test_fp8_experts_split_match_one_device_and_reduce_scatter_their_gradient(request, fp8_dispatch):
  """moe_fp8's CPU backend (xla_fp8) on a2a_padded, data 2 x fsdp 2 x expert 2. The forward's and dlhs's tiles and
  the weights' blocks are the one-device ones (the blocks are cut from the gathered weight), so the loss and the
  token and router gradients are the one-device ones. dW's 128-row tiles are cut from each token shard's rows of
  a group, so on a mesh dW is another quantization of the same sum (tests/test_ep.py): it is held instead to the
  same mesh with the weights entered whole, which quantizes the same tiles and differs only in where it sums."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  backend, shape, options = BACKENDS[2]
  cfg = _cfg("xla_fp8", fp8_dispatch)
  (want_val, _), want = _one_device(cfg)
  ((val, overflow), got), hlo = _on_mesh(cfg, backend, shape, options)
  (_, whole) = _on_mesh(cfg, backend, shape, options, split=False)[0]
  assert not overflow
  assert_close(val, want_val, what="loss")
  assert_close(got[0], want[0], what="dx")
  assert_close(got[1], want[1], what="drouter kernel")
  jax.tree.map(lambda g, w: assert_close(g, w, what="dExperts vs the weights entered whole"), got[2], whole[2])
  assert_dw_reduce_scattered(hlo, shape)


# Tokens over fsdp and expert only: the weights' "tensor" split (upstream's mlp_moe) is over an axis every token
# shard of which holds the same tokens.
TENSOR_AXES, TENSOR_SHAPE = ("fsdp", "tensor", "expert"), (2, 2, 2)


def test_a_split_over_an_axis_the_tokens_are_not_split_on_is_gathered_too(request):
  """wi P("expert", "fsdp", "tensor"), wo P("expert", "tensor", "fsdp"): the tensor split is gathered as the
  checked shard_map needs it (all_gather_invariant: the output is the same on every tensor shard), and the
  gradient is the one-device one, each tensor shard keeping its slice of dW."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  cfg = _cfg()
  (want_val, _), want = _one_device(cfg)
  mesh = jax.make_mesh(TENSOR_SHAPE, TENSOR_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
  sharding = block.Sharding(mesh=mesh, token_axes=("fsdp", "expert"), expert_axis="expert",
                            wi_spec=P("expert", "fsdp", "tensor"), wo_spec=P("expert", "tensor", "fsdp"))
  x, kernel, ex, probe = _params()
  f = _grad_fn(_loss(cfg, _dispatcher("ring", mesh, {}), sharding, probe), sharding)
  (val, overflow), got = f(x, kernel, ex)
  assert not overflow
  assert_close(val, want_val, what="loss")
  jax.tree.map(lambda g, w: assert_close(g, w, what="grads"), got, want)
  all_reduces = _collectives(f.lower(x, kernel, ex).compile().as_text(), "all-reduce")
  assert [(s, axes) for s, axes in all_reduces if s in _dw_shapes((1, 2, 2), 1)] == [], all_reduces


@pytest.mark.slow  # 25 s in a process of its own: the slow tier (scripts/test.sh --all, CI) runs it
def test_under_the_pipelines_vmap_split_experts_match_one_device(request):
  """The pipeline's layout (patches/pipeline_v3.py): a vmap over stages (spmd_axis_name "stage") around the block,
  whose shard_map runs unchecked and leaves the stage axis to the vmap; each stage's weights split over expert and
  fsdp. Every gradient equals each stage's block on one device, and dW is reduce-scattered, not all-reduced."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  stages, cfg = 2, _cfg()
  mesh = jax.make_mesh((stages, 2, 2), ("stage", "fsdp", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  sharding = block.Sharding(mesh=mesh, token_axes=("fsdp", "expert"), expert_axis="expert", vmapped_axis="stage",
                            wi_spec=WI_SPEC, wo_spec=WO_SPEC)
  keys = jax.random.split(jax.random.key(0), stages)
  params = [make_params(k, tokens=TOKENS // stages, hidden=HIDDEN, experts=EXPERTS, mlp=MLP) for k in keys]
  x_STD, kernel_SDE, ex_S = jax.tree.map(lambda *a: jnp.stack(a), *[(x, r.kernel_DE, ex) for x, r, ex in params])
  probe_STD = jax.random.normal(jax.random.key(5), x_STD.shape)

  def stage_loss(disp, sharding):
    def one(x, kernel, ex, probe):
      y, _, _ = block.moe_block(x, block.Router(kernel, None), ex, cfg, disp, sharding)
      return jnp.sum(y * probe)
    return one

  one_device = jax.jit(jax.grad(stage_loss(dispatch.make("local", num_experts=EXPERTS), None), argnums=(0, 1, 2)))
  want = [one_device(x_STD[s], kernel_SDE[s], jax.tree.map(lambda a, s=s: a[s], ex_S), probe_STD[s])
          for s in range(stages)]
  want = jax.tree.map(lambda *a: jnp.stack(a), *want)

  per_stage = jax.vmap(stage_loss(_dispatcher("ring", mesh, {}), sharding), spmd_axis_name="stage")
  ex_specs = block._expert_specs(ex_S, sharding)  # pylint: disable=protected-access
  ex_sharding = jax.tree.map(lambda spec: NamedSharding(mesh, P("stage", *spec)), ex_specs)
  f = jax.jit(jax.grad(lambda *a: jnp.sum(per_stage(*a)), argnums=(0, 1, 2)),
              in_shardings=(NamedSharding(mesh, P("stage")),) * 2 + (ex_sharding, NamedSharding(mesh, P("stage"))),
              out_shardings=(NamedSharding(mesh, P("stage")),) * 2 + (ex_sharding,))
  got = f(x_STD, kernel_SDE, ex_S, probe_STD)
  jax.tree.map(lambda g, w: assert_close(g, w, what="grads"), got, want)
  # no data axis here; each stage's dW (the vmap's dim of 1 leading) reduce-scattered over fsdp
  assert_dw_reduce_scattered(f.lower(x_STD, kernel_SDE, ex_S, probe_STD).compile().as_text(), (1, 2, 2), lead="1,")


@pytest.mark.slow  # lowers the whole train step (as tests/test_overflow.py's does)
def test_the_train_step_takes_the_experts_split_and_reduce_scatters_their_gradient(tmp_path):
  """patches/routed_moe.py hands the block the weights' specs from upstream's logical rules: in the tiny DeepSeek
  train step on data 2 x fsdp 2 x expert 2, lowered for CUDA, the block's shard_map takes wi_0/wi_1 as
  [expert, fsdp, -] and wo as [expert, -, fsdp], gathers them over fsdp inside, and the backward reduce-scatters
  their gradient over fsdp; no all-reduce over fsdp is left (main summed each whole dW over data x fsdp)."""
  hlo = _lowered_train_step(tmp_path, "base_num_decoder_layers=4", "ici_data_parallelism=2",
                            "ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "moe_dispatch_backend=ring")
  wi, wo = '<@mesh, [{"expert"}, {"fsdp"}, {}]>', '<@mesh, [{"expert"}, {}, {"fsdp"}]>'
  assert f"{wi}, {wi}, {wo}]" in hlo  # the block's shard_map's last in-specs: w0, w1, wo
  ops = _collectives_lowered(hlo)
  over = lambda op, axes: sum(o == op and a == axes for o, a in ops)  # noqa: E731
  # w0, w1 and wo gathered in the forward (and again by the remat of the backward); their dW reduce-scattered
  assert over("all_gather", ["fsdp"]) >= 3 and over("reduce_scatter", ["fsdp"]) == 3, ops
  assert [a for o, a in ops if o == "all_reduce" and "fsdp" in a] == [], ops


@pytest.mark.slow  # lowers the whole train step
@pytest.mark.parametrize("ag_once", [False, True])
def test_under_the_pipeline_the_experts_enter_as_the_stage_holds_them(tmp_path, ag_once):
  """PP 2 x EP 2 x FSDP 2 (tests/test_pipeline.py's pp2_ep2_fsdp2), lowered for CUDA: in the stages our block
  takes wi_0/wi_1 split over fsdp and gathers them itself, unless upstream's pipeline_fsdp_ag_once has gathered a
  stage's weights over fsdp before its loop: then they enter without fsdp, and the block gathers nothing over it."""
  hlo = _lowered_train_step(tmp_path, "base_num_decoder_layers=5", "first_num_dense_layers=1",
                            "per_device_batch_size=2", "ici_pipeline_parallelism=2", "ici_expert_parallelism=2",
                            "ici_fsdp_parallelism=2", "num_pipeline_microbatches=2", "num_layers_per_pipeline_stage=2",
                            "scan_layers_per_stage=true", f"pipeline_fsdp_ag_once={str(ag_once).lower()}")
  # the vmap over stages batches the block's shard_map: its in-specs gain the stage dim
  wi_split, wi_whole = '<@mesh, [{"stage"}, {"expert"}, {"fsdp"}, {}]>', '<@mesh, [{"stage"}, {"expert"}, {}, {}]>'
  gathers_over_fsdp = [o for o, a in _collectives_lowered(hlo) if o == "all_gather" and a == ["fsdp"]]
  if ag_once:
    assert wi_split not in hlo and wi_whole in hlo and gathers_over_fsdp == []
  else:
    assert wi_split in hlo and gathers_over_fsdp


def _lowered_train_step(tmp_path, *args: str) -> str:
  """The tiny DeepSeek train step with our block on 8 simulated devices, lowered for CUDA (StableHLO)."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  proc = subprocess.run([sys.executable, str(REPO / "tests/lower_train_step.py"), "configs/deepseek3-tiny.yml",
                         "steps=1", "enable_checkpointing=false", f"base_output_directory={tmp_path}", "moe_block=ours",
                         "moe_gmm_backend=xla", "max_target_length=64", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def _collectives_lowered(hlo: str) -> list[tuple[str, list[str]]]:
  """(op, mesh axes of its groups) of each all_gather, reduce_scatter and all_reduce in StableHLO text."""
  ops = re.findall(r'"stablehlo\.(all_gather|reduce_scatter|all_reduce)"[^\n]*?axes = \[([^]]*)\]', hlo)
  return [(op, re.findall(r'name = "(\w+)"', axes)) for op, axes in ops]


@pytest.mark.slow  # interpreted Mosaic kernels, 40 s each: the slow tier (CI) runs them
@pytest.mark.parametrize("gmm_backend", ["mgpu", "mgpu_fp8"])
def test_gpu_kernels_gradient_traces_with_the_weights_split(request, gmm_backend):
  """The GPU grouped GEMMs' outputs carry no varying manual axes (MaxText/moe/vma.py types them): the block's
  gradient with the weights gathered inside the shard_map traces with them, as a GPU run traces it (tracing checks
  every value's type; the kernels are never run), on every CPU dispatch backend (mgpu_fp8 as moe_fp8 runs it, with
  the FP8 dispatch)."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  from MaxText.moe.gmm.mgpu import bf16 as mgpu  # pylint: disable=import-outside-toplevel

  mgpu.unavailable_reason = lambda: None  # its kernels (and mgpu_fp8's) are only traced here
  cfg = dataclasses.replace(_cfg(gmm_backend, gmm_backend == "mgpu_fp8"), dtype=jnp.bfloat16)
  x, kernel, ex, probe = _params()
  for backend, shape, options in BACKENDS:
    sharding = _sharding(_mesh(shape))
    loss = _loss(cfg, _dispatcher(backend, sharding.mesh, options), sharding, probe)
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)).trace(x, kernel, ex)
