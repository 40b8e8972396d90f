"""A tiny trained DeepSeek-V3 exported (python -m MaxText.export_hf) and run by transformers' DeepseekV3ForCausalLM.

Slow: each block trains the tiny model 5 steps (with an MTP module, and a routing-bias rate high enough that the
bias changes which experts are picked), then: every weight lands where DeepSeek publishes it; transformers' logits
(torch, CPU, float32, the environment scripts/hf_env.sh builds) equal our forward's within 1e-4; the same export
with the routing bias zeroed (what upstream's converter leaves) or without the RoPE column order is off by far
more; a damaged checkpoint is refused, nothing written.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from conftest import REPO, run_train
from MaxText import export_hf
from MaxText.hf import checkpoint, layout, safetensors
from MaxText.hf.errors import DAMAGED, NO_CHECKPOINT

pytestmark = pytest.mark.slow
TOL = 1e-4  # float32 logits, ours against transformers' (measured: 3e-6)
TRAIN = ("configs/deepseek3-tiny.yml", "steps=5", "mtp_num_layers=1", "routed_bias_update_rate=0.05")
_RUNS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  def get(block: str) -> Path:
    if block not in _RUNS:
      result = run_train(tmp_path_factory.mktemp(f"hf_{block}"), *TRAIN, f"moe_block={block}", run_name=block)
      assert result.returncode == 0, result.stderr[-3000:]
      _RUNS[block] = result.run_dir
    return _RUNS[block]

  return get


@pytest.fixture(scope="session")
def hf_python() -> str:
  """.venv-hf's python (scripts/hf_env.sh; one builder at a time across pytest-xdist workers)."""
  with open(Path(tempfile.gettempdir()) / "maxtext-moe-hf-env.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    proc = subprocess.run([str(REPO / "scripts" / "hf_env.sh")], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.strip().splitlines()[-1]


def _export(run_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "MaxText.export_hf", str(run_dir), str(out), *args], cwd=REPO,
                        capture_output=True, text=True, check=False)


def _ours(run_dir: Path, out: Path) -> np.ndarray:
  proc = subprocess.run([sys.executable, "tests/hf_logits.py", "ours", str(run_dir), str(out)], cwd=REPO,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return np.load(out)


def _hf(hf_python: str, hf_dir: Path, out: Path) -> np.ndarray:
  proc = subprocess.run([hf_python, "tests/hf_logits.py", "hf", str(hf_dir), str(out)], cwd=REPO,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "DeepseekV3ForCausalLM" in proc.stdout
  return np.load(out)


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


def test_export_places_every_weight_where_deepseek_publishes_it(trained, tmp_path):
  from transformers import AutoConfig  # pylint: disable=import-outside-toplevel  (no torch needed)

  run_dir = trained("ours")
  proc = _export(run_dir, tmp_path / "f32", "--dtype", "f32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "digests as at save" in proc.stderr and "peak resident memory" in proc.stderr
  config = AutoConfig.from_pretrained(tmp_path / "f32")
  assert type(config).__name__ == "DeepseekV3Config" and config.rope_interleave
  assert (config.num_hidden_layers, config.first_k_dense_replace, config.n_routed_experts, config.n_group,
          config.topk_group, config.num_nextn_predict_layers) == (5, 3, 8, 4, 3, 1)
  f32 = safetensors.Reader(tmp_path / "f32")
  assert set(f32.names()) == _expected_names(5, 3, 8, 1)
  ckpt = checkpoint.Checkpoint(run_dir)
  bias_LE = ckpt.peek(checkpoint.AUX + ("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias"), ())
  assert np.abs(bias_LE).max() > 0.05  # trained away from zero
  for i in (0, 1):
    assert np.array_equal(f32.read(f"model.layers.{3 + i}.mlp.gate.e_score_correction_bias"), bias_LE[i])
  assert np.array_equal(f32.read("model.layers.5.shared_head.head.weight"), f32.read("lm_head.weight"))
  proc = _export(run_dir, tmp_path / "bf16")
  assert proc.returncode == 0, proc.stderr[-3000:]
  bf16 = safetensors.Reader(tmp_path / "bf16")
  for name in ("model.layers.4.mlp.experts.7.down_proj.weight", "model.layers.1.self_attn.q_b_proj.weight"):
    assert np.array_equal(bf16.read(name), f32.read(name).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("block", ["ours", "upstream"])
def test_transformers_logits_equal_ours(block, trained, hf_python, tmp_path):
  run_dir = trained(block)
  proc = _export(run_dir, tmp_path / "hf", "--dtype", "f32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  ours, theirs = _ours(run_dir, tmp_path / "ours.npy"), _hf(hf_python, tmp_path / "hf", tmp_path / "hf.npy")
  diff = float(np.abs(ours - theirs).max())
  print(f"moe_block={block}: max |ours - transformers| = {diff:.2e} over logits of max |{np.abs(ours).max():.2f}|")
  assert diff < TOL


def _without_bias(src: Path, dst: Path) -> None:
  """The export with every e_score_correction_bias zeroed: what transformers holds after upstream's converter."""
  reader = safetensors.Reader(src)
  names = list(reader.names())
  dst.mkdir()
  shutil.copy(src / "config.json", dst / "config.json")
  produce = lambda i: np.zeros_like(reader.read(names[i])) if "e_score" in names[i] else reader.read(names[i])  # noqa: E731
  safetensors.write(dst, [(n, tuple(reader.info(n)["shape"])) for n in names], produce, np.dtype(np.float32), 5e9)


def test_dropping_the_bias_or_the_rope_order_breaks_the_logits(trained, hf_python, tmp_path, monkeypatch):
  """The two things upstream's path misses, each shown to matter: the same comparison fails without either."""
  run_dir = trained("ours")
  assert _export(run_dir, tmp_path / "hf", "--dtype", "f32").returncode == 0
  ours = _ours(run_dir, tmp_path / "ours.npy")
  _without_bias(tmp_path / "hf", tmp_path / "no_bias")
  monkeypatch.setattr(layout, "rope_to_interleaved", np.arange)  # columns left in MaxText's order
  export_hf.export(run_dir, tmp_path / "no_rope", None, "f32", int(5e9))
  diffs = {}
  for variant in ("no_bias", "no_rope"):
    diffs[variant] = float(np.abs(ours - _hf(hf_python, tmp_path / variant, tmp_path / f"{variant}.npy")).max())
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
  proc = _export(run_dir, tmp_path / "out")
  assert proc.returncode == DAMAGED, proc.stderr[-3000:]
  line = proc.stderr.strip().splitlines()[-1]
  assert line.startswith(f"export_hf: checkpoint step {step} of {run_dir} is damaged: ")
  assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
  (run_dir / "maxtext-moe" / "checkpoints" / f"{step}.json").unlink()  # our record of the save gone
  proc = _export(run_dir, tmp_path / "out", "--step", str(step))
  assert proc.returncode == NO_CHECKPOINT and "no record of ours" in proc.stderr
