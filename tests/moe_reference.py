"""Shared fixtures for the MoE tests: tiny weights and the float32 dense reference.

The reference runs every token through *every* expert with plain einsums and
picks each token's K outputs with a one-hot: nothing is sorted, gathered or
grouped, so it shares no code with the block under test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.moe import block


def make_params(key, *, tokens=13, hidden=8, experts=8, mlp=6):
  kx, kr, k0, k1, ko = jax.random.split(key, 5)
  x_TD = jax.random.normal(kx, (tokens, hidden), jnp.float32)
  router = block.Router(kernel_DE=jax.random.normal(kr, (hidden, experts)) * 0.5, bias_E=jnp.zeros((experts,)))
  ex = block.Experts(
      w0_EDF=jax.random.normal(k0, (experts, hidden, mlp)) * 0.4,
      w1_EDF=jax.random.normal(k1, (experts, hidden, mlp)) * 0.4,
      wo_EFD=jax.random.normal(ko, (experts, mlp, hidden)) * 0.4,
  )
  return x_TD, router, ex


def dense_ffn(x_TD, ids_TK, weights_TK, experts: block.Experts, activation="silu"):
  """sum_k w[t,k] * FFN_{ids[t,k]}(x[t]) with every expert computed densely, float32."""
  x = x_TD.astype(jnp.float32)
  h0 = jnp.einsum("td,edf->tef", x, experts.w0_EDF.astype(jnp.float32))
  h1 = jnp.einsum("td,edf->tef", x, experts.w1_EDF.astype(jnp.float32))
  y_TED = jnp.einsum("tef,efd->ted", block.ACTIVATIONS[activation](h0) * h1, experts.wo_EFD.astype(jnp.float32))
  onehot_TKE = jax.nn.one_hot(ids_TK, experts.w0_EDF.shape[0], dtype=jnp.float32)
  return jnp.einsum("tke,tk,ted->td", onehot_TKE, weights_TK.astype(jnp.float32), y_TED)


def assert_close(got, want, tol=1e-5, what=""):
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol,
                             err_msg=what)
