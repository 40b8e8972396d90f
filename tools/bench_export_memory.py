"""Peak host memory of `python -m MaxText.export_hf` on a model too large to train on this machine.

  python tools/bench_export_memory.py CONFIG OUT_ROOT [key=value ...]

Writes a run directory as the trainer leaves it after a save on one device (OUT_ROOT/run: effective_config.json,
an orbax checkpoint of the parameters and the routing bias at random values, one chunk per array, and our record
of its digests; no optimizer state, which an export never reads), in a child process; then exports it
under /usr/bin/time and prints the parameters, the checkpoint's size, its largest stored array, and the export's
peak resident memory (BENCHMARKS.md "Hugging Face export").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def write_run(config_path: str, root: Path, overrides: list[str]) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import patches  # pylint: disable=import-outside-toplevel
  from maxtext.common import checkpoint_context  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint import v1 as ocp  # pylint: disable=import-outside-toplevel

  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel
  from MaxText.hf import import_cli as import_hf  # pylint: disable=import-outside-toplevel
  from MaxText.run import loop  # pylint: disable=import-outside-toplevel
  from MaxText.hf import checkpoint, run as hf_run  # pylint: disable=import-outside-toplevel

  run = fork_config.load([config_path, *overrides, f"base_output_directory={root}", "run_name=run"])
  run = hf_run.on_this_machine(run)
  config = hf_run.upstream_config(run)
  patches.apply_all(run.fork)
  shapes, _ = import_hf.abstract_shapes(config)
  loop.write_run_files(run, env={}, applied=[])
  tree: dict = {}
  named, digests = [], []
  for i, (key, shape) in enumerate(shapes.items()):  # jax arrays on the CPU: the only copy of the model here
    x = jax.random.normal(jax.random.key(i), shape, jnp.float32) * 0.02
    node = tree
    for part in key[:-1]:
      node = node.setdefault(part, {})
    node[key[-1]] = x
    named.append((checkpoint.Checkpoint.record_name(key), x))
    digests += checkpoint_records.scan([x])[1]  # what the trainer records at a save
  step_dir = root / "run" / "checkpoints" / "0"
  with checkpoint_context.build_context(use_ocdbt=True, use_zarr3=True):
    ocp.save(step_dir, tree, checkpointable_name="items", overwrite=True)
  checkpoint_records.write_record(root / "run", 0, named, digests)
  print(json.dumps({"params": int(sum(np.prod(s) for s in shapes.values())),
                    "largest_mib": max(int(np.prod(s)) for s in shapes.values()) * 4 / 2**20}))


def main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(__doc__)
    return 2
  config_path, root, overrides = argv[0], Path(argv[1]), argv[2:]
  made = subprocess.run(["/usr/bin/time", "-v", sys.executable, __file__, "--write", config_path, str(root),
                         *overrides], cwd=REPO, capture_output=True, text=True, check=False)
  if made.returncode:
    print(made.stderr[-3000:], file=sys.stderr)
    return made.returncode
  facts = json.loads(made.stdout.strip().splitlines()[-1])
  write_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", made.stderr).group(1))
  size = sum(p.stat().st_size for p in (root / "run" / "checkpoints").rglob("*") if p.is_file())
  timed = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "MaxText.export_hf", str(root / "run"),
                          str(root / "hf")], cwd=REPO, capture_output=True, text=True, check=False)
  if timed.returncode:
    print(timed.stderr[-3000:], file=sys.stderr)
    return timed.returncode
  peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timed.stderr).group(1))
  line = next(l for l in timed.stderr.splitlines() if l.startswith("[export_hf]"))
  print(f"{config_path} {' '.join(overrides)}: {facts['params'] / 1e6:,.1f} M parameters, checkpoint "
        f"{size / 2**20:,.1f} MiB, largest array {facts['largest_mib']:,.1f} MiB (float32); export peak resident "
        f"memory {peak_kib / 2**10:,.0f} MiB (writing the checkpoint took {write_kib / 2**10:,.0f} MiB)\n  {line}")
  return 0


if __name__ == "__main__":
  if sys.argv[1:2] == ["--write"]:
    write_run(sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
  else:
    sys.exit(main(sys.argv[1:]))
