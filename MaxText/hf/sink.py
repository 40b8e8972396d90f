"""The imported checkpoint written a tensor at a time: upstream's params-only layout (checkpointing.
save_params_to_path, which MaxText's load_parameters_path reads), with host memory bounded by the tensor being
written, never the model.

orbax saves a tree whole, so orbax writes only the tree's skeleton, every array a placeholder with one element per
axis: that gives the checkpoint's own files (_METADATA, the tree, which holds no shapes; _CHECKPOINT_METADATA; the
commit marker). Each array is then created again at its real shape in the same OCDBT store through orbax's own
tensorstore spec (tensorstore_utils.ArrayWriteSpec: zarr3, zstd, orbax's file-size rules), chunked by the regions
the import writes (one expert of one layer, or a layer, cut to at most CHUNK_BYTES along its first axis), and
each region is written as its tensor is read, one chunk row at a time. A restore takes each array's shape from its
zarr.json.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from MaxText.hf import checkpoint, quiet
from MaxText.hf.errors import NotWritten

# A chunk's bytes at most: a write holds its region plus about one chunk being encoded.
CHUNK_BYTES = 256 * 2**20

Key = tuple[str, ...]
Index = tuple[int | slice, ...]


def params_path(key: Key) -> Key:
  """The array's tree path in upstream's params-only layout: {params, MoEBiasVar}/..., which save_params_to_path
  stores under a further "params"."""
  return ("params" if key[:2] == checkpoint.PARAMS else "MoEBiasVar", *key[2:])


def region_rows(slice_shape: tuple[int, ...], itemsize: int) -> int:
  """How many rows (the slice's first axis) of a region one chunk holds: all, unless that is over CHUNK_BYTES."""
  if not slice_shape:
    return 1
  row_bytes = math.prod(slice_shape[1:]) * itemsize
  return max(1, min(slice_shape[0], CHUNK_BYTES // max(1, row_bytes)))


def chunk_shape(shape: tuple[int, ...], index: Index, itemsize: int) -> tuple[int, ...]:
  """One region's chunk: 1 on the axes the region picks (a layer, an expert), its extent on the rest, the first of
  those cut by region_rows."""
  free = [a for a, i in enumerate(index) if not isinstance(i, int)]
  chunk = [1 if isinstance(i, int) else n for i, n in zip(index, shape)]
  if free:
    chunk[free[0]] = region_rows(tuple(shape[a] for a in free), itemsize)
  return tuple(chunk)


class Sink:
  """`write(key, index, region)` into the checkpoint at `out`, each array stored in chunks of `chunks[key]`.

  The import writes upstream's params-only layout (params_path). `trainer_layout` writes a training run's `items`
  instead, every checkpoint key its own tree path (tools/bench_hf_memory.py makes a run's checkpoint so)."""

  def __init__(self, out: Path, shapes: Mapping[Key, tuple[int, ...]], dtypes: Mapping[Key, np.dtype],
               chunks: Mapping[Key, tuple[int, ...]], trainer_layout: bool = False):
    self.out, self.dtypes, self.chunks = out, dtypes, chunks
    self._at = out.absolute()  # orbax refuses a relative path, which a user's OUT_DIR may well be
    self._trainer_layout = trainer_layout
    self._skeleton(shapes)
    self._arrays: dict[Key, Any] = {}
    self._open(shapes)

  def _path(self, key: Key) -> Key:
    return key if self._trainer_layout else params_path(key)

  def _name(self, key: Key) -> str:
    """The array's name in the OCDBT store: its tree path as orbax saved it, joined by dots."""
    wrapper = () if self._trainer_layout else ("params",)  # save_params_to_path saves {"params": tree}
    return ".".join((*wrapper, *self._path(key)))

  def _skeleton(self, shapes: Mapping[Key, tuple[int, ...]]) -> None:
    from maxtext.common import checkpoint_context, checkpointing  # pylint: disable=import-outside-toplevel
    from orbax.checkpoint import v1 as ocp  # pylint: disable=import-outside-toplevel

    tree: dict[str, Any] = {}
    for key, shape in shapes.items():
      path = self._path(key)
      node = tree
      for part in path[:-1]:
        node = node.setdefault(part, {})
      node[path[-1]] = np.zeros((1,) * len(shape), self.dtypes[key])
    with _not_written(self.out):
      if self._trainer_layout:
        with checkpoint_context.build_context(use_ocdbt=True, use_zarr3=True):
          ocp.save(self._at, tree, checkpointable_name="items", overwrite=True)
      else:
        checkpointing.save_params_to_path(str(self._at), tree)

  def _open(self, shapes: Mapping[Key, tuple[int, ...]]) -> None:
    import tensorstore as ts  # pylint: disable=import-outside-toplevel
    from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=import-outside-toplevel

    context = tensorstore_utils.get_ts_context(use_ocdbt=True)
    opened = []
    with _not_written(self.out):
      for key, shape in shapes.items():
        spec = tensorstore_utils.ArrayWriteSpec(
            str(self._at / "items"), self._name(key), global_shape=shape, write_shape=self.chunks[key],
            dtype=np.dtype(self.dtypes[key]), use_zarr3=True, use_ocdbt=True)
        opened.append((key, ts.open(ts.Spec(spec.json), create=True, delete_existing=True, context=context)))
      for key, future in opened:
        self._arrays[key] = future.result()

  def write(self, key: Key, index: Index, region: np.ndarray) -> None:
    """region (the slice's shape) at `index` (integers pick an axis, slices keep it) of the array `key`, converted
    to its dtype and written a chunk's extent of its first kept axis at a time."""
    array, dtype = self._arrays[key], self.dtypes[key]
    kept = [a for a, i in enumerate(index) if not isinstance(i, int)]
    first = index[kept[0]].indices(array.shape[kept[0]])[0] if kept else 0
    step = self.chunks[key][kept[0]] if kept else 1
    rows = region.shape[0] if region.ndim else 1
    with _not_written(self.out):  # once a region: it diverts fd 2 into a new temporary file each time
      for start in range(0, rows, step):
        at = list(index)
        if kept:
          at[kept[0]] = slice(first + start, first + min(rows, start + step))
        array[tuple(at)].write(np.asarray(region[start:start + step] if kept else region, dtype)).result()


@contextlib.contextmanager
def _not_written(out: Path) -> Iterator[None]:
  """A write the storage refuses (orbax and tensorstore raise their own errors, not OSError) is NotWritten, in the
  words the trainer's checkpoint guard reads; what orbax's threads print while it fails goes to a file dropped."""
  from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

  try:
    with quiet.captured_stderr(lambda e: checkpoint_guard.no_space_reason(e) is not None):
      yield
  except Exception as e:  # pylint: disable=broad-except
    reason = checkpoint_guard.no_space_reason(e)
    if reason is None:
      raise
    raise NotWritten(f"{out} could not be written: {reason}") from None


def covered(shapes: Mapping[Key, tuple[int, ...]], regions: Iterable[tuple[Key, Index]]) -> Key | None:
  """The first array whose regions do not add up to it (None: every element has a tensor): arithmetic on the
  regions, before a tensor is read."""
  count = {k: 0 for k in shapes}
  for key, index in regions:
    count[key] += math.prod(n for i, n in zip(index, shapes[key]) if not isinstance(i, int))
  return next((k for k, n in count.items() if n != math.prod(shapes[k])), None)
