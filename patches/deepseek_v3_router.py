"""Seam: maxtext.layers.moe.RoutedAndSharedMoE (maxtext 0.2.5) -> DeepSeek-V3's router whatever model_name says.

Upstream 0.2.5 decides "is this DeepSeek-V3's router?" by `model_name.startswith("deepseek3")`
(layers/moe.py: ~640 the gate bias becomes a `MoEBiasVar`, a non-trained variable; ~708 the
gate returns the pre-bias scores; ~1321 get_topk selects with the bias and group limit and
weighs with the pre-bias scores; ~2402/~3536/~3971 shard those scores). Our configs keep
`model_name: default` (a deepseek3* name would load upstream's model YAML under ours), so with
`moe_router: deepseek_v3` each MoE block of a DeepSeek layer (models/deepseek.py ~427 builds
`moe.RoutedAndSharedMoE(...)`, looked up at construction; the MTP layer is a DeepSeek layer too)
is built with a view of the config whose `model_name` starts with "deepseek3". Nothing outside
the MoE block sees it: upstream reads model_name elsewhere only to load its YAML (already done)
and for other model families. The routed block inside (upstream's RoutedMoE, or ours via
patches/routed_moe.py, which reads the same view) then has V3's semantics on either block:

  sigmoid scores s; the bias b (MoEBiasVar: no gradient, not in the optimizer, no weight decay)
  only selects: top-k of s + b within the best `topk_routing_group` of `n_routing_groups`
  groups (group score: sum of its top-2 s + b); weights = the chosen s, normalized, times
  routed_scaling_factor. The bias moves by upstream's train step (train.py ~640-670):
  b += routed_bias_update_rate * sign(mean load - load), per layer and step.

Parameter paths and shapes are upstream's deepseek3 ones, so a checkpoint of upstream's
deepseek3 path and ours are interchangeable; one written with the bias as a trained parameter
is not (MaxText/checkpoints/compat.py refuses it).
"""

from __future__ import annotations

from patches import _config_view
from patches._seam import Seam

SEAM = Seam(
    name="deepseek_v3_router",
    module="maxtext.layers.moe",
    attr="RoutedAndSharedMoE",
    sha256="38ee315338456d20",
)
# Any name upstream's startswith("deepseek3") accepts; shown nowhere but in the MoE block's config.
V3_MODEL_NAME = "deepseek3-maxtext-moe"


def v3_view(config):
  """`config` with a model_name upstream's MoE code treats as DeepSeek-V3; else the same object."""
  if config.model_name.startswith("deepseek3"):
    return config
  return _config_view.view(config, model_name=V3_MODEL_NAME)


def _subclass(upstream_cls):
  class RoutedAndSharedMoE(upstream_cls):  # pylint: disable=missing-class-docstring
    __doc__ = "upstream RoutedAndSharedMoE with DeepSeek-V3's router (patches/deepseek_v3_router.py)"

    def __init__(self, config, *args, **kwargs):
      super().__init__(v3_view(config), *args, **kwargs)

  RoutedAndSharedMoE.__qualname__ = f"patched.{upstream_cls.__qualname__}"
  return RoutedAndSharedMoE


def wanted(fork) -> bool:
  return fork.moe_router == "deepseek_v3"


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  _config_view.SEAM.check()
  SEAM.apply(_subclass)
