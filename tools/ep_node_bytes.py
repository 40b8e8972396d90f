#!/usr/bin/env python3
"""How many nodes a token's experts sit on under DeepSeek-V3's router, and what that makes of the rows that cross
nodes, flat against two-level EP: the expected value, from routing statistics, before any compile.

  python3 tools/ep_node_bytes.py                      # V3 at EP 64 over 8 nodes, and the CPU plans' layouts
  python3 tools/ep_node_bytes.py 256 8 8 4            # experts, top-k, nodes, node limit M

Routes random tokens (unit Gaussian, hidden 64, a random router, no bias) through our router
(MaxText/moe/routing.py) with groups = the nodes, each scored by its top K/M, and the best M kept
(moe_node_limited_routing; M = nodes: no limit), then counts each token's distinct nodes. Per token, flat EP
(a2a_padded) sends K copies, (N-1)/N of them to other nodes; the two-level dispatch (hierarchical) sends one row per node it needs, (N-1)/N of those across. The
ratio is what the exchanged rows would be if buffers held exactly what is routed; the compiled buffers hold a
capacity instead (MaxText/moe/dispatch/hierarchical.py says how each is sized), so the compiled ratio at equal
capacity factors is K / min(K, M, N), or more where the two-level buffer is capped at the tokens.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def nodes_per_token(experts: int, top_k: int, nodes: int, limit: int, tokens: int = 20_000, seed: int = 0):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from MaxText.moe import routing  # pylint: disable=import-outside-toplevel

  x = jax.random.normal(jax.random.key(seed), (tokens, 64))
  kernel = jax.random.normal(jax.random.key(seed + 1), (64, experts)) * 0.5
  cfg = routing.RouterConfig(num_experts=experts, top_k=top_k, routed_scaling_factor=2.5)
  if limit < nodes:  # each node scored by its top K/M (moe_node_limited_routing)
    cfg = routing.node_limited(dataclasses.replace(cfg, n_groups=nodes, topk_groups=limit))
  node_TK = np.asarray(routing.route(x, kernel, jnp.zeros((experts,)), cfg).ids_TK) // (experts // nodes)
  per_token = np.array([len(set(row)) for row in node_TK])
  return float(per_token.mean()), int(per_token.max())


def main(argv: list[str]) -> int:
  cases = [tuple(int(a) for a in argv)] if argv else [(256, 8, 8, 4), (256, 8, 8, 8), (16, 8, 4, 4), (16, 8, 4, 2)]
  if any(len(c) != 4 for c in cases):
    print("usage: ep_node_bytes.py [EXPERTS TOP_K NODES NODE_LIMIT]", file=sys.stderr)
    return 2
  for experts, top_k, nodes, limit in cases:
    mean, most = nodes_per_token(experts, top_k, nodes, limit)
    flat, two_level = top_k * (nodes - 1) / nodes, mean * (nodes - 1) / nodes
    print(f"experts {experts} top-{top_k} over {nodes} nodes, node limit {limit}: {mean:.3f} nodes a token (max {most}); "
          f"rows across nodes a token: flat {flat:.2f}, two-level {two_level:.3f}: {flat / two_level:.2f}x fewer")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
