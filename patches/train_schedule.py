"""Seam: maxtext.trainers.pre_train.train.train_step (maxtext 0.2.5) -> two token-count switches of DeepSeek-V3.

Upstream's routing-bias update rate and MTP loss weight are constants for the whole run. V3
(arXiv 2412.19437 §4.2) changes both once, by tokens trained:
  - moe_bias_update_stop_tokens: the bias-update speed gamma goes from routed_bias_update_rate to
    0 (V3: 0.001 for the first 14.3T tokens, then 0);
  - mtp_loss_switch_tokens: the MTP loss weight goes from mtp_loss_scaling_factor to
    mtp_loss_scaling_factor_late (V3: 0.3 for the first 10T tokens, then 0.1).

train_loop jits `train_step` looked up in the module at call time (train.py ~1189), so a wrapper
bound there runs inside the jitted step, where the step number (the optimizer's count) is a
traced value: no recompile at the switch. Tokens map to a step index once, at trace time, from
upstream's own batch schedule (utils/rampup_batch.py RampupBatchManager under
enable_rampup_batch_size): a switch at N tokens acts from the first step whose preceding steps
have consumed >= N tokens.

The bias: upstream's step adds its update to the MoEBiasVar (~640-670); after the stop step the
wrapper keeps the bias it was given, so the update is exactly 0. The MTP weight: upstream
multiplies by `config.mtp_loss_scaling_factor` in calculate_mtp_loss, its only reader; the
wrapper hands train_step a view of the config whose value is that traced choice.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from MaxText.console.progress import log as _log
from patches import _config_view
from patches._seam import Seam

SEAM = Seam(
    name="train_schedule",
    module="maxtext.trainers.pre_train.train",
    attr="train_step",
    sha256="e68464f0c15a65b7",
)


def step_at_tokens(config, tokens: int) -> int:
  """Index of the first step that starts with >= `tokens` tokens consumed before it."""
  seq = int(config.max_target_length)
  if not config.enable_rampup_batch_size:
    return math.ceil(tokens / (int(config.global_batch_size_to_train_on) * seq))
  from maxtext.utils import rampup_batch  # pylint: disable=import-outside-toplevel

  ramp = rampup_batch.RampupBatchManager(config, -1)
  seen, step, ramping = 0, 0, True
  while seen < tokens and ramping:
    seen += ramp.global_batch_size_current * seq
    ramping = ramp.update()
    step += 1
  return step + max(0, math.ceil((tokens - seen) / (ramp.global_batch_size_end * seq)))


def _is_gate_bias(path) -> bool:
  names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  return "gate" in names and "bias" in names[names.index("gate"):]


def _diagnose_kept_bias(scalars: dict, new_state, keep_update) -> None:
  """log_step_diagnostics' bias scalars (train.py ~439) for the bias this step keeps, not the one it discarded."""
  if "diag/moe_bias_checksum" not in scalars:
    return
  biases = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(new_state) if _is_gate_bias(path)]
  scalars["diag/moe_bias_checksum"] = sum(jnp.sum(b.astype(jnp.float32)) for b in biases)
  scalars["diag/moe_bias_update_nonzero"] = jnp.where(keep_update, scalars["diag/moe_bias_update_nonzero"], 0.0)


def _wrap(train_step, settings: dict):
  @functools.wraps(train_step)
  def step_fn(model, config, state_mesh_shardings, params_shardings, state, data, dropout_rng=None):
    step = state["optimizer"]["step"]
    step = getattr(step, "value", step)
    if settings["mtp_switch_tokens"] is not None:
      at = step_at_tokens(config, settings["mtp_switch_tokens"])
      _log(f"MTP loss weight {config.mtp_loss_scaling_factor} -> {settings['mtp_late']} from step {at} "
           f"({settings['mtp_switch_tokens']:,} tokens)")
      weight = jnp.where(step < at, config.mtp_loss_scaling_factor, settings["mtp_late"]).astype(jnp.float32)
      config_in = _config_view.view(config, mtp_loss_scaling_factor=weight)
    else:
      config_in = config
    # The bias before the step, by path: train_step merges `state` into modules and updates their
    # variables in place, so the leaves of `state` itself read the updated bias afterwards.
    bias_before = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)
                   if _is_gate_bias(path)}
    new_state, metrics = train_step(model, config_in, state_mesh_shardings, params_shardings, state, data,
                                    dropout_rng)
    if settings["bias_stop_tokens"] is not None:
      stop = step_at_tokens(config, settings["bias_stop_tokens"])
      _log(f"routing-bias update rate {config.routed_bias_update_rate} -> 0 from step {stop} "
           f"({settings['bias_stop_tokens']:,} tokens)")
      keep_update = step < stop
      new_state = jax.tree_util.tree_map_with_path(
          lambda path, new: jnp.where(keep_update, new, bias_before[jax.tree_util.keystr(path)])
          if _is_gate_bias(path) else new, new_state)
      _diagnose_kept_bias(metrics["scalar"], new_state, keep_update)
    return new_state, metrics

  return step_fn


def settings_from(fork) -> dict:
  return {"bias_stop_tokens": fork.moe_bias_update_stop_tokens, "mtp_switch_tokens": fork.mtp_loss_switch_tokens,
          "mtp_late": fork.mtp_loss_scaling_factor_late}


def wanted(fork) -> bool:
  return fork.moe_bias_update_stop_tokens is not None or fork.mtp_loss_switch_tokens is not None


def apply(fork, hooks=None) -> None:  # pylint: disable=unused-argument
  _config_view.SEAM.check()
  settings = settings_from(fork)
  SEAM.apply(lambda train_step: _wrap(train_step, settings))
