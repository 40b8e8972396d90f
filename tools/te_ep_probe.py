#!/usr/bin/env python3
"""te_ncclep on one GPU, up to what one GPU allows (docs/container.md "Transformer Engine, measured").

    source tools/te_offline/install.sh build/te && PYTHONPATH=$PWD:$PYTHONPATH python3 tools/te_ep_probe.py

NCCL EP needs >= 2 GPUs, so on one GPU this checks everything before it: the released TE's
EP API is the one the adapter is written to (api_mismatch), the backend reports itself
available, and TE's ep_bootstrap refuses a one-device EP world with one line naming the
backend. Prints PASS/FAIL per case; exit 1 on any FAIL.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.sharding import Mesh


def main() -> int:
  import transformer_engine  # pylint: disable=import-outside-toplevel
  import transformer_engine.jax.ep as te_ep  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax.sharding import MeshResource, global_shard_guard  # pylint: disable=import-outside-toplevel

  from MaxText.moe.dispatch import te_ncclep  # pylint: disable=import-outside-toplevel

  print(f"transformer-engine {transformer_engine.__version__}, jax {jax.__version__}, {jax.devices()}")
  results = {"api matches the released ep.py": te_ncclep.api_mismatch(te_ep) is None,
             "backend available on this GPU": te_ncclep.unavailable_reason() is None}
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
  try:
    with jax.set_mesh(mesh), global_shard_guard(MeshResource(dp_resource="data", ep_resource="expert")):
      te_ncclep.bootstrap(num_experts=8, max_tokens_per_rank=16, recv_capacity_per_rank=128, hidden_dim=256)
    refused = None
  except RuntimeError as e:
    refused = str(e).splitlines()[0]
  results["one-device EP world refused in one line"] = bool(refused and "te_ncclep" in refused)
  print(f"  bootstrap: {refused or 'accepted'}")
  for case, ok in results.items():
    print(f"{'PASS' if ok else 'FAIL'}  {case}")
  return 0 if all(results.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
