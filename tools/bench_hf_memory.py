"""Peak host memory of `python -m MaxText.export_hf` and `python -m MaxText.import_hf` on a model too large to
train on this machine.

  python tools/bench_hf_memory.py CONFIG OUT_ROOT [key=value ...]

Writes a run directory as the trainer leaves it after a save on 8 devices, experts over 4 and FSDP over 2
(OUT_ROOT/run: effective_config.json, an orbax checkpoint of the parameters and the routing bias at random values,
each array stored in the chunks that sharding gives it, and our record of its digests; no optimizer state, which an
export never reads), in a child process with 8 simulated CPU devices, a shard at a time (MaxText/hf/sink.py). Then
exports it under /usr/bin/time (OUT_ROOT/hf, bf16), removes the run's checkpoint (disk), imports the export under
/usr/bin/time (OUT_ROOT/imported), and prints one line per command: peak resident memory against the bound
2 x the largest tensor (float32) + 1 GiB (docs/huggingface.md "Host memory, measured").
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEVICES = 8
SHARDING = ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]  # the run's layout on its 8 devices


def write_run(config_path: str, root: Path, overrides: list[str]) -> None:
  root = root.absolute()  # orbax refuses a relative path
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
  import jax  # pylint: disable=import-outside-toplevel
  import patches  # pylint: disable=import-outside-toplevel

  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel
  from MaxText.hf import checkpoint, import_cli, run as hf_run, sink  # pylint: disable=import-outside-toplevel
  from MaxText.run import loop  # pylint: disable=import-outside-toplevel

  run = hf_run.on_this_machine(fork_config.load([config_path, *SHARDING, *overrides, f"base_output_directory={root}",
                                                 "run_name=run"]))
  config = hf_run.upstream_config(run)
  patches.apply_all(run.fork)
  arrays = import_cli.abstract_arrays(config, jax.devices())
  shapes = {k: tuple(a.shape) for k, a in arrays.items()}
  chunks = {k: tuple(a.sharding.shard_shape(a.shape)) for k, a in arrays.items()}  # a device's shard
  loop.write_run_files(run, env={}, applied=[])
  f32 = np.dtype(np.float32)
  written = sink.Sink(root / "run" / "checkpoints" / "0", shapes, dict.fromkeys(shapes, f32), chunks,
                      trainer_layout=True)
  named, digests = [], []
  for i, (key, shape) in enumerate(shapes.items()):
    sums = [0, 0, 0, 0]
    grid = [range(0, n, c) for n, c in zip(shape, chunks[key])]
    for j, starts in enumerate(np.ndindex(*[len(g) for g in grid])):  # one shard at a time: never the model
      index = tuple(slice(g[s], g[s] + c) for g, s, c in zip(grid, starts, chunks[key]))
      shard = np.random.default_rng((i, j)).standard_normal(chunks[key], np.float32) * np.float32(0.02)
      written.write(key, index, shard)
      checkpoint.fold(sums, shape, f32, index, shard)  # what the trainer records at a save
    named.append((checkpoint.Checkpoint.record_name(key), types.SimpleNamespace(shape=shape, dtype=f32)))
    digests.append(f"{sums[0]:08x}{sums[1]:08x}")
  checkpoint_records.write_record(root / "run", 0, named, digests)
  print(json.dumps({"params": sum(math.prod(s) for s in shapes.values()),
                    "largest_mib": max(math.prod(s) for s in shapes.values()) * 4 / 2**20,
                    "largest_chunk_mib": max(math.prod(c) for c in chunks.values()) * 4 / 2**20}))


def timed(argv: list[str]) -> tuple[float, str, str]:
  """(peak resident MiB, stdout, stderr) of argv under /usr/bin/time -v; raises on failure."""
  done = subprocess.run(["/usr/bin/time", "-v", *argv], cwd=REPO, capture_output=True, text=True, check=False)
  if done.returncode:
    raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-3000:]}")
  peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
  return peak_kib / 2**10, done.stdout, done.stderr


def largest_tensor_mib(hf_dir: Path) -> float:
  """The largest tensor of the export, in float32 (the dtype both commands convert through)."""
  index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
  from MaxText.hf import safetensors  # pylint: disable=import-outside-toplevel

  reader = safetensors.Reader(hf_dir)
  return max(math.prod(reader.info(name)["shape"]) for name in index["weight_map"]) * 4 / 2**20


def main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(__doc__)
    return 2
  config_path, root, overrides = argv[0], Path(argv[1]), argv[2:]
  write_mib, made, _ = timed([sys.executable, __file__, "--write", config_path, str(root), *overrides])
  facts = json.loads(made.strip().splitlines()[-1])
  checkpoint = root / "run" / "checkpoints"
  size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
  export_mib, _, export_err = timed([sys.executable, "-m", "MaxText.export_hf", str(root / "run"), str(root / "hf")])
  shutil.rmtree(checkpoint)  # the disk: a 7.36B run's checkpoint is 27 GiB, its import as much again
  import_mib, _, import_err = timed([sys.executable, "-m", "MaxText.import_hf", str(root / "hf"), str(root / "imported")])
  largest = largest_tensor_mib(root / "hf")
  bound = 2 * largest + 1024
  print(f"{config_path} {' '.join(overrides)}: {facts['params'] / 1e6:,.1f} M parameters, checkpoint "
        f"{size / 2**20:,.1f} MiB on {DEVICES} devices ({', '.join(SHARDING)}; largest stored chunk "
        f"{facts['largest_chunk_mib']:,.1f} MiB, largest array {facts['largest_mib']:,.1f} MiB), largest tensor "
        f"{largest:,.1f} MiB (float32), bound {bound:,.0f} MiB; writing it took {write_mib:,.0f} MiB")
  for name, mib, err in (("export_hf", export_mib, export_err), ("import_hf", import_mib, import_err)):
    line = next(l for l in err.splitlines() if l.startswith(f"[{name}]"))
    print(f"  {name}: peak resident memory {mib:,.0f} MiB ({mib / bound:.2f} of the bound)\n    {line}")
  return 0


if __name__ == "__main__":
  if sys.argv[1:2] == ["--write"]:
    write_run(sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
  else:
    sys.exit(main(sys.argv[1:]))
