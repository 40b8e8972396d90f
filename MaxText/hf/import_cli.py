"""Published weights in: a Hugging Face directory to a parameters checkpoint that `load_parameters_path` trains from.

  python -m MaxText.import_hf HF_DIR OUT_DIR [config.yml] [key=value ...]
  python -m MaxText.train CONFIG load_parameters_path=OUT_DIR ...

Without a config, the model's keys come from HF_DIR/config.json, read as its transformers class reads it
(MaxText/hf/config_json.py), on the family's tiny CPU config (run settings only: the widths are all HF's); with
one, every key that changes the function must equal config.json's (the first that differs stops the import, naming
both values, before anything is converted). Every parameter the config builds comes from a tensor (the routing
bias too), and every tensor goes to a parameter (the MTP module's copies of the embedding and head aside: MaxText
shares the main ones). DeepSeek's FP8 weights (float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block)
are dequantized as they are read. The checkpoint is written a tensor at a time (MaxText/hf/sink.py): the host holds
the tensor being written, never the model. OUT_DIR is claimed before anything is read, written to OUT_DIR.tmp, fsynced and renamed when
complete (MaxText/hf/output.py). Exit codes: MaxText/hf/errors.py.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import patches
from MaxText import config as fork_config
from MaxText.hf import checkpoint, config_json, deepseek, gqa, output, quiet, run as hf_run, safetensors, sink, stop
from MaxText.hf.errors import BadInput, Damaged, HFError

# config.json's architecture -> what lays it out (pieces, maxtext_keys, free_keys, DEFAULT_CONFIG)
FAMILIES = {f.ARCHITECTURE: f for f in (deepseek, gqa.QWEN3_MOE, gqa.MIXTRAL)}
# Architectures our trainer runs (configs/models/) that the import does not map yet, and why.
NOT_MAPPED = {
    "GptOssForCausalLM": "GPT-OSS's experts are stored fused (gate_up_proj, with biases, interleaved gate and up "
                         "columns) and its attention has sinks and alternating sliding windows: no layout here yet",
    "Llama4ForConditionalGeneration": "Llama 4 is multimodal (a vision tower beside the text model), with chunked "
                                      "attention, fused experts and MoE layers interleaved with dense ones: no "
                                      "layout here yet",
    "Llama4ForCausalLM": "Llama 4's text model has chunked attention, fused experts and MoE layers interleaved "
                         "with dense ones: no layout here yet",
    "DeepseekV2ForCausalLM": "DeepSeek-V2's router (softmax scores, group-limited greedy top-k without a bias) and "
                             "its YaRN on MLA are not mapped: no layout here yet",
}
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def log(msg: str) -> None:
  print(f"[import_hf] {msg}", file=sys.stderr, flush=True)


def read_hf(hf_dir: Path) -> tuple[dict[str, Any], Any, safetensors.Reader]:
  """(config.json, family module, tensor reader); BadInput for another architecture, Damaged for missing shards or
  one whose header does not parse or fit its file."""
  try:
    hf = json.loads((hf_dir / "config.json").read_text())
  except FileNotFoundError:
    raise BadInput(f"{hf_dir} has no config.json: not a Hugging Face model directory") from None
  except (OSError, ValueError) as e:
    raise BadInput(f"{hf_dir}/config.json cannot be read: {' '.join(str(e).split())[:120]}") from None
  arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
  if arch in NOT_MAPPED:
    raise BadInput(f"{hf_dir} holds a {arch}: {NOT_MAPPED[arch]}")
  if arch not in FAMILIES:
    raise BadInput(f"{hf_dir} holds a {arch} (model_type {hf.get('model_type')!r}): import knows "
                   f"{', '.join(sorted(FAMILIES))}")
  try:
    reader = safetensors.Reader(hf_dir)
  except FileNotFoundError as e:
    raise Damaged(str(e)) from None
  except (OSError, ValueError, KeyError) as e:
    raise Damaged(f"{hf_dir}'s safetensors index cannot be read: {' '.join(str(e).split())[:120]}") from None
  for shard in reader.shards():
    if not (hf_dir / shard).is_file():
      named = sum(1 for s in reader.weight_map.values() if s == shard)
      raise Damaged(f"{hf_dir}/{shard} is missing ({named} tensors of the index are in it)")
  for name in reader.names():  # headers only (Damaged if garbled): found before the model is built, not after
    reader.info(name)
  return hf, FAMILIES[arch], reader


def config_argv(keys: dict[str, Any], family, args: list[str]) -> list[str]:
  """The config the import builds its model from: the one given, else the family's tiny CPU config with
  config.json's keys (`keys`, family.maxtext_keys) and the key=value overrides given."""
  if args and "=" not in args[0]:
    return list(args)
  return [family.DEFAULT_CONFIG, *(f"{k}={fork_config.cli_value(v)}" for k, v in keys.items()), *args]


def disagreement(keys: dict[str, Any], family, config, hf_dir: Path) -> str | None:
  """One line naming the first key whose value in the config differs from config.json's (keys: maxtext_keys), or
  None; the keys family.free_keys leaves free are not compared."""
  free = family.free_keys(keys)
  for key, want in keys.items():
    got = getattr(config, key)
    got = getattr(got, "value", got)
    if key in free or got == want or (isinstance(want, float) and abs(got - want) <= 1e-12 * abs(want)):
      continue
    return (f"config key '{key}' = {got!r} but {hf_dir}/config.json gives {want!r}: the config would build "
            "another model than the weights'")
  return None


def mtp_layers(hf: dict[str, Any], reader: safetensors.Reader, keys: dict[str, Any]) -> int:
  """The MTP modules config.json names that the directory holds: transformers' DeepseekV3Config says 1 by default
  (and saves it) while its class neither makes nor saves one; log() says when they differ."""
  n, named = keys["base_num_decoder_layers"], keys["mtp_num_layers"]
  held = 0
  while held < named and any(name.startswith(f"model.layers.{n + held}.") for name in reader.names()):
    held += 1
  if held < named:
    log(f"config.json names {named} MTP module(s) (num_nextn_predict_layers, DeepseekV3Config's default is 1) but "
        f"the directory holds {held}: importing {held} (mtp_num_layers={held})")
  return held


def abstract_arrays(config, devices: list | None = None) -> dict[tuple[str, ...], Any]:
  """{checkpoint key: abstract array (shape, dtype, sharding)} of every parameter (and routing bias) the config's
  model has, on a mesh of `devices` (default: one)."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, model_creation_utils  # pylint: disable=import-outside-toplevel

  mesh = maxtext_utils.get_mesh_from_config(config, devices or jax.devices()[:1])
  _, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  arrays = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, moe.MoEBiasVar))):
    top = checkpoint.AUX if isinstance(var, moe.MoEBiasVar) else checkpoint.PARAMS
    arrays[top + tuple(str(p) for p in path)] = var.get_value()
  return arrays


def abstract_shapes(config) -> tuple[dict[tuple[str, ...], tuple[int, ...]], dict[tuple[str, ...], np.dtype]]:
  """{checkpoint key: shape} and dtypes of every parameter (and routing bias) the config's model has."""
  arrays = abstract_arrays(config)
  return {k: tuple(a.shape) for k, a in arrays.items()}, {k: np.dtype(a.dtype) for k, a in arrays.items()}


def dequantized(reader: safetensors.Reader, name: str, block: tuple[int, int]) -> np.ndarray:
  """The tensor in float32; an FP8 one times its scale_inv, one per block (DeepSeek-V3's released weights),
  dequantized a block row at a time (the scales are never expanded to the tensor's size)."""
  x = reader.read(name)
  if x.dtype != FP8:
    return x.astype(np.float32)
  scale_name = f"{name}_scale_inv"
  if scale_name not in reader.weight_map:
    raise BadInput(f"{name} is float8_e4m3fn without {scale_name}: no scale to dequantize it with")
  s = reader.read(scale_name).astype(np.float32)
  out = np.empty(x.shape, np.float32)
  rows, cols = block
  for r in range(0, x.shape[0], rows):
    out[r:r + rows] = x[r:r + rows].astype(np.float32) * np.repeat(s[r // rows], cols)[: x.shape[1]]
  return out


def check_pieces(pieces, reader, shapes, hf_dir: Path) -> None:
  """Every tensor the pieces read is there at the shape the config builds, and every array gets all its elements:
  from the headers and the pieces' arithmetic, before anything is written."""
  for p in pieces:
    if p.copy:
      continue
    if p.name not in reader.weight_map:
      raise BadInput(f"{hf_dir} has no {p.name}, which the config's model needs: the config and the weights "
                     "describe different models")
    got = tuple(reader.info(p.name)["shape"])
    if got != p.hf_shape:
      raise BadInput(f"{p.name} is {list(got)} in {hf_dir} but the config builds {list(p.hf_shape)} "
                     f"({'/'.join(p.key[2:])}): the config's widths disagree with the weights")
  empty = sink.covered(shapes, ((p.key, p.index) for p in pieces if not p.copy))
  if empty is not None:
    raise BadInput(f"no tensor of {hf_dir} gives {'/'.join(empty)}: it would train from its initial values")


def stream(pieces, reader, out: sink.Sink, hf: dict[str, Any], hf_dir: Path) -> None:
  """Each tensor read, dequantized, laid out and written, one at a time: the host holds one tensor, not the model."""
  block = tuple((hf.get("quantization_config") or {}).get("weight_block_size", (128, 128)))
  for p in pieces:
    if p.copy:
      continue
    try:
      region = p.transform.to_maxtext(dequantized(reader, p.name, block), p.maxtext_shape)
    except (OSError, ValueError) as e:
      raise Damaged(f"{p.name} cannot be read from {hf_dir}/{reader.weight_map[p.name]}: "
                    f"{' '.join(str(e).split())[:120]}") from None
    out.write(p.key, p.index, region)


def unused(pieces, reader) -> list[str]:
  placed = {p.name for p in pieces}
  return [n for n in reader.names() if n not in placed and not n.endswith("_scale_inv")]


def import_(hf_dir: Path, out_dir: Path, args: list[str]) -> dict[str, Any]:
  """OUT_DIR claimed first (MaxText/hf/output.py: an unwritable parent or another run fails before anything is
  read), written into OUT_DIR.tmp and renamed when complete."""
  with output.writing(out_dir) as tmp:
    return _import(hf_dir, tmp, args)


def _import(hf_dir: Path, tmp: Path, args: list[str]) -> dict[str, Any]:
  hf, family, reader = read_hf(hf_dir)
  keys = family.maxtext_keys(hf)
  left_out = config_json.training_only(hf, family.MODEL_TYPE)
  if left_out:
    log(f"not carried: config.json {', '.join(left_out)} (training settings, not the model's function: the run's "
        "own keys, such as dropout_rate, say how it trains)")
  keys = {**keys, "mtp_num_layers": mtp_layers(hf, reader, keys)} if "mtp_num_layers" in keys else keys
  argv = config_argv(keys, family, args)
  try:
    run = fork_config.load(argv)
  except fork_config.ConfigError as e:
    raise BadInput(f"config error: {e}") from None
  config = hf_run.upstream_config(hf_run.on_this_machine(run))
  why = disagreement(keys, family, config, hf_dir)
  if why:
    raise BadInput(why)
  patches.apply_all(run.fork)  # the model as the trainer builds it (DeepSeek-V3's bias a MoEBiasVar at any model_name)
  shapes, dtypes = abstract_shapes(config)
  pieces = family.pieces(shapes, config, run.fork, hf)
  left = unused(pieces, reader)
  n, hf_mtp = config.num_decoder_layers, hf.get("num_nextn_predict_layers") or 0
  skipped = tuple(f"model.layers.{i}." for i in range(n + getattr(config, "mtp_num_layers", 0), n + hf_mtp))
  wrong = [name for name in left if not name.startswith(skipped)] if skipped else left
  if wrong:
    raise BadInput(f"{wrong[0]} of {hf_dir} has no place in the config's model ({len(wrong)} tensors in all): the "
                   "config and the weights describe different models")
  check_pieces(pieces, reader, shapes, hf_dir)
  start = time.perf_counter()
  index_of = {p.key: p.index for p in pieces if not p.copy}  # one key's pieces share a pattern (a layer, an expert)
  chunks = {k: sink.chunk_shape(s, index_of[k], np.dtype(dtypes[k]).itemsize) for k, s in shapes.items()}
  written = sink.Sink(tmp, shapes, dtypes, chunks)
  stream(pieces, reader, written, hf, hf_dir)
  model_keys = {k: v for k, v in run.upstream.items() if k in keys}
  (tmp / "import.json").write_text(json.dumps({"source": str(hf_dir.resolve()), "config": argv,
                                               "model_keys": model_keys}, indent=1))
  return {"arrays": len(shapes), "tensors": sum(not p.copy for p in pieces), "left": left,
          "params": sum(math.prod(s) for s in shapes.values()), "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
  args = sys.argv[1:] if argv is None else list(argv)
  if len(args) < 2 or args[0] in ("-h", "--help"):
    print(__doc__)
    return 0 if args[:1] in (["-h"], ["--help"]) else 2
  hf_dir, out_dir = Path(args[0]), Path(args[1])
  try:
    with stop.on_signals("import_hf", out_dir):
      done = import_(hf_dir, out_dir, args[2:])
  except HFError as e:
    quiet.say(f"import_hf: {e}")
    return e.code
  if done["left"]:
    log(f"not imported: {len(done['left'])} tensors of the MTP modules beyond the config's mtp_num_layers "
        f"(first {done['left'][0]})")
  log(f"{hf_dir} -> {out_dir}: {done['tensors']} tensors into {done['arrays']} arrays, {done['params']:,} "
      f"parameters in {done['seconds']:.1f} s; train from it with load_parameters_path={out_dir}")
  return 0
