"""The pieces of the Hugging Face export that need no torch and no trained run (MaxText/hf/).

RoPE's column order, every transform's round trip, the digest folded slice by slice against the one a save
records, the header-first safetensors against the safetensors library, and the bad inputs that stop before a
checkpoint is read. tests/test_hf_export.py exports a trained run and compares with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from MaxText.checkpoints import records as checkpoint_records
from MaxText.hf import export_cli as export_hf
from MaxText.hf import checkpoint, errors, layout, safetensors
from MaxText.hf.errors import BAD_INPUT, DAMAGED, NO_CHECKPOINT


def _rope_halves(x_TR, pos_T, theta=10_000.0):
  """MaxText's plain RoPE: column i turns with column i + r/2 at frequency i."""
  r = x_TR.shape[-1]
  freq = theta ** (-np.arange(r // 2) * 2 / r)
  ang = pos_T[:, None] * freq[None]
  a, b = x_TR[:, : r // 2], x_TR[:, r // 2:]
  return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], axis=-1)


def _rope_interleaved(x_TR, pos_T, theta=10_000.0):
  """DeepSeek's (transformers' rope_interleave=True): columns 2i and 2i + 1 turn together at frequency i."""
  r = x_TR.shape[-1]
  freq = theta ** (-np.arange(r // 2) * 2 / r)
  ang = pos_T[:, None] * freq[None]
  a, b = x_TR[:, 0::2], x_TR[:, 1::2]
  out = np.empty_like(x_TR)
  out[:, 0::2], out[:, 1::2] = a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)
  return out


def test_rope_columns_interleaved_give_maxtexts_attention_scores():
  rng = np.random.default_rng(0)
  q_TR, k_TR, pos_T = rng.normal(size=(7, 8)), rng.normal(size=(7, 8)), np.arange(7.0) * 3
  want_TT = _rope_halves(q_TR, pos_T) @ _rope_halves(k_TR, pos_T).T
  perm = layout.rope_to_interleaved(8)
  assert list(perm) == [0, 4, 1, 5, 2, 6, 3, 7]
  got_TT = _rope_interleaved(q_TR[:, perm], pos_T) @ _rope_interleaved(k_TR[:, perm], pos_T).T
  np.testing.assert_allclose(got_TT, want_TT, rtol=1e-12, atol=1e-12)
  unpermuted_TT = _rope_interleaved(q_TR, pos_T) @ _rope_interleaved(k_TR, pos_T).T
  assert np.abs(unpermuted_TT - want_TT).max() > 0.1  # what an export without the permutation would give


TRANSFORMS = [(layout.SAME, (5,)), (layout.LINEAR, (6, 4)), (layout.heads_in(rope=4), (6, 3, 10)),
              (layout.heads_in(), (6, 3, 10)), (layout.HEADS_OUT, (3, 5, 6)), (layout.linear_rope_tail(4), (6, 12))]


@pytest.mark.parametrize("transform,shape", TRANSFORMS, ids=[t.name for t, _ in TRANSFORMS])
def test_every_transform_comes_back_bit_for_bit(transform, shape):
  x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
  y = transform.to_hf(x)
  assert y.shape == transform.hf_shape(shape)
  assert np.array_equal(transform.to_maxtext(y, shape), x)


def test_heads_in_moves_only_each_heads_rope_tail():
  """q_b_proj [in, H, nope + r] -> [H * (nope + r), in]: per head the nope columns stay, the r RoPE columns are
  interleaved, and heads stay in order (HF splits the rows per head, nope first)."""
  x = np.arange(2 * 2 * 6, dtype=np.float32).reshape(2, 2, 6)  # in 2, heads 2, nope 2 + rope 4
  rows = layout.heads_in(rope=4).to_hf(x)[:, 0]
  assert list(rows) == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


@pytest.mark.parametrize("dtype,block", [(np.float32, 1 << 22), (ml_dtypes.bfloat16, 1 << 22), (np.float32, 7)])
def test_digest_folded_slice_by_slice_is_the_saved_digest(dtype, block, monkeypatch):
  """The export checks what it reads against our record: slices read in any order (and folded a few rows at a
  time) add up to the digest the trainer takes of the whole array at save (MaxText/checkpoints/records.py's scan)."""
  monkeypatch.setattr(checkpoint, "BLOCK", block)
  x = np.random.default_rng(2).normal(size=(3, 4, 5, 6)).astype(dtype)
  _, (want,) = checkpoint_records.scan([x])
  sums = [0, 0, 0, 0]
  for e in (2, 0, 1):
    for layer in (3, 1, 0, 2):
      checkpoint.fold(sums, x.shape, x.dtype, (e, layer), x[e, layer])
  assert f"{sums[0]:08x}{sums[1]:08x}" == want and sums[2:] == [0, x.size]
  flipped = x.copy()
  flipped.view(np.uint8 if x.itemsize == 1 else np.uint16)[1, 2, 3, 4] ^= 1  # one bit
  again = [0, 0, 0, 0]
  checkpoint.fold(again, x.shape, x.dtype, (), flipped)
  assert f"{again[0]:08x}{again[1]:08x}" != want


def test_safetensors_shards_read_back_by_the_safetensors_library(tmp_path):
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(3)
  tensors = {f"t{i}": rng.normal(size=(i + 1, 3)).astype(np.float32) for i in range(6)}
  names = list(tensors)
  bf16 = np.dtype(ml_dtypes.bfloat16)
  safetensors.write(tmp_path, [(n, tensors[n].shape) for n in names], lambda i: tensors[names[i]], bf16,
                    max_shard_bytes=30)
  index = json.loads((tmp_path / safetensors.INDEX).read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and index["metadata"]["total_size"] == sum(t.size * 2 for t in tensors.values())
  loaded = {}
  for shard in shards:
    loaded.update(load_file(tmp_path / shard))
  reader = safetensors.Reader(tmp_path)
  for name, x in tensors.items():
    assert np.array_equal(loaded[name], x.astype(bf16)) and np.array_equal(reader.read(name), x.astype(bf16))


def _damage(raw: bytes, n: int, how: str) -> bytes:
  """One shard's bytes (8-byte length, n bytes of header, data) damaged one way."""
  header = raw[8:8 + n]
  return {
      "one byte not UTF-8": raw[:8] + header.replace(b'"shape"', b'"sh\xffpe"') + raw[8 + n:],
      "not JSON": raw[:8] + header.replace(b":", b";", 1) + raw[8 + n:],
      "an unknown dtype": raw[:8] + header.replace(b'"BF16"', b'"BX16"', 1) + raw[8 + n:],
      "offsets past the file": raw[:-4],
      "a header longer than the file": raw[:8 + n // 2],
      "empty": b"",
      "a tensor the index places there missing": raw[:8] + header.replace(b'"t1"', b'"u1"') + raw[8 + n:],
  }[how]


@pytest.mark.parametrize("how", ["one byte not UTF-8", "not JSON", "an unknown dtype", "offsets past the file",
                                 "a header longer than the file", "empty", "a tensor the index places there missing"])
def test_a_garbled_safetensors_header_is_damaged_input_naming_the_file(how, tmp_path, capsys):
  from MaxText.hf import import_cli as import_hf  # pylint: disable=import-outside-toplevel

  hf = tmp_path / "hf"
  hf.mkdir()
  tensors = {f"t{i}": np.full((2, 3), i, np.float32) for i in range(2)}
  safetensors.write(hf, [(n, x.shape) for n, x in tensors.items()], lambda i: tensors[f"t{i}"],
                    np.dtype(ml_dtypes.bfloat16), max_shard_bytes=1 << 20)
  shard = hf / json.loads((hf / safetensors.INDEX).read_text())["weight_map"]["t1"]
  raw = shard.read_bytes()
  shard.write_bytes(_damage(raw, int.from_bytes(raw[:8], "little"), how))
  with pytest.raises(errors.Damaged) as e:  # the reader, as the import's fill() calls it
    safetensors.Reader(hf).info("t1")
  assert str(e.value).startswith(str(shard)) and "\n" not in str(e.value)
  # The import finds it from the headers alone, before it builds a model from config.json.
  (hf / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"]}))
  assert import_hf.main([str(hf), str(tmp_path / "out")]) == DAMAGED
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"import_hf: {shard}") and err.count("\n") == 0, err
  assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def _export(tmp_path: Path, *args: str, capsys) -> tuple[int, str]:
  code = export_hf.main([*args])
  return code, capsys.readouterr().err.strip()


def test_export_refuses_a_run_without_checkpoints(tmp_path, capsys):
  code, err = _export(tmp_path, str(tmp_path / "run"), str(tmp_path / "out"), capsys=capsys)
  assert code == NO_CHECKPOINT and err.count("\n") == 0 and "has no checkpoints/ directory" in err
  (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)  # a save that never completed
  code, err = _export(tmp_path, str(tmp_path / "run"), str(tmp_path / "out"), capsys=capsys)
  assert code == NO_CHECKPOINT and "no complete checkpoint (steps present: 4)" in err
  code, err = _export(tmp_path, str(tmp_path / "run"), str(tmp_path / "out"), "--step", "4", capsys=capsys)
  assert code == NO_CHECKPOINT and "step 4" in err and "commit marker" in err
  code, err = _export(tmp_path, str(tmp_path / "run"), str(tmp_path / "out"), "--step", "7", capsys=capsys)
  assert code == NO_CHECKPOINT and "has no checkpoint step 7 (steps: 4)" in err
  assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_export_refuses_an_existing_output(tmp_path, capsys):
  (tmp_path / "out").mkdir()
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  code, err = _export(tmp_path, str(tmp_path / "run"), str(tmp_path / "out"), capsys=capsys)
  assert code == BAD_INPUT and "already exists" in err


@pytest.mark.parametrize("size", ["nan", "inf", "0", "-1"])
def test_export_refuses_a_shard_size_that_is_not_a_positive_number(size, tmp_path, capsys):
  # The run exists, so that the size (not a missing checkpoint) is what stops it: checked before anything is read.
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  code, err = _export(tmp_path, str(tmp_path / "run"), str(tmp_path / "out"), "--shard-size", size, capsys=capsys)
  assert code == BAD_INPUT and err.count("\n") == 0, err
  assert err.startswith(f"export_hf: --shard-size {float(size)}: ") and "finite number above 0" in err
  assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


# Tiny family configs (configs/<name>-tiny.yml) that no layout takes, and the reason each gives.
NO_LAYOUT = {
    "gpt-oss": "config key 'decoder_block' = 'gpt_oss': no Hugging Face layout for it yet",
    "llama4": "config key 'decoder_block' = 'llama4': no Hugging Face layout for it yet",
    "deepseek2": "config key 'routed_score_func' = 'softmax': DeepseekV3's router is sigmoid (DeepSeek-V2's",
}


@pytest.mark.parametrize("family", sorted(NO_LAYOUT))
def test_a_family_without_a_layout_is_refused_naming_the_key(family):
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.hf import errors, run as hf_run  # pylint: disable=import-outside-toplevel

  run = hf_run.on_this_machine(fork_config.load([f"configs/{family}-tiny.yml"]))
  with pytest.raises(errors.BadInput) as e:
    export_hf.family_of(hf_run.upstream_config(run), run.fork)
  assert str(e.value).startswith(NO_LAYOUT[family]) and "\n" not in str(e.value)


def test_import_refuses_another_architecture_and_missing_shards(tmp_path, capsys):
  from MaxText.hf import import_cli as import_hf  # pylint: disable=import-outside-toplevel

  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"],
                                                           "model_type": "gpt_oss"}))
  assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out")]) == BAD_INPUT
  err = capsys.readouterr().err.strip()
  assert err.startswith("import_hf: ") and "holds a GptOssForCausalLM: GPT-OSS's experts are stored fused" in err
  for arch, words in (("Llama4ForConditionalGeneration", "Llama 4 is multimodal"),
                      ("DeepseekV2ForCausalLM", "DeepSeek-V2's router (softmax scores")):
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": [arch]}))
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out")]) == BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"holds a {arch}: {words}" in err, err
  (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"]}))
  (tmp_path / "hf" / safetensors.INDEX).write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}}))
  assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out")]) == DAMAGED
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "model-00002-of-00002.safetensors is missing (1 tensors of the index" in err
  assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


@pytest.mark.parametrize("architecture, says", [
    ("DeepseekV3ForCausalLM", "the biases of q_a_proj, kv_a_proj_with_mqa and o_proj have no place here"),
    ("Qwen3MoeForCausalLM", "the biases of q, k, v and o_proj have no place here"),
])
def test_import_refuses_attention_bias_for_the_biases_we_lack(architecture, says, tmp_path, capsys):
  """attention_bias true, its biases saved with the weights (config and weights agree): the line names what our
  attention lacks, before the model is built (before: a bias tensor 'has no place in the config's model', blaming
  a config that describes another model). transformers' own save of such a model is in tests/test_hf_published.py's
  families; here config.json alone decides, so a one-tensor directory suffices."""
  from MaxText.hf import import_cli as import_hf  # pylint: disable=import-outside-toplevel

  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  config = {"architectures": [architecture], "attention_bias": True, "norm_topk_prob": True}
  (hf_dir / "config.json").write_text(json.dumps(config))
  safetensors.write(hf_dir, [("model.norm.weight", (4,))], lambda i: np.ones(4, np.float32), np.dtype(np.float32),
                    1 << 20)
  assert import_hf.main([str(hf_dir), str(tmp_path / "out")]) == BAD_INPUT
  err = capsys.readouterr().err.strip()
  assert err.startswith("import_hf: config.json attention_bias true: ") and says in err and "\n" not in err, err
  assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_config_keys_that_change_the_numbers_not_the_shapes_are_carried_refused_or_named():
  """Beside rope_interleave (tests/test_hf_published.py): YaRN over part of the columns is refused (transformers
  turns head_dim x partial_rotary_factor of them, ours all), and the training-only keys are named as not carried."""
  from MaxText.hf import config_json, deepseek  # pylint: disable=import-outside-toplevel

  yarn = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}
  with pytest.raises(errors.BadInput, match="partial_rotary_factor 0.5: our YaRN turns every RoPE column"):
    deepseek.maxtext_keys({"max_position_embeddings": 163840, "rope_parameters": {**yarn, "partial_rotary_factor": 0.5}})
  assert deepseek.maxtext_keys({"max_position_embeddings": 163840, "rope_parameters": yarn})["rope_type"] == "yarn"
  assert config_json.training_only({"attention_dropout": 0.1, "router_jitter_noise": 0.0}, "mixtral") == [
      "attention_dropout 0.1"]
  assert config_json.training_only({"router_jitter_noise": 0.01}, "mixtral") == ["router_jitter_noise 0.01"]
  assert config_json.training_only({"router_jitter_noise": 0.01}, "qwen3_moe") == []  # not a Qwen3MoeConfig key


def test_the_export_reads_an_ep_sharded_array_a_stored_chunk_at_a_time():
  """An array [experts 8, layers 3, ...] stored in chunks of 4 experts x every layer (EP over 2): pieces come layer by
  layer, expert by expert; read so, each chunk would be decoded once per layer with a one-chunk cache. Ordered, the
  pieces of one chunk are contiguous, and the other arrays keep their place."""
  wi, norm = ("params", "params", "wi"), ("params", "params", "norm")
  pieces = [layout.Piece(f"l{l}.e{e}", wi, (e, l, slice(None)), layout.SAME, (2,)) for l in range(3) for e in range(8)]
  pieces.insert(0, layout.Piece("norm", norm, (slice(None),), layout.SAME, (2,)))
  got = export_hf.ordered(pieces, {wi: (4, 3, 2), norm: (2,)})
  chunks = [p.index[0] // 4 for p in got[1:]]
  assert got[0].name == "norm" and chunks == sorted(chunks)  # each chunk's 12 pieces together
  assert [p.name for p in got[1:13]] == [f"l{l}.e{e}" for l in range(3) for e in range(4)]  # in order within it
