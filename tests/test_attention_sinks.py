"""Attention with sinks in a fused kernel (MaxText/attention/sinks.py): forward and gradients (dq, dk, dv and the
sinks') against upstream's dot_product formulation in float32 (tests/sinks_reference.py), causal with and without
a sliding window, GQA, a sink of -inf (plain attention), a dominant sink and a huge one.

Kernel "xla" is the custom VJP with flash_xla.py's forward and backward. Kernel "cudnn" is the same custom VJP
through flash_cudnn.py's binding of jax's cuDNN primitives, which cannot run on CPU: the `cpu_cudnn` fixture
gives jax's two core cuDNN primitives a CPU lowering with their contract (flash_xla.py's math, reading the
primitives' own scale and sliding_window_length), so what runs is our binding, jax's wrapper primitives and
their partitioning, and the custom VJP that runs on the GPU. tools/sinks_selftest.py checks the real cuDNN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as fa
from jax.sharding import PartitionSpec as P

from conftest import MANY_CPU_THREADS, in_own_process, load_script
from MaxText.attention import sinks
from sinks_reference import cpu_cudnn, dense_attention_with_sinks  # noqa: F401  pylint: disable=unused-import

B, T, N, H = 2, 12, 4, 8
SCALE = 0.35
TOL = 2e-5  # float32 throughout: max |got - want| / max |want|


def _operands(kv_heads: int, sink: str, seed: int = 0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H), np.float32)
  k = rng.standard_normal((B, T, kv_heads, H), np.float32)
  v = rng.standard_normal((B, T, kv_heads, H), np.float32)
  ct = rng.standard_normal((B, T, N, H), np.float32)
  sinks_N = {"random": rng.standard_normal(N).astype(np.float32),
             "minus_inf": np.full(N, -np.inf, np.float32),
             "dominant": np.full(N, 9.0, np.float32),  # ~99.9% of each row's mass: out' is ~1e-3 of out
             "huge": np.full(N, 1e4, np.float32)}[sink]
  return q, k, v, sinks_N, ct


def _value_and_grads(attention, q, k, v, sinks_N, ct):
  loss = lambda *args: jnp.sum(attention(*args) * ct)  # noqa: E731
  return attention(q, k, v, sinks_N), jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks_N)


def _rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.isfinite(got).all()
  scale = np.abs(want).max()
  return float(np.abs(got - want).max() / scale) if scale else float(np.abs(got).max())


def _check(kernel: str, kv_heads: int, window, sink: str, tol=TOL):
  q, k, v, sinks_N, ct = _operands(kv_heads, sink)
  ours = jax.jit(lambda *a: sinks.attention_with_sinks(*a, scale=SCALE, window=window, kernel=kernel))
  reference = lambda *a: dense_attention_with_sinks(*a, scale=SCALE, window=window)  # noqa: E731
  got_out, got = _value_and_grads(ours, q, k, v, sinks_N, ct)
  want_out, want = _value_and_grads(reference, q, k, v, sinks_N, ct)
  errors = {"out": _rel_err(got_out, want_out)}
  errors.update({f"d{name}": _rel_err(g, w) for name, g, w in zip(("q", "k", "v", "sinks"), got, want)})
  assert all(e <= tol for e in errors.values()), errors
  return got_out, got


# GQA (1 and 2 KV heads of 4) and MHA, with and without the window; a sink that takes ~99.9% of each row.
@pytest.mark.parametrize("kv_heads,window,sink", [(1, 5, "random"), (2, None, "random"), (4, 5, "random"),
                                                  (2, 5, "dominant")])
def test_xla_kernel_matches_dense_attention_with_sinks(kv_heads, window, sink):
  _check("xla", kv_heads, window, sink)


@pytest.mark.parametrize("kv_heads,window,sink", [(2, 5, "random"), (1, None, "dominant")])
def test_cudnn_kernel_binding_matches_dense_attention_with_sinks(cpu_cudnn, kv_heads, window, sink):
  _check("cudnn", kv_heads, window, sink)


def test_a_sink_of_minus_inf_is_plain_attention_and_gets_no_gradient():
  out, grads = _check("xla", 2, None, "minus_inf")
  q, k, v, _, _ = _operands(2, "minus_inf")
  plain = jax.nn.dot_product_attention(q, k, v, scale=SCALE, is_causal=True, implementation="xla")
  assert _rel_err(out, plain) <= TOL
  np.testing.assert_array_equal(grads[3], np.zeros(N, np.float32))


def test_a_huge_sink_takes_every_row_whole_without_nan():
  out, grads = _check("xla", 2, 5, "huge")
  assert not np.asarray(out).any() and all(not np.asarray(g).any() for g in grads[:3])
  assert np.isfinite(grads[3]).all()


def test_the_sigmoid_on_jaxs_cudnn_vjp_gets_dq_and_dk_wrong(cpu_cudnn):
  """What sinks.py exists for: out * sigmoid(lse - sink) on jax's own cuDNN attention (return_residual) has the
  right output and dv, but jax's backward drops the LSE's cotangent, so dq and dk come out wrong, silently."""
  q, k, v, sinks_N, ct = _operands(2, "random")

  def naive(q, k, v, sinks_N):
    out, lse_BNT = fa.dot_product_attention(q, k, v, scale=SCALE, mask_type=fa.MaskType.CAUSAL, return_residual=True)
    return out * jax.nn.sigmoid(lse_BNT - sinks_N[None, :, None]).transpose(0, 2, 1)[..., None]

  got_out, got = _value_and_grads(jax.jit(naive), q, k, v, sinks_N, ct)
  want_out, want = _value_and_grads(lambda *a: dense_attention_with_sinks(*a, scale=SCALE), q, k, v, sinks_N, ct)
  assert _rel_err(got_out, want_out) <= TOL and _rel_err(got[2], want[2]) <= TOL  # out and dv: right
  assert _rel_err(got[0], want[0]) > 0.05 and _rel_err(got[1], want[1]) > 0.05  # dq and dk: wrong


def test_an_unknown_kernel_or_window_is_refused_by_name():
  q, k, v, sinks_N, _ = _operands(2, "random")
  with pytest.raises(ValueError, match=r"kernel 'flash': not one of cudnn, xla, te"):
    sinks.attention_with_sinks(q, k, v, sinks_N, kernel="flash")
  with pytest.raises(ValueError, match=r"sliding window 0: must be > 0"):
    sinks.attention_with_sinks(q, k, v, sinks_N, window=0, kernel="xla")


def test_te_kernel_without_transformer_engine_says_what_to_install():
  q, k, v, sinks_N, _ = _operands(2, "random")
  with pytest.raises(ImportError, match=r"kernel 'te' needs Transformer Engine for JAX: pip install 'maxtext-moe\[te\]'"):
    sinks.attention_with_sinks(q, k, v, sinks_N, kernel="te")


def test_in_shard_map_on_four_devices_the_sinks_gradient_is_summed_over_the_batch_shards(request, cpu_cudnn):
  """Batch over `data`, heads over `tensor`; the sinks split over `tensor` only, so each data shard holds a
  partial dsink: the custom VJP's cotangent is summed over `data` (MaxText/moe/vma.py like_primal)."""
  if not in_own_process(request, MANY_CPU_THREADS):
    return
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
  q, k, v, sinks_N, ct = _operands(2, "random")
  qkv_spec = P("data", None, "tensor", None)
  want_out, want = _value_and_grads(lambda *a: dense_attention_with_sinks(*a, scale=SCALE, window=5),
                                    q, k, v, sinks_N, ct)
  for kernel in ("xla", "cudnn"):
    body = lambda *a, kernel=kernel: sinks.attention_with_sinks(*a, scale=SCALE, window=5, kernel=kernel)  # noqa: E731
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(qkv_spec,) * 3 + (P("tensor"),), out_specs=qkv_spec)
    got_out, got = _value_and_grads(jax.jit(sharded), q, k, v, sinks_N, ct)
    errors = {name: _rel_err(g, w) for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"),
                                                           (got_out, *got), (want_out, *want))}
    assert all(e <= TOL for e in errors.values()), (kernel, errors)


def test_the_gpu_selftest_fails_cleanly_here_and_passes_its_cpu_smoke(capsys):
  """tools/sinks_selftest.py: on CPU one line and exit 2; its --cpu-smoke cases (kernel xla) pass its bound."""
  selftest = load_script("sinks_selftest", "tools/sinks_selftest.py")
  assert selftest.main(["--seed", "0"]) == 2
  assert capsys.readouterr().out.splitlines() == [
      "sinks_selftest: no GPU here (JAX's backend is cpu); run it on an NVIDIA GPU, or --cpu-smoke for the XLA "
      "kernel on CPU"]
  for i, case in enumerate(selftest.smoke_cases()):
    errors, _, _ = selftest.run_case("xla", case, seed=i)
    assert set(errors) == {"out", "dq", "dk", "dv", "dsinks"} and max(errors.values()) <= selftest.TOLERANCE, errors
