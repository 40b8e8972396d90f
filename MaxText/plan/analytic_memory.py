"""Per-GPU memory estimate for a DeepSeek-V3 config, with the arithmetic shown.

The planner's analytic cross-check (`python -m MaxText.plan <config>` prints it
under the compiler's figure); the compiler's own figure needs a GPU compile
(an AOT compile for CPU devices reports CPU buffers). It counts
  params      every weight, by dtype (weight_dtype), sharded over all devices
              but the data-parallel replicas (upstream's logical rules shard
              every weight over fsdp x expert; data axes replicate it: HSDP)
  grads       same count, in grad_dtype
  optimizer   AdamW mu + nu (mu_dtype, which defaults to weight_dtype; nu too)
  activations what the remat policy keeps per layer for the backward pass:
              the layer input always (remat checkpoint), plus every tensor the
              custom policy marks 'device'; 'offload' moves it to host memory
  transient   the largest of one layer's backward working sets (MoE, MLA) and
              the logits' (tokens x vocab, per num_vocab_tiling tile)
Not counted: XLA's scratch and fragmentation, NCCL buffers, the CUDA
context (~1-2 GB): the headroom each recipe leaves is for those.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
GB = 1e9


@dataclasses.dataclass(frozen=True)
class ParamCount:
  """Parameters by where they live (counts, not bytes)."""

  embedding: int  # token embedding + untied output head
  attention: int  # all layers' MLA projections and norms
  dense_mlp: int  # the leading dense layers' MLPs
  routed_experts: int  # all MoE layers' routed experts
  shared_and_router: int  # shared experts, router weights and bias
  mtp: int  # multi-token prediction module(s)

  @property
  def total(self) -> int:
    return sum(dataclasses.astuple(self))


def _mla(c: Mapping[str, Any]) -> int:
  d, h = c["base_emb_dim"], c["base_num_query_heads"]
  qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
  q = d * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * h * qk  # wq_a, q_norm, wq_b
  kv = d * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]  # wkv_a, kv_norm
  kv += c["kv_lora_rank"] * h * (c["qk_nope_head_dim"] + c["v_head_dim"])  # wkv_b
  return q + kv + h * c["v_head_dim"] * d + 2 * d  # + out proj + 2 layer norms


def count_params(c: Mapping[str, Any]) -> ParamCount:
  """DeepSeek-V3 block structure (upstream decoder_block: deepseek)."""
  d, n_layers, n_dense = c["base_emb_dim"], c["base_num_decoder_layers"], c["first_num_dense_layers"]
  n_moe = n_layers - n_dense
  glu = 3  # silu gate, linear up, down
  expert = glu * d * c["base_moe_mlp_dim"]
  router = d * c["num_experts"] + c["num_experts"]  # gate kernel + routing bias
  layer_attn = _mla(c)
  mtp_layers = int(c.get("mtp_num_layers", 0))
  # An MTP depth: 3 norms + projection of [h; emb] (2d -> d) + one MoE decoder layer.
  mtp = mtp_layers * (3 * d + 2 * d * d + layer_attn + c["num_experts"] * expert + c["shared_experts"] * expert + router)
  return ParamCount(
      embedding=2 * c["vocab_size"] * d + d,  # embedding, head, final norm
      attention=n_layers * layer_attn,
      dense_mlp=n_dense * glu * d * c["base_mlp_dim"],
      routed_experts=n_moe * c["num_experts"] * expert,
      shared_and_router=n_moe * (c["shared_experts"] * expert + router),
      mtp=mtp,
  )


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per GPU, by kind."""

  params: float
  grads: float
  optimizer: float
  activations: float
  transient: float
  host_offloaded: float  # per GPU, in pinned host memory (not HBM)

  @property
  def device_total(self) -> float:
    return self.params + self.grads + self.optimizer + self.activations + self.transient


def estimate(c: Mapping[str, Any], num_devices: int) -> tuple[ParamCount, MemoryEstimate, list[str]]:
  """The estimate and the lines of arithmetic behind it."""
  p = count_params(c)
  w = BYTES[c.get("weight_dtype", "float32")]
  g = BYTES[c.get("grad_dtype", "float32")]
  mu = BYTES[c.get("mu_dtype") or c.get("weight_dtype", "float32")]
  act = BYTES[c.get("dtype", "bfloat16")]
  n = p.total
  d, layers = c["base_emb_dim"], c["base_num_decoder_layers"] + int(c.get("mtp_num_layers", 0))
  t = int(c["per_device_batch_size"] * c["max_target_length"])  # tokens per GPU
  k, f, h = c["num_experts_per_tok"], c["base_moe_mlp_dim"], c["base_num_query_heads"]
  qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
  # Per-layer tensors a custom remat policy can keep, in elements per GPU.
  named = {
      "decoder_layer_input": t * d,
      "moe_mlpwi_0": t * k * f,
      "moe_mlpwi_1": t * k * f,
      "moe_mlpwo": t * k * d,
      "query_proj": t * h * qk,
      "out_proj": t * d,
  }
  placement = {name: c.get(name, "remat") for name in named} if c.get("remat_policy", "full") == "custom" else {}
  placement.setdefault("decoder_layer_input", "device")  # the remat checkpoint (scan carry)
  kept = sum(v for name, v in named.items() if placement.get(name) == "device") * act * layers
  offloaded = sum(v for name, v in named.items() if placement.get(name) == "offload") * act * layers
  # Backward of one layer, recomputed; the largest of three phases is live at once:
  #   MoE:    routed tokens in, expert output, its grad (t*k*d each) and the
  #           two up-projections, their product and two grads (t*k*f each)
  #   MLA:    q, k, v, out and their grads (flash attention keeps no scores)
  #   logits: bf16 logits + fp32 softmax over the vocab, per vocab tile
  moe_ws = act * t * k * (3 * d + 5 * f)
  attn_ws = act * 8 * t * h * qk
  tiles = int(c.get("num_vocab_tiling", 1))
  logits_ws = t * c["vocab_size"] * (act + 4) / tiles
  replicas = max(1, int(c.get("ici_data_parallelism", 1))) * max(1, int(c.get("dcn_data_parallelism", 1)))
  shards = max(1, num_devices // replicas)
  est = MemoryEstimate(
      params=n * w / shards,
      grads=n * g / shards,
      optimizer=2 * n * mu / shards,
      activations=kept,
      transient=max(moe_ws, attn_ws, logits_ws),
      host_offloaded=offloaded,
  )
  device_kept = ", ".join(name for name, v in placement.items() if v == "device")
  host_kept = ", ".join(name for name, v in placement.items() if v == "offload") or "none"
  over = f"{shards} GPUs" + (f" ({replicas} data-parallel replicas)" if replicas > 1 else "")
  lines = [
      f"params      {n / 1e9:.2f}B x {w} B / {over} = {est.params / GB:.2f} GB",
      f"grads       {n / 1e9:.2f}B x {g} B / {over} = {est.grads / GB:.2f} GB",
      f"optimizer   AdamW mu+nu 2 x {n / 1e9:.2f}B x {mu} B / {over} = {est.optimizer / GB:.2f} GB",
      f"activations {device_kept}: {layers} layers x {t} tokens/GPU x {act} B = {est.activations / GB:.2f} GB",
      f"transient   max(MoE {moe_ws / GB:.2f}, MLA {attn_ws / GB:.2f}, logits/{tiles} tiles {logits_ws / GB:.2f})"
      f" = {est.transient / GB:.2f} GB",
      f"host        offloaded {host_kept}: {est.host_offloaded / GB:.2f} GB per GPU of pinned host memory",
      f"total HBM   {est.device_total / GB:.1f} GB per GPU (+ XLA scratch, NCCL buffers, CUDA context ~2 GB)",
  ]
  return p, est, lines


def upstream_param_count(config_path: str, overrides: list[str] = ()) -> int:
  """Upstream MaxText's own count: its model built abstractly (jax.eval_shape) on CPU."""
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, model_creation_utils  # pylint: disable=import-outside-toplevel

  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel

  run = fork_config.load(
      [config_path, "hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=synthetic",
       "per_device_batch_size=1", "max_target_length=8", "ici_fsdp_parallelism=-1", "ici_expert_parallelism=1",
       "enable_checkpointing=false", "attention=dot_product", *overrides]
  )
  config = pyconfig.initialize(run.upstream_argv())
  model = model_creation_utils.from_config(config, devices=jax.devices()[:1])
  abstract = maxtext_utils.get_abstract_param(model, config)
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(abstract))
