"""FLOPs a training step runs that MaxText's own count leaves out or does not split: the routed experts' GEMMs
(the ones moe_fp8 runs in FP8) and the remat policy's recompute. The planner's schedule and layout search charge
them at MaxText/hardware.py's rates."""

from __future__ import annotations


def _microbatches(config) -> int:
  """Microbatches a step: per_device_batch_size is one microbatch's (upstream's global batch to train on and its
  TFLOP count both multiply by gradient_accumulation_steps)."""
  return int(getattr(config, "gradient_accumulation_steps", 1) or 1)


def _routed_forward_flops(config) -> float:
  """The routed experts' three GEMMs (wi_0, wi_1, wo) per device a step (every microbatch), forward only: every MoE
  decoder layer and each MTP module's, a MoE layer too (upstream's count takes them so:
  maxtext_utils.calculate_tflops_training_per_device, "the final layer is always an MoE layer")."""
  tokens = config.per_device_batch_size * config.max_target_length * _microbatches(config)
  moe_layers = (config.num_decoder_layers - getattr(config, "first_num_dense_layers", 0)
                + getattr(config, "mtp_num_layers", 0))
  return 2 * tokens * config.num_experts_per_tok * 3 * config.emb_dim * config.moe_mlp_dim * moe_layers


def _experts_saved(config) -> bool:
  """remat_policy=custom keeping both expert up-projections: wo's input is elementwise from them, so
  the backward runs no routed-expert GEMM again."""
  return getattr(config, "remat_policy", "full") == "custom" and {
      getattr(config, "moe_mlpwi_0", "remat"), getattr(config, "moe_mlpwi_1", "remat")} <= {"device", "offload"}


def routed_expert_flops(config) -> float:
  """FLOPs per device of the routed experts' GEMMs in one training step: forward, dlhs and dW,
  plus the forward again where the remat policy recomputes it (`recompute_flops`). These are the
  GEMMs moe_fp8 runs in FP8; 0 for a dense model."""
  if getattr(config, "num_experts", 1) <= 1:
    return 0.0
  recomputed = getattr(config, "remat_policy", "full") in ("full", "custom") and not _experts_saved(config)
  return _routed_forward_flops(config) * (4 if recomputed else 3)


def recompute_flops(config) -> tuple[float, str]:
  """FLOPs per device the remat policy re-runs in the backward pass, which MaxText's count leaves out.

  full: every decoder layer's forward again (all but the output head, a third
  of the layers' training FLOPs). custom: the same, less the routed experts'
  GEMMs when their up-projections (moe_mlpwi_0 and _1) are saved or offloaded:
  the backward then needs no expert GEMM again (wo's input is elementwise from
  them). Other policies save the matmul outputs: counted as no recompute.
  The term the H200 honesty check found missing (tools/gpu_checks.sh plan-honesty; BENCHMARKS.md "Planner accuracy").
  """
  policy = getattr(config, "remat_policy", "full")
  tokens = config.per_device_batch_size * config.max_target_length
  if policy not in ("full", "custom"):
    return 0.0, f"remat_policy={policy}: matmul outputs saved, no recompute counted"
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  total = maxtext_utils.calculate_tflops_training_per_device(config, log=False)[0] * 1e12
  # Forward + backward, never rematerialized; every microbatch, as MaxText's count (its total multiplies by them).
  head = 2 * tokens * _microbatches(config) * config.emb_dim * config.vocab_size * 3
  flops = (total - head) / 3
  note = f"remat_policy={policy}: the decoder layers' forward again"
  if getattr(config, "num_experts", 1) > 1 and _experts_saved(config):
    flops -= _routed_forward_flops(config)
    note += ", less the routed experts' GEMMs (moe_mlpwi_0/1 kept)"
  return max(flops, 0.0), note
