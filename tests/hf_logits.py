"""Logits of the same tokens from our forward and from transformers' class, each in its own environment.

  .venv/bin/python    tests/hf_logits.py ours     RUN_DIR OUT.npy [--step N] [--params PARAMS] [--len L] [key=value ...]
  .venv/bin/python    tests/hf_logits.py imported PARAMS  OUT.npy [--len L]
  .venv-hf/bin/python tests/hf_logits.py hf       HF_DIR  OUT.npy [--len L]
  .venv-hf/bin/python tests/hf_logits.py make     HF_DIR  ARCHITECTURE '{"config key": value, ...}'

`ours`: upstream's model as the run built it (its config from the run's record, our patches, so `moe_block: ours`
runs our block), activations in float32, with the weights of the run's checkpoint read by their own paths
(params/params/<path> and the routing bias at nnx_aux/model/<path>: no Hugging Face mapping involved), or of a
parameters checkpoint (--params, what MaxText.import_hf writes) restored by upstream's load_parameters_path code.
`hf`: AutoModelForCausalLM.from_pretrained in float32 on the CPU; it fails if any weight the class needs is missing
and prints the keys it did not load. Both run TOKENS (fixed, 2 x 24; --len L: 1 x L) and save [B, L, vocab] float32
logits. `imported`: our forward on what MaxText.import_hf wrote, its model rebuilt from the config its import.json
names. `make`: a random model of transformers' class (seed 0, weights drawn at 0.2 so the routing has
margins), built from the config keys given over the class's own defaults, saved with save_pretrained.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def tokens(vocab: int, length: int | None = None) -> np.ndarray:
  shape = (2, 24) if length is None else (1, length)
  return (np.arange(shape[0] * shape[1]).reshape(shape) * 37 + 11) % vocab


def imported(params: Path, out: Path, length: int | None) -> None:
  """Our forward on an import: the model its import.json's config builds, the weights by load_parameters_path."""
  import json  # pylint: disable=import-outside-toplevel

  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel

  from MaxText.hf import import_cli  # pylint: disable=import-outside-toplevel

  record = json.loads((params / "import.json").read_text())
  argv = record.get("config")
  if argv is None:  # an import.json of before it named its config: the family's, with the keys it lists
    hf = json.loads((Path(record["source"]) / "config.json").read_text())
    family = import_cli.FAMILIES[hf["architectures"][0]]
    argv = [family.DEFAULT_CONFIG, *(f"{k}={fork_config.cli_value(v)}" for k, v in record["model_keys"].items())]
  run = fork_config.load(argv)
  ours(run, out, None, str(params), [f"max_target_length={max(length or 24, 24)}"], length)


def ours(run, out: Path, step: int | None, params: str | None, overrides: list[str], length: int | None = None,
         run_dir: Path | None = None) -> None:
  import dataclasses  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, model_creation_utils  # pylint: disable=import-outside-toplevel

  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.config import environment  # pylint: disable=import-outside-toplevel
  from MaxText.hf import checkpoint, run as hf_run  # pylint: disable=import-outside-toplevel
  from MaxText.plan import aot  # pylint: disable=import-outside-toplevel

  run = hf_run.on_this_machine(run)
  keys = {"dtype": "float32", "matmul_precision": "highest", "enable_checkpointing": False,
          "base_output_directory": str(out.parent), "run_name": "hf_logits", **fork_config.parse_overrides(overrides)}
  if params:
    keys["load_parameters_path"] = params
  run = dataclasses.replace(run, upstream={**run.upstream, **keys})
  run = environment.prepare_environment(run).run
  config = aot.start_upstream(run)
  mesh = maxtext_utils.get_mesh_from_config(config, jax.devices())
  ids = tokens(config.vocab_size, length)
  with jax.set_mesh(mesh), nnx.use_eager_sharding(False) if hasattr(nnx, "use_eager_sharding") else _null():
    model = model_creation_utils.from_config(config, mesh=mesh, rngs=nnx.Rngs(0))
    if params:
      _load_params(model, config)
    else:
      ckpt = checkpoint.Checkpoint(run_dir, step)  # pylint: disable=possibly-used-before-assignment
      for path, var in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, _bias_var()))):
        path = tuple(str(p) for p in path)
        key = next(k for k in (checkpoint.PARAMS + path, checkpoint.AUX + path) if ckpt.has(k))
        var.set_value(jax.numpy.asarray(ckpt.peek(key, ())))
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    logits = model(ids, positions, np.ones_like(ids), enable_dropout=False)
  np.save(out, np.asarray(logits[0] if isinstance(logits, tuple) else logits, np.float32))


def _bias_var():
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  return moe.MoEBiasVar


def _load_params(model, config) -> None:
  """Upstream's own params-only restore (load_parameters_path), as a training run starts from it."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  state = nnx.state(model, nnx.Any(nnx.Param, _bias_var()))
  restored = checkpointing.load_params_from_path(config.load_parameters_path, state,
                                                 config.checkpoint_storage_concurrent_gb)
  nnx.update(model, restored)


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def make(hf_dir: Path, architecture: str, keys: dict) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  cls = getattr(transformers, architecture)
  config = cls.config_class(**keys)
  torch.manual_seed(0)
  model = cls(config)
  with torch.no_grad():  # the class's init (std 0.02) leaves router scores within rounding of each other
    for name, w in [*model.named_parameters(), *model.named_buffers()]:
      if "e_score_correction_bias" in name:
        w.normal_(0.0, 0.1)  # a bias that changes the picks, as a trained one does
      elif w.dim() > 1 and w.is_floating_point():
        w.normal_(0.0, 0.2 if "embed" not in name else 1.0)
  model.save_pretrained(hf_dir)
  print(f"hf_logits: made {architecture} in {hf_dir}", flush=True)


def hf(hf_dir: Path, out: Path, length: int | None = None) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  model, info = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                                  output_loading_info=True)
  missing = sorted(info["missing_keys"])
  if missing or info.get("mismatched_keys"):
    raise SystemExit(f"hf_logits: {type(model).__name__} lacks {missing[:3]} {info.get('mismatched_keys')}")
  print(f"hf_logits: {type(model).__name__}; not loaded: {sorted(info['unexpected_keys'])}", flush=True)
  ids = torch.tensor(tokens(model.config.vocab_size, length))
  with torch.no_grad():
    logits = model(input_ids=ids).logits
  np.save(out, logits.float().numpy())


if __name__ == "__main__":
  import argparse  # pylint: disable=import-outside-toplevel

  p = argparse.ArgumentParser()
  p.add_argument("side", choices=["ours", "imported", "hf", "make"])
  p.add_argument("src", type=Path)
  p.add_argument("out")
  p.add_argument("--step", type=int)
  p.add_argument("--params")
  p.add_argument("--len", type=int, dest="length")
  args, rest = p.parse_known_args()
  if args.side == "ours":
    from MaxText.hf import run as hf_run  # pylint: disable=import-outside-toplevel

    rest = [*rest, f"max_target_length={args.length}"] if args.length else rest
    ours(hf_run.load(args.src), Path(args.out), args.step, args.params, rest, args.length, run_dir=args.src)
  elif args.side == "imported":
    imported(args.src, Path(args.out), args.length)
  elif args.side == "make":
    import json  # pylint: disable=import-outside-toplevel

    make(args.src, args.out, json.loads(rest[0]))
  else:
    hf(args.src, Path(args.out), args.length)
