"""The MoE block: route -> dispatch -> grouped GEMM -> combine.

    routing = route(x, router)                       # which K experts, what weights
    x_MD, meta = dispatcher.dispatch(x, routing.ids) # rows grouped by expert
    y_MD = expert_ffn(x_MD, meta, experts)           # three grouped GEMMs (+ expert biases), a GLU
    y = dispatcher.combine(y_MD, routing.weights, meta)

With FP8 experts the tokens cross the dispatch already quantized, and so does the combine's cotangent on
its way back to the experts (`fp8_dispatch`, BlockConfig.fp8_dispatch).
Routing runs in the global (auto-sharded) view; dispatch -> combine runs per
shard inside `jax.shard_map` when a mesh is given, the expert axis carrying
expert parallelism (the dispatcher owns its collectives); a `global_view`
dispatcher (te_ncclep: TE's ops partition themselves) is called outside it
and only the grouped GEMMs run per shard. Upstream-agnostic:
patches/routed_moe.py feeds it upstream RoutedMoE's parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from MaxText.moe import fp8_dispatch
from MaxText.moe import routing as routing_lib
from MaxText.moe import vma
from MaxText.moe.dispatch import Dispatcher
from MaxText.moe.gmm import gmm

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "relu": jax.nn.relu,
    "sigmoid": jax.nn.sigmoid,  # GPT-OSS's gate, inside its own GLU form ("gpt_oss" below)
    "linear": lambda x: x,
}


def _glu(h0, h1, act, limit):
  return act(h0) * h1


def _clamped_glu(h0, h1, act, limit):
  return act(jnp.minimum(h0, limit)) * jnp.clip(h1, -limit, limit)


def _gpt_oss_glu(h0, h1, act, limit):
  h0 = jnp.minimum(h0, limit)
  return h0 * act(h0 * 1.702) * (jnp.clip(h1, -limit, limit) + 1)


# How the gate (h0 = x @ w0) and up (h1 = x @ w1) projections combine, as upstream's
# RoutedMoE.apply_ffn_activation (layers/moe.py ~1441) does per decoder block.
GLUS: dict[str, Callable] = {
    "glu": _glu,  # act(h0) * h1: SwiGLU with silu (DeepSeek, Qwen3, Mixtral, Llama 4)
    "clamped_glu": _clamped_glu,  # act(min(h0, L)) * clip(h1, +-L): DeepSeek-V4 (mlp_activations_limit L)
    "gpt_oss": _gpt_oss_glu,  # h0' * act(1.702 h0') * (clip(h1, +-L) + 1), h0' = min(h0, L): GPT-OSS
}


# The dispatched rows' checkpoint name: upstream's for its sorted MoE tokens (its remat_policy=custom key
# moe_x_sorted: remat | device | offload). Kept (device) or offloaded, the backward's recompute of the layer
# reads them instead of exchanging them again: one EP exchange a layer fewer (tests/test_ep_remat.py).
DISPATCHED_ROWS = "moe_x_sorted"


@dataclasses.dataclass(frozen=True)
class Router:
  """Router parameters: kernel_DE, and the routing bias_E (or None)."""

  kernel_DE: jax.Array
  bias_E: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Experts:
  """GLU expert weights of the experts this shard holds (all without EP).

  E is the number of local experts; F the expert MLP width. The biases (upstream's
  mlp_bias: GPT-OSS) are None for models without them.
  """

  w0_EDF: jax.Array  # gate projection (activation applied)
  w1_EDF: jax.Array  # up projection (linear)
  wo_EFD: jax.Array  # down projection
  b0_EF: jax.Array | None = None  # gate projection's bias
  b1_EF: jax.Array | None = None  # up projection's bias
  bo_ED: jax.Array | None = None  # down projection's bias


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Static settings of the block.

  Attributes:
    router: routing hyper-parameters.
    activation: name in ACTIVATIONS for the gate projection.
    glu: name in GLUS: how the activated gate and the up projection combine.
    activation_limit: GLUS' clamp L (the clamped forms only).
    gmm_backend: MaxText.moe.gmm backend name.
    dtype: compute dtype of the grouped GEMMs and the output.
    gate_dtype: dtype of the router matmul (upstream: float32_gate_logits).
    fp8_dispatch: quantize tokens to 1x128 e4m3 tiles before the dispatch and move them so, and the
      combine's cotangent before the backward's exchange towards the experts (MaxText/moe/fp8_dispatch.py);
      needs an FP8 gmm_backend. Not for `global_view` dispatchers.
    overlap_chunks: per shard, the tokens in this many equal chunks, each dispatched, computed and combined on
      its own (`chunked`), so that XLA's scheduler can run one chunk's exchange while another's grouped GEMMs
      run; 1: one pass. For EP dispatchers (patches/routed_moe.py sets it only under EP).
  """

  router: routing_lib.RouterConfig
  activation: str = "silu"
  glu: str = "glu"
  activation_limit: float = 0.0
  gmm_backend: str = "xla"
  dtype: jnp.dtype = jnp.float32
  gate_dtype: jnp.dtype | None = None
  fp8_dispatch: bool = False
  overlap_chunks: int = 1


def expert_ffn(x_MD, meta, experts: Experts, cfg: BlockConfig, x_tiles=None):
  """GLU of each row with its expert: glu(x @ w0 + b0, x @ w1 + b1) @ wo + bo (biases where the model has
  them). x_tiles: x_MD's rows already quantized (the FP8 dispatch), which both up-projections multiply."""
  return _down(_up_glu(x_MD, meta, experts, cfg, x_tiles), meta, experts, cfg)


def _gmm_kw(meta, cfg: BlockConfig):
  return dict(backend=cfg.gmm_backend, group_offset=meta.group_offset, preferred_element_type=cfg.dtype)


def _up_glu(x_MD, meta, experts: Experts, cfg: BlockConfig, x_tiles=None):
  """The up-projections, their biases and the GLU: h_MF."""
  with jax.named_scope("gmm"):
    # Inside shard_map the weights are shared by every token shard: gmm's VJP sums their dW over the
    # token axes (MaxText/moe/vma.py).
    w0, w1 = (w.astype(cfg.dtype) for w in (experts.w0_EDF, experts.w1_EDF))
    # The operands that are gathers of token rows: x_MD (the dispatch's output) and the combine's
    # cotangent of wo's output. FP8 backends let XLA quantize those through the gather (gmm's doc).
    h0_MF = gmm(x_MD, w0, meta.group_sizes_G, lhs_tiles=x_tiles, gathered=(True, False), **_gmm_kw(meta, cfg))
    h1_MF = gmm(x_MD, w1, meta.group_sizes_G, lhs_tiles=x_tiles, gathered=(True, False), **_gmm_kw(meta, cfg))
    h0_MF, h1_MF = (_tag(_plus_row_bias(h, b, meta, cfg.dtype), name)
                    for h, b, name in ((h0_MF, experts.b0_EF, "mlpwi_0"), (h1_MF, experts.b1_EF, "mlpwi_1")))
    return GLUS[cfg.glu](h0_MF, h1_MF, ACTIVATIONS[cfg.activation], cfg.activation_limit).astype(cfg.dtype)


def _down(h_MF, meta, experts: Experts, cfg: BlockConfig):
  """wo's grouped GEMM and its bias: y_MD."""
  with jax.named_scope("gmm"):
    y_MD = gmm(h_MF, experts.wo_EFD.astype(cfg.dtype), meta.group_sizes_G, gathered=(False, True),
               **_gmm_kw(meta, cfg))
    return _tag(_plus_row_bias(y_MD, experts.bo_ED, meta, cfg.dtype), "mlpwo")


def _plus_row_bias(h_MN, bias_EN, meta, dtype):
  """h_MN + the bias of each row's expert; rows of experts this shard does not hold and padding rows stay
  as the grouped GEMM left them (zeros), as upstream masks them (layers/moe.py ~2925)."""
  if bias_EN is None:
    return h_MN
  num_rows, num_local = h_MN.shape[0], bias_EN.shape[0]
  # Row m belongs to (global) group g(m): the first whose cumulative size exceeds m; rows past the last are padding.
  group_M = jnp.searchsorted(jnp.cumsum(meta.group_sizes_G), jnp.arange(num_rows), side="right")
  # One-hot rows (all zero for rows of experts not held here, and padding), so the bias is a GEMM, and so is its
  # gradient, onehot_ME^T @ dh_MN. Gathering bias_EN[local_M] instead makes the backward a scatter-add of every row
  # into E rows, serialized by its collisions on a GPU: the GPT-OSS proxy's step took 2.98 s on an H200, 82% of it
  # under the grouped GEMMs' scope (tools/bench_families.py, BENCHMARKS.md "Families on one H200").
  onehot_ME = jax.nn.one_hot(group_M - meta.group_offset, num_local, dtype=dtype)
  bias_MN = jnp.dot(onehot_ME, bias_EN.astype(dtype), preferred_element_type=jnp.float32)
  return h_MN + bias_MN.astype(h_MN.dtype)


def _tag(y, name: str):
  """Upstream's two checkpoint names for an expert activation ("mlpwi_0" and "moe_mlpwi_0", layers/moe.py),
  so its remat policies (`minimal` saves the first, `custom` with offload acts on the second) and the
  host_offload preset treat our block's activations exactly as upstream's."""
  return checkpoint_name(checkpoint_name(y, name), f"moe_{name}")


def _tag_mlpwo(y_MD):
  return _tag(y_MD, "mlpwo")


def dispatch_ffn_combine(x_TD, ids_TK, weights_TK, experts: Experts, cfg: BlockConfig, dispatcher: Dispatcher):
  """Per-shard part of the block: tokens and routing in, weighted expert sum out.

  Returns (y_TD, overflow, buffer_12): overflow is a bool[1], True where a
  bounded dispatch buffer (a2a_padded) of this shard could not hold every row;
  False otherwise. buffer_12: this shard's [largest rows sent to a peer / capacity,
  rows over capacity (dropped)], zeros for dispatchers without such a buffer.
  """
  moved = _dispatch(x_TD, ids_TK, cfg, dispatcher)
  y_TD = _output(_up(moved, experts, cfg), moved, ids_TK, weights_TK, experts, cfg, dispatcher)
  return y_TD, _overflow(moved[2]), _buffer_12(moved[2])


def _dispatch(x_TD, ids_TK, cfg: BlockConfig, dispatcher: Dispatcher):
  """(x_MD, x_tiles or None, meta): the rows at their experts, named DISPATCHED_ROWS for the remat policy."""
  with jax.named_scope("dispatch"):
    if cfg.fp8_dispatch:
      x_MD, x_tiles, meta = fp8_dispatch.dispatch(dispatcher, x_TD.astype(cfg.dtype), ids_TK)
      return checkpoint_name(x_MD, DISPATCHED_ROWS), jax.tree.map(_keep_rows, x_tiles), meta
    x_MD, meta = dispatcher.dispatch(x_TD.astype(cfg.dtype), ids_TK)
    return checkpoint_name(x_MD, DISPATCHED_ROWS), None, meta


def _keep_rows(a):
  return checkpoint_name(a, DISPATCHED_ROWS)


def _up(moved, experts: Experts, cfg: BlockConfig):
  """The up-projections and the activation: h_MF."""
  x_MD, x_tiles, meta = moved
  return _up_glu(x_MD, meta, experts, cfg, x_tiles)


def _output(h_MF, moved, ids_TK, weights_TK, experts: Experts, cfg: BlockConfig, dispatcher: Dispatcher):
  """wo's product and the combine: y_TD."""
  meta = moved[2]
  if cfg.fp8_dispatch:
    if experts.bo_ED is not None:  # MaxText/config/checks.py refuses moe_fp8 with mlp_bias first
      raise ValueError("expert biases (mlp_bias) with the FP8 dispatch's fused output and combine: not implemented")
    # wo's product and the combine in one VJP: the combine's backward moves the cotangent to the experts as
    # FP8 tiles, which wo's dlhs and dW take as they are (its combine's ops in a "combine" scope of their own).
    with jax.named_scope("gmm"):
      return fp8_dispatch.expert_output_combine(dispatcher, h_MF, experts.wo_EFD.astype(cfg.dtype), meta,
                                                weights_TK, ids_TK, backend=cfg.gmm_backend, dtype=cfg.dtype,
                                                tag=_tag_mlpwo)
  y_MD = _down(h_MF, meta, experts, cfg)
  with jax.named_scope("combine"):
    return dispatcher.combine(y_MD, weights_TK, meta)


def _overflow(meta):
  return jnp.reshape(getattr(meta, "overflow", jnp.bool_(False)), (1,))


def chunked(x_TD, ids_TK, weights_TK, experts: Experts, cfg: BlockConfig, dispatcher: Dispatcher):
  """dispatch_ffn_combine on cfg.overlap_chunks equal chunks of the tokens, results in token order.

  The chunks share nothing but the weights, so XLA's latency-hiding scheduler may run one chunk's exchanges
  while another's grouped GEMMs run (DeepSeek-V3 overlaps two micro-batches' exchanges with each other's
  compute, section 3.2.1); MaxText/plan/overlap.py reads what it did from the compiled schedule. Pinning the
  pairs with optimization barriers (chunk i+1's dispatch tied to chunk i's up-projections) put fewer GEMMs
  beside the exchanges in the compile-only H200 schedule, not more, and was removed. Each chunk's buffers are
  sized for its tokens.
  """
  n, t = cfg.overlap_chunks, x_TD.shape[0]
  if n == 1:
    return dispatch_ffn_combine(x_TD, ids_TK, weights_TK, experts, cfg, dispatcher)
  if t % n:
    raise ValueError(f"moe_ep_overlap_chunks={n} does not divide the {t} tokens of a shard")
  split = lambda a: jnp.split(a, n)  # noqa: E731
  outs = [dispatch_ffn_combine(x, i, w, experts, cfg, dispatcher)
          for x, i, w in zip(split(x_TD), split(ids_TK), split(weights_TK))]
  overflow = jnp.any(jnp.stack([o[1] for o in outs]), axis=0)
  buffers = jnp.stack([o[2] for o in outs])  # [chunks, 1, 2]: the fullest fill, rows past capacity summed
  return (jnp.concatenate([o[0] for o in outs]), overflow,
          jnp.stack([jnp.max(buffers[..., 0], 0), jnp.sum(buffers[..., 1], 0)], axis=-1))


def _buffer_12(meta):
  """[fill of the fullest per-peer buffer, rows beyond capacity] of a bounded dispatch (a2a_padded's send_P, C;
  a meta with buffers of its own says it: hierarchical's two stages)."""
  if hasattr(meta, "buffer_12"):
    return meta.buffer_12()
  capacity, send_P = getattr(meta, "capacity", None), getattr(meta, "send_P", None)
  if not isinstance(capacity, int) or send_P is None:
    return jnp.zeros((1, 2), jnp.float32)
  fill = jnp.max(send_P).astype(jnp.float32) / capacity
  over = jnp.sum(jnp.maximum(send_P - capacity, 0)).astype(jnp.float32)
  return jnp.stack([fill, over])[None]


@dataclasses.dataclass(frozen=True)
class Sharding:
  """How the block is laid out on a mesh (None: no shard_map, one device).

  Attributes:
    mesh: the device mesh.
    token_axes: mesh axes the token dimension is split over (batch axes).
    expert_axis: mesh axis splitting the experts (EP), or None.
    vmapped_axis: mesh axis that a surrounding `jax.vmap(spmd_axis_name=...)` maps (upstream's pipeline
      stages, patches/pipeline_v3.py), or None. The vmap owns that axis, so the shard_map's specs leave it
      out, and the shard_map runs unchecked (check_vma=False): JAX 0.11.2 cannot batch a lax loop inside a
      vma-checked shard_map under such a vmap (its scan batching re-binds a pvary over the vmapped axis on a
      value that already varies over it; jnp.searchsorted is such a loop). Unchecked, the shard_map's
      transpose sums the cotangents of inputs replicated over an axis (the experts' weights over the token
      axes) at its boundary, where the checked one does it inside gmm's VJP (MaxText/moe/vma.py): the same sum.
    wi_spec, wo_spec: how w0_EDF and w1_EDF, and wo_EFD, lie on the mesh (the logical axis rules' specs, e.g.
      P("expert", "fsdp", None)); None: split over the expert axis only. They enter the shard_map so split and
      are gathered inside it (`_gathered`), so that the backward reduce-scatters dW over those axes: entered
      whole, every shard's dW was all-reduced over the token axes at its full size.
  """

  mesh: jax.sharding.Mesh
  token_axes: Sequence[str]
  expert_axis: str | None = None
  vmapped_axis: str | None = None
  wi_spec: P | None = None
  wo_spec: P | None = None


def global_view_dispatch_ffn_combine(x_TD, ids_TK, weights_TK, experts: Experts, cfg: BlockConfig,
                                     dispatcher: Dispatcher, sharding: Sharding):
  """For dispatchers whose ops partition themselves (`global_view`, te_ncclep).

  dispatch/combine run in the global view and the weights go out with the
  tokens; only the grouped GEMMs run per shard, on the [P, R, D] receive
  buffer (and meta) whose leading dim P is split like the tokens. The expert
  axis must be the innermost token axis: rank p = (outer coordinate) * EP +
  (expert coordinate) holds that expert shard's weights.
  """
  if sharding is None or not sharding.token_axes or sharding.token_axes[-1] != sharding.expert_axis:
    raise ValueError(f"MoE dispatch backend {dispatcher.name!r} needs a mesh whose innermost token axis is the "
                     f"expert axis; got {sharding}")
  tok = P(tuple(sharding.token_axes))
  pin = lambda a: jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(sharding.mesh, tok))  # noqa: E731
  with jax.named_scope("dispatch"):
    x_PRD, meta = dispatcher.dispatch(pin(x_TD.astype(cfg.dtype)), pin(ids_TK), pin(weights_TK))
  exp = _expert_specs(experts, sharding)
  def ffn(x_1RD, meta_1, e):
    return expert_ffn(x_1RD[0], meta_1, _gathered(e, exp, sharding, cfg.dtype), cfg)[None]

  y_PRD = jax.shard_map(ffn, mesh=sharding.mesh, in_specs=(tok, tok, exp), out_specs=tok)(x_PRD, meta, experts)
  with jax.named_scope("combine"):
    y_TD = dispatcher.combine(y_PRD, weights_TK, meta)
  return y_TD, meta.overflow_P


def _expert_specs(experts: Experts, sharding: Sharding) -> Experts:
  """The expert tensors' in-specs: the weights as they lie (Sharding.wi_spec, wo_spec), the biases (small) split
  over the expert axis by their leading E dim only."""
  specs = jax.tree.map(lambda _: P(sharding.expert_axis), experts)
  return dataclasses.replace(specs, w0_EDF=_weight_spec(sharding.wi_spec, sharding),
                             w1_EDF=_weight_spec(sharding.wi_spec, sharding),
                             wo_EFD=_weight_spec(sharding.wo_spec, sharding))


def _axes_of(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _weight_spec(spec: P | None, sharding: Sharding) -> P:
  """A weight's in-spec: the expert axis leads its E dim (the dispatch hands each expert shard its own experts),
  then the other axes its layout splits E over; its other dims as they lie. The vmap's axis is the vmap's."""
  dims = [_axes_of(entry) for entry in (spec or P())] or [()]
  keep = lambda axes: tuple(a for a in axes if a not in (sharding.expert_axis, sharding.vmapped_axis))  # noqa: E731
  dims = [(*_axes_of(sharding.expert_axis), *keep(dims[0])), *map(keep, dims[1:])]
  return P(*(axes or None for axes in dims))


def _gathered(experts: Experts, specs: Experts, sharding: Sharding, dtype) -> Experts:
  """Inside the shard_map: each weight whole but for its expert split, in the compute dtype (the cast is exact
  either side of the gather; before it, a bf16 gather moves half a float32 one's bytes).

  Over a token axis the gather is typed varying, and its transpose reduce-scatters dW; over an axis the tokens
  are not split on (the checked shard_map's output is invariant there) invariant, and its transpose takes this
  shard's slice of a dW that every shard holds whole. The weights are first typed varying over the
  token axes they are not split on (data), so that dW's sum over those (vary's transpose, a psum) comes after
  the reduce-scatter, on the shard. Unchecked (under a vmap) the shard_map's transpose does those sums itself.
  """
  checked = sharding.vmapped_axis is None
  token_axes = frozenset(sharding.token_axes)

  def gather(w, spec: P):
    w = w.astype(dtype)
    if checked:
      w = vma.vary(w, token_axes)
    for dim, entry in enumerate(spec):
      axes = _axes_of(entry)[1:] if dim == 0 and sharding.expert_axis else _axes_of(entry)
      for axis in reversed(axes):  # the minor axis first: the tiles land in the spec's major-to-minor order
        to = "varying" if axis in token_axes or not checked else "invarying"
        w = jax.lax.all_gather(w, axis, axis=dim, tiled=True, to=to)
    return w

  return dataclasses.replace(experts, w0_EDF=gather(experts.w0_EDF, specs.w0_EDF),
                             w1_EDF=gather(experts.w1_EDF, specs.w1_EDF), wo_EFD=gather(experts.wo_EFD, specs.wo_EFD))


def moe_block(x_TD, router: Router, experts: Experts, cfg: BlockConfig, dispatcher: Dispatcher,
              sharding: Sharding | None = None):
  """Routed experts of T tokens; returns (y_TD, Routing, overflow: bool[], any shard's).

  With `sharding`, `experts` holds every expert (global view) and the shard_map
  hands each expert shard its slice.
  """
  y_TD, r, overflow_S, _ = moe_block_with_buffer(x_TD, router, experts, cfg, dispatcher, sharding)
  return y_TD, r, jnp.any(overflow_S)


def moe_block_with_buffer(x_TD, router: Router, experts: Experts, cfg: BlockConfig, dispatcher: Dispatcher,
                          sharding: Sharding | None = None):
  """moe_block with each shard's overflow flag unreduced, bool[shards] (bool[1] on one device: the train step
  reduces every layer's at once, MaxText/moe/overflow.py), plus the bounded dispatch buffer's use: f32[2] =
  [fullest per-peer buffer's fill (fraction of capacity, max over shards), rows beyond capacity, i.e. dropped
  (sum over shards)]; zeros when unbounded."""
  with jax.named_scope("route"):
    r = routing_lib.route(x_TD, router.kernel_DE, router.bias_E, cfg.router, dtype=cfg.gate_dtype)
  weights_TK = r.weights_TK
  if cfg.router.weigh_input:  # Llama 4: the score scales the token before its (one) expert; combine with 1
    x_TD, weights_TK = x_TD * weights_TK, jnp.ones_like(weights_TK)
  if getattr(dispatcher, "global_view", False):
    y_TD, overflow = global_view_dispatch_ffn_combine(x_TD, r.ids_TK, weights_TK, experts, cfg, dispatcher,
                                                      sharding)
    return y_TD.astype(cfg.dtype), r, overflow, jnp.zeros((2,), jnp.float32)
  body = lambda x, ids, w, e: chunked(x, ids, w, e, cfg, dispatcher)  # noqa: E731
  if sharding is not None:
    tok = P(tuple(sharding.token_axes) or None)
    exp = _expert_specs(experts, sharding)
    gathered = lambda e: _gathered(e, exp, sharding, cfg.dtype)  # noqa: E731
    body = lambda x, ids, w, e: chunked(x, ids, w, gathered(e), cfg, dispatcher)  # noqa: E731
    # One overflow flag per device (per stage: the pipeline's vmap adds its own axis).
    every_shard = P(tuple(a for a in sharding.mesh.axis_names if a != sharding.vmapped_axis))
    body = jax.shard_map(body, mesh=sharding.mesh, in_specs=(tok, tok, tok, exp),
                         out_specs=(tok, every_shard, every_shard), check_vma=sharding.vmapped_axis is None)
  y_TD, overflow, buffer_S2 = body(x_TD, r.ids_TK, weights_TK, experts)
  buffer_2 = jnp.stack([jnp.max(buffer_S2[:, 0]), jnp.sum(buffer_S2[:, 1])])
  return y_TD.astype(cfg.dtype), r, overflow, jax.lax.stop_gradient(buffer_2)


jax.tree_util.register_dataclass(Experts, data_fields=["w0_EDF", "w1_EDF", "wo_EFD", "b0_EF", "b1_EF", "bo_ED"],
                                 meta_fields=[])
