"""On a host with >= 2 GPUs: the SLURM layouts give each process the GPUs they should.

  python3 tools/launch_layout_check.py          # PASS/FAIL per case, exit 1 on any FAIL

Each case starts two processes under a simulated srun environment (no SLURM
needed) that join one jax.distributed job through MaxText/run/launch.py, and
compares the GPUs each process drives (jax.local_devices()) with the layout's:

  per-gpu   two tasks on one node of 2 GPUs (JAX's convention): GPU 0 and GPU 1
  per-node  one task on each of two "nodes" (both this host), every GPU each:
            the case train.sbatch runs by default (it used to get GPU 0 only)

tests/test_launch.py checks the same on CPU through the value JAX is handed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = (
    "import json, jax\n"
    "from MaxText.run import launch\n"
    "info = launch.discover()\n"
    "launch.initialize(info, 'gpu')\n"
    "print('DEVICES', json.dumps([jax.process_index(), [d.local_hardware_id for d in jax.local_devices()],"
    " jax.device_count()]))\n"
)


def run_case(tasks_per_node: int, nodes: int, gpus: int, port: int) -> list[list]:
  procs = []
  for procid in range(2):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_")) and k != "CUDA_VISIBLE_DEVICES"}
    env.update({"PYTHONPATH": f"{REPO}:{env.get('PYTHONPATH', '')}", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                "SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % tasks_per_node),
                "SLURM_NODEID": str(procid // tasks_per_node), "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})",
                "SLURM_GPUS_ON_NODE": str(gpus), "JAX_COORDINATOR_PORT": str(port)})
    procs.append(subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  seen = []
  for proc in procs:
    out = proc.communicate(timeout=300)[0]
    line = next((ln for ln in out.splitlines() if ln.startswith("DEVICES ")), None)
    seen.append(json.loads(line[len("DEVICES "):]) if line else ["error", out[-1500:]])
  return seen


def main() -> int:
  gpus = int(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout.count("GPU "))
  if gpus < 2:
    print(f"FAIL need >= 2 GPUs, found {gpus}")
    return 1
  cases = {
      "per-gpu": (run_case(2, 1, 2, 23451), [[0, [0], 2], [1, [1], 2]]),
      "per-node": (run_case(1, 2, gpus, 23452), [[0, list(range(gpus)), 2 * gpus], [1, list(range(gpus)), 2 * gpus]]),
  }
  failed = 0
  for name, (seen, want) in cases.items():
    ok = seen == want
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: [process, local GPU ids, global devices] = {seen}"
          + ("" if ok else f", want {want}"))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
