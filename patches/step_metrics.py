"""Seam: maxtext.utils.train_utils.jit_train_and_eval_step (maxtext 0.2.5).

Upstream's training loop builds its train steps (normal, dropless, first
phase) through this function and calls them as `state, metrics = p(state,
batch)`. We wrap the returned train step so that each call's scalar metrics
(device arrays: nothing is synced) are kept as "the latest step's". The
checkpoint guard (patches/checkpoint_guard.py) reads them only when it refuses
a non-finite state, to name that step's loss and gradient norm; upstream's
metric logger sees them a step later. Everything else (`.lower`, attributes)
passes through to upstream's jitted function.

With moe_a2a_padded_on_overflow=error, a step whose scalars carry the MoE
overflow scalar (MaxText/moe/overflow.py: only when a layer traced a bounded
dispatch) is waited for here and, if any buffer overflowed, stops the run
(DispatchOverflow) before upstream's loop saves or logs that step.
"""

from __future__ import annotations

from typing import Any

from patches._seam import Seam

SEAM = Seam(
    name="step_metrics",
    module="maxtext.utils.train_utils",
    attr="jit_train_and_eval_step",
    sha256="9eaff973276c17aa",
)

_latest: dict[str, Any] = {}
_fork: list[Any] = [None]  # the run's ForkConfig: what the overflow message names


def latest_scalars() -> dict[str, Any]:
  """The last train step's scalars, fetched to the host now (call only when needed)."""
  import jax  # pylint: disable=import-outside-toplevel

  return {k: v for k, v in jax.device_get(_latest).items()} if _latest else {}


class _KeepsMetrics:
  """A train step that remembers its scalar metrics; otherwise the jitted function itself."""

  def __init__(self, jitted):
    self._jitted = jitted

  def __call__(self, *args, **kwargs):
    state, metrics = self._jitted(*args, **kwargs)
    _latest.clear()
    _latest.update((metrics or {}).get("scalar", {}))
    _stop_on_overflow(state)
    return state, metrics

  def __getattr__(self, name):
    return getattr(self._jitted, name)


def _stop_on_overflow(state) -> None:
  from MaxText.moe import overflow  # pylint: disable=import-outside-toplevel

  fork = _fork[0]
  if fork is None or not overflow.checked(fork) or overflow.SCALAR not in _latest:
    return
  import jax  # pylint: disable=import-outside-toplevel

  if float(jax.device_get(_latest[overflow.SCALAR])) > 0:  # waits for the step: one scalar, once per step
    from patches import routed_moe  # pylint: disable=import-outside-toplevel

    traced = tuple(b for b in routed_moe.call_counts() if b in routed_moe.BOUNDED)
    raise overflow.DispatchOverflow(overflow.message(fork, latest_scalars(), _step_of(state), traced))


def _step_of(state) -> int | None:
  """The step just trained: the optimizer's count after it, less one (None where the state has no such count)."""
  try:
    import jax  # pylint: disable=import-outside-toplevel

    return int(jax.device_get(state["optimizer"]["step"].get_value())) - 1
  except Exception:  # pylint: disable=broad-exception-caught
    return None


def _wrap(original):
  def jit_train_and_eval_step(*args, **kwargs):
    p_train_step, p_eval_step = original(*args, **kwargs)
    return _KeepsMetrics(p_train_step), p_eval_step

  jit_train_and_eval_step.__wrapped__ = original
  return jit_train_and_eval_step


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  _fork[0] = fork
  SEAM.apply(_wrap)


def undo() -> None:
  _fork[0] = None
  _latest.clear()
  SEAM.undo()
