"""Runtime patches to upstream MaxText, one module per seam.

Nothing outside this package touches upstream internals. Each module declares
a `SEAM` (patches/_seam.py) that checks the installed maxtext version and the
target's source hash before it patches, refuses on a mismatch, is idempotent,
and can be undone. Each module also exposes:

  wanted(fork) -> bool      whether this run needs the seam (fork: ForkConfig)
  wrap(original)            the replacement of SEAM's target, for the default apply
  apply(fork, hooks)        only where patching does more than SEAM.apply(wrap) (hooks: callbacks into our code)
  undo()                    only where restoring upstream does more than SEAM.undo()

`apply_module` / `undo_module` (patches/_seam.py) run a module's own or the default.

`apply_all` is what `python -m MaxText.train` calls; tests use `undo_all`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from patches._seam import (UPSTREAM_VERSION, Seam, UpstreamMismatch, apply_module, installed_maxtext_version,
                           undo_module)

# Seam modules, in the order they are applied. One line each.
SEAM_MODULES = (
    "patches.quiet_notices",  # gcloud_stub's import-time "[DECOUPLED NO-OP]" prints, unless verbose=true
    "patches.quiet_tflops",  # upstream's print of the step's model TFLOPs (three lines), unless verbose=true
    "patches.config_errors",  # upstream config errors reach our one-line reporter
    "patches.metric_logger",  # per-step scalars feed our progress line and summary
    "patches.step_metrics",  # keeps the latest train step's scalars (device arrays) for the checkpoint guard
    "patches.checkpoint_guard",  # no non-finite state saved; stop signals save at the step boundary; full disks
    "patches.checkpoint_restore",  # a resume after a model-shape change names the first array that differs
    "patches.tensorboard",  # event files in the run directory in decoupled mode
    "patches.megablox_gmm",  # upstream's sparse_matmul grouped GEMMs -> MaxText/moe/gmm backends
    "patches.deepseek_v3_router",  # DeepSeek-V3's router (moe.py's model_name checks) for moe_router=deepseek_v3
    "patches.pipeline_v3",  # upstream's pipeline with V3's MoE layers: the bias rides with the weights, sown values per layer
    "patches.attention_sinks",  # attention=cudnn_flash_jax with sinks (GPT-OSS): jax's cuDNN + our custom VJP
    "patches.cudnn_mla_vmap",  # jax's cuDNN attention under vmap (pipeline stages) with MLA's unequal head sizes
    "patches.a2a_groups_vmap",  # jax's grouped all_to_all (hierarchical dispatch) under vmap over another axis (stages)
    "patches.pipeline_mtp",  # MTP after the pipeline on each stage's share of the batch (our block), not gathered whole
    "patches.train_schedule",  # token-count switches: bias-update rate -> 0, MTP loss weight (train_step)
    "patches.moe_profile",  # upstream's profiler step hooks: a one-step trace every N steps -> moe_time/ scalars
    "patches.moe_metrics",  # train_step: our block's sown routing statistics -> moe/ scalars (no host callback)
    "patches.cpu_slices",  # upstream's multi-node mesh on simulated CPU devices: consecutive ids fill a node
    "patches.routed_moe",  # RoutedMoE.__call__ -> our route/dispatch/gmm/combine block (moe_block)
    "patches.te_ncclep_bootstrap",  # upstream's TE MoE bootstrap moment also bootstraps te_ncclep's NCCL EP
    "patches.grain_iterator_close",  # a grain pipeline's iterator closes at exit without an AssertionError traceback
    "patches.data_passes",  # grain data that runs out: another pass, or a saved stop with exit 11 (data_exhausted)
)


@dataclasses.dataclass(frozen=True)
class Hooks:
  """Callbacks from patched upstream code into ours."""

  on_train_step: Callable[[int, dict[str, Any]], None] = lambda step, scalars: None
  # Tokens per expert of one MoE layer call (moe_log_expert_load; host numpy array [experts]).
  on_expert_counts: Callable[[Any], None] = lambda counts_E: None
  # The stop request's signal name (SIGTERM, SIGUSR1, SIGINT) or None; read at each step boundary.
  stop_signal: Callable[[], str | None] = lambda: None
  # The latest train step's scalars on the host (patches/step_metrics.py), for error messages.
  step_scalars: Callable[[], dict[str, Any]] = dict
  # Once the run's starting point is settled (patches/checkpoint_restore.py): the checkpoint step restored, or
  # None for a start from scratch; the trainer writes the run's records then, never for a refused resume.
  on_restored: Callable[[int | None], None] = lambda step: None
  # A new pass over the grain data began (data_exhausted=repeat): the pass number and the step of its first batch.
  on_data_pass: Callable[[int, int], None] = lambda pass_no, step: None


def _modules():
  return [importlib.import_module(name) for name in SEAM_MODULES]


def seams() -> list[Seam]:
  return [module.SEAM for module in _modules()]


def check_all(fork: Any = None) -> None:
  """Raises UpstreamMismatch for the first wanted seam whose target moved."""
  for module in _modules():
    if fork is None or module.wanted(fork):
      module.SEAM.check()


def apply_all(fork: Any, hooks: Hooks | None = None) -> list[str]:
  """Applies every seam this run wants; returns their names.

  All are checked first, so a mismatch leaves upstream untouched.
  """
  hooks = hooks or Hooks()
  check_all(fork)
  applied = []
  for module in _modules():
    if module.wanted(fork):
      apply_module(module, fork, hooks)
      applied.append(module.SEAM.name)
  return applied


def undo_all() -> None:
  for module in reversed(_modules()):
    undo_module(module)


__all__ = [
    "UPSTREAM_VERSION",
    "Hooks",
    "Seam",
    "UpstreamMismatch",
    "apply_all",
    "apply_module",
    "check_all",
    "installed_maxtext_version",
    "seams",
    "undo_all",
    "undo_module",
]
