"""Seam: jax.experimental.mesh_utils.create_hybrid_device_mesh, as upstream's create_device_mesh calls it
(maxtext 0.2.5 utils/maxtext_utils.py ~2066, with num_slices > 1) -> simulated CPU devices grouped into nodes.

Upstream lays a multi-node mesh out as jax's hybrid mesh: the devices are grouped into DCN granules
(slices: on a GPU cluster one node each) by their `slice_index`, an ICI mesh is built inside each
granule, and the granules are tiled over the DCN mesh shape. So every mesh axis is DCN x ICI,
DCN-major: along `expert`, coordinate c sits on node c // ici_expert_parallelism at local rank
c % ici_expert_parallelism (MaxText/moe/dispatch/hierarchical.py relies on it).

Simulated CPU devices carry no slice_index, so upstream stops ("does not have attribute
slice_index") on a CPU run with `num_slices` > 1; compile-only GPU devices (MaxText/plan/gpu_target.py)
all carry slice_index 0, so it stops there too ("Number of slices 1 must equal ..."). Where the devices
name no more than one slice and the DCN shape asks for several, they are grouped instead: consecutive
device ids fill a node in turn, as processes fill nodes on a cluster (one GPU per process: ids follow
processes), and the granules are laid out exactly as jax does. That lets CPU runs and plans keep dcn_*
axes (2 "nodes" x 4 devices on 8 simulated devices: `hardware=cpu num_slices=2 dcn_expert_parallelism=2
ici_expert_parallelism=4`) and compile-only plans span nodes. Devices that name their slices (a GPU
cluster's, TPUs) go to jax's own function unchanged.
"""

from __future__ import annotations

import numpy as np

from patches._seam import Seam

SEAM = Seam(
    name="cpu_slices",
    module="jax.experimental.mesh_utils",
    attr="create_hybrid_device_mesh",
    sha256="fae070c9f5959f6b",
)


def hybrid_device_mesh(mesh_shape, dcn_mesh_shape, devices, allow_split_physical_axes: bool = False) -> np.ndarray:
  """jax's hybrid layout with granules of consecutive devices: an ICI mesh of `mesh_shape` per granule,
  tiled over `dcn_mesh_shape` (np.block), so each axis is DCN-major."""
  from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel

  devices = sorted(devices, key=lambda d: d.id)
  nodes = int(np.prod(dcn_mesh_shape))
  if len(devices) % nodes:
    raise ValueError(f"{len(devices)} devices cannot be split into {nodes} nodes (dcn mesh {list(dcn_mesh_shape)})")
  per_node = len(devices) // nodes
  granules = [devices[i * per_node:(i + 1) * per_node] for i in range(nodes)]
  meshes = [mesh_utils.create_device_mesh(mesh_shape, g, allow_split_physical_axes=allow_split_physical_axes)
            for g in granules]
  granule_mesh = np.arange(nodes).reshape(dcn_mesh_shape)
  return np.block(np.vectorize(lambda i: meshes[i], otypes=[object])(granule_mesh).tolist())


def wrap(original):
  def create_hybrid_device_mesh(mesh_shape, dcn_mesh_shape, devices=None, **kwargs):
    slices = {getattr(d, "slice_index", None) for d in devices or ()}
    if len(slices) == 1 and int(np.prod(dcn_mesh_shape)) > 1 and not kwargs.get("process_is_granule"):
      return hybrid_device_mesh(mesh_shape, dcn_mesh_shape, devices, kwargs.get("allow_split_physical_axes", False))
    return original(mesh_shape, dcn_mesh_shape, devices, **kwargs)

  return create_hybrid_device_mesh


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True  # devices with a slice_index pass through: nothing changes off CPU
