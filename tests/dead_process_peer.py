"""One process of a two-process CPU job (tests/test_dead_process.py): jax.distributed through our launcher
(MaxText/run/launch.py), then all-gathers across the processes until killed or ended.

  python tests/dead_process_peer.py PROCESS_ID PORT
"""

from __future__ import annotations

import sys
import time

import jax

from MaxText.run import launch


def main() -> None:
  process_id, port = int(sys.argv[1]), sys.argv[2]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # a CPU job's cross-process collectives
  launch.initialize(launch.ProcessInfo(scheduler="env", coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                       process_id=process_id), "cpu")
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  for step in range(100_000):
    multihost_utils.process_allgather(jnp.ones(4) * step)
    if step % 20 == 0:
      print(f"process {process_id} step {step}", flush=True)
    time.sleep(0.05)


if __name__ == "__main__":
  main()
