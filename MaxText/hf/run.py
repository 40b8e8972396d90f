"""A run directory's model config (what export needs), rebuilt from the run's own record of it.

The trainer writes `<run>/maxtext-moe/effective_config.json` (MaxText/run/loop.py's write_run_files): our keys and every
upstream key that differs from upstream's base.yml. Upstream's pyconfig resolves them (model_name's file, derived
widths) exactly as the run did, on this machine's CPU: the model's shape does not depend on where it trained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from MaxText import config as fork_config
from MaxText.hf.errors import BadInput

# Keys that name the machine the run trained on, not the model: reading the config here must not need it.
ON_THIS_MACHINE = {"hardware": "cpu", "skip_jax_distributed_system": True, "num_slices": 1,
                   "compile_topology": "", "compile_topology_num_slices": -1}


def on_this_machine(run: fork_config.RunConfig) -> fork_config.RunConfig:
  return dataclasses.replace(run, upstream={**run.upstream, **ON_THIS_MACHINE})


def load(run_dir: Path) -> fork_config.RunConfig:
  path = run_dir / "maxtext-moe" / "effective_config.json"
  try:
    effective = json.loads(path.read_text())
    upstream = {**effective["upstream_overrides"], **ON_THIS_MACHINE}
    return fork_config.RunConfig(config_path=Path(effective["config_path"]),
                                 fork=fork_config.ForkConfig(**effective["fork"]), upstream=upstream,
                                 explicit=frozenset(upstream))
  except FileNotFoundError:
    raise BadInput(f"{path} is missing: {run_dir} is not a run directory written by MaxText.train") from None
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise BadInput(f"{path} cannot be read: {' '.join(str(e).split())[:160]}") from None


@contextlib.contextmanager
def _quiet():
  """Upstream logs its whole config through absl while it resolves it."""
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.WARNING)
  try:
    yield
  finally:
    absl.setLevel(level)


def upstream_config(run: fork_config.RunConfig) -> Any:
  """Upstream's resolved config (pyconfig.HyperParameters) for the run's keys."""
  os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # local-first, as MaxText.train
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  with _quiet():
    try:
      return pyconfig.initialize(run.upstream_argv())
    except (ValueError, TypeError, KeyError, AssertionError) as e:
      raise BadInput(f"upstream refuses the run's config: {' '.join(str(e).split())[:200]}") from None
