"""One process of a two-process CPU job (tests/test_dead_process.py): jax.distributed through our launcher
(MaxText/run/launch.py), kept by MaxText/run/keeper.py as `python -m MaxText.train` is, then one of:

  step     all-gathers across the processes, one every 50 ms
  save     an orbax CheckpointManager saving a 2-process sharded array every step (ASYNC=1: async saves)
  restore  one save, then restores of it, one after another

  python tests/dead_process_peer.py MODE PROCESS_ID PORT DIR [DIE_AT [HOW]]

The process whose id is DIE_AT ends itself at the moment the mode names (HOW: kill, SIGKILL, the default; stop,
SIGSTOP: it stays, silent, its sockets open), printing `dying` first: in a step between two all-gathers, in a save
once the save has begun (async: its commit in flight), in a restore as the restore begins.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from MaxText.run import keeper, launch


def _die(how: str) -> None:
  print("dying", flush=True)
  os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def main(mode: str, process_id: int, port: str, directory: str, die_at: int | None, how: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  launch.initialize(launch.ProcessInfo(scheduler="env", coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                       process_id=process_id), "cpu")
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

  dying = die_at == process_id
  if mode == "step":
    for step in range(100_000):
      multihost_utils.process_allgather(jnp.ones(4) * step)
      print(f"step {step}", flush=True)
      if dying and step == 20:
        _die(how)
      time.sleep(0.05)
  sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec("x"))
  state = {"w": jax.make_array_from_callback((2 * 2**22,), sharding, lambda i: np.ones(2**22, np.float32))}  # 16 MiB
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=os.environ.get("ASYNC") == "1")
  with ocp.CheckpointManager(directory, options=options) as manager:
    for step in range(100_000):
      if mode == "save" or step == 0:
        print(f"saving {step}", flush=True)
        die_here = dying and mode == "save" and step == 2
        if die_here and not options.enable_async_checkpointing:  # inside the save, which returns once written
          threading.Timer(0.02, _die, [how]).start()
        manager.save(step, args=ocp.args.StandardSave(state))
        if die_here and options.enable_async_checkpointing:  # save() has returned, its commit in flight
          _die(how)
        manager.wait_until_finished()
      else:
        print(f"restoring {step}", flush=True)
        if dying and step == 3:
          _die(how)
        manager.restore(0, args=ocp.args.StandardRestore(state))


def cli(argv: list[str]) -> None:
  mode, process_id, port, directory = argv[0], int(argv[1]), argv[2], argv[3]
  if not keeper.kept():
    sys.exit(keeper.keep([sys.executable, __file__, *argv], own_rank=process_id))
  try:
    main(mode, process_id, port, directory, int(argv[4]) if len(argv) > 4 else None, argv[5] if len(argv) > 5 else "kill")
  except Exception as e:  # pylint: disable=broad-exception-caught
    keeper.await_verdict(e)  # as MaxText/run/main.py does
    raise


if __name__ == "__main__":
  cli(sys.argv[1:])
