"""A view of upstream's config (HyperParameters) with some values replaced, for the seams that need one.

Upstream 0.2.5's HyperParameters answers attribute reads from its `_flat_config` dict
(configs/pyconfig.py ~365); a view shares everything else with the original. The class's source
hash is checked before the first view is made, so an upstream that stores its values
differently is refused rather than read wrongly.
"""

from __future__ import annotations

from patches._seam import Seam

SEAM = Seam(
    name="config view",
    module="maxtext.configs.pyconfig",
    attr="HyperParameters",
    sha256="02ed9edce604c097",
)


def view(config, **values):
  """`config` with `values` replacing its own (read-only, like the original)."""
  out = object.__new__(type(config))
  object.__setattr__(out, "_pydantic_config", object.__getattribute__(config, "_pydantic_config"))
  object.__setattr__(out, "_flat_config", {**object.__getattribute__(config, "_flat_config"), **values})
  return out
