"""What a bounded MoE dispatch buffer's overflow does to a run (moe_a2a_padded_on_overflow).

a2a_padded, hierarchical and ragged_a2a move rows through buffers of a fixed capacity (their capacity factors;
the EP size never overflows). A buffer sent more rows than it holds sends only the first ones: the rows past it
are dropped. Each shard flags that on the device (no host callback, no collective); each MoE layer sows its
shards' flags unreduced as `moe_has_overflow`, and the train step reduces them once, into one scalar
(patches/moe_metrics.py). Then, by moe_a2a_padded_on_overflow:

  error  (default) the host reads that scalar right after each train step, before anything saves or logs the
         step, and stops the run with one line and exit code 8 (MaxText/config/command_line.py): the step that dropped
         rows is never saved. The host waits for each step to finish before queuing the next, as upstream's own
         dropless fallback does; only when a layer traced a bounded buffer.
  flag   only with upstream's moe_dropless_fallback=step: upstream rolls the step's update back in the step
         and replays it with its dropless program, in which our block's buffers hold the EP size (capacity
         factor = EP size: none can overflow; patches/routed_moe.py reads upstream's `force_dropless`). So
         every step trains on every token. `flag` without the fallback would drop rows with only a flag, and
         the fallback with `error` would stop the run before the replay: both are config errors.

Upstream validates moe_dropless_fallback=step against keys of its own block (use_ring_of_experts,
use_ragged_sort, ragged_buffer_factor > 0); our block never reads them, so under moe_block=ours they are set
for that check where the config leaves them at upstream's defaults (--print-config names why).
"""

from __future__ import annotations

from typing import Any

SCALAR = "moe/dispatch_overflow"  # the step's reduction of every layer's flags: 1.0 if any buffer overflowed
CAPACITY_KEYS = {"a2a_padded": "moe_a2a_padded_capacity_factor", "hierarchical": "moe_hierarchical_capacity_factor",
                 "ragged_a2a": "moe_ragged_a2a_capacity_factor"}
# What upstream's check of moe_dropless_fallback=step asks of its own block (configs/types.py
# validate_moe_dropless_fallback), which moe_block=ours never runs.
FALLBACK_VALIDATION_KEYS = {"use_ring_of_experts": True, "use_ragged_sort": True, "ragged_buffer_factor": 1.0}


class DispatchOverflow(RuntimeError):
  """A bounded MoE dispatch buffer dropped rows in the step just trained (moe_a2a_padded_on_overflow=error)."""


def checked(fork) -> bool:
  """Whether the train step must carry the overflow scalar for the host to stop the run."""
  return fork.moe_block == "ours" and fork.moe_a2a_padded_on_overflow == "error"


def upstream_keys(fork, upstream: dict[str, Any], origins: dict[str, str]) -> tuple[str | None, dict[str, Any]]:
  """(what contradicts, in one line naming the keys, or None; upstream's keys with what its fallback's check
  needs). MaxText/config/loader.py raises the line as a config error."""
  fallback = upstream.get("moe_dropless_fallback")
  if fork.moe_block != "ours":
    return None, upstream
  mode = fork.moe_a2a_padded_on_overflow
  both = (f"config keys 'moe_a2a_padded_on_overflow' = {mode!r} ({origins.get('moe_a2a_padded_on_overflow', 'default')})"
          f" and 'moe_dropless_fallback' = {fallback!r} ({origins.get('moe_dropless_fallback', 'default')}): ")
  if fallback == "layer":
    return both + "our block has no in-layer fallback; use moe_dropless_fallback=step with flag", upstream
  if mode == "flag" and fallback != "step":
    return both + ("flag alone would drop the rows past a buffer's capacity with only a flag; add "
                   "moe_dropless_fallback=step (the step is replayed dropless) or use error (the run stops)"), upstream
  if fallback == "step" and mode != "flag":
    return both + "error stops the run at an overflow, before upstream's replay; set flag", upstream
  if fallback == "step" and fork.moe_dispatch_backend == "te_ncclep":
    return (f"config keys 'moe_dispatch_backend' = 'te_ncclep' ({origins.get('moe_dispatch_backend', 'default')}) "
            f"and 'moe_dropless_fallback' = 'step' ({origins.get('moe_dropless_fallback', 'default')}): TE's "
            "receive capacity is fixed when it is bootstrapped, so its replay could not be dropless; leave "
            "moe_te_ncclep_recv_capacity_per_rank unset (the dropless bound) and the fallback off"), upstream
  if fallback != "step":
    return None, upstream
  out = dict(upstream)
  for key, value in FALLBACK_VALIDATION_KEYS.items():
    if key not in origins:
      out[key] = value
      origins[key] = "set for moe_dropless_fallback=step: upstream checks it; moe_block=ours never reads it"
  return None, out


def message(fork, scalars: dict[str, Any], step: int | None, traced: tuple[str, ...] = ()) -> str:
  """One line: where rows were dropped and what to change. traced: the bounded dispatchers the layers ran
  (moe_dispatch_backend=auto resolves per platform)."""
  backend = traced[0] if len(traced) == 1 else fork.moe_dispatch_backend
  key = CAPACITY_KEYS.get(backend, "the dispatch's capacity factor")
  dropped = scalars.get("moe/dropped_tokens")
  fill = scalars.get("moe/capacity_used_pct")
  seen = (f": {float(dropped):g} token-expert rows past capacity, the fullest buffer at {float(fill):.0f}% of it"
          if dropped is not None and fill is not None else "")
  where = f"in step {step}" if step is not None else "in the step just trained"
  return (f"a bounded buffer of our block's {backend} dispatch was sent more rows than it holds {where}{seen}; "
          f"that step was not saved. Raise {key} (the EP size never overflows), or set "
          "moe_a2a_padded_on_overflow=flag with moe_dropless_fallback=step to replay such steps dropless")
