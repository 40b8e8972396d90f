"""Lowers upstream MaxText's train step for a config, for CUDA, on a CPU machine.

  python tests/lower_train_step.py <config.yml> [key=value ...]   -> StableHLO text on stdout

Used by tests/test_offload.py: the host-offload preset must reach the program
upstream compiles (memory-placement annotations on the offloaded activations).
jax lowers for a platform it has no device for (`lowering_platforms`), so the
GPU program's annotations can be read without a GPU; nothing is compiled.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def lowered_train_step(args: list[str]) -> str:
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train as upstream_train  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train_compile  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, sharding  # pylint: disable=import-outside-toplevel
  from flax.core.spmd import logical_axis_rules as axis_rules  # pylint: disable=import-outside-toplevel

  import patches  # pylint: disable=import-outside-toplevel
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText import train, xla_presets  # pylint: disable=import-outside-toplevel

  run = fork_config.load(args)
  composed = xla_presets.compose_for(run, dict(os.environ))
  run = xla_presets.with_upstream_defaults(run, composed)
  os.environ.update(train.run_environment(run, dict(os.environ), composed))
  patches.apply_all(run.fork)
  config = pyconfig.initialize(run.upstream_argv())
  mesh = maxtext_utils.get_mesh_from_config(config, jax.devices())
  shaped_args, shaped_kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
  in_state = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  func, in_shard, out_shard, static_argnums, donate_argnums = maxtext_utils.get_functional_train_with_signature(
      upstream_train.train_step, data_sharding, in_state, model, config, params_shardings
  )
  with jax.set_mesh(mesh), axis_rules(config.logical_axis_rules):
    jitted = jax.jit(
        func, in_shardings=in_shard, out_shardings=out_shard, static_argnums=static_argnums, donate_argnums=donate_argnums
    )
    traced = jitted.trace(*shaped_args, **shaped_kwargs)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


if __name__ == "__main__":
  sys.stdout.write(lowered_train_step(sys.argv[1:]))
