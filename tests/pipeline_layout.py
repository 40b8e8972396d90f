"""A checkpoint's MoE layers between upstream's scanned layout and its pipeline layout, for tests.

A pipelined run cannot start from a one-device run's random init (the pipeline splits its
parameter keys per stage), and upstream 0.2.5 restores a checkpoint only into the layout that
wrote it. So the tests give both runs the same weights: a one-device checkpoint's parameters,
rewritten into the pipeline's layout and loaded with `load_parameters_path` (which restores
`params` only: the routing bias starts at its zero init in every run).

Layouts (maxtext 0.2.5, checked on the tiny config's checkpoints):
  scanned   params/params/decoder/moe_layers/...: parameters [..., layers at param_scan_axis 1, ...];
            nnx_aux/model/decoder/moe_layers/.../gate/bias: [layers, experts]
  pipeline  params/params/decoder/pipeline_module/layers/[scanned_layers/]...: [(repeats,) stages, (layers
            per stage,) ...];
            nnx_aux/.../pipeline_module/layers/.../gate/bias likewise. Layer r * stages + s sits at
            [r, s] (circular); stage s holds layers s * L ... s * L + L - 1 (L per stage, scanned, its
            parameters stacked at param_scan_axis after the stage axis).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SCAN_AXIS = 1  # upstream's param_scan_axis default


def _load(path: Path) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint import v1 as ocp  # pylint: disable=import-outside-toplevel

  meta = ocp.metadata(str(path), checkpointable_name="items").metadata
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
  numpy = lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else np.asarray(x)  # noqa: E731 (RNG keys)
  return jax.tree.map(numpy, ocp.load(str(path), abstract, checkpointable_name="items"))


def _pipeline_shape(layers: int, stages: int, repeats: int, per_stage: int) -> tuple[int, ...]:
  if stages * repeats * per_stage != layers:
    raise ValueError(f"{layers} MoE layers do not split into {stages} stages x {repeats} repeats x {per_stage}")
  return ((repeats,) if repeats > 1 else ()) + (stages,) + ((per_stage,) if per_stage > 1 else ())


def write_params(step_dir: Path, out_dir: Path, stages: int = 1, repeats: int = 1, per_stage: int = 1,
                 outside: int = 0) -> Path:
  """The weights of a one-device checkpoint step (`.../checkpoints/N`), in the pipeline's layout unless
  stages == 1, the first `outside` MoE layers before the pipeline (pipeline_parallel_layers = the rest);
  returns the path for load_parameters_path.

  The routing biases go too, in the params item's `MoEBiasVar` collection: upstream's params-only
  restore asks for every variable of the model by collection (checkpointing.py ~983) and fails on a
  missing bias.
  """
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  state = _load(step_dir)
  params = state["params"]["params"]
  aux = state["nnx_aux"]["model"]
  biases = {"decoder": {"moe_layers": _only_gate_biases(aux["decoder"]["moe_layers"])}}
  if "mtp_block" in aux:
    biases["mtp_block"] = _only_gate_biases(aux["mtp_block"])
  if stages > 1:
    split = (stages, repeats, per_stage)
    params = _to_pipeline(params, SCAN_AXIS, outside, lambda w: _pipeline_param(w, *split), per_stage)
    biases = _to_pipeline(biases, 0, outside,
                          lambda b: b.reshape(_pipeline_shape(b.shape[0], *split) + b.shape[1:]), per_stage)
  checkpointing.save_params_to_path(str(out_dir), {"params": params, "MoEBiasVar": biases})
  return out_dir


def _pipeline_param(w, stages: int, repeats: int, per_stage: int):
  w_L = np.moveaxis(w, SCAN_AXIS, 0)
  lead = _pipeline_shape(w_L.shape[0], stages, repeats, per_stage)
  w = w_L.reshape(lead + w_L.shape[1:])
  # A scanned stage (scan_layers_per_stage) stacks its parameters at param_scan_axis too.
  return np.moveaxis(w, len(lead) - 1, len(lead) - 1 + SCAN_AXIS) if per_stage > 1 else w


def _to_pipeline(tree: dict, layer_axis: int, outside: int, fn, per_stage: int) -> dict:
  """decoder/moe_layers/... -> decoder/moe_layers_outside_pipeline/... (the first `outside` layers, still
  scanned) and decoder/pipeline_module/layers/[scanned_layers/]... (the rest, each leaf through fn)."""
  decoder = dict(tree["decoder"])
  moe = decoder.pop("moe_layers")
  take = lambda lo, hi: (lambda w: np.take(w, np.arange(lo, hi), axis=layer_axis))  # noqa: E731
  if outside:
    decoder["moe_layers_outside_pipeline"] = _map(take(0, outside), moe)
  layers = _map(lambda w: fn(take(outside, w.shape[layer_axis])(w)), moe)
  decoder["pipeline_module"] = {"layers": {"scanned_layers": layers} if per_stage > 1 else layers}
  return {**tree, "decoder": decoder}


def _only_gate_biases(tree: dict) -> dict:
  out = {}
  for k, v in tree.items():
    if k == "gate":
      out[k] = {"bias": v["bias"]}
    elif isinstance(v, dict) and (sub := _only_gate_biases(v)):
      out[k] = sub
  return out


def _map(fn, tree):
  return {k: _map(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def routing_biases(step_dir: Path) -> dict[str, np.ndarray]:
  """{"decoder": f32[MoE layers, experts] in layer order, "mtp": f32[experts]} from a checkpoint step of
  either layout."""
  aux = _load(step_dir)["nnx_aux"]["model"]
  decoder = aux["decoder"]
  bias = lambda layers: layers["DeepSeekMoeBlock_0"]["MoeBlock_0"]["gate"]["bias"]  # noqa: E731
  if "moe_layers" in decoder:
    parts = [bias(decoder["moe_layers"])]
  else:
    layers = decoder["pipeline_module"]["layers"]
    parts = [bias(decoder["moe_layers_outside_pipeline"])] if "moe_layers_outside_pipeline" in decoder else []
    parts.append(bias(layers.get("scanned_layers", layers)))
  out = {"decoder": np.concatenate([p.reshape(-1, p.shape[-1]) for p in parts])}
  mtp = aux.get("mtp_block", {}).get("mtp_layer_1")
  if mtp is not None:
    out["mtp"] = bias(mtp["mtp_1_transformer_layer"])
  return out
