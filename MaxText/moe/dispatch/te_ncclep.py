"""EP via Transformer Engine's NCCL-EP kernels (`transformer_engine.jax.ep`).

Written to TE's JAX EP API as released in transformer-engine 2.20.2
(transformer_engine/jax/ep.py, checked against the wheel's source; api_mismatch
refuses other forms). It needs >= 2 GPUs and NCCL >= 2.30.4, so it has not run a
dispatch yet:

  EpLayerConfig(top_k, dispatch_output_per_expert_alignment=0)     per layer
  ep_bootstrap(world_size, rank, num_experts, max_tokens_per_rank,
               recv_capacity_per_rank, hidden_dim, ...)  eagerly, once per process,
               inside the mesh and global_shard_guard(MeshResource(ep_resource=..))
  ep_dispatch(cfg, topk_idx_TK, tokens_TD, topk_weights_TK, recv_capacity_per_rank)
      -> recv_tokens_PRD, recv_topk_weights_PR (float32, 0 on padding slots),
         handle_mem_PN (uint8 routing state), token_counts_PG (int32),
         [total_recv_tokens_P1 in later TEs: pre-drop rows, for overflow]
  ep_combine(cfg, handle_mem_PN, token_counts_PG, expert_out_PRD, num_local_tokens)
      -> y_TD: per token, the UNWEIGHTED sum of its K rows

Upstream MaxText 0.2.5 calls ep_bootstrap with these keywords too (plus
max_token_dtype, drop_on_overflow: max_utils.maybe_bootstrap_te_moe). A TE
read later (NVIDIA/TransformerEngine at 00145f7) has another API: ep_bootstrap
also takes ep_size, ep_dispatch a per-layer EpHandle (ep_make_handle) in place
of EpLayerConfig, and ep_combine the recv weights (it weights the rows
itself). This adapter does not fit that one; check the installed TE first.
In a run, patches/te_ncclep_bootstrap.py calls `bootstrap` (upstream's own TE
bootstrap moment) and patches/routed_moe.py passes the same capacity to `make`.

P = ranks (dp * ep, one GPU per process), R = recv_capacity_per_rank, G =
local experts. Rank p's buffer is expert-major: local expert g's zone follows
g-1's, padded to the alignment, and token_counts_PG[p] are the zone sizes
(TE's own moe.py feeds them to its grouped GEMM as group sizes); order within
a zone is unspecified. Both ops are custom VJPs: dispatch's returns gradients
for the tokens and for topk_weights (through recv_topk_weights), combine's for
expert_out only. The wire is bfloat16 only (ep_bootstrap's max_token_dtype).

Why this backend differs from the others (the block calls it differently):
  * TE's ops run in the GLOBAL view: they are custom_partitioning primitives
    whose shapes carry the P dim and whose partition rules read TE's
    MeshResource. Inside our shard_map they would see per-shard shapes with
    no mesh to partition over, so `global_view = True` makes the block call
    dispatch/combine outside shard_map and run only the grouped GEMMs per
    shard, on the [P, R, D] buffer split like the tokens (TE's moe.py does
    the same: EP ops global, FFN in shard_map).
  * the routing weights travel WITH the tokens (combine is unweighted, the
    receiver pre-multiplies), so `dispatch` takes weights_TK and `combine`
    ignores its weights argument: their gradient returns through TE's
    dispatch VJP instead.
Overflow (a rank receiving more than R rows) traps in NCCL EP unless TE was
bootstrapped with drop_on_overflow; with a TE that returns total_recv_tokens
it is flagged in meta.overflow_P, as a2a_padded flags its overflow.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math

import jax
import jax.numpy as jnp

from MaxText.moe import te_release

NAME = "te_ncclep"
INSTALL = ("install Transformer Engine 2.20 for JAX (transformer_engine.jax.ep, built with NCCL EP; needs SM90+ "
           "GPUs and NCCL >= 2.30.4): pip install 'maxtext-moe[te]', tools/te_offline/ on an air-gapped node, "
           "or an NGC JAX container that ships it")


def _te_ep():
  """transformer_engine.jax.ep, or RuntimeError saying what to install."""
  try:
    return importlib.import_module("transformer_engine.jax.ep")
  except (ImportError, OSError) as e:  # OSError: TE present but its CUDA libraries are not
    raise RuntimeError(f"MoE dispatch backend {NAME!r} is unavailable: transformer_engine.jax.ep does not "
                       f"import ({e}); {INSTALL}") from e


def api_mismatch(te_ep) -> str | None:
  """Why the installed TE's EP API is not the one this adapter is written to, or None.

  The later API (EpHandle from ep_make_handle; ep_combine taking the received weights and
  weighting the rows itself) would get rows we already weighted: a silently wrong sum,
  so it is refused rather than guessed at. A release outside te_release.SUPPORTED_TE is
  refused by name first, even when its API looks the same."""
  why = te_release.unsupported(te_release.installed_version())
  if why:
    return f"{NAME} {why}; use moe_dispatch_backend=a2a_padded"
  if not hasattr(te_ep, "EpLayerConfig") or hasattr(te_ep, "ep_make_handle"):
    return ("the installed transformer_engine.jax.ep has the EpHandle API (ep_make_handle), not the "
            "EpLayerConfig API of NVIDIA/TransformerEngine#3036 this adapter is written to; use "
            "moe_dispatch_backend=a2a_padded")
  params = inspect.signature(te_ep.ep_combine).parameters
  if any("weight" in name for name in params):
    return (f"the installed TE's ep_combine takes routing weights ({', '.join(params)}): it weights rows "
            "itself, and this adapter pre-weights them; use moe_dispatch_backend=a2a_padded")
  return None


def unavailable_reason() -> str | None:
  try:
    te_ep = _te_ep()
  except RuntimeError as e:
    return str(e).split(": ", 1)[1]
  mismatch = api_mismatch(te_ep)
  if mismatch:
    return mismatch
  if jax.default_backend() != "gpu":
    return f"NCCL EP runs on CUDA GPUs (SM90+) only, not on {jax.default_backend()}"
  if jax.local_device_count() != 1:
    return (f"NCCL EP needs one GPU per process (this process has {jax.local_device_count()}); launch one "
            "process per GPU")
  return None


def dropless_recv_capacity(*, tokens_per_rank: int, top_k: int, ep_size: int, num_local_experts: int,
                           alignment: int) -> int:
  """The smallest R that no routing overflows.

  An EP group sends ep_size * tokens_per_rank tokens; each lands on one local
  expert at most once, so a zone holds at most that many rows, and the rank
  at most min(top_k, G) per token plus (alignment - 1) padding per non-empty zone.
  """
  a = max(alignment, 1)
  up = lambda n: -(-n // a) * a  # noqa: E731
  tokens = ep_size * tokens_per_rank
  rows = tokens * min(top_k, num_local_experts)
  return min(num_local_experts * up(tokens), up(rows + (a - 1) * min(num_local_experts, rows)))


def bootstrap(*, num_experts: int, max_tokens_per_rank: int, recv_capacity_per_rank: int, hidden_dim: int,
              **te_options) -> None:
  """TE's ep_bootstrap for this process (one GPU per process).

  Call eagerly, once, before any jit, inside `with mesh` and TE's
  `global_shard_guard(MeshResource(dp_resource=<outer token axis>, ep_resource=<expert axis>))`;
  keep that guard active while tracing and compiling the block. te_options
  (max_num_sms, drop_on_overflow, ...) go to TE as they are.
  """
  try:
    # world_size=None: TE 2.20.2 takes the active mesh's device count (an explicit value must equal it, and
    # it is devices, not processes); it refuses fewer than 2.
    _te_ep().ep_bootstrap(world_size=None, rank=jax.process_index(), num_experts=num_experts,
                          max_tokens_per_rank=max_tokens_per_rank, recv_capacity_per_rank=recv_capacity_per_rank,
                          hidden_dim=hidden_dim, **te_options)
  except (ValueError, RuntimeError, AssertionError) as e:
    raise RuntimeError(f"MoE dispatch backend {NAME!r}: Transformer Engine's ep_bootstrap refused this mesh: {e}") from e


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["recv_weights_PR", "handle_mem_PN", "group_sizes_PG", "overflow_P"],
                   meta_fields=["num_local_experts", "top_k", "num_tokens"])
@dataclasses.dataclass(frozen=True)
class NcclEPMeta:
  """What combine (and, per shard, the grouped GEMM) needs; from TE's ep_dispatch.

  Every array has the leading P dim (one row per rank, split like the tokens),
  so the block hands it to shard_map with the token spec; inside, P = 1.

  Attributes:
    recv_weights_PR: float32[P, R]: routing weight of each received row, 0 on padding.
    handle_mem_PN: uint8[P, N]: TE's routing state for ep_combine (opaque).
    group_sizes_PG: int32[P, G]: rows (aligned zone sizes) per local expert.
    overflow_P: bool[P]: a rank would have received more than R rows (TE
      returning total_recv_tokens only; otherwise False: NCCL EP traps).
    num_local_experts: G.
    top_k: K (TE's EpLayerConfig).
    num_tokens: T of the global view (ep_combine's static output rows).
  """

  recv_weights_PR: jax.Array
  handle_mem_PN: jax.Array
  group_sizes_PG: jax.Array
  overflow_P: jax.Array
  num_local_experts: int
  top_k: int
  num_tokens: int

  @property
  def group_sizes_G(self) -> jax.Array:
    """int32[G] rows per local expert: this shard's (only inside the block's shard_map, where P = 1)."""
    if self.group_sizes_PG.shape[0] != 1:
      raise ValueError(f"group_sizes_G is per shard; this meta holds {self.group_sizes_PG.shape[0]} ranks "
                       "(use it inside the shard_map over the receive buffer)")
    return self.group_sizes_PG[0]

  @property
  def group_offset(self) -> jax.Array:
    """int32[] = 0: the receive buffer holds local experts only."""
    return jnp.zeros((), jnp.int32)


@dataclasses.dataclass(frozen=True)
class NcclEPDispatcher:
  """TE NCCL-EP over `axis_name` (TE's MeshResource.ep_resource); global view.

  recv_capacity_per_rank: R, exactly what ep_bootstrap got.
  alignment: rows each expert zone is padded to (TE's moe.py uses 128, which
    it says NCCL EP's high-throughput kernels need).
  """

  num_experts: int
  axis_name: str
  ep_size: int
  recv_capacity_per_rank: int
  alignment: int = 128
  name: str = NAME
  global_view: bool = True  # the block calls dispatch/combine outside shard_map (module note)

  def _layer_config(self, te_ep, top_k: int):
    # Layers may share one config: TE keys its routing cache on handle_mem, not on the config.
    return te_ep.EpLayerConfig(top_k=top_k, dispatch_output_per_expert_alignment=self.alignment)

  def _check_mesh_resource(self):
    from transformer_engine.jax.sharding import global_mesh_resource  # pylint: disable=import-outside-toplevel
    ep_resource = global_mesh_resource().ep_resource
    if ep_resource != self.axis_name:
      raise ValueError(f"te_ncclep: TE's MeshResource.ep_resource is {ep_resource!r}, the expert axis is "
                       f"{self.axis_name!r}; trace the block inside transformer_engine.jax.sharding."
                       f"global_shard_guard(MeshResource(ep_resource={self.axis_name!r}, ...)) after "
                       "te_ncclep.bootstrap(...)")

  def dispatch(self, x_TD, ids_TK, weights_TK):
    """Global view: tokens [T, D] -> ([P, R, D] rows, expert-major per rank; meta)."""
    if x_TD.dtype != jnp.bfloat16:
      raise ValueError(f"te_ncclep: NCCL EP moves bfloat16 tokens only (ep_bootstrap's max_token_dtype), got "
                       f"{x_TD.dtype}; run the block with dtype=bfloat16")
    te_ep = _te_ep()
    self._check_mesh_resource()
    num_tokens, top_k = ids_TK.shape
    recv_PRD, recv_w_PR, handle_PN, counts_PG, *total = te_ep.ep_dispatch(
        self._layer_config(te_ep, top_k), ids_TK, x_TD, weights_TK.astype(jnp.float32),
        self.recv_capacity_per_rank)
    if total:  # later TEs: pre-drop rows per rank, [P, 1]
      overflow_P = total[0].reshape(-1) > self.recv_capacity_per_rank
    else:
      overflow_P = jnp.zeros(counts_PG.shape[:1], jnp.bool_)
    meta = NcclEPMeta(recv_weights_PR=recv_w_PR, handle_mem_PN=handle_PN, group_sizes_PG=counts_PG,
                      overflow_P=overflow_P, num_local_experts=self.num_experts // self.ep_size, top_k=top_k,
                      num_tokens=num_tokens)
    return recv_PRD, meta

  def combine(self, y_PRD, weights_TK, meta: NcclEPMeta):
    """Global view: weight each row by the weight that travelled with it, TE scatter-sums home."""
    del weights_TK  # already at the rows (meta.recv_weights_PR); its gradient returns through ep_dispatch
    te_ep = _te_ep()
    w_PR1 = meta.recv_weights_PR[..., None]
    # Padding rows (weight 0) are zeroed, not multiplied: TE's contract, and NaN-safe.
    weighted_PRD = jnp.where(w_PR1 != 0, y_PRD.astype(jnp.float32) * w_PR1, 0).astype(y_PRD.dtype)
    return te_ep.ep_combine(self._layer_config(te_ep, meta.top_k), meta.handle_mem_PN, meta.group_sizes_PG,
                            weighted_PRD, meta.num_tokens)


def make(*, num_experts: int, axis_name: str | None, ep_size: int = 1, recv_capacity_per_rank: int | None = None,
         alignment: int = 128) -> NcclEPDispatcher:
  mismatch = api_mismatch(_te_ep())  # the install message first: nothing below helps without TE
  if mismatch:
    raise RuntimeError(f"MoE dispatch backend {NAME!r} cannot use this TE: {mismatch}")
  if axis_name is None or ep_size < 2 or num_experts % ep_size:
    raise ValueError(f"te_ncclep dispatch needs an expert mesh axis of size >= 2 dividing num_experts "
                     f"({num_experts}); got axis {axis_name!r} of size {ep_size}")
  if recv_capacity_per_rank is None or recv_capacity_per_rank <= 0:
    raise ValueError("te_ncclep dispatch needs recv_capacity_per_rank (the R given to ep_bootstrap; "
                     "te_ncclep.dropless_recv_capacity(...) never overflows)")
  if alignment < 0 or (alignment > 1 and not math.log2(alignment).is_integer()):
    raise ValueError(f"te_ncclep: alignment must be 0 or a power of two, got {alignment}")
  return NcclEPDispatcher(num_experts=num_experts, axis_name=axis_name, ep_size=ep_size,
                          recv_capacity_per_rank=recv_capacity_per_rank, alignment=alignment)
