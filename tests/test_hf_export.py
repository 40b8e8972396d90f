"""A tiny trained DeepSeek-V3 exported (python -m MaxText.export_hf) and run by transformers' DeepseekV3ForCausalLM.

Slow: each block trains the tiny model 5 steps (with an MTP module, and a routing-bias rate high enough that the
bias changes which experts are picked), then: every weight lands where DeepSeek publishes it; transformers' logits
(torch, CPU, float32, the environment scripts/hf_env.sh builds) equal our forward's within 1e-4, from the float32
export, from the bf16 one (against our forward on the same rounded weights; the routing bias stays float32), and
from the run's record with the 671B YaRN keys at 4,160 tokens; the same export with the routing bias zeroed (what
upstream's converter leaves) or without the RoPE column order is off by far more; a damaged checkpoint is refused,
nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import hf_helpers
from conftest import run_train
from MaxText.hf import export_cli as export_hf
from MaxText.hf import checkpoint, deepseek, layout, safetensors
from MaxText.hf.errors import BAD_INPUT, DAMAGED, NO_CHECKPOINT

pytestmark = pytest.mark.slow
TOL = 1e-4  # float32 logits, ours against transformers' (measured: 3e-6)
# The schedule pinned to 6 steps: the run resumed to step 6 and the run started from its import (one step) then
# compile the trained run's train step, from the session's cache.
TRAIN = ("configs/deepseek3-tiny.yml", "steps=5", "learning_rate_schedule_steps=6", "mtp_num_layers=1",
         "routed_bias_update_rate=0.05")
_RUNS: dict[str, Path] = {}
ARCH = "DeepseekV3ForCausalLM"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  def get(block: str) -> Path:
    if block not in _RUNS:
      result = run_train(tmp_path_factory.mktemp(f"hf_{block}"), *TRAIN, f"moe_block={block}", run_name=block)
      assert result.returncode == 0, result.stderr[-3000:]
      _RUNS[block] = result.run_dir
    return _RUNS[block]

  return get


_CACHED: dict[tuple, Path] = {}


def _exported(run_dir: Path, dtype: str, root: Path) -> Path:
  """One export per run and dtype for the module (each is a subprocess that starts upstream's config)."""
  if (run_dir, dtype) not in _CACHED:
    out = root / f"{run_dir.name}_{dtype}"
    proc = hf_helpers.export(run_dir, out, "--dtype", dtype)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _CACHED[(run_dir, dtype)] = out
  return _CACHED[(run_dir, dtype)]


def _ours_cached(run_dir: Path, root: Path) -> np.ndarray:
  if (run_dir, "ours") not in _CACHED:
    hf_helpers.ours(run_dir, root / f"{run_dir.name}_ours.npy")
    _CACHED[(run_dir, "ours")] = root / f"{run_dir.name}_ours.npy"
  return np.load(_CACHED[(run_dir, "ours")])


def _expected_names(layers: int, dense: int, experts: int, mtp: int) -> set[str]:
  attn = ["input_layernorm", "post_attention_layernorm", "self_attn.q_a_proj", "self_attn.q_a_layernorm",
          "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
          "self_attn.o_proj"]
  dense_mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
  moe = ["mlp.gate", *[f"mlp.shared_experts.{w}" for w in ("gate_proj", "up_proj", "down_proj")],
         *[f"mlp.experts.{e}.{w}" for e in range(experts) for w in ("gate_proj", "up_proj", "down_proj")]]
  names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
  for i in range(layers + mtp):
    names |= {f"model.layers.{i}.{n}.weight" for n in attn + (dense_mlp if i < dense else moe)}
    if i >= dense:
      names.add(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
    if i >= layers:
      names |= {f"model.layers.{i}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "embed_tokens",
                                                           "shared_head.norm", "shared_head.head")}
  return names


def test_export_places_every_weight_where_deepseek_publishes_it(trained, tmp_path, tmp_path_factory):
  from transformers import AutoConfig  # pylint: disable=import-outside-toplevel  (no torch needed)

  run_dir, root = trained("ours"), tmp_path_factory.getbasetemp()
  out = root / f"{run_dir.name}_f32"  # kept for the module's other tests (pytest removes a passed test's tmp_path)
  proc = hf_helpers.export(run_dir, out, "--dtype", "f32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "digests as at save" in proc.stderr and "peak resident memory" in proc.stderr
  _CACHED[(run_dir, "f32")] = out
  config = AutoConfig.from_pretrained(out)
  assert type(config).__name__ == "DeepseekV3Config" and config.rope_interleave
  assert (config.num_hidden_layers, config.first_k_dense_replace, config.n_routed_experts, config.n_group,
          config.topk_group, config.num_nextn_predict_layers) == (5, 3, 8, 4, 3, 1)
  f32 = safetensors.Reader(out)
  assert set(f32.names()) == _expected_names(5, 3, 8, 1)
  ckpt = checkpoint.Checkpoint(run_dir)
  bias_LE = ckpt.peek(checkpoint.AUX + ("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias"), ())
  assert np.abs(bias_LE).max() > 0.05  # trained away from zero
  for i in (0, 1):
    assert np.array_equal(f32.read(f"model.layers.{3 + i}.mlp.gate.e_score_correction_bias"), bias_LE[i])
  assert np.array_equal(f32.read("model.layers.5.shared_head.head.weight"), f32.read("lm_head.weight"))
  bf16 = safetensors.Reader(_exported(run_dir, "bf16", root))
  for name in ("model.layers.4.mlp.experts.7.down_proj.weight", "model.layers.1.self_attn.q_b_proj.weight"):
    assert np.array_equal(bf16.read(name), f32.read(name).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("block", ["ours", "upstream"])
def test_transformers_logits_equal_ours(block, trained, hf_python, tmp_path, tmp_path_factory):
  run_dir, root = trained(block), tmp_path_factory.getbasetemp()
  ours = _ours_cached(run_dir, root)
  theirs = hf_helpers.theirs(hf_python, _exported(run_dir, "f32", root), tmp_path / "hf.npy", ARCH)
  diff = float(np.abs(ours - theirs).max())
  print(f"moe_block={block}: max |ours - transformers| = {diff:.2e} over logits of max |{np.abs(ours).max():.2f}|")
  assert diff < TOL


def test_bf16_export_keeps_the_bias_in_float32_and_gives_our_logits_on_its_weights(trained, hf_python, tmp_path,
                                                                                   tmp_path_factory):
  """--dtype bf16: every tensor bf16 but e_score_correction_bias, float32 and the run's bits (DeepSeek publishes it
  so, and transformers keeps it float32 in any dtype: _keep_in_fp32_modules_strict). transformers on that export
  gives our logits on the same weights (the bf16 import, restored by load_parameters_path) within the float32
  tolerance: the rounding is the export's only change. Against the run's float32 weights the bf16 rounding moves
  the logits (measured: 8.1e-2 of 4.3, argmax 48 of 48), bounded here by 5% of their range. This run's trained bias
  is +-0.05 everywhere (sign updates), which bf16 moves by the same 4.9e-5 in every entry: rounding it changes no
  pick here (measured on a 5-step schedule: the same 2.9e-6), so only its bits are asserted, not its effect."""
  run_dir, root = trained("ours"), tmp_path_factory.getbasetemp()
  out = _exported(run_dir, "bf16", root)
  reader = safetensors.Reader(out)
  dtypes = {name: reader.info(name)["dtype"] for name in reader.names()}
  bias_names = [n for n in dtypes if n.endswith("e_score_correction_bias")]
  assert {dtypes[n] for n in bias_names} == {"F32"} and {d for n, d in dtypes.items() if n not in bias_names} == {
      "BF16"}
  bias_LE = checkpoint.Checkpoint(run_dir).peek(checkpoint.AUX + ("decoder", "moe_layers", *deepseek.BIAS), ())
  for i in (0, 1):
    got = reader.read(f"model.layers.{3 + i}.mlp.gate.e_score_correction_bias")
    assert np.array_equal(got.view(np.uint32), bias_LE[i].view(np.uint32))
  same = hf_helpers.ours(run_dir, tmp_path / "ours_bf16.npy", "--params", str(_imported(run_dir, "bf16", root)))
  theirs = hf_helpers.theirs(hf_python, out, tmp_path / "hf.npy", ARCH)
  ours = _ours_cached(run_dir, root)
  diff, rounding = float(np.abs(same - theirs).max()), float(np.abs(ours - theirs).max())
  print(f"bf16 export: max |ours on its weights - transformers| = {diff:.2e}; against the run's float32 weights "
        f"{rounding:.2e} over logits of max |{np.abs(ours).max():.2f}|, argmax "
        f"{int((ours.argmax(-1) == theirs.argmax(-1)).sum())} of {ours.shape[0] * ours.shape[1]}")
  assert diff < TOL and rounding < 0.05 * np.abs(ours).max()


# configs/models/deepseek3-671b-yarn.yml's YaRN: DeepSeek-V3 after its context extension (163,840 positions from
# 4,096). YaRN changes no shape, so the trained run's record with these keys is a YaRN run of the same weights.
YARN_671B = {"rope_type": "yarn", "max_position_embeddings": 163840, "original_max_position_embeddings": 4096,
             "rope_factor": 40, "beta_fast": 32, "beta_slow": 1, "rope_interleave": False, "rope_truncate": True,
             "rope_attention_scaling": False}
LONG = 4096 + 64  # past the original length, where YaRN's interpolated frequencies and its softmax scale act


def test_a_yarn_run_exported_gives_transformers_our_logits_past_the_original_length(trained, hf_python, tmp_path,
                                                                                    tmp_path_factory):
  """The run's config record (maxtext-moe/effective_config.json) with the 671B YaRN keys: exported, its config.json
  holds transformers' yarn rope_parameters, and DeepseekV3ForCausalLM gives our logits at 4,160 tokens within 1e-4
  (measured 5.4e-6). The same weights under the plain-RoPE export are off by far more there."""
  run_dir, root = trained("ours"), tmp_path_factory.getbasetemp()
  yarn = shutil.copytree(run_dir, tmp_path / "outputs" / "yarn", ignore=shutil.ignore_patterns("jax_cache"))
  record = yarn / "maxtext-moe" / "effective_config.json"
  effective = json.loads(record.read_text())
  effective["upstream_overrides"].update(YARN_671B)
  record.write_text(json.dumps(effective))
  proc = hf_helpers.export(yarn, tmp_path / "hf", "--dtype", "f32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rope = json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]
  assert rope == {"rope_type": "yarn", "rope_theta": 10000, "factor": 40, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 4096, "truncate": True, "mscale": 1.0, "mscale_all_dim": 1.0}
  ours = hf_helpers.ours(yarn, tmp_path / "ours.npy", length=LONG)
  theirs = hf_helpers.theirs(hf_python, tmp_path / "hf", tmp_path / "hf.npy", ARCH, LONG)
  plain = hf_helpers.theirs(hf_python, _exported(run_dir, "f32", root), tmp_path / "plain.npy", ARCH, LONG)
  diff, off = float(np.abs(ours - theirs).max()), float(np.abs(ours - plain).max())
  print(f"YaRN export at {LONG} tokens: max |ours - transformers| = {diff:.2e} over logits of max "
        f"|{np.abs(ours).max():.2f}|; with the plain-RoPE export {off:.3g}")
  assert diff < TOL and off > 100 * TOL


def _without_bias(src: Path, dst: Path) -> None:
  """The export with every e_score_correction_bias zeroed: what transformers holds after upstream's converter."""
  reader = safetensors.Reader(src)
  names = list(reader.names())
  dst.mkdir()
  shutil.copy(src / "config.json", dst / "config.json")
  produce = lambda i: np.zeros_like(reader.read(names[i])) if "e_score" in names[i] else reader.read(names[i])  # noqa: E731
  safetensors.write(dst, [(n, tuple(reader.info(n)["shape"])) for n in names], produce, np.dtype(np.float32), 5e9)


def test_dropping_the_bias_or_the_rope_order_breaks_the_logits(trained, hf_python, tmp_path, monkeypatch,
                                                              tmp_path_factory):
  """The two things upstream's path misses, each shown to matter: the same comparison fails without either."""
  run_dir, root = trained("ours"), tmp_path_factory.getbasetemp()
  ours = _ours_cached(run_dir, root)
  _without_bias(_exported(run_dir, "f32", root), tmp_path / "no_bias")
  monkeypatch.setattr(layout, "rope_to_interleaved", np.arange)  # columns left in MaxText's order
  export_hf.export(run_dir, tmp_path / "no_rope", None, "f32", int(5e9))
  diffs = {}
  for variant in ("no_bias", "no_rope"):
    theirs = hf_helpers.theirs(hf_python, tmp_path / variant, tmp_path / f"{variant}.npy", ARCH)
    diffs[variant] = float(np.abs(ours - theirs).max())
  print(f"max |ours - transformers|: bias zeroed {diffs['no_bias']:.3g}, RoPE columns not interleaved "
        f"{diffs['no_rope']:.3g} (tolerance {TOL})")
  assert min(diffs.values()) > 100 * TOL


def test_a_damaged_checkpoint_is_refused_and_nothing_is_written(trained, tmp_path):
  run_dir = shutil.copytree(trained("ours"), tmp_path / "run", ignore=shutil.ignore_patterns("jax_cache"))
  step = max(s for s, _ in checkpoint.checkpoint_records.step_dirs(run_dir))
  # One bit in the middle of every data file: the parameters' among them (a file of the optimizer's state alone
  # is not read by an export, and would pass).
  for data in (p for p in (run_dir / "checkpoints" / str(step) / "items").rglob("d/*") if p.is_file()):
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
  proc = hf_helpers.export(run_dir, tmp_path / "out")
  assert proc.returncode == DAMAGED, proc.stderr[-3000:]
  line = proc.stderr.strip().splitlines()[-1]
  assert line.startswith(f"export_hf: checkpoint step {step} of {run_dir} is damaged: ")
  assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
  (run_dir / "maxtext-moe" / "checkpoints" / f"{step}.json").unlink()  # our record of the save gone
  proc = hf_helpers.export(run_dir, tmp_path / "out", "--step", str(step))
  assert proc.returncode == NO_CHECKPOINT and "no record of ours" in proc.stderr


# --- import: python -m MaxText.import_hf, and training from what it writes ---


def _imported(run_dir: Path, dtype: str, root: Path) -> Path:
  """One import of each export for the module (the bf16 one is also the weights of the bf16 parity test)."""
  if (run_dir, dtype, "imported") not in _CACHED:
    out = root / f"{run_dir.name}_{dtype}_imported"
    proc = hf_helpers.import_(_exported(run_dir, dtype, root), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not imported" not in proc.stderr  # the config takes the MTP module too
    _CACHED[(run_dir, dtype, "imported")] = out
  return _CACHED[(run_dir, dtype, "imported")]


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_import_of_an_export_gives_the_runs_parameters_bit_for_bit(dtype, trained, tmp_path_factory):
  """From bf16, every weight after the same rounding, except the routing bias: the export writes it in float32."""
  run_dir = trained("ours")
  got = hf_helpers.params_checkpoint(_imported(run_dir, dtype, tmp_path_factory.getbasetemp()))
  ckpt = checkpoint.Checkpoint(run_dir)
  assert sorted(got) == sorted(ckpt.arrays)
  for key, x in got.items():
    want = ckpt.peek(key, ())
    if dtype == "bf16" and key[:len(checkpoint.AUX)] != checkpoint.AUX:
      want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert x.dtype == want.dtype and np.array_equal(x.view(np.uint32), want.view(np.uint32)), key


def test_a_run_trains_from_the_import_and_its_logits_are_the_runs(trained, tmp_path, tmp_path_factory):
  """load_parameters_path restores every weight (the routing bias included): upstream's own params-only load gives
  logits identical to the run's checkpoint, and a run started from it has, at its first step, the loss the
  original run has when it resumes from that checkpoint (the tiny config's synthetic data is one fixed batch)."""
  run_dir, root = trained("ours"), tmp_path_factory.getbasetemp()
  params = _imported(run_dir, "f32", root)  # the f32 export's import, as the bit-for-bit test reads it
  ours = _ours_cached(run_dir, root)
  assert np.array_equal(hf_helpers.ours(run_dir, tmp_path / "imp.npy", "--params", str(params)), ours)
  resumed = shutil.copytree(run_dir, tmp_path / "resumed" / "outputs" / "resumed")
  again = run_train(tmp_path / "resumed", *TRAIN, "steps=6", "moe_block=ours", run_name="resumed")
  assert again.returncode == 0 and resumed == again.run_dir, again.stderr[-3000:]
  started = run_train(tmp_path, *TRAIN, "steps=1", f"load_parameters_path={params}", run_name="started")
  assert started.returncode == 0, started.stderr[-3000:]
  print(f"loss at the import's first step {started.losses()[0]:.7f}, the run's after resuming "
        f"{again.losses()[5]:.7f}")
  assert abs(started.losses()[0] - again.losses()[5]) <= 1e-6 * abs(again.losses()[5])


def _fp8_blocks(w_OI: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
  """DeepSeek-V3's released form: float8_e4m3fn weights and a float32 scale_inv per block x block tile."""
  rows, cols = -(-w_OI.shape[0] // block), -(-w_OI.shape[1] // block)
  s = np.zeros((rows, cols), np.float32)
  q = np.zeros(w_OI.shape, ml_dtypes.float8_e4m3fn)
  for i in range(rows):
    for j in range(cols):
      tile = w_OI[i * block:(i + 1) * block, j * block:(j + 1) * block]
      s[i, j] = max(np.abs(tile).max(), 1e-12) / 448.0
      q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s[i, j]).astype(ml_dtypes.float8_e4m3fn)
  return q, s


def test_fp8_block_scaled_weights_are_dequantized_as_read(trained, tmp_path, tmp_path_factory):
  run_dir = trained("ours")
  hf_dir = _exported(run_dir, "f32", tmp_path_factory.getbasetemp())
  reader = safetensors.Reader(hf_dir)
  fp8 = {n for n in reader.names() if n.endswith("proj.weight") and "layers.0." not in n}  # layer 0 stays f32
  tensors, want = [], {}
  for name in reader.names():
    x = reader.read(name)
    if name in fp8:
      q, s = _fp8_blocks(x, block=16)  # the tiny widths are under 128: 16 x 16 tiles, so that several scales act
      tensors += [(name, q), (f"{name}_scale_inv", s)]
      want[name] = q.astype(np.float32) * np.repeat(np.repeat(s, 16, 0), 16, 1)[: x.shape[0], : x.shape[1]]
    else:
      tensors.append((name, x))
  (tmp_path / "fp8").mkdir()
  config = json.loads((hf_dir / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
  (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
  for dtype in (np.dtype(np.float32), np.dtype(ml_dtypes.float8_e4m3fn)):  # safetensors' shards hold one dtype here
    part = [(n, x) for n, x in tensors if x.dtype == dtype]
    sub = tmp_path / f"part_{dtype.name}"
    sub.mkdir()
    safetensors.write(sub, [(n, x.shape) for n, x in part], lambda i, part=part: part[i][1], dtype, 5e9)
  _merge_shards(tmp_path / "fp8", [tmp_path / "part_float32", tmp_path / "part_float8_e4m3fn"])
  proc = hf_helpers.import_(tmp_path / "fp8", tmp_path / "params")
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = hf_helpers.params_checkpoint(tmp_path / "params")
  q_b = want["model.layers.3.self_attn.q_b_proj.weight"]
  assert not np.array_equal(q_b, reader.read("model.layers.3.self_attn.q_b_proj.weight"))  # FP8 lost bits
  key = checkpoint.PARAMS + ("decoder", "moe_layers", "self_attention", "wq_b", "kernel")
  assert np.array_equal(got[key][:, 0], layout.heads_in(rope=8).to_maxtext(q_b, got[key][:, 0].shape))
  key = checkpoint.PARAMS + ("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "wo")
  assert np.array_equal(got[key][5, 1], want["model.layers.4.mlp.experts.5.down_proj.weight"].T)


def _merge_shards(dst: Path, parts: list[Path]) -> None:
  weight_map = {}
  for n, part in enumerate(parts):
    for shard in sorted(part.glob("*.safetensors")):
      name = f"part{n}-{shard.name}"
      shutil.move(shard, dst / name)
      index = json.loads((part / safetensors.INDEX).read_text())["weight_map"]
      weight_map.update({t: name for t, s in index.items() if s == shard.name})
  (dst / safetensors.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_import_refuses_bad_input_in_one_line_and_writes_nothing(trained, tmp_path, tmp_path_factory):
  shutil.copytree(_exported(trained("ours"), "f32", tmp_path_factory.getbasetemp()), tmp_path / "hf")
  cases = {
      "widths": (["configs/deepseek3-tiny.yml", "mtp_num_layers=1", "base_moe_mlp_dim=16"], BAD_INPUT,
                 "config key 'base_moe_mlp_dim' = 16 but "),
      "layers": (["configs/deepseek3-tiny.yml", "mtp_num_layers=1", "base_num_decoder_layers=4"], BAD_INPUT,
                 "config key 'base_num_decoder_layers' = 4 but "),
  }
  for name, (args, code, words) in cases.items():
    proc = hf_helpers.import_(tmp_path / "hf", tmp_path / name, *args)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == code and line.startswith("import_hf: ") and words in line, (name, proc.stderr[-2000:])
    assert not (tmp_path / name).exists() and not (tmp_path / f"{name}.tmp").exists()
  shard = next((tmp_path / "hf").glob("*.safetensors"))
  shard.rename(shard.with_suffix(".gone"))
  proc = hf_helpers.import_(tmp_path / "hf", tmp_path / "missing")
  assert proc.returncode == DAMAGED and f"{shard.name} is missing (" in proc.stderr.strip().splitlines()[-1]
