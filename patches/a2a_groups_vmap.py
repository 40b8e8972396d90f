"""Seam: jax 0.11.2's batching rule for all_to_all (jax/_src/lax/parallel.py ~1505) -> batches a grouped exchange
under a vmap over another axis, as it batches an ungrouped one.

Upstream MaxText's pipeline vmaps its stages (layers/pipeline.py, spmd_axis_name "stage"), so the MoE layers in
them run our block under that vmap. The two-level dispatch (MaxText/moe/dispatch/hierarchical.py) exchanges over
subgroups of the `expert` axis (`all_to_all(..., axis_index_groups=...)`), and jax's rule raises "Please open a
feature request!" for any grouped all_to_all before it looks at which axis is vmapped. When the vmap is over
another axis (the stages; the exchange is over `expert`), each stage's slice exchanges exactly as the unbatched
call does, whatever the groups: jax's own rule for that case (`_all_to_all_batcher`: the split and concat axes
shifted past the vmapped one) is right with groups too, and is what this rule calls. A grouped exchange over the
vmapped axis itself still goes to jax's rule (and its error).
"""

from __future__ import annotations

import importlib

from patches._seam import Seam, UpstreamMismatch

SEAM = Seam(name="a2a_groups_vmap", module="jax._src.lax.parallel", attr="_all_to_all_batched_collective",
            sha256="e299f319af5418b3", version="0.11.2", package="jax")
_saved: dict = {}  # all_to_all_p -> jax's rule, while ours is registered


def _grouped_rule(parallel, jax_rule):
  def rule(axis_data, vals_in, dims_in, *, axis_name, axis_index_groups, **params):
    names = axis_name if isinstance(axis_name, (list, tuple)) else (axis_name,)
    if axis_index_groups is None or axis_data.name in names:
      return jax_rule(axis_data, vals_in, dims_in, axis_name=axis_name, axis_index_groups=axis_index_groups,
                      **params)
    (x,), (d,) = vals_in, dims_in
    if d is None:  # nothing batched here: the exchange as it was
      return parallel.all_to_all_p.bind(x, axis_name=axis_name, axis_index_groups=axis_index_groups, **params), None
    return parallel._all_to_all_batcher(  # pylint: disable=protected-access
        vals_in, dims_in, axis_name=axis_name, axis_index_groups=axis_index_groups, **params)

  rule.__wrapped__ = jax_rule
  return rule


def apply(fork=None, hooks=None) -> None:  # pylint: disable=unused-argument
  if _saved:
    return
  from jax._src.interpreters import batching  # pylint: disable=import-outside-toplevel

  SEAM.check()
  parallel = importlib.import_module(SEAM.module)
  if batching.fancy_primitive_batchers.get(parallel.all_to_all_p) is not SEAM.target():
    raise UpstreamMismatch(f"patch '{SEAM.name}': jax's batching rule for all_to_all is no longer {SEAM.attr} "
                           f"(jax {SEAM.version}); re-read the seam before patching")
  _saved[parallel.all_to_all_p] = SEAM.target()
  batching.fancy_primitive_batchers[parallel.all_to_all_p] = _grouped_rule(parallel, SEAM.target())


def undo() -> None:
  from jax._src.interpreters import batching  # pylint: disable=import-outside-toplevel

  batching.fancy_primitive_batchers.update(_saved)
  _saved.clear()


def applied() -> bool:
  return bool(_saved)


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True  # changes only grouped exchanges under a vmap over another axis, which jax's rule refuses
