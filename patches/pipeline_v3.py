"""Seams: upstream's pipeline (maxtext 0.2.5 layers/pipeline.py) with DeepSeek-V3's MoE layers in its stages.

Upstream's NNX pipeline vmaps one decoder-layer class over the stages (and repeats), scans its
iterations, and splits the layers' state into parameters, sown intermediates and a catch-all it
asserts holds only RNG state. A DeepSeek-V3 MoE layer breaks it three ways (tiny V3 at
ici_pipeline_parallelism=2 on CPU, either block):
  - its routing bias, a non-trained variable (upstream's MoEBiasVar), lands in the catch-all:
    "Non-RngState variable found in layers_mutables" (pipeline.py ~904);
  - what the layers sow per call (load-balance loss, routing-bias update, our block's statistics)
    comes out stacked per iteration [iterations, (repeats,) stages, ...], bubble iterations
    included: upstream's loss then sums every microbatch's load-balance loss plus the bubbles'
    (computed on zeros), and its train step adds the stacked update to the bias [stages, E]
    (train.py ~656: a shape error at compile time);
  - with num_pipeline_repeats > 1 the per-iteration write-back of the stage state (pipeline.py
    ~812) needs sown intermediates already in the layers: any MoE layer fails there ("pytree
    structure error ... moe_lb_loss").

Fixed here, one seam each, all acting only inside the pipeline (upstream builds it only when
ici/dcn_pipeline_parallelism > 1: without it none of these targets runs and the program is
upstream's):
  pipeline_utils.is_static_param
      the bias rides with the weights: loop-invariant, gathered per repeat like them; no gradient
      (the train step differentiates nnx.Param only), no optimizer state, no weight decay;
  NNXDecoder._get_pipeline_stage_module
      the pipelined MoE layers see a config view: they report raw expert counts (upstream's
      gradient-accumulation behaviour, moe.py ~2507/~4021: counts summed over microbatches, then
      one sign), and our block knows the stage axis is the vmap's (patches/routed_moe.py);
  PipelineBase.get_main_vmap_func_for_iterations (NNXPipeline's)
      upstream's stage function, but the stage drops the sown template (below) before it runs;
  NNXPipeline.__call__
      circular schedules: a zero template of what one stage sows, so that the write-back's
      structures match; after the loop, each sown value is reduced over the microbatches its
      layer really ran (bubble iterations masked by upstream's schedule,
      get_microbatch_and_repeat_ids) to one value per layer, in the layout of the layer's
      variables: [(repeats,) stages, (layers per stage,) ...];
  train.loss_fn, train.gradient_accumulation_loss_and_grad
      (with a moving bias) each decoder bias moves by its own layers' update, and upstream's train
      step is handed none: it moves one decoder bias variable (the first it finds, train.py ~650,
      by the last update it collected), and under the pipeline the decoder may hold several (MoE
      layers outside the pipeline, unscanned layers of a stage). Without gradient accumulation the
      training loss moves them, after the forward that used them; with it, the loss hands each
      stack's counts on (accumulation sums them over its microbatches) and the bias moves once,
      by the sign of the sums, when the accumulation returns.

Upstream's loss then reads the pipeline as it reads a scanned stack of layers: the load-balance
loss per layer (mean over microbatches: exact for V3's sequence-wise loss); each bias moves by
rate * sign(mean load - load) of the whole batch's counts, once per step, after the forward that
used it, as upstream's train step would move it. The statistics are reduced by what they are
(REDUCTIONS).

What is not inside the pipeline, and why:
  - the dense layers (first_num_dense_layers): a stage is one vmapped layer class, so upstream
    runs DeepSeek's dense layers before the pipeline (nnx_decoders.py ~1845), every stage on its
    share of the batch (the stage axis acts as data parallelism), weights replicated over stages;
  - MoE layers beyond pipeline_parallel_layers run there too (V3's 58 MoE layers split into 8 or 16
    stages only so: upstream needs stages x repeats x layers per stage = pipelined layers);
  - MTP: after the last stage, on the decoder's output, outside the pipeline (models.py), as a
    scanned decoder has it; its MoE layer's bias moves by upstream's own MTP update.
Refused (MaxText/config/checks.py check_pipeline): pipeline_fsdp_ag_per_repeat with MoE layers
(upstream's prefetching circular pipeline, NNXCircularPipeline, drops every sown intermediate), and
upstream's block in MoE layers before the pipeline with a moving bias (there the stage axis acts as data
parallelism, and upstream's block sums its expert counts over the batch axes it knows, which leave out
`stage`, moe.py ~491: each stage's counts are half the batch's; our block counts in the global view).
A resume onto another pipeline layout is refused too (MaxText/checkpoints/compat.py).
"""

from __future__ import annotations

import functools

import numpy as np

from patches import _config_view
from patches._seam import Seam

SEAM_STATIC_PARAM = Seam(
    name="pipeline_v3 static params",
    module="maxtext.utils.pipeline_utils",
    attr="is_static_param",
    sha256="165dd59bfee77142",
)
SEAM_STAGE = Seam(
    name="pipeline_v3 stage layers",
    module="maxtext.layers.nnx_decoders",
    attr="NNXDecoder._get_pipeline_stage_module",
    sha256="7c629b3b76f6884a",
)
SEAM_VMAP = Seam(
    name="pipeline_v3 stage function",
    module="maxtext.layers.pipeline",
    attr="PipelineBase.get_main_vmap_func_for_iterations",
    sha256="4e84a4bd64e39550",
)
SEAM_CALL = Seam(
    name="pipeline_v3 schedule",
    module="maxtext.layers.pipeline",
    attr="NNXPipeline.__call__",
    sha256="f26bf745d0fdc64c",
)
SEAM_LOSS = Seam(
    name="pipeline_v3 bias update",
    module="maxtext.trainers.pre_train.train",
    attr="loss_fn",
    sha256="7a97c1cc3bd1b19a",
)
SEAM_ACCUMULATION = Seam(
    name="pipeline_v3 bias update under gradient accumulation",
    module="maxtext.trainers.pre_train.train",
    attr="gradient_accumulation_loss_and_grad",
    sha256="7807d0b23ab33c3c",
)
SEAMS = (SEAM_STATIC_PARAM, SEAM_STAGE, SEAM_VMAP, SEAM_CALL, SEAM_LOSS, SEAM_ACCUMULATION)
SEAM = SEAM_CALL  # the one patches.seams() lists

# In the config view of a pipelined layer: the mesh axis its stage vmap maps (read by patches/routed_moe.py).
STAGE_AXIS_KEY = "maxtext_moe_pipeline_stage_axis"
# In the loss's aux under gradient accumulation: {"decoder/...": expert counts} of each decoder layer stack.
COUNTS_KEY = "maxtext_moe_decoder_bias_counts"

# How a value each layer sows per call becomes one per layer: over the microbatches it ran.
# "counts": routing-bias counts, summed, then upstream's sign rule (raw counts under gradient
# accumulation, whose own code takes the sign). Bool values: any. A name not listed is an error naming it: a
# statistic reduced the wrong way would be wrong in TensorBoard with nothing to say so.
REDUCTIONS = {
    "moe_bias_updates": "counts",
    "moe_lb_loss": "mean",  # per-microbatch loss; V3's sequence-wise loss: the mean is the batch's
    "moe_stats_counts_E": "sum",  # MaxText/moe/stats.py: tokens per expert
    "moe_stats_overflow": "max",
    "moe_stats_buffer2": "max,sum",  # [fullest buffer's fill, dropped rows]
    "moe_stats_entropy": "mean",  # the mean over tokens of equal-sized microbatches
    "moe_stats_bias3": "mean",  # the bias's statistics: the bias does not move inside a step, so each is the value
    "moe_max_load_ratio": "max",
    "moe_required_rbf": "max",
    "te_moe_total_recv_tokens": "max",
    "te_moe_recv_capacity_per_rank": "min",
    # Upstream's record_internal_nn_metrics (its decoder layers): per-microbatch scalars of equal-sized
    # microbatches, so the mean is the batch's; for the standard deviation it is the microbatches' mean stdev.
    "activation_mean": "mean",
    "activation_stdev": "mean",
    "activation_fraction_zero": "mean",
}


def stage_view(config):
  """A pipelined layer's config: raw expert counts per call, and the stage axis named."""
  return _config_view.view(config, gradient_accumulation_steps=max(2, int(config.gradient_accumulation_steps)),
                           **{STAGE_AXIS_KEY: "stage"})


_PIPELINED: dict[type, type] = {}


def pipelined(layer_cls: type) -> type:
  """`layer_cls` built with stage_view(config); one subclass per class, so graph definitions compare equal."""
  if layer_cls not in _PIPELINED:
    class Pipelined(layer_cls):  # pylint: disable=missing-class-docstring
      __doc__ = f"{layer_cls.__name__} inside upstream's pipeline (patches/pipeline_v3.py)"

      def __init__(self, config, *args, **kwargs):
        super().__init__(stage_view(config), *args, **kwargs)

    Pipelined.__name__ = layer_cls.__name__
    Pipelined.__qualname__ = f"pipelined.{layer_cls.__qualname__}"
    _PIPELINED[layer_cls] = Pipelined
  return _PIPELINED[layer_cls]


def schedule_mask(stages: int, repeats: int, microbatches: int, delay: int = 1) -> np.ndarray:
  """bool[iterations, repeats, stages]: whether stage s ran a real microbatch of repeat r at iteration t.

  Upstream's schedule (pipeline.py get_microbatch_and_repeat_ids): at iteration t stage s has
  processed t - delay * s microbatches (delay: 2 with pipeline_delay_activation_forwarding); it is
  in the bubble while that is < 0 or >= microbatches * repeats. iterations = microbatches *
  repeats + delay * (stages - 1).
  """
  iterations = microbatches * repeats + delay * (stages - 1)
  done_TS = np.arange(iterations)[:, None] - delay * np.arange(stages)[None, :]
  real_TS = (done_TS >= 0) & (done_TS < microbatches * repeats)
  repeat_TS = np.clip(done_TS, 0, None) // microbatches
  return real_TS[:, None, :] & (repeat_TS[:, None, :] == np.arange(repeats)[None, :, None])


def reduce_sown(name: str, x, mask_TRS: np.ndarray, config):
  """x: one sown value stacked by the pipeline, [T, (R,) S, ...] -> [(R,) S, ...] over its layer's microbatches."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  T, R, S = mask_TRS.shape
  circular = R > 1
  x_TRS = x if circular else x[:, None]
  if x_TRS.shape[:3] != (T, R, S):
    raise ValueError(f"pipeline_v3: sown '{name}' has shape {x.shape}, expected [{T}, {'R, ' if circular else ''}"
                     f"{S}, ...] from the schedule")
  m = jnp.asarray(mask_TRS).reshape(mask_TRS.shape + (1,) * (x_TRS.ndim - 3))
  how = "any" if x.dtype == jnp.bool_ else REDUCTIONS.get(name)
  if how is None:
    raise ValueError(f"pipeline_v3: no reduction over microbatches is known for the value '{name}' a pipelined "
                     f"layer sows; add it to patches/pipeline_v3.py REDUCTIONS (known: {', '.join(REDUCTIONS)})")
  zero = jnp.zeros((), x_TRS.dtype)
  total = lambda v: jnp.sum(jnp.where(m, v, zero), axis=0)  # noqa: E731
  if how in ("sum", "counts"):
    out = total(x_TRS)
  elif how == "mean":  # every layer ran exactly `microbatches` real iterations
    out = total(x_TRS) / config.num_pipeline_microbatches
  elif how == "any":
    out = jnp.any(m & x_TRS, axis=0)
  elif how in ("max", "min"):
    info = jnp.finfo(x_TRS.dtype) if jnp.issubdtype(x_TRS.dtype, jnp.floating) else jnp.iinfo(x_TRS.dtype)
    fill = jnp.asarray(info.min if how == "max" else info.max, x_TRS.dtype)
    out = (jnp.max if how == "max" else jnp.min)(jnp.where(m, x_TRS, fill), axis=0)
  elif how == "max,sum":
    out = jnp.stack([jnp.max(jnp.where(m, x_TRS, -jnp.inf)[..., 0], axis=0), total(x_TRS)[..., 1]], axis=-1)
  else:
    raise ValueError(f"pipeline_v3: unknown reduction {how!r} for '{name}'")
  if how == "counts" and config.gradient_accumulation_steps == 1:
    from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

    out = moe.load_balance_updates_from_counts(out, out.shape[-1], config.routed_bias_update_rate)
  return out if circular else out[0]


def _mask(pipeline):
  cfg = pipeline.config
  return schedule_mask(pipeline.num_stages, cfg.num_pipeline_repeats, cfg.num_pipeline_microbatches,
                       pipeline.forwarding_delay)


def _reduce_layers_sown(pipeline) -> None:
  """Replaces the stacked intermediates in pipeline.layers by one value per layer."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  mask = _mask(pipeline)
  sown = nnx.state(pipeline.layers, nnx.Intermediate)

  def one(path, var):
    name = str(getattr(path[-1], "key", path[-1]))
    return var.replace(value=tuple(reduce_sown(name, x, mask, pipeline.config) for x in var.value))

  is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
  nnx.update(pipeline.layers, jax.tree_util.tree_map_with_path(one, sown, is_leaf=is_var))


def _install_template(pipeline, inputs, segment_ids, positions, deterministic, model_mode) -> None:
  """Zeros shaped like what the stages sow, [repeats, stages, ...], in pipeline.layers (circular schedules).

  Upstream writes each iteration's stage state back into the [repeats, stages, ...] state with a
  tree map over both (pipeline.py ~812); the sown values must be in both trees. One stage call
  is traced (jax.eval_shape, nothing runs) to learn them.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  cfg = pipeline.config
  nnx.pop(pipeline.layers, nnx.Intermediate)
  graph, state = nnx.split(pipeline.layers)
  raw = lambda v: v.value if isinstance(v, nnx.Variable) else v  # noqa: E731
  first_repeat = jax.tree.map(lambda v: raw(v)[0], state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  micro = (pipeline.num_stages, pipeline.pipeline_microbatch_size, cfg.max_target_length)
  x = jax.ShapeDtypeStruct(micro + (cfg.emb_dim,), inputs.dtype)
  ids = lambda a: None if a is None else jax.ShapeDtypeStruct(micro, a.dtype)  # noqa: E731
  stage_fn = pipeline.get_main_vmap_func_for_iterations()
  _, out_state = jax.eval_shape(
      lambda st, x, seg, pos: stage_fn(graph, st, x, seg, pos, deterministic, model_mode),
      first_repeat, x, ids(segment_ids), ids(positions))
  sown = out_state.filter(nnx.Intermediate)
  repeats = cfg.num_pipeline_repeats
  template = jax.tree.map(lambda s: jnp.zeros((repeats,) + s.shape, s.dtype), sown)
  nnx.update(pipeline.layers, template)


def _wrap_call(call):
  @functools.wraps(call)
  def __call__(self, inputs, segment_ids, positions, deterministic, *args, **kwargs):
    from maxtext.layers.nnx_wrappers import is_linen_initializing  # pylint: disable=import-outside-toplevel

    if is_linen_initializing():
      return call(self, inputs, segment_ids, positions, deterministic, *args, **kwargs)
    if self.config.num_pipeline_repeats > 1:
      model_mode = args[0] if args else kwargs.get("model_mode", "train")
      _install_template(self, inputs, segment_ids, positions, deterministic, model_mode)
    out = call(self, inputs, segment_ids, positions, deterministic, *args, **kwargs)
    _reduce_layers_sown(self)
    return out

  return __call__


def _stage_function(original):
  @functools.wraps(original)
  def get_main_vmap_func_for_iterations(self):
    """Upstream's stage function (merge, run, return output and state), run on a stage without the sown template."""
    import jax  # pylint: disable=import-outside-toplevel
    from flax import nnx  # pylint: disable=import-outside-toplevel

    def func_to_vmap(graph, state, stages_inputs, stages_segment_ids, stages_positions, deterministic, model_mode):
      module = nnx.merge(graph, state)
      nnx.pop(module, nnx.Intermediate)  # a stage sows afresh each iteration; sow would append to the template
      out = module(stages_inputs, stages_segment_ids, stages_positions, deterministic, model_mode)
      return out, nnx.state(module)

    kwargs = {"in_axes": (None, 0, 0, 0, 0, None, None), "out_axes": (0, 0)}
    if self.spmd_axis_name is not None:
      kwargs["spmd_axis_name"] = self.spmd_axis_name
    return jax.vmap(func_to_vmap, **kwargs)

  return get_main_vmap_func_for_iterations


def _wrap_stage_module(original):
  @functools.wraps(original)
  def _get_pipeline_stage_module(self, decoder_blocks, rngs):
    blocks = list(decoder_blocks)
    staged = 1 if self.is_deepseek else 0  # upstream's choice of the pipelined class (nnx_decoders.py ~927)
    blocks[staged] = pipelined(blocks[staged])
    return original(self, blocks, rngs)

  return _get_pipeline_stage_module


def _wrap_static_param(original):
  @functools.wraps(original)
  def is_static_param(path, v):
    from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

    return original(path, v) or isinstance(v, moe.MoEBiasVar)

  return is_static_param


def _decoder_bias_updates(intermediates: dict, path: tuple = ()):
  """(path, update) of every routing-bias update the decoder's layers sowed."""
  for key, value in intermediates.items():
    if key == "moe_bias_updates" and "decoder" in path:
      yield path, value[0] if isinstance(value, (tuple, list)) else value
    elif isinstance(value, dict):
      yield from _decoder_bias_updates(value, path + (key,))


def _without_bias_updates(intermediates: dict, path: tuple = ()) -> dict:
  return {k: _without_bias_updates(v, path + (k,)) if isinstance(v, dict) else v for k, v in intermediates.items()
          if not (k == "moe_bias_updates" and "decoder" in path)}


def _move_decoder_biases(model, updates) -> None:
  """bias += update for each (path, update) a decoder layer stack sowed (shapes as its bias variable)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  for path, update in updates:
    module = model
    for key in path:
      module = getattr(module, key)
    gates = [node for _, node in nnx.iter_graph(module) if isinstance(node, moe.GateLogit) and node.bias is not None]
    where = "/".join(path)
    if len(gates) != 1 or gates[0].bias.value.shape != update.shape:
      raise ValueError(f"pipeline_v3: the routing-bias update sown at {where} {update.shape} has no single bias of "
                       f"its shape there ({[g.bias.value.shape for g in gates]})")
    gates[0].bias.value = gates[0].bias.value + update.astype(gates[0].bias.value.dtype)


def _wrap_loss(loss_fn):
  @functools.wraps(loss_fn)
  def wrapped(model, config, data, dropout_rng, params, *args, **kwargs):
    loss, aux = loss_fn(model, config, data, dropout_rng, params, *args, **kwargs)
    if not (config.using_pipeline_parallelism and config.routed_bias and config.routed_bias_update_rate > 0):
      return loss, aux  # the program upstream's train step builds, untouched
    is_train = kwargs["is_train"] if "is_train" in kwargs else (args[1] if len(args) > 1 else True)
    updates = list(_decoder_bias_updates(aux["intermediate_outputs"]))
    aux = {**aux, "moe_bias_updates": None, "intermediate_outputs": _without_bias_updates(aux["intermediate_outputs"])}
    if is_train and config.gradient_accumulation_steps > 1:  # raw counts (moe.py ~2507): summed, then one sign
      aux[COUNTS_KEY] = {"/".join(path): counts for path, counts in updates}
    elif is_train:
      _move_decoder_biases(model, updates)
    return loss, aux

  return wrapped


def _wrap_accumulation(accumulate):
  @functools.wraps(accumulate)
  def gradient_accumulation_loss_and_grad(_loss_fn, config, model, *args, **kwargs):
    loss, aux, raw_grads = accumulate(_loss_fn, config, model, *args, **kwargs)
    counts = aux.pop(COUNTS_KEY, None) if isinstance(aux, dict) else None
    if counts:  # summed over the accumulated microbatches: the step's whole batch
      from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

      rate = config.routed_bias_update_rate
      _move_decoder_biases(model, [(tuple(path.split("/")), moe.load_balance_updates_from_counts(c, c.shape[-1], rate))
                                   for path, c in counts.items()])
    return loss, aux, raw_grads

  return gradient_accumulation_loss_and_grad


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  """Always: every target acts only when upstream builds a pipeline (ici/dcn_pipeline_parallelism > 1): the
  pipeline's own functions run only then, and the loss function hands upstream's result back unchanged
  otherwise."""
  return True


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  _config_view.SEAM.check()
  for seam in SEAMS:
    seam.check()
  SEAM_STATIC_PARAM.apply(_wrap_static_param)
  SEAM_STAGE.apply(_wrap_stage_module)
  SEAM_VMAP.apply(_stage_function)
  SEAM_CALL.apply(_wrap_call)
  SEAM_LOSS.apply(_wrap_loss)
  SEAM_ACCUMULATION.apply(_wrap_accumulation)


def undo() -> None:
  for seam in reversed(SEAMS):
    seam.undo()
