"""Lowers upstream MaxText's train step for a config, for CUDA, on a CPU machine.

  python tests/lower_train_step.py <config.yml> [key=value ...]   -> StableHLO text on stdout

Used by tests/test_offload.py: the host-offload preset must reach the program
upstream compiles (memory-placement annotations on the offloaded activations).
jax lowers for a platform it has no device for (`lowering_platforms`), so the
GPU program's annotations can be read without a GPU; nothing is compiled.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def lowered_train_step(args: list[str]) -> str:
  import jax  # pylint: disable=import-outside-toplevel
  from flax.core.spmd import logical_axis_rules as axis_rules  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  from MaxText.config import environment  # pylint: disable=import-outside-toplevel
  from MaxText.plan import aot  # pylint: disable=import-outside-toplevel
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel

  prepared = environment.prepare_environment(fork_config.load(args))
  config = aot.start_upstream(prepared.run)
  mesh = maxtext_utils.get_mesh_from_config(config, jax.devices())
  step = aot.train_step(config, mesh)
  with jax.set_mesh(mesh), axis_rules(config.logical_axis_rules):
    jitted = jax.jit(step.func, in_shardings=step.in_shardings, out_shardings=step.out_shardings,
                     static_argnums=step.static_argnums, donate_argnums=step.donate_argnums)
    traced = jitted.trace(*step.args, **step.kwargs)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


if __name__ == "__main__":
  sys.stdout.write(lowered_train_step(sys.argv[1:]))
