"""Our keys (ForkConfig: every key maxtext-moe owns, with its one-line description), upstream's fields, and
ConfigError, the one-line verdict every check raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pydantic


class ConfigError(ValueError):
  """A config problem, described in one line that names the key or path."""


class ForkConfig(pydantic.BaseModel):
  """Keys that belong to maxtext-moe, not upstream. Upstream never sees them.

  Each subsystem owns a section; every key has a one-line `description` (what
  `python -m MaxText.train --help` prints; tests/test_configs.py checks it is there).
  """

  model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

  # --- run (MaxText/train.py) ---
  progress_every: int = pydantic.Field(
      default=1, ge=0, description='Print our "[progress]" line every N train steps (0 turns it off).')
  mfu_peak_tflops: float | None = pydantic.Field(
      default=None, gt=0,
      description="Dense bf16 peak TF/s per device that MFU is measured against (progress line, perf/mfu); unset: "
      "the GPU's datasheet figure (MaxText/hardware.py PEAK_BF16_FLOPS), n/a on unknown devices and CPU.")
  allow_schedule_change: bool = pydantic.Field(
      default=False,
      description="Resume even when the learning-rate schedule differs from the checkpoint's (else refused; "
      "MaxText/lifecycle.py).")
  verbose: bool = pydantic.Field(
      default=False,
      description="Print what upstream prints as it runs: its INFO log lines (its own per-step line, the "
      "checkpoint manager's), its prints (the step's TFLOPs, the \"[DECOUPLED NO-OP]\" stub notices) and "
      "transformers' warnings, and our start-up details (patches, XLA_FLAGS); else absl logs at WARNING "
      "(MaxText/quiet.py). XLA's own C++ INFO lines: TF_CPP_MIN_LOG_LEVEL=0.")
  nonfinite_skip_batches: int = pydantic.Field(
      default=0, ge=0,
      description="After a stop at a non-finite step N (exit 4), the resume from the last finite checkpoint C "
      "skips this many batches after C, and never fewer than the N-C through the one that went non-finite "
      "(0: replay them; MaxText/lifecycle.py).")
  data_exhausted: Literal["repeat", "stop"] = pydantic.Field(
      default="repeat",
      description="When a grain dataset runs out before `steps`: repeat starts another pass over it (one line; the "
      "pass counted in the summary and in TensorBoard's data/pass), stop saves the last step trained and exits 11 "
      "naming the files and the step (patches/data_passes.py).")
  allow_data_change: bool = pydantic.Field(
      default=False,
      description="Resume even when the data (dataset_type, its files, the tokenizer, vocab_size) differs from "
      "what the run recorded (else refused; MaxText/lifecycle.py).")

  # --- MoE (MaxText/moe) ---
  moe_gmm_backend: Literal["upstream", "auto", "xla", "tokamax", "mgpu", "te"] = pydantic.Field(
      default=None,
      description="Grouped-GEMM backend (MaxText/moe/gmm) of our block, or of upstream's sparse_matmul under "
      "moe_block=upstream (\"upstream\" leaves that path untouched; the others set megablox=true, see "
      "MOE_GMM_UPSTREAM_KEYS). Unset: auto with moe_block=ours (mgpu on Hopper), else upstream.")

  @pydantic.model_validator(mode="before")
  @classmethod
  def _gmm_backend_follows_the_block(cls, data: Any) -> Any:
    if isinstance(data, dict) and data.get("moe_gmm_backend") is None:
      data = {**data, "moe_gmm_backend": "auto" if data.get("moe_block") == "ours" else "upstream"}
    return data

  moe_fp8: Literal["none", "blockwise", "mxfp8"] = pydantic.Field(
      default="none",
      description="Our block's expert GEMMs in FP8. blockwise: DeepSeek-V3's recipe (e4m3; 1x128 activation "
      "tiles, 128x128 weight blocks; f32 promotion every 128 of the contraction) on Hopper (grouped-GEMM backend "
      "mgpu_fp8; xla_fp8 emulates it on CPU). The forward, dlhs and dW GEMMs all run in FP8 (dW's operands in "
      "128x1 tiles along the rows, each expert's rows 128-aligned). mxfp8: OCP MXFP8 (e4m3, one power-of-two E8M0 "
      "scale per 32 values along each product's contraction) through Transformer Engine's grouped GEMM on Blackwell "
      "(te_mxfp8; xla_mxfp8 emulates it on CPU; refused on other GPUs). Needs moe_block=ours and moe_gmm_backend "
      "unset (auto; te also with mxfp8).")

  # --- MoE block (MaxText/moe/block.py, patches/routed_moe.py) ---
  moe_block: Literal["upstream", "ours", "te"] = pydantic.Field(
      default="upstream",
      description="Routed-MoE block: upstream's, ours (route -> dispatch -> gmm -> combine), or upstream's TE "
      "MoEBlock path.")
  moe_dispatch_backend: Literal["auto", "local", "ring", "ragged_a2a", "a2a_padded", "hierarchical",
                                "te_ncclep"] = pydantic.Field(
      default="auto",
      description="Our block's dispatch (MaxText/moe/dispatch); auto: local, or with EP ring (CPU) / a2a_padded (GPU); "
      "hierarchical: EP across nodes in two exchanges, a token crossing InfiniBand once per node it needs.")
  moe_hierarchical_capacity_factor: float = pydantic.Field(
      default=2.0, gt=0, allow_inf_nan=False,  # inf: ceil(inf x rows) is an OverflowError at the first trace
      description="hierarchical: each stage's buffer = factor x its balanced share ((token, node) rows per node, "
      "capped at the tokens; slots per GPU inside the node); the EP size never overflows.")
  moe_ep_overlap_chunks: int = pydantic.Field(
      # Each chunk is its own copy of the dispatch, grouped GEMMs and combine in every MoE layer of the compiled
      # program, so the compile grows with it (256 on the tiny config compiled for more than 5 minutes); 2 is what
      # the compile-only H200 schedule was read at (BENCHMARKS.md, "Dispatch and expert parallelism").
      default=1, ge=1, le=8,
      description="Our block under EP splits each shard's tokens into this many chunks (at most 8), each dispatched, "
      "computed and combined on its own, so that one chunk's all-to-all overlaps another's grouped GEMMs; 1: no "
      "split. No effect without EP; must divide the tokens per shard.")
  moe_node_limited_routing: bool = pydantic.Field(
      default=False,
      description="DeepSeek-V3's node-limited routing: moe_router=deepseek_v3's groups are the EP nodes "
      "(n_routing_groups = dcn_expert_parallelism; unset: set to it), each scored by the sum of its top K/M biased "
      "scores (M = topk_routing_group, which must divide num_experts_per_tok), so each token's experts are on at "
      "most M nodes.")
  moe_a2a_padded_capacity_factor: float = pydantic.Field(
      default=2.0, gt=0, allow_inf_nan=False,
      description="a2a_padded: rows per peer buffer = factor x the balanced share (the EP size never overflows).")
  moe_a2a_padded_on_overflow: Literal["error", "flag"] = pydantic.Field(
      default="error",
      description="a bounded dispatch buffer (a2a_padded, ragged_a2a, hierarchical) sent more rows than it holds: "
      "error stops the run after that step (exit 8, the step not saved); flag, only with upstream's "
      "moe_dropless_fallback=step, replays the step with every buffer at the EP size (MaxText/overflow.py).")
  moe_ragged_a2a_capacity_factor: float | None = pydantic.Field(
      default=None, gt=0, allow_inf_nan=False,
      description="ragged_a2a: receive rows = factor x this shard's T*K (unset: the EP size, never overflows).")
  moe_log_expert_load: bool = pydantic.Field(
      default=False,
      description="Our block reports each MoE layer's tokens per expert to the host (max/mean in the run summary); "
      "a jax.debug.callback per layer call: for measurements, not for production runs.")
  moe_metrics_every_n_steps: int = pydantic.Field(
      default=1, ge=0,
      description="Our block's routing statistics (tokens per expert, load ratio, CV, idle experts, router "
      "entropy, bias, overflow) as moe/ TensorBoard scalars, a histogram and a heatmap every N steps; 0 turns "
      "them off and compiles nothing extra. Computed in the step, no host callback: 0.1% of the step on one H200 "
      "(BENCHMARKS.md, \"End to end on one H200\").")
  moe_metrics_heatmap_every_n_steps: int = pydantic.Field(
      default=100, ge=0,
      description="A layers x experts heatmap of load / mean in TensorBoard's images tab every N steps, its numbers "
      "on stdout up to 32 experts and 16 MoE layers (0: none); "
      "needs moe_metrics_every_n_steps > 0.")
  moe_profile_every_n_steps: int = pydantic.Field(
      default=0, ge=0,
      description="The MoE time split live: every N steps (steps s with (s+1) % N == 0, never a process's first "
      "step, which compiles) a jax.profiler trace of that one step into <run>/moe_profile/step_<s>/, classified "
      "into route/dispatch/gmm/combine/attention/rest (xprof's per-op statistics) as moe_time/ TensorBoard "
      "scalars and a log line. 0: off. Process 0 only; needs profiler unset (one trace at a time).")
  moe_te_ncclep_recv_capacity_per_rank: int | None = pydantic.Field(
      default=None, ge=1,
      description="te_ncclep: rows each rank receives (TE's recv_capacity_per_rank); unset: the dropless bound "
      "for the batch.")
  moe_te_ncclep_alignment: int = pydantic.Field(
      default=128, ge=1,
      description="te_ncclep: rows each local expert's zone is padded to, a power of two (TE's moe.py uses 128 "
      "for NCCL EP).")

  @pydantic.field_validator("moe_te_ncclep_alignment")
  @classmethod
  def _alignment_is_a_power_of_two(cls, value: int) -> int:
    if value & (value - 1):
      raise ValueError("must be a power of two (1, 2, 4, ..., 128)")
    return value

  # --- Router and training schedule of DeepSeek-V3 (patches/deepseek_v3_router.py, patches/train_schedule.py) ---
  moe_router: Literal["upstream", "deepseek_v3"] = pydantic.Field(
      default="upstream",
      description="deepseek_v3: DeepSeek-V3's router (selection-only bias variable, group-limited routing, bias "
      "update) on either block, whatever model_name says; upstream 0.2.5 applies it only to model names deepseek3*.")
  moe_bias_update_stop_tokens: int | None = pydantic.Field(
      default=None, ge=1,
      description="Training tokens after which the routing-bias update rate becomes 0 (V3: 14.3T); unset: never.")
  mtp_loss_switch_tokens: int | None = pydantic.Field(
      default=None, ge=1,
      description="Training tokens after which the MTP loss weight becomes mtp_loss_scaling_factor_late "
      "(V3: 10T, 0.3 -> 0.1).")
  mtp_loss_scaling_factor_late: float | None = pydantic.Field(
      default=None, ge=0, description="The MTP loss weight after mtp_loss_switch_tokens (V3: 0.1).")

  # --- XLA / environment presets (MaxText/xla_presets.py) ---
  xla_presets: list[str] = pydantic.Field(
      default_factory=list,
      description="Named XLA flag/env presets (python -m MaxText.xla_presets lists them), merged in order; "
      "your XLA_FLAGS win.")
  recipe_num_gpus: int | None = pydantic.Field(
      default=None, ge=1,
      description="GPUs a recipe (configs/recipes/) is written for; the run refuses any other count.")

  # --- planner (MaxText/plan/planner.py) ---
  target_gpu: Literal["h100", "h200", "b200"] | None = pydantic.Field(
      default=None,
      description="GPU the run is planned for: its HBM, GEMM rate and links (MaxText/hardware.py); unset: the "
      "local GPU's kind.")
  gpus_per_node: int = pydantic.Field(
      default=8, ge=1,
      description="GPUs per node (one NVLink domain): collectives over more cross InfiniBand; the mocked "
      "topology's slice size.")


def upstream_configs_dir() -> Path:
  import maxtext  # pylint: disable=import-outside-toplevel

  return Path(maxtext.__file__).resolve().parent / "configs"


def upstream_fields() -> dict[str, Any]:
  """Upstream's pydantic fields, including those of nested models."""
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  fields = dict(types.MaxTextConfig.model_fields)
  for info in list(fields.values()):
    nested = getattr(info.annotation, "model_fields", None)
    if nested:
      fields.update(nested)
  return fields


