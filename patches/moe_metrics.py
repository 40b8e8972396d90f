"""Seams: maxtext.trainers.pre_train.train.train_step and .record_activation_metrics (maxtext 0.2.5).

Our block's layers, and upstream's (patches/routed_moe.py recomputes its routing
in the global view), sow small routing statistics (MaxText/moe/stats.py) as
intermediates. Upstream's train_step gathers the intermediates (`aux
["intermediate_outputs"]`, after the backward pass) but hands them to only one
function that may add metrics: `record_activation_metrics(metrics,
intermediate_outputs, config)` (train.py ~738), called when
`config.record_internal_nn_metrics`. So:

  - train_step gets a config view (patches/_config_view.py) with that flag on
    and a marker; the model keeps its own config, so its layers sow no extra
    activation statistics;
  - record_activation_metrics, under the marker, adds the `moe/` scalars and a
    top-level "moe_expert_counts_LE" array (upstream already carries vectors
    there, e.g. moe_required_rbf), then calls upstream's own only when the
    user's config asked for it;
  - with moe_a2a_padded_on_overflow=error, it also reduces every MoE layer's
    `moe_has_overflow` flags (our block sows them per shard, unreduced, only
    for a bounded dispatch) into one scalar, MaxText/moe/overflow.py's SCALAR, once per
    step; patches/step_metrics.py reads it right after the step.

Everything is computed inside the jitted step; nothing syncs. Which steps are
written is decided on the host (patches/metric_logger.py).
"""

from __future__ import annotations

import functools

from patches import _config_view
from patches._seam import Seam

SEAM = Seam(
    name="moe_metrics",
    module="maxtext.trainers.pre_train.train",
    attr="train_step",
    sha256="e68464f0c15a65b7",
)
SEAM_RECORD = Seam(
    name="moe_metrics record",
    module="maxtext.trainers.pre_train.train",
    attr="record_activation_metrics",
    sha256="06a340c8b174173a",
)

_MARKER = "_maxtext_moe_metrics_user_record"  # in the view: the user's record_internal_nn_metrics
_STATS = "_maxtext_moe_metrics_stats"  # in the view: the moe/ statistics are on
_OVERFLOW = "_maxtext_moe_metrics_overflow"  # in the view: the step carries the overflow scalar
COUNTS_KEY = "moe_expert_counts_LE"


def _gather(intermediate_outputs) -> dict | None:
  """The sown statistics, concatenated over layers (scanned blocks give one stacked leaf)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  from MaxText.moe import stats  # pylint: disable=import-outside-toplevel

  counts = maxtext_utils.collect_intermediates_by_suffix(intermediate_outputs, stats.COUNTS, ravel=False)
  if not counts:
    return None
  num_experts = counts[0].shape[-1]
  per = lambda name, width: jnp.concatenate([  # noqa: E731
      v.reshape(-1, width) for v in maxtext_utils.collect_intermediates_by_suffix(
          intermediate_outputs, name, ravel=False)])
  return {"counts_LE": jnp.concatenate([c.reshape(-1, num_experts) for c in counts]),
          "entropy_L": per(stats.ENTROPY, 1)[:, 0], "bias_L3": per(stats.BIAS, 3),
          "overflow_L": per(stats.OVERFLOW, 1)[:, 0], "buffer_L2": per(stats.BUFFER, 2)}


def _overflow_flags(intermediate_outputs):
  """float32 1.0 if any shard of any MoE layer flagged an overflow; None when no layer sowed a flag."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  flags = maxtext_utils.collect_intermediates_by_suffix(intermediate_outputs, "moe_has_overflow", ravel=False)
  if not flags:
    return None
  return jnp.any(jnp.concatenate([jnp.ravel(f) for f in flags])).astype(jnp.float32)


def _wrap_record(original):
  @functools.wraps(original)
  def record_activation_metrics(output_metrics, intermediate_outputs, config):
    flat = object.__getattribute__(config, "_flat_config")
    if _MARKER not in flat:
      return original(output_metrics, intermediate_outputs, config)
    from MaxText.moe import overflow  # pylint: disable=import-outside-toplevel
    from MaxText.moe import stats  # pylint: disable=import-outside-toplevel

    if flat[_OVERFLOW]:
      flags = _overflow_flags(intermediate_outputs)
      if flags is not None:  # a bounded dispatch in some layer: else nothing can overflow, and no scalar
        output_metrics["scalar"][overflow.SCALAR] = flags
    got = _gather(intermediate_outputs) if flat[_STATS] else None
    if got is not None:
      output_metrics["scalar"].update(stats.summarize(got["counts_LE"], got["entropy_L"], got["bias_L3"],
                                                      got["overflow_L"], got["buffer_L2"]))
      output_metrics[COUNTS_KEY] = got["counts_LE"]
    if flat[_MARKER]:
      return original(output_metrics, intermediate_outputs, config)
    return None

  return record_activation_metrics


def _wrap_step(train_step):
  @functools.wraps(train_step)
  def step_fn(model, config, *args, **kwargs):
    view = _config_view.view(config, record_internal_nn_metrics=True,
                             **{_MARKER: bool(getattr(config, "record_internal_nn_metrics", False)),
                                _STATS: _wanted["stats"], _OVERFLOW: _wanted["overflow"]})
    return train_step(model, view, *args, **kwargs)

  return step_fn


_wanted = {"stats": False, "overflow": False}


def _stats(fork) -> bool:
  return fork.moe_block in ("ours", "upstream") and fork.moe_metrics_every_n_steps > 0


def wanted(fork) -> bool:
  from MaxText.moe import overflow  # pylint: disable=import-outside-toplevel

  return _stats(fork) or overflow.checked(fork)


def apply(fork, hooks=None) -> None:  # pylint: disable=unused-argument
  from MaxText.moe import overflow  # pylint: disable=import-outside-toplevel

  _wanted.update(stats=_stats(fork), overflow=overflow.checked(fork))
  _config_view.SEAM.check()
  SEAM_RECORD.check()
  SEAM.apply(_wrap_step)
  SEAM_RECORD.apply(_wrap_record)


def undo() -> None:
  _wanted.update(stats=False, overflow=False)
  SEAM_RECORD.undo()
  SEAM.undo()
