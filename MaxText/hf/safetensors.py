"""Sharded safetensors, written header-first so that only one tensor is in memory at a time, and read back.

The format (github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the tensors' bytes. Every shape is
known before any data is read (from the checkpoint's metadata), so each shard's header is written first and its
tensors are appended as they are produced; `model.safetensors.index.json` maps each name to its shard as
transformers' sharded checkpoints do.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

from MaxText.hf.errors import Damaged

DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
          "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8)}
NAME_OF = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"


def plan_shards(tensors: Sequence[tuple[str, tuple[int, ...]]], itemsize: int | Callable[[str], int],
                max_bytes: int) -> list[list[int]]:
  """Tensor positions per shard, in order, each shard at most max_bytes (a larger tensor gets one of its own)."""
  size_of = itemsize if callable(itemsize) else (lambda _: itemsize)
  shards: list[list[int]] = [[]]
  size = 0
  for i, (name, shape) in enumerate(tensors):
    nbytes = int(np.prod(shape)) * size_of(name)
    if shards[-1] and size + nbytes > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(i)
    size += nbytes
  return shards


def _header(entries: Sequence[tuple[str, tuple[int, ...]]], dtype_of: Callable[[str], np.dtype]) -> bytes:
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape in entries:
    nbytes = int(np.prod(shape)) * dtype_of(name).itemsize
    header[name] = {"dtype": NAME_OF[dtype_of(name)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  return text + b" " * (-len(text) % 8)  # the data starts 8-byte aligned


def write(out_dir: Path, tensors: Sequence[tuple[str, tuple[int, ...]]], produce: Callable[[int], np.ndarray],
          dtype: np.dtype | Callable[[str], np.dtype], max_shard_bytes: int) -> dict[str, str]:
  """Writes tensors[i] = produce(i) (cast to dtype, or to dtype(name)) in order into shards; returns {name: shard
  file}."""
  dtype_of = dtype if callable(dtype) and not isinstance(dtype, np.dtype) else (lambda _: dtype)
  shards = plan_shards(tensors, lambda name: dtype_of(name).itemsize, max_shard_bytes)
  weight_map: dict[str, str] = {}
  total = 0
  for n, positions in enumerate(shards):
    name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
    entries = [tensors[i] for i in positions]
    header = _header(entries, dtype_of)
    with open(out_dir / name, "wb") as f:
      f.write(struct.pack("<Q", len(header)))
      f.write(header)
      for i, (tname, shape) in zip(positions, entries):
        x = produce(i)
        if tuple(x.shape) != tuple(shape):
          raise AssertionError(f"{tname}: produced {x.shape}, planned {shape}")
        x = x.astype(dtype_of(tname), order="C", copy=False)  # one copy at most (a transposed view, or a dtype)
        f.write(memoryview(np.ascontiguousarray(x).view(np.uint8)))
        total += x.nbytes
        weight_map[tname] = name
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
  return weight_map


class Reader:
  """The tensors of an HF directory (sharded with an index, or one model.safetensors), read one at a time.

  A shard whose header does not parse or does not fit its file (bad UTF-8 or JSON, an unknown dtype, offsets past
  its end, an empty or truncated file) raises Damaged naming the file, before any tensor of it is read."""

  def __init__(self, hf_dir: Path):
    self.dir = hf_dir
    self._headers: dict[str, dict] = {}
    index = hf_dir / INDEX
    if index.is_file():
      self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (hf_dir / "model.safetensors").is_file():
      self.weight_map = {name: "model.safetensors" for name in self.header("model.safetensors")}
    else:
      raise FileNotFoundError(f"{hf_dir} has neither {INDEX} nor model.safetensors")

  def header(self, shard: str) -> dict[str, dict]:
    """{name: {dtype, shape, data_offsets}} of one shard (its __metadata__ left out), checked against its file."""
    if shard not in self._headers:
      self._headers[shard] = _checked_header(self.dir / shard)
    return self._headers[shard]

  def shards(self) -> list[str]:
    return sorted(set(self.weight_map.values()))

  def names(self) -> Iterable[str]:
    return self.weight_map.keys()

  def info(self, name: str) -> dict:
    shard = self.weight_map[name]
    if name not in self.header(shard):
      raise Damaged(f"{self.dir / shard} has no tensor {name}, which {INDEX} places in it")
    return self.header(shard)[name]

  def read(self, name: str) -> np.ndarray:
    shard, info = self.weight_map[name], self.info(name)
    begin, end = info["data_offsets"]
    with open(self.dir / shard, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      f.seek(8 + n + begin)
      data = f.read(end - begin)
    if len(data) != end - begin:
      raise ValueError(f"{shard} is truncated: {name} needs bytes {begin}..{end} of its data")
    return np.frombuffer(data, DTYPES[info["dtype"]]).reshape(info["shape"])


def _checked_header(path: Path) -> dict[str, dict]:
  """The header of the safetensors file at path; Damaged naming the file and what is wrong with it."""
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size < 8:
        raise Damaged(f"{path} is {size} bytes: too short for a safetensors header")
      (n,) = struct.unpack("<Q", f.read(8))
      if n > size - 8:
        raise Damaged(f"{path}'s header claims {n} bytes but the file holds {size - 8} after its length")
      raw = f.read(n)
  except OSError as e:
    raise Damaged(f"{path} cannot be read: {e.strerror or e}") from None
  try:
    header = json.loads(raw.decode("utf-8"))  # UnicodeDecodeError is a ValueError, as JSON's errors are
  except ValueError as e:
    raise Damaged(f"{path}'s header is not UTF-8 JSON: {' '.join(str(e).split())[:120]}") from None
  if not isinstance(header, dict):
    raise Damaged(f"{path}'s header is a JSON {type(header).__name__}, not an object of tensors")
  header.pop("__metadata__", None)
  data = size - 8 - n
  for name, info in header.items():
    why = _entry_problem(info, data)
    if why:
      raise Damaged(f"{path}: tensor {name!r} {why}")
  return header


def _entry_problem(info: object, data_bytes: int) -> str | None:
  """What is wrong with one header entry, given the bytes of data after the header; None when it reads."""
  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
    return "lacks dtype, shape or data_offsets"
  if info["dtype"] not in DTYPES:
    return f"has dtype {info['dtype']!r}, not one of {', '.join(sorted(DTYPES))}"
  shape, offsets = info["shape"], info["data_offsets"]
  if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
    return f"has shape {shape!r}, not a list of sizes"
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
          and 0 <= offsets[0] <= offsets[1]):
    return f"has data_offsets {offsets!r}, not [begin, end]"
  nbytes = int(np.prod(shape)) * DTYPES[info["dtype"]].itemsize
  if offsets[1] - offsets[0] != nbytes:
    return f"is {info['dtype']} {shape}, {nbytes} bytes, but its data_offsets {offsets} span {offsets[1] - offsets[0]}"
  if offsets[1] > data_bytes:
    return f"ends at byte {offsets[1]} of data, past the file's {data_bytes}: the file is truncated"
  return None
