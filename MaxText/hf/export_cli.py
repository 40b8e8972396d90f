"""A trained run out to Hugging Face's layout: config.json, sharded safetensors and their index.

  python -m MaxText.export_hf RUN_DIR OUT_DIR [--step N] [--dtype bf16|f32] [--shard-size GB]

Reads the newest complete checkpoint of RUN_DIR (or step N) one slice at a time (MaxText/hf/checkpoint.py): host
memory holds one stored chunk and one tensor, never the model. Every weight the checkpoint holds is placed (a
weight the layout has no place for stops the export), and every one read is checked against the digests the run
recorded when it saved (the verdict a resume gives). OUT_DIR is claimed before anything is read, written to
OUT_DIR.tmp, fsynced and renamed to OUT_DIR only when complete (MaxText/hf/output.py). Exit codes:
MaxText/hf/errors.py (docs/huggingface.md).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from MaxText.hf import checkpoint, deepseek, gqa, output, quiet, run as hf_run, safetensors, stop
from MaxText.hf.errors import BadInput, HFError

DTYPES = {"bf16": ("BF16", "bfloat16"), "f32": ("F32", "float32")}
# decoder_block -> the module that lays that family out (pieces(shapes, config), hf_config(config, dtype))
FAMILIES = {"deepseek": deepseek, gqa.QWEN3_MOE.decoder_block: gqa.QWEN3_MOE, gqa.MIXTRAL.decoder_block: gqa.MIXTRAL}


def log(msg: str) -> None:
  print(f"[export_hf] {msg}", file=sys.stderr, flush=True)


def family_of(config: Any, fork: Any):
  """The layout this model exports to; BadInput naming the key when there is none (or it cannot hold the model)."""
  block = str(getattr(config.decoder_block, "value", config.decoder_block))
  if block not in FAMILIES:
    raise BadInput(f"config key 'decoder_block' = {block!r}: no Hugging Face layout for it yet "
                   f"(exported: {', '.join(sorted(FAMILIES))})")
  why = FAMILIES[block].refusal(config, fork)
  if why:
    raise BadInput(why)
  return FAMILIES[block]


# Tensors written in float32 whatever --dtype says: the routing bias picks the experts, and a bf16 rounding of it
# (8 bits of mantissa on values near the sigmoid scores it is added to) changes the picks; DeepSeek publishes it in
# float32 beside its FP8 and bf16 weights.
FLOAT32_ALWAYS = ("e_score_correction_bias",)


def dtype_of(dtype: np.dtype):
  f32 = np.dtype(np.float32)
  return lambda name: f32 if name.endswith(FLOAT32_ALWAYS) else dtype


def ordered(pieces: list, chunks: dict[tuple[str, ...], tuple[int, ...]]) -> list:
  """Pieces grouped by the stored array they read (first appearance order), and within one by the stored chunk
  their slice falls in, so that each chunk is decoded once while it sits in the reader's cache. An EP-sharded
  array's chunk holds a few experts of every layer: read layer by layer, each chunk was decoded once a layer. The
  index maps every name to its shard whatever the order."""
  first: dict[tuple[str, ...], int] = {}
  for i, p in enumerate(pieces):
    first.setdefault(p.key, i)

  def chunk_of(p) -> tuple[int, ...]:
    chunk = chunks.get(p.key, ())
    return tuple(ix // n if isinstance(ix, int) else 0 for ix, n in zip(p.index, chunk))

  return sorted(pieces, key=lambda p: (first[p.key], chunk_of(p)))  # stable: slice order within a chunk kept


def export(run_dir: Path, out_dir: Path, step: int | None, dtype: str, shard_bytes: int) -> dict[str, Any]:
  """OUT_DIR claimed first (MaxText/hf/output.py: an unwritable parent or another run fails before anything is
  read), written into OUT_DIR.tmp and renamed when complete."""
  with output.writing(out_dir) as tmp:
    return _export(run_dir, tmp, step, dtype, shard_bytes)


def _export(run_dir: Path, tmp: Path, step: int | None, dtype: str, shard_bytes: int) -> dict[str, Any]:
  ckpt = checkpoint.Checkpoint(run_dir, step)
  run = hf_run.load(run_dir)
  config = hf_run.upstream_config(run)
  family = family_of(config, run.fork)
  pieces = ordered(family.pieces({k: a.shape for k, a in ckpt.arrays.items()}, config, run.fork),
                   {k: a.chunk for k, a in ckpt.arrays.items()})
  placed = {p.key for p in pieces}
  left = [k for k in ckpt.arrays if k not in placed]
  if left:
    raise BadInput(f"the checkpoint holds {'/'.join(left[0])} ({len(left)} arrays in all) that the "
                   f"{family.ARCHITECTURE} layout has no place for: not exported, rather than dropped")
  st_dtype, name = DTYPES[dtype]
  start = time.perf_counter()
  tmp.mkdir()
  (tmp / "config.json").write_text(json.dumps(family.hf_config(config, name), indent=2) + "\n")

  def produce(i: int) -> np.ndarray:
    p = pieces[i]
    region = ckpt.read(p.key, p.index) if not p.copy else ckpt.peek(p.key, p.index)
    return p.transform.to_hf(region)

  safetensors.write(tmp, [(p.name, p.hf_shape) for p in pieces], produce, dtype_of(safetensors.DTYPES[st_dtype]),
                    shard_bytes)
  ckpt.verdict()
  if ckpt.unread():
    raise AssertionError(f"not every element of {ckpt.unread()[0]} was read")
  files = sorted(tmp.glob("*.safetensors"))
  return {"step": ckpt.step, "tensors": len(pieces), "shards": len(files),
          "bytes": sum(f.stat().st_size for f in files), "seconds": time.perf_counter() - start,
          "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m MaxText.export_hf", description=__doc__.split("\n\n")[0])
  p.add_argument("run_dir", type=Path)
  p.add_argument("out_dir", type=Path)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
  p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the written tensors")
  p.add_argument("--shard-size", type=float, default=5.0, help="largest shard in GB (default 5, more than 0)")
  return p.parse_args(argv)


def shard_bytes(gb: float) -> int:
  """--shard-size in bytes; BadInput for one that plans no shards (0, negative) or none at all (nan, inf, which
  argparse's float() accepts and int() would crash on)."""
  if not (math.isfinite(gb) and gb > 0):
    raise BadInput(f"--shard-size {gb}: the largest shard in GB must be a finite number above 0 (e.g. 5)")
  return max(1, int(gb * 1e9))


def main(argv: list[str] | None = None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  try:
    with stop.on_signals("export_hf", args.out_dir):
      done = export(args.run_dir, args.out_dir, args.step, args.dtype, shard_bytes(args.shard_size))
  except HFError as e:
    quiet.say(f"export_hf: {e}")
    return e.code
  log(f"step {done['step']} of {args.run_dir} -> {args.out_dir}: {done['tensors']} tensors in {done['shards']} "
      f"shards, {done['bytes'] / 2**20:.1f} MiB in {done['seconds']:.1f} s; peak resident memory "
      f"{done['peak_rss_mib']:.0f} MiB; digests as at save")
  return 0
