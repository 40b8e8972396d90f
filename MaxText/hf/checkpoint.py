"""A run's orbax checkpoint, read one slice at a time, and checked as a resume checks it.

Which step: the newest that MaxText/checkpoints/records.py calls complete (orbax's commit marker, its tree metadata
and our record), or the one asked for. Reads go through tensorstore straight to the stored arrays, a slice at a
time (a layer, or one expert of a layer): only the stored chunks a slice touches are decoded, and a cache the size
of the largest chunk keeps each chunk decoded once while its slices are read chunk by chunk (the export orders
them so: MaxText/hf/export_cli.py's ordered). A checkpoint written on one device stores each array as one chunk,
so there the bound is the largest array; a sharded run's chunks are its shards.

Every element read is folded into the same two position-weighted sums our record holds for the array
(checkpoint_records._digest_and_nonfinite, here in numpy over the slice's global positions), and counted; once
everything is read, `verdict()` is the verified restore's verdict on it (checkpoint_records.mismatch): finite, and
the bytes the digests were taken from at save.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from MaxText.checkpoints import records as checkpoint_records
from MaxText.hf.errors import Damaged, NoCheckpoint

PARAMS = ("params", "params")  # the trained weights' subtree in a training checkpoint's items
AUX = ("nnx_aux", "model")  # persistent non-Param variables (DeepSeek-V3's routing bias) of the NNX state


def _a_weight(path: tuple[str, ...]) -> bool:
  """A model variable an export reads: any but an RNG stream's state (its key and count)."""
  return "rngs" not in path


@dataclasses.dataclass(frozen=True)
class Stored:
  """One stored array: its checkpoint key, shape, dtype and the chunk tensorstore decodes as a unit."""

  key: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: np.dtype
  chunk: tuple[int, ...]  # the stored chunk's shape: a sharded run's shard, one device's whole array

  @property
  def chunk_bytes(self) -> int:
    return int(np.prod(self.chunk)) * self.dtype.itemsize


def pick_step(run_dir: Path, step: int | None) -> int:
  """The step to read: the one asked for, or the newest complete one; NoCheckpoint saying why not."""
  if not (run_dir / "checkpoints").is_dir():
    raise NoCheckpoint(f"{run_dir} has no checkpoints/ directory: not a run directory, or a run that saved none")
  present = [s for s, _ in checkpoint_records.step_dirs(run_dir)]
  if step is None:
    complete = checkpoint_records.complete_steps(run_dir)
    if not complete:
      raise NoCheckpoint(f"{run_dir}/checkpoints holds no complete checkpoint (steps present: "
                         f"{', '.join(map(str, present)) or 'none'})")
    return complete[-1]
  if step not in present:
    raise NoCheckpoint(f"{run_dir} has no checkpoint step {step} (steps: {', '.join(map(str, present)) or 'none'})")
  why = checkpoint_records.problem(run_dir, step)
  if why:
    raise NoCheckpoint(f"checkpoint step {step} of {run_dir} is not a complete checkpoint: {why}")
  return step


def _damaged(run_dir: Path, step: int, e: BaseException) -> Damaged:
  why = checkpoint_records.damage(e) or f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
  return Damaged(f"checkpoint step {step} of {run_dir} is damaged: it does not load: {why}")


BLOCK = 1 << 22  # elements folded at a time: a few temporaries of this many uint32 (tens of MB), whatever the slice


def fold(sums: list[int], shape: tuple[int, ...], dtype: np.dtype, index: tuple[int | slice, ...],
         region: np.ndarray) -> None:
  """Adds region = whole[index] to sums [sum1, sum2, nonfinite, elements] of an array of `shape`: the digest of
  checkpoint_records._digest_and_nonfinite, each element weighted by its row-major position in the whole array,
  so that the regions of a partition, in any order, add up to the whole array's digest. uint32 arithmetic wraps
  as the digest's does (mod 2^32)."""
  full = tuple(index) + (slice(None),) * (len(shape) - len(index))
  bounds = [ix.indices(n)[:2] if isinstance(ix, slice) else (ix, ix + 1) for ix, n in zip(full, shape)]
  extent = [stop - start for start, stop in bounds]
  region = np.ascontiguousarray(region).reshape(extent) if extent else np.ascontiguousarray(region).reshape(())
  if not extent:  # a scalar
    region, bounds, shape, extent = region.reshape(1), [(0, 1)], (1,), [1]
  strides = [int(np.prod(shape[a + 1:])) % 2**32 for a in range(len(shape))]
  rows = max(1, BLOCK // max(1, int(np.prod(extent[1:]))))
  for r0 in range(0, extent[0], rows):
    block = region[r0:r0 + rows]
    first = [(bounds[0][0] + r0, bounds[0][0] + r0 + block.shape[0])] + bounds[1:]
    _fold_block(sums, dtype, first, strides, block)


def _fold_block(sums: list[int], dtype: np.dtype, bounds: list[tuple[int, int]], strides: list[int],
                block: np.ndarray) -> None:
  width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[dtype.itemsize]
  bits = block.view(width).astype(np.uint32, copy=False)
  position = np.zeros(block.shape, np.uint32)
  for axis, ((start, stop), stride) in enumerate(zip(bounds, strides)):
    along = ((np.arange(start, stop, dtype=np.uint64) * np.uint64(stride)) % 2**32).astype(np.uint32)
    position += along.reshape([-1 if a == axis else 1 for a in range(block.ndim)])
  s1 = int(np.sum(bits * (position * np.uint32(2) + np.uint32(1)), dtype=np.uint64))
  s2 = int(np.sum(bits ^ (position * np.uint32(0x9E3779B1)), dtype=np.uint64))
  sums[0], sums[1] = (sums[0] + s1) & 0xFFFFFFFF, (sums[1] + s2) & 0xFFFFFFFF
  if dtype.kind == "f" or dtype.name.startswith(("bfloat", "float")):  # ml_dtypes' bfloat16 is kind "V"
    finite = np.isfinite(block if dtype.kind == "f" else block.astype(np.float32))
    sums[2] += int(block.size - np.count_nonzero(finite))
  sums[3] += block.size


class Checkpoint:
  """Slices of one checkpoint's arrays, their digests folded in as they are read."""

  def __init__(self, run_dir: Path, step: int | None = None):
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    self.run_dir, self.step = run_dir, pick_step(run_dir, step)
    self.items = run_dir / "checkpoints" / str(self.step) / "items"
    self.record = checkpoint_records.read_record(run_dir, self.step)
    try:
      tree = json.loads((self.items / "_METADATA").read_text())["tree_metadata"]
      self._kv = {"driver": "ocdbt", "base": f"file://{self.items.resolve()}/"}
      self.arrays: dict[tuple[str, ...], Stored] = {}
      for text in tree:
        key = tuple(k["key"] for k in tree[text]["key_metadata"])
        if key[:2] in (PARAMS, AUX) and _a_weight(key):
          self.arrays[key] = self._stored(ts, key)
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise _damaged(run_dir, self.step, e) from e
    largest = max((a.chunk_bytes for a in self.arrays.values()), default=0)
    # One decoded chunk stays cached while its slices are read (tensorstore evicts beyond the limit).
    self._context = ts.Context({"cache_pool": {"total_bytes_limit": largest + (1 << 20)}})
    self._open: dict[tuple[tuple[str, ...], bool], Any] = {}  # (key, whole array?) -> tensorstore handle
    self._sums: dict[tuple[str, ...], list[int]] = {}  # key -> [sum1, sum2, nonfinite, elements read]

  def _stored(self, ts, key: tuple[str, ...]) -> Stored:
    spec = {"driver": "zarr3", "kvstore": {**self._kv, "path": ".".join(key) + "/"}}
    handle = ts.open(spec, open=True, read=True).result()
    chunk = handle.chunk_layout.read_chunk.shape or handle.shape
    return Stored(key, tuple(handle.shape), np.dtype(handle.dtype.numpy_dtype), tuple(int(n) for n in chunk))

  def has(self, key: tuple[str, ...]) -> bool:
    return key in self.arrays

  def read(self, key: tuple[str, ...], index: tuple[int | slice, ...]) -> np.ndarray:
    """arrays[key][index] as numpy; integer indices drop their axis. Every element must be read once for
    verdict() to vouch for the array."""
    region = self.peek(key, index)
    stored = self.arrays[key]
    fold(self._sums.setdefault(key, [0, 0, 0, 0]), stored.shape, stored.dtype, index, region)
    return region

  def peek(self, key: tuple[str, ...], index: tuple[int | slice, ...]) -> np.ndarray:
    """A read not counted towards the digest (a second copy of a region read())."""
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    whole = all(isinstance(ix, slice) and ix == slice(None) for ix in index)
    if (key, whole) not in self._open:  # a whole-array read gains nothing from keeping its chunk decoded
      spec = {"driver": "zarr3", "kvstore": {**self._kv, "path": ".".join(key) + "/"}}
      context = ts.Context() if whole else self._context
      self._open[key, whole] = ts.open(spec, open=True, read=True, context=context).result()
    try:
      region = np.asarray(self._open[key, whole][index].read().result())
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise _damaged(self.run_dir, self.step, e) from e
    return region

  @staticmethod
  def record_name(key: tuple[str, ...]) -> str:
    """Our record's name for a checkpoint key (patches/checkpoint_guard._leaves_with_paths of the NNX state)."""
    return "/".join(("model",) + key[2:] + ("value",))

  def unread(self) -> list[tuple[str, ...]]:
    """Arrays not read whole: a mapping that leaves any of them out would drop trained weights."""
    return [k for k, a in self.arrays.items() if self._sums.get(k, [0] * 4)[3] != int(np.prod(a.shape))]

  def verdict(self) -> None:
    """Raises Damaged unless every array read is finite and matches our record's digest."""
    named = [(self.record_name(k), None) for k in self._sums]
    unlisted = [name for name, _ in named if name not in self.record["arrays"]]
    if unlisted and self.record.get("digest") == checkpoint_records.DIGEST:
      raise Damaged(f"checkpoint step {self.step} of {self.run_dir} does not match our record of it: the record "
                    f"lists no {unlisted[0]}")
    finite = [s[2] == 0 for s in self._sums.values()]
    digests = [f"{s[0]:08x}{s[1]:08x}" for s in self._sums.values()]
    # The model's weights are what an export reads: the record's other arrays (optimizer state, step, RNG keys)
    # are not asked for, while a recorded weight that was not read is missing, as on a resume.
    weights = {name: a for name, a in self.record["arrays"].items()
               if (path := tuple(name.split("/")))[0] == "model" and _a_weight(path)}
    why = checkpoint_records.mismatch({**self.record, "arrays": weights}, named, finite, digests)
    if why:
      raise Damaged(f"checkpoint step {self.step} of {self.run_dir} is damaged: {why}")
