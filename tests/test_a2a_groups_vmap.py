"""A grouped all_to_all (the two-level dispatch's, MaxText/moe/dispatch/hierarchical.py) under a vmap over another
mesh axis, as upstream's pipeline vmaps its stages (patches/a2a_groups_vmap.py): jax 0.11.2 refuses it.

On 8 simulated CPU devices, a mesh stage 2 x expert 4: a shard_map over `expert` (unchecked, as our block's) whose
all_to_all exchanges within the pairs of shards {0, 1} and {2, 3}, vmapped over the stages with
spmd_axis_name="stage" as upstream's pipeline vmaps them; its values and its gradient (the exchange's transpose)
against each stage's slice run alone, without vmap.
"""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

_CHECK = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
if sys.argv[1] == "1":
  from patches import a2a_groups_vmap
  a2a_groups_vmap.apply()
mesh = jax.make_mesh((2, 4), ("stage", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
PAIRS = [[0, 1], [2, 3]]

def exchange(x_RD):  # one stage: rows split over expert, each shard's 4 rows: 2 to each shard of its pair
  def local(x):
    return jax.lax.all_to_all(x * (1 + jax.lax.axis_index("expert")), "expert", 0, 0, tiled=True,
                              axis_index_groups=PAIRS)
  # as our block's (MaxText/moe/block.py): the specs leave the vmapped stage axis to the vmap, unchecked
  return jax.shard_map(local, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"), check_vma=False)(x_RD)

x_SRD = jnp.arange(2 * 16 * 3, dtype=jnp.float32).reshape(2, 16, 3)
ct_SRD = jnp.cos(x_SRD)
loss = lambda f: lambda x: jnp.sum(f(x) * ct_SRD)
with jax.set_mesh(mesh):
  try:
    batched = jax.jit(jax.vmap(exchange, spmd_axis_name="stage"))
    got, dgot = batched(x_SRD), jax.jit(jax.grad(loss(jax.vmap(exchange, spmd_axis_name="stage"))))(x_SRD)
  except NotImplementedError as e:
    print("error:", e)
    raise SystemExit(0)
  alone = lambda x: jnp.stack([jax.jit(exchange)(x[s]) for s in range(2)])
  want, dwant = alone(x_SRD), jax.grad(loss(alone))(x_SRD)
assert not np.array_equal(np.asarray(want), np.asarray(x_SRD))  # the exchange moved rows
np.testing.assert_array_equal(got, want)
np.testing.assert_array_equal(dgot, dwant)
print("equal")
"""


def _run(with_seam: str) -> str:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
  env.pop("XLA_FLAGS", None)
  run = subprocess.run([sys.executable, "-c", _CHECK, with_seam], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  return run.stdout


def test_a_grouped_exchange_under_the_stages_vmap_equals_each_stage_alone():
  assert _run("0").strip() == "error: Please open a feature request!"  # jax's rule, without the seam
  assert _run("1").strip() == "equal"


def test_the_seam_checks_jax_and_undo_restores_its_rule():
  from jax._src.interpreters import batching  # pylint: disable=import-outside-toplevel
  from jax._src.lax import parallel  # pylint: disable=import-outside-toplevel

  from patches import a2a_groups_vmap  # pylint: disable=import-outside-toplevel

  before = batching.fancy_primitive_batchers[parallel.all_to_all_p]
  try:
    a2a_groups_vmap.apply()
    a2a_groups_vmap.apply()  # a no-op
    assert a2a_groups_vmap.applied() and batching.fancy_primitive_batchers[parallel.all_to_all_p] is not before
  finally:
    a2a_groups_vmap.undo()
  assert batching.fancy_primitive_batchers[parallel.all_to_all_p] is before and not a2a_groups_vmap.applied()
