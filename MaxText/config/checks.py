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
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pydantic

from MaxText.config import ConfigError, RunConfig, upstream_fields

# The kernels upstream's attention_op.py (0.2.5) dispatches on; anything else
# raises ValueError only when the model is traced.
ATTENTION_KERNELS = ("autoselected", "dot_product", "flash", "cudnn_flash_te", "cudnn_flash_jax", "paged",
                     "vllm_rpa", "vllm_batched_rpa")

# Keys that must be > 0 (upstream types them as plain ints / numbers). log_period: its metric logger takes
# the step modulo it (a ZeroDivisionError after the first checkpoint).
POSITIVE = ("per_device_batch_size", "vocab_size", "max_target_length", "base_emb_dim", "base_num_decoder_layers",
            "base_num_query_heads", "base_num_kv_heads", "log_period")

# Step counts the optimizer's int32 step counter must hold (optax's count, the schedules' step).
INT32_STEPS = ("steps", "learning_rate_schedule_steps", "checkpoint_period", "log_period")
INT32_MAX = 2**31 - 1

# Upstream 0.2.5 types these as plain strings and dispatches on them only when the model is traced or the
# input pipeline is built, after the run directory exists (an AssertionError for remat_policy=nosuch).
# remat_policy: layers/nnx_decoders.py get_remat_policy.
REMAT_POLICIES = ("none", "full", "minimal", "minimal_with_context", "minimal_flash", "minimal_with_quantization",
                  "minimal_with_context_and_quantization", "save_dot_with_context_except_mlp",
                  "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "qkv_proj_offloaded",
                  "minimal_offloaded", "custom", "save_out_proj")


def _origin(run: RunConfig, key: str) -> str:
  return "as set" if key in run.explicit else "upstream default"


def _origin_of(run: RunConfig, key: str) -> str:
  return run.origins.get(key, "as set")


def check_fork(run: RunConfig) -> None:
  """Our keys against this machine, before patches apply (routed_moe would refuse with a RuntimeError)."""
  if run.fork.moe_block == "te" and importlib.util.find_spec("transformer_engine") is None:
    raise ConfigError("config key 'moe_block' = 'te' needs Transformer Engine, which is not installed: "
                      "pip install 'maxtext-moe[te]' on a CUDA machine, or use moe_block=ours")


def fp8_gpu_refusal(compute_capability: str, recipe: str = "blockwise", te_missing: str | None = None) -> str | None:
  """Why moe_fp8=`recipe` cannot run on a GPU of this compute capability, or None. blockwise: our sm_90a e4m3 wgmma
  kernels. mxfp8: Transformer Engine's grouped GEMM on Blackwell's block-scaled tensor cores; te_missing: why TE
  cannot be used here (None: it can)."""
  major, _, minor = compute_capability.partition(".")
  name = f"this GPU (compute capability {compute_capability or 'unknown'})"
  if recipe == "mxfp8":
    if not major.isdigit() or int(major) < 10:
      return (f"{name} has no MXFP8 tensor cores (Blackwell, compute capability 10.x, is needed); use "
              "moe_fp8=blockwise on Hopper or moe_fp8=none")
    return f"MXFP8 experts run Transformer Engine's grouped GEMM: {te_missing}; or use moe_fp8=none" if te_missing else None
  if major == "9":
    return None
  if not major.isdigit() or (int(major), int(minor or 0)) < (8, 9):
    return f"{name} has no FP8 tensor cores (Hopper, compute capability 9.x, is needed); use moe_fp8=none"
  if int(major) == 8:
    return (f"{name} has FP8 tensor cores, but our blockwise kernel is written for Hopper's wgmma (sm_90a); "
            "use moe_fp8=none")
  return (f"{name} is past Hopper: our blockwise kernel is sm_90a-only, and Blackwell's FP8 path is Transformer "
          "Engine's MXFP8: use moe_fp8=mxfp8 or moe_fp8=none")


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
  chunks, tokens = run.fork.moe_ep_overlap_chunks, config.per_device_batch_size * config.max_target_length
  if chunks > 1 and (tokens != int(tokens) or int(tokens) % chunks):
    # A shard's tokens are the device's or a multiple of them (routed_moe splits them over token axes only).
    raise ConfigError(f"config key 'moe_ep_overlap_chunks' = {chunks} ({_origin(run, 'moe_ep_overlap_chunks')}): "
                      f"must divide the tokens per device, per_device_batch_size x max_target_length = {tokens:g}")
  if config.enable_checkpointing and config.checkpoint_period <= 0:
    raise ConfigError(f"config key 'checkpoint_period' = {config.checkpoint_period}: must be > 0 "
                      "(or enable_checkpointing=false)")
  for key in INT32_STEPS:
    if getattr(config, key, 0) > INT32_MAX:
      raise ConfigError(f"config key '{key}' = {getattr(config, key)} ({_origin(run, key)}): more than "
                        f"{INT32_MAX}, the most the optimizer's int32 step counter holds")
  dataset_type = str(getattr(config.dataset_type, "value", config.dataset_type))  # upstream's enum, or its string
  if "data_exhausted" in run.explicit and dataset_type != "grain":
    why = ("synthetic data never runs out" if dataset_type == "synthetic" else
           f"upstream's {dataset_type} iterator ends the run its own way when its data runs out")
    raise ConfigError(f"config key 'data_exhausted' = {run.fork.data_exhausted!r} ({_origin_of(run, 'data_exhausted')})"
                      f" applies to grain data only, and dataset_type is {dataset_type!r}: {why}; leave "
                      "data_exhausted unset, or use dataset_type=grain")
  check_schedule(run, config)
  _check_choices(run, config)
  check_remat_names(run, config)
  check_run_name(str(config.run_name), Path(config.base_output_directory))
  check_pipeline(run, config)
  check_output_directory(Path(config.base_output_directory))
  check_run_directory(Path(config.base_output_directory) / str(config.run_name))
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


def upstream_error(run: RunConfig, e: Exception) -> ConfigError:
  """An exception from upstream's validation as one line naming the key.

  A pydantic field error names its key in `loc`. A model validator's (loc empty) names none: the key is
  a field its message names, else the keys the run sets away from upstream's default whose name shares
  two words with the message ("DCN parallelism ..." -> dcn_fsdp_parallelism).
  """
  if not isinstance(e, pydantic.ValidationError):
    return ConfigError(f"rejected by upstream MaxText: {' '.join(str(e).split())[:400]}")
  err = e.errors()[0]
  message = " ".join(str(err["msg"]).removeprefix("Value error, ").split())[:400]
  fields = [str(part) for part in err["loc"] if isinstance(part, str)]
  keys = fields[-1:] or _keys_named_in(run, message)
  if not keys:
    return ConfigError(f"rejected by upstream MaxText's validation (it names no key; --print-config shows every "
                       f"value): {message}")
  named = ", ".join(f"'{k}' = {run.upstream[k]!r} ({run.origins.get(k, 'maxtext-moe default')})"
                    if k in run.upstream else f"'{k}'" for k in keys)
  return ConfigError(f"config key{'s' if len(keys) > 1 else ''} {named}: rejected by upstream MaxText: {message}")


def _keys_named_in(run: RunConfig, message: str) -> list[str]:
  """At most three keys: fields the message spells out (a one-word field only if the run sets it), else
  the run's non-default keys that share two words with it."""
  fields = upstream_fields()
  words = set(re.findall(r"[a-z0-9]+", message.lower()))
  named = [k for k in fields if ("_" in k or k in run.upstream)
           and re.search(rf"(?<![A-Za-z0-9_]){re.escape(k)}(?![A-Za-z0-9_])", message)]
  if not named:
    named = [k for k, v in run.upstream.items() if k in fields and v != fields[k].default
             and len(set(k.split("_")) & words) >= 2]
  return named[:3]


def check_pipeline(run: RunConfig, config: Any) -> None:
  """Pipeline settings that would fail deep in jax, or train MoE layers wrong without a word (patches/pipeline_v3.py)."""
  if not config.using_pipeline_parallelism:
    return
  # attention=cudnn_flash_jax with MLA's unequal head sizes runs in the stages: patches/cudnn_mla_vmap.py.
  if config.num_experts <= 1:
    return
  if config.pipeline_fsdp_ag_per_repeat:
    where = _origin(run, "pipeline_fsdp_ag_per_repeat")
    raise ConfigError(f"config key 'pipeline_fsdp_ag_per_repeat' = True ({where}): "
                      "upstream 0.2.5's prefetching circular pipeline drops what the MoE layers sow (load-balance "
                      "loss, routing-bias counts); leave it false (pipeline_fsdp_ag_once gathers the weights once)")
  outside = config.num_decoder_layers - config.first_num_dense_layers - config.pipeline_parallel_layers
  if (config.decoder_block.value == "deepseek" and outside > 0 and run.fork.moe_block != "ours"
      and config.routed_bias and config.routed_bias_update_rate > 0):
    # Measured on 8 CPU devices: those layers' biases differ from one device's after the first step.
    raise ConfigError(f"config key 'pipeline_parallel_layers' = {config.pipeline_parallel_layers} "
                      f"({_origin(run, 'pipeline_parallel_layers')}) leaves {outside} MoE layers before the pipeline, "
                      "where upstream's block counts only a stage's share of the batch for the routing-bias update "
                      "(its batch axes leave out 'stage', moe.py ~491); use moe_block=ours or pipeline every MoE layer")


def _writable(directory: Path) -> bool:
  """By trying (os.access says yes to root even on a read-only mount); leaves nothing behind."""
  return _write_error(directory) is None


def _write_error(directory: Path) -> str | None:
  """Why a file cannot be created in `directory` (the OS's words); None when one can."""
  try:
    with tempfile.TemporaryFile(dir=directory):
      return None
  except OSError as e:
    return e.strerror or str(e)


RUN_ENTRIES = ("checkpoints", "maxtext-moe", "tensorboard")  # the folders a run writes in, inside its directory


def check_run_directory(run_dir: Path) -> None:
  """An existing run directory, and the folders a run writes in there: each where it points, a directory, and
  writable. A dangling symlink (a scratch disk not mounted) ended in orbax's FileExistsError traceback after the
  compile; a read-only one was reported as a full disk."""
  key = f"config key 'run_name' = '{run_dir.name}'"
  for path in (run_dir, *(run_dir / name for name in RUN_ENTRIES)):
    if path.is_symlink() and not path.exists():
      raise ConfigError(f"{key}: {path} is a symbolic link to '{os.readlink(path)}', which does not exist (a disk "
                        "not mounted?); mount it, or remove the link")
    if path.exists() and not path.is_dir():
      raise ConfigError(f"{key}: {path} exists and is not a directory")
    if path.is_dir() and (why := _write_error(path)) is not None:
      raise ConfigError(f"{key}: {path} cannot be written here ({why}); make it writable, or pick another run_name")


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
    te_missing = None
    if run.fork.moe_fp8 == "mxfp8":
      from MaxText.moe.gmm import te  # pylint: disable=import-outside-toplevel
      te_missing = te.unavailable_reason()
    why = fp8_gpu_refusal(str(getattr(jax.devices()[0], "compute_capability", "")), run.fork.moe_fp8, te_missing)
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


def _check_choices(run: RunConfig, config: Any) -> None:
  """Upstream's string keys that name one of a few choices."""
  policy = config.remat_policy
  if policy and policy not in REMAT_POLICIES:
    raise ConfigError(f"config key 'remat_policy' = {policy!r} ({_origin(run, 'remat_policy')}): not a remat "
                      f"policy upstream MaxText knows; one of {', '.join(REMAT_POLICIES)}")
  import jax  # pylint: disable=import-outside-toplevel

  # Activation names upstream turns into functions (layers/linears.py _convert_to_activation_function).
  named = [("routed_score_func", config.routed_score_func)] + [("mlp_activations", a) for a in config.mlp_activations]
  for key, name in named:
    if name and name not in ("linear", "sqrtsoftplus") and not callable(getattr(jax.nn, str(name), None)):
      raise ConfigError(f"config key '{key}' names {name!r} ({_origin(run, key)}): not an activation upstream "
                        "MaxText knows: linear, sqrtsoftplus, or a jax.nn function (sigmoid, softmax, silu, ...)")


def check_schedule(run: RunConfig, config: Any) -> None:
  """The learning rate and its schedule's length. Upstream takes `learning_rate: .inf` to the first step (after
  the compile) and `learning_rate_schedule_steps: 0` to a schedule that is 0 from step 0 on (warm-up and decay
  over no steps), a run that trains nothing and says nothing; -1 means `steps`."""
  import math  # pylint: disable=import-outside-toplevel

  rate = config.learning_rate
  if not math.isfinite(rate) or rate < 0:
    raise ConfigError(f"config key 'learning_rate' = {rate!r} ({_origin(run, 'learning_rate')}): must be a finite "
                      "number >= 0")
  length = config.learning_rate_schedule_steps
  if length == 0 or length < -1:
    raise ConfigError(f"config key 'learning_rate_schedule_steps' = {length} ({_origin(run, 'learning_rate_schedule_steps')})"
                      ": must be > 0, or -1 for `steps`; at 0 the learning rate is 0 from the first step on")


def check_remat_names(run: RunConfig, config: Any) -> None:
  """A remat location (`moe_mlpwi_0: offload`, ...) is read only by remat_policy=custom: under any other policy
  the key is accepted and does nothing, so an offload the user asked for silently never happens."""
  if config.remat_policy == "custom":
    return
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  for key, field in types.RematAndOffload.model_fields.items():
    value = getattr(config, key, None)
    if key in run.explicit and isinstance(value, types.RematLocation) and value != field.default:
      raise ConfigError(f"config key '{key}' = {value.value!r} ({run.origins.get(key, 'as set')}) does nothing under "
                        f"remat_policy = {config.remat_policy!r}: only remat_policy=custom reads remat locations "
                        "(or xla_presets=[host_offload], which sets it)")


def check_run_name(run_name: str, base: Path) -> None:
  """run_name: one directory name inside base_output_directory, one the filesystem takes."""
  if run_name in ("", ".", "..") or "/" in run_name or "\\" in run_name or "\0" in run_name:
    raise ConfigError(f"config key 'run_name' = {run_name!r}: must be one directory name inside "
                      f"base_output_directory ({base}), without '/' and not '.' or '..'")

  probe = base if base.is_dir() else base.parent
  try:
    longest = os.pathconf(probe, "PC_NAME_MAX")
  except (OSError, ValueError):
    longest = 255
  if len(run_name.encode()) > longest:
    raise ConfigError(f"config key 'run_name' = '{run_name[:24]}...' is {len(run_name.encode())} bytes long; the "
                      f"filesystem of base_output_directory ({base}) takes names of at most {longest} bytes")


def check_backends(run: RunConfig) -> None:
  """Our MoE backends named in the config against this machine (after the jax backend started): else the
  first trace of the block fails with BackendUnavailable."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.moe import dispatch, gmm  # pylint: disable=import-outside-toplevel

  platform = jax.default_backend()
  name = run.fork.moe_gmm_backend
  if name not in ("upstream", "auto") and (why := gmm.unavailable_reason(name)):
    raise ConfigError(f"config key 'moe_gmm_backend' = {name!r} ({_origin(run, 'moe_gmm_backend')}) cannot run "
                      f"on this {platform.upper()} machine: {why}")
  name = run.fork.moe_dispatch_backend
  if run.fork.moe_block == "ours" and name != "auto" and (why := dispatch.unavailable_reason(name)):
    raise ConfigError(f"config key 'moe_dispatch_backend' = {name!r} ({_origin(run, 'moe_dispatch_backend')}) "
                      f"cannot run on this {platform.upper()} machine: {why}")


def backend_failure(e: BaseException) -> ConfigError | None:
  """jax failing to start its backend (JAX_PLATFORMS=cuda without a GPU is an AssertionError with no
  message inside xla_bridge) as one line naming the environment; None for any other error."""
  import traceback  # pylint: disable=import-outside-toplevel

  frames = traceback.extract_tb(e.__traceback__)
  if not any(f.filename.endswith(os.path.join("jax", "_src", "xla_bridge.py")) for f in frames):
    return None
  platforms = os.environ.get("JAX_PLATFORMS", "")
  said = " ".join(str(e).split())[:200] or "no backend came up"
  if platforms:
    return ConfigError(f"environment JAX_PLATFORMS={platforms!r}: jax cannot start that platform here ({said}); "
                       "unset JAX_PLATFORMS, or run where it exists (a GPU needs jax[cuda13])")
  return ConfigError(f"jax could not start a backend here: {said}")

