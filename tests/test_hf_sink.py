"""The import's checkpoint written a region at a time (MaxText/hf/sink.py), read back by orbax as a tree."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from MaxText.hf import sink

WI = ("params", "params", "decoder", "moe", "wi_0")  # [experts, layers, embed, mlp]: one expert of one layer a tensor
BIAS = ("nnx_aux", "model", "decoder", "moe", "bias")  # [layers, experts]: a layer a tensor
EMBED = ("params", "params", "token_embedder", "embedding")  # whole
PATTERN = {WI: (0, 0, slice(None), slice(None)), BIAS: (0, slice(None)), EMBED: (slice(None), slice(None))}


def _regions(pattern, shape):
  """Every index of the pattern's shape: its integer axes enumerated."""
  ints = [a for a, i in enumerate(pattern) if isinstance(i, int)]
  for picks in np.ndindex(*[shape[a] for a in ints]):
    index = list(pattern)
    for a, i in zip(ints, picks):
      index[a] = i
    yield tuple(index)


def _load(out):
  from orbax.checkpoint import v1 as ocp  # pylint: disable=import-outside-toplevel

  return ocp.load(out, checkpointable_name="items")["params"]


@pytest.mark.parametrize("chunk_bytes", [sink.CHUNK_BYTES, 48])
def test_regions_written_one_at_a_time_load_as_the_tree_upstreams_params_save_writes(tmp_path, monkeypatch,
                                                                                    chunk_bytes):
  # 48 bytes: the embedding's chunks are 2 rows of 5 float32 (and its write 4 pieces), an expert's 1 row of 6
  monkeypatch.setattr(sink, "CHUNK_BYTES", chunk_bytes)
  shapes = {WI: (4, 3, 5, 6), BIAS: (3, 4), EMBED: (7, 5)}
  dtypes = {WI: np.dtype(np.float32), BIAS: np.dtype(np.float32), EMBED: np.dtype(ml_dtypes.bfloat16)}
  chunks = {k: sink.chunk_shape(shapes[k], PATTERN[k], dtypes[k].itemsize) for k in shapes}
  if chunk_bytes == 48:
    assert chunks == {WI: (1, 1, 2, 6), BIAS: (1, 4), EMBED: (4, 5)}
  else:
    assert chunks == {WI: (1, 1, 5, 6), BIAS: (1, 4), EMBED: (7, 5)}
  rng = np.random.default_rng(0)
  want = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
  out = tmp_path / "ckpt"
  written = sink.Sink(out, shapes, dtypes, chunks)
  for key, array in want.items():
    for index in _regions(PATTERN[key], shapes[key]):
      written.write(key, index, array[index])  # float32 in, each array's dtype stored
  got = _load(out)
  assert np.array_equal(got["params"]["decoder"]["moe"]["wi_0"], want[WI])
  assert np.array_equal(got["MoEBiasVar"]["decoder"]["moe"]["bias"], want[BIAS])
  embedding = got["params"]["token_embedder"]["embedding"]
  assert embedding.dtype == ml_dtypes.bfloat16 and np.array_equal(embedding, want[EMBED].astype(ml_dtypes.bfloat16))
  # the skeleton's tree is orbax's own: no shapes in it, so nothing of the placeholders survives
  assert "shape" not in (out / "items" / "_METADATA").read_text()
  assert json.loads((out / "_CHECKPOINT_METADATA").read_text())["item_handlers"]


def test_the_regions_arithmetic_finds_an_array_no_tensor_fills():
  shapes = {WI: (2, 3, 5, 6), EMBED: (7, 5)}
  every = [(WI, i) for i in _regions(PATTERN[WI], shapes[WI])] + [(EMBED, PATTERN[EMBED])]
  assert sink.covered(shapes, every) is None
  assert sink.covered(shapes, every[1:]) == WI  # one expert of one layer missing
  assert sink.covered(shapes, every[:-1]) == EMBED


def test_the_trainer_layout_names_each_array_by_its_tree_path(tmp_path):
  shapes = {WI: (2, 1, 3, 4)}
  written = sink.Sink(tmp_path / "step", shapes, {WI: np.dtype(np.float32)}, {WI: (1, 1, 3, 4)}, trainer_layout=True)
  for index in _regions(PATTERN[WI], shapes[WI]):
    written.write(WI, index, np.full((3, 4), index[0], np.float32))
  got = _load(tmp_path / "step")  # the tree's top is the key's own "params"
  assert got["params"]["decoder"]["moe"]["wi_0"][:, 0].tolist() == [[[0.0] * 4] * 3, [[1.0] * 4] * 3]
