"""One process of a two-process CPU job (tests/test_data_passes.py) whose grain shards are uneven, as upstream's
are for an odd number of batches (`dataset[process::2]`): process 0 reads 3 batches, process 1 reads 2.

upstream's training loop in small, through our seams as the trainer applies them (patches/data_passes.py with
data_exhausted=stop, patches/checkpoint_guard.py): each step reads the next batch through the DataPasses
iterator, runs a train step over the global batch (a sum across both processes: one collective) and calls
upstream's maybe_save_checkpoint with a real orbax checkpointer and grain's iterator state. The data running out
ends the loop as upstream's loader does (StopIteration); then both processes meet once more (upstream's end of
training) and print what data_passes recorded, as JSON on the last line.

  python tests/data_passes_peer.py PROCESS_ID PORT DIR
"""

from __future__ import annotations

import json
import sys
import types

from MaxText.run import launch

BATCHES = 5  # over both processes: 3 on process 0, 2 on process 1


def _config(checkpoint_dir: str) -> types.SimpleNamespace:
  """The keys upstream's maybe_save_checkpoint and save_checkpoint read; periodic saves off (period 100)."""
  return types.SimpleNamespace(
      checkpoint_period=100, save_checkpoint_on_start=False, enable_continuous_checkpointing=False,
      enable_emergency_checkpoint=False, enable_multi_tier_checkpointing=False, enable_autocheckpoint=False,
      enable_checkpointing=True, enable_diloco=False, dataset_type="grain", expansion_factor_real_data=-1,
      checkpoint_dir=checkpoint_dir, grain_train_files="corpus.array_record", grain_train_mixture_config_path="",
      global_batch_size_to_load=2, max_target_length=4)


def main(process_id: int, port: str, directory: str) -> None:
  launch.initialize(launch.ProcessInfo(scheduler="env", coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                       process_id=process_id), "cpu")
  import grain  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel
  from maxtext.input_pipeline import multihost_dataloading  # pylint: disable=import-outside-toplevel

  import patches  # pylint: disable=import-outside-toplevel
  from patches import checkpoint_guard, data_passes  # pylint: disable=import-outside-toplevel

  patches.apply_module(checkpoint_guard, None, patches.Hooks())
  patches.apply_module(data_passes, types.SimpleNamespace(data_exhausted="stop"), patches.Hooks())
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  config = _config(f"{directory}/checkpoints")
  shard = grain.MapDataset.range(BATCHES)[process_id::2].map(
      lambda i: {"inputs": np.full((1, 4), i + 1, np.int32)}).to_iter_dataset()
  it = data_passes.wrap(lambda c, m, indices: multihost_dataloading.MultiHostDataLoadIterator(shard, mesh))(
      config, mesh, [0, 1])
  data_passes.start(0, 1)
  manager = checkpointing.create_orbax_checkpoint_manager(config.checkpoint_dir, True, False, 100)
  train_step = jax.jit(lambda w, batch: w + batch["inputs"].sum())  # the global sum: both processes' batches
  w = jax.numpy.zeros((), np.int32)
  steps = 0
  for step in range(10):
    try:
      batch = next(it)  # upstream's loader turns a StopIteration into StopTraining: the loop's normal end
    except StopIteration:
      break
    w = train_step(w, batch)
    checkpointing.maybe_save_checkpoint(manager, {"w": w}, config, it, step)
    steps += 1
    print(f"step {step}", flush=True)
  multihost_utils.sync_global_devices("end of training")
  print(json.dumps({"steps": steps, "w": int(w), "exhausted": data_passes.exhausted}), flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
