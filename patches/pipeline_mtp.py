"""Seam: DeepSeek-V3's MTP block under upstream's pipeline runs with the stage axis as data parallelism.

Upstream (maxtext 0.2.5) runs the layers before the pipeline under logical_axis_rules_pp_act_as_dp (the
`stage` mesh axis joins the batch axes, nnx_decoders.py ~1849), but the MTP block after it under the
plain rules, where `activation_batch` leaves `stage` out: every stage computes the whole MTP for its
(fsdp x expert) share of the batch, S times over. Its logits then go out as
`activation_embed_and_logits_batch`, which has `stage` before `fsdp`: a batch split over (fsdp, expert)
and one split over (stage, fsdp, expert) hold different rows on each device, and XLA reshards it by
all-gathering the whole global batch's logits onto every device. Measured (`python -m MaxText.plan`,
compile-only H100s, the 1,024 x H100 PP8 x EP8 x FSDP16 overrides of docs/pipeline.md): the MTP logits'
gradient, bf16[1024, 4096, 129280] = 1,010 GiB, all-gathered over all 1,024 GPUs once per accumulated
microbatch (nnx_decoders.py ~1619 `apply_output_head`, under transpose(jvp)): the step's 1,166 GiB per
GPU and its all-gathers over stage x fsdp x expert. The pipelined layers' weights are gathered per stage
(over fsdp and expert only) with or without this seam.

  MultiTokenPredictionBlock.__call__
      with pipeline parallelism, the MTP block runs under upstream's own pp-as-dp rules: the main
      model's hidden state arrives split over (stage, fsdp, expert) as the pipeline leaves it, each
      stage runs the MTP layer, head and loss on its own share of the batch, and its logits stay
      where they are made.

Only with our block (moe_block=ours), which counts its experts' load in the global view: upstream's
block sums its counts over batch axes that leave `stage` out (moe.py ~491), so under these rules its
MTP bias would move by one stage's share of the batch (the same reason config_checks.py refuses it in
MoE layers before the pipeline). With upstream's block the MTP keeps upstream's layout.
"""

from __future__ import annotations

import functools

from patches._seam import Seam

SEAM = Seam(
    name="pipeline MTP stage as data",
    module="maxtext.layers.multi_token_prediction",
    attr="MultiTokenPredictionBlock.__call__",
    sha256="7585a6ac161e233a",
)


def wrap(call):
  @functools.wraps(call)
  def __call__(self, *args, **kwargs):
    if not getattr(self.config, "using_pipeline_parallelism", False):
      return call(self, *args, **kwargs)
    from flax import linen as nn  # pylint: disable=import-outside-toplevel
    from maxtext.utils import sharding  # pylint: disable=import-outside-toplevel

    with nn.partitioning.axis_rules(sharding.logical_axis_rules_pp_act_as_dp(self.config.logical_axis_rules)):
      return call(self, *args, **kwargs)

  return __call__


def wanted(fork) -> bool:
  """With our block; acts only when upstream builds a pipeline (ici/dcn_pipeline_parallelism > 1)."""
  return fork.moe_block == "ours"
