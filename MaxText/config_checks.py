"""Value checks upstream MaxText 0.2.5 leaves to a traceback.

Upstream's validation (pyconfig + validate_train_config) accepts each of these
and the run then fails with a traceback: some after the first compile (49 s
for `checkpoint_period=0` on the tiny config), some inside jnp shape code. Each
check here runs on upstream's resolved config (model_name and derived keys
applied), before anything is compiled or written, and raises a ConfigError
whose one line names the key and the value.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from MaxText.config import ConfigError, RunConfig

# The kernels upstream's attention_op.py (0.2.5) dispatches on; anything else
# raises ValueError only when the model is traced.
ATTENTION_KERNELS = ("autoselected", "dot_product", "flash", "cudnn_flash_te", "cudnn_flash_jax", "paged",
                     "vllm_rpa", "vllm_batched_rpa")

# Keys that must be > 0 (upstream types them as plain ints / numbers).
POSITIVE = ("per_device_batch_size", "vocab_size", "max_target_length", "base_emb_dim", "base_num_decoder_layers",
            "base_num_query_heads", "base_num_kv_heads")


def _origin(run: RunConfig, key: str) -> str:
  return "as set" if key in run.explicit else "upstream default"


def check_fork(run: RunConfig) -> None:
  """Our keys against this machine, before patches apply (routed_moe would refuse with a RuntimeError)."""
  if run.fork.moe_block == "te" and importlib.util.find_spec("transformer_engine") is None:
    raise ConfigError("config key 'moe_block' = 'te' needs Transformer Engine, which is not installed: "
                      "pip install 'maxtext-moe[te]' on a CUDA machine, or use moe_block=ours")


def fp8_gpu_refusal(compute_capability: str) -> str | None:
  """Why moe_fp8's kernel (sm_90a e4m3 wgmma) cannot run on a GPU of this compute capability, or None."""
  major, _, minor = compute_capability.partition(".")
  if major == "9":
    return None
  name = f"this GPU (compute capability {compute_capability or 'unknown'})"
  if not major.isdigit() or (int(major), int(minor or 0)) < (8, 9):
    return f"{name} has no FP8 tensor cores (Hopper, compute capability 9.x, is needed); use moe_fp8=none"
  if int(major) == 8:
    return (f"{name} has FP8 tensor cores, but our blockwise kernel is written for Hopper's wgmma (sm_90a); "
            "use moe_fp8=none")
  return (f"{name} is past Hopper: our blockwise kernel is sm_90a-only, and Blackwell's FP8 path is Transformer "
          "Engine's MXFP8 (not wired to our block yet); use moe_fp8=none")


def check_upstream_values(run: RunConfig, config: Any) -> None:
  """Checks upstream's resolved config (a pyconfig.HyperParameters)."""
  for key in POSITIVE:
    value = getattr(config, key, None)
    if value is not None and not value > 0:
      raise ConfigError(f"config key '{key}' = {value!r} ({_origin(run, key)}): must be > 0")
  if config.attention not in ATTENTION_KERNELS:
    raise ConfigError(f"config key 'attention' = {config.attention!r}: not an attention kernel upstream MaxText "
                      f"knows; one of {', '.join(ATTENTION_KERNELS)}")
  if config.num_experts > 1 and config.num_experts_per_tok > config.num_experts:
    raise ConfigError(f"config key 'num_experts_per_tok' = {config.num_experts_per_tok} is more than "
                      f"num_experts = {config.num_experts}: a token cannot be routed to more experts than exist")
  if config.enable_checkpointing and config.checkpoint_period <= 0:
    raise ConfigError(f"config key 'checkpoint_period' = {config.checkpoint_period}: must be > 0 "
                      "(or enable_checkpointing=false)")
  check_output_directory(Path(config.base_output_directory))
  if run.fork.moe_block == "ours" and config.num_experts > 1:
    check_our_block(run, config)


def check_our_block(run: RunConfig, config: Any) -> None:
  """moe_block=ours on a model whose MoE our block cannot express (MaxText/moe/families.py): one line naming the
  key, never a silent fallback to upstream's block."""
  from MaxText.moe import families  # pylint: disable=import-outside-toplevel

  def origin(key: str) -> str:
    if key in run.explicit:
      return run.origins.get(key, "as set")
    return f"model_name {config.model_name}" if config.model_name != "default" else "upstream default"

  refused = families.refusals(config)
  if refused:
    key, value, why = refused[0]
    more = f" (also {', '.join(k for k, _, _ in refused[1:])})" if refused[1:] else ""
    raise ConfigError(f"config key '{key}' = {value!r} ({origin(key)}): moe_block=ours cannot run it: {why}{more}; "
                      "use moe_block=upstream for this model")
  if run.fork.moe_fp8 != "none" and config.mlp_bias:
    raise ConfigError(f"config keys 'moe_fp8' = {run.fork.moe_fp8!r} and 'mlp_bias' = True ({origin('mlp_bias')}) "
                      "contradict each other: the FP8 experts have no expert biases; use moe_fp8=none")


def _writable(directory: Path) -> bool:
  """By trying (os.access says yes to root even on a read-only mount); leaves nothing behind."""
  try:
    with tempfile.TemporaryFile(dir=directory):
      return True
  except OSError:
    return False


def check_output_directory(base: Path) -> None:
  """base_output_directory: writable, and (when missing) with an existing parent.

  A missing directory is created, as upstream does, but only under an existing
  parent: a mistyped mount point (/mnt/lustr/...) must not silently become a
  directory tree on the node's local disk.
  """
  if base.is_dir():
    if not _writable(base):
      raise ConfigError(f"config key 'base_output_directory' = '{base}': not writable here")
    return
  if base.exists():
    raise ConfigError(f"config key 'base_output_directory' = '{base}': exists and is not a directory")
  if not base.parent.is_dir():
    raise ConfigError(f"config key 'base_output_directory' = '{base}': neither it nor its parent '{base.parent}' "
                      "exists; create it, or fix the path")
  if not _writable(base.parent):
    raise ConfigError(f"config key 'base_output_directory' = '{base}': does not exist, and its parent "
                      f"'{base.parent}' is not writable here")


def check_devices(run: RunConfig, config: Any) -> None:
  """The hardware key and the global batch against the devices jax found (needs a backend)."""
  import jax  # pylint: disable=import-outside-toplevel

  backend = jax.default_backend()
  hardware = str(config.hardware)
  wants = "gpu" if hardware.startswith("gpu") else hardware
  if wants != backend:
    raise ConfigError(f"config key 'hardware' = '{hardware}' ({_origin(run, 'hardware')}), but jax found "
                      f"{jax.device_count()} {backend.upper()} device(s) here; set hardware={backend} or run "
                      f"on a {wants.upper()} machine")
  global_batch = config.per_device_batch_size * jax.device_count()
  if global_batch < 1 or global_batch != int(global_batch):
    raise ConfigError(f"config key 'per_device_batch_size' = {config.per_device_batch_size}: times the "
                      f"{jax.device_count()} device(s) gives a global batch of {global_batch:g}, which must be a "
                      "whole number >= 1")
  if run.fork.moe_fp8 != "none" and backend == "gpu":
    why = fp8_gpu_refusal(str(getattr(jax.devices()[0], "compute_capability", "")))
    if why:
      raise ConfigError(f"config key 'moe_fp8' = {run.fork.moe_fp8!r} ({_origin(run, 'moe_fp8')}): {why}")
  if run.fork.moe_block == "te" and (jax.process_count() < 2 or jax.local_device_count() != 1):
    # Upstream's te_moe_block bootstraps TE's NCCL EP before the first step. TE refuses a world of one
    # process, and upstream refuses more than one GPU per process; both end in a traceback (measured on
    # the H200: ep_bootstrap's ValueError, then upstream's TE context masks it with a RuntimeError).
    raise ConfigError(f"config key 'moe_block' = 'te' runs TE's MoE block, whose NCCL EP needs >= 2 processes "
                      f"with one GPU each; this run has {jax.process_count()} process(es) with "
                      f"{jax.local_device_count()} device(s) each: launch one process per GPU "
                      "(scripts/launch_local.sh -n N), or use moe_block=ours")
