"""jax's cuDNN attention under vmap with MLA's unequal head sizes (patches/cudnn_mla_vmap.py): upstream's pipeline
vmaps its stages, and jax 0.11.2's batching rule reshapes the values with the keys' head size.

cuDNN cannot run on CPU. The fast tests give jax's two cuDNN primitives a CPU kernel with their contract (the
forward returns the output [B, T, N, Hv] and the softmax's log-sum-exp [B, N, T]; the backward takes both back with
the output's cotangent and returns dq, dk, dv, as flash attention's backward does), in float32 (cuDNN itself takes
bf16/fp16 only; its dtype check is lifted here). What runs is jax's own wrapper, custom VJP and partitioning, and
the batching rule under test; a wrongly folded operand gives a wrong value or gradient. The reference is plain MLA
attention in einsums, one stage at a time. The slow test compiles the vmapped call for a compile-only H200 with
the real cuDNN custom calls.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as fa
from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
from jax._src.interpreters import batching

import cpu_cudnn as cpu_cudnn_lib
from conftest import REPO, require_gpu_plan
from patches import cudnn_mla_vmap
from patches._seam import UpstreamMismatch

B, T, N, H_QK, H_V = 2, 8, 2, 24, 16  # per stage: MLA's head sizes differ (DeepSeek-V3: 192 and 128)
SCALE = 0.3


def _mask_NTS(t: int, s: int):
  return jnp.tril(jnp.ones((t, s), bool))[None]


def _scores_BNTS(q_BTNH, k_BSNH, mask_type):
  assert mask_type == MaskType.CAUSAL
  s_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH) * SCALE
  return jnp.where(_mask_NTS(s_BNTS.shape[2], s_BNTS.shape[3]), s_BNTS, -1e30)


def _kernel_fwd(q, k, v, *unused, scale, mask_type, layout, is_training, **_):
  assert scale == SCALE and layout == 0 and not any(u.size for u in unused)  # BTNH (0); no bias, seqlens, offsets
  s_BNTS = _scores_BNTS(q, k, mask_type)
  lse_BNT = jax.nn.logsumexp(s_BNTS, axis=-1)
  out_BTNV = jnp.einsum("bnts,bsnv->btnv", jnp.exp(s_BNTS - lse_BNT[..., None]), v)
  return (out_BTNV, lse_BNT) if is_training else (out_BTNV,)


def _kernel_bwd(q, k, v, *rest, scale, mask_type, **_):
  """Flash attention's backward: P from the saved log-sum-exp, D from the saved output."""
  *unused, lse_BNT, out_BTNV, dout_BTNV = rest
  assert scale == SCALE and not any(u.size for u in unused)
  p_BNTS = jnp.exp(_scores_BNTS(q, k, mask_type) - lse_BNT[..., None])
  dv = jnp.einsum("bnts,btnv->bsnv", p_BNTS, dout_BTNV)
  dp_BNTS = jnp.einsum("btnv,bsnv->bnts", dout_BTNV, v)
  d_BNT = jnp.einsum("btnv,btnv->bnt", dout_BTNV, out_BTNV)
  ds_BNTS = p_BNTS * (dp_BNTS - d_BNT[..., None]) * scale
  return jnp.einsum("bnts,bsnh->btnh", ds_BNTS, k), jnp.einsum("bnts,btnh->bsnh", ds_BNTS, q), dv


@pytest.fixture
def cpu_cudnn(monkeypatch):
  """jax's cuDNN primitives with the kernels above (tests/cpu_cudnn.py)."""
  with cpu_cudnn_lib.kernels(monkeypatch, _kernel_fwd, _kernel_bwd) as module:
    yield module


@pytest.fixture
def seam():
  cudnn_mla_vmap.apply()
  yield cudnn_mla_vmap
  cudnn_mla_vmap.undo()


def _cudnn(q, k, v):
  return dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL, scale=SCALE, qkv_layout="BTNH")


def _reference(q, k, v):
  """Plain MLA attention, softmax over the causal scores."""
  return jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(_scores_BNTS(q, k, MaskType.CAUSAL), axis=-1), v)


# How the stages reach the attention: one vmap (upstream's stages), one with keys shared by every stage (an
# operand without the vmap axis), and two nested (stages x repeats, as a circular pipeline holds its layers).
BATCHINGS = {
    "stages": jax.vmap,
    "keys_shared": lambda f: jax.vmap(f, in_axes=(0, None, 0)),
    "stages_x_repeats": lambda f: jax.vmap(jax.vmap(f)),
}


def _operands(how: str):
  rng = np.random.default_rng(0)
  lead = {"stages": (3,), "keys_shared": (3,), "stages_x_repeats": (2, 3)}[how]
  q = rng.standard_normal((*lead, B, T, N, H_QK), np.float32)
  k = rng.standard_normal((B, T, N, H_QK) if how == "keys_shared" else (*lead, B, T, N, H_QK), np.float32)
  v = rng.standard_normal((*lead, B, T, N, H_V), np.float32)
  ct = rng.standard_normal((*lead, B, T, N, H_V), np.float32)
  return q, k, v, ct


@pytest.mark.parametrize("how", sorted(BATCHINGS))
def test_vmapped_mla_attention_and_its_gradients_equal_the_reference(cpu_cudnn, seam, how):
  q, k, v, ct = _operands(how)
  batched = BATCHINGS[how]

  def loss(attention):
    return lambda q, k, v: jnp.sum(batched(attention)(q, k, v) * ct)

  np.testing.assert_allclose(jax.jit(batched(_cudnn))(q, k, v), batched(_reference)(q, k, v), rtol=1e-5, atol=1e-5)
  got = jax.jit(jax.grad(loss(_cudnn), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(loss(_reference), argnums=(0, 1, 2))(q, k, v)
  for name, g, w in zip("qkv", got, want):
    assert g.shape == w.shape, name
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_the_reference_is_jaxs_xla_attention_on_values_padded_to_the_keys_head_size():
  """The other way to batch it: V zero-padded to d_qk through jax.nn.dot_product_attention's XLA path (which
  takes only equal head sizes), the output sliced: the same values as the einsum reference."""
  q, k, v, _ = _operands("stages")
  padded = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
      q, k, jnp.pad(v, ((0, 0),) * 3 + ((0, H_QK - H_V),)), scale=SCALE, is_causal=True, implementation="xla")
  np.testing.assert_allclose(jax.vmap(padded)(q, k, v)[..., :H_V], jax.vmap(_reference)(q, k, v), rtol=1e-5, atol=1e-5)


def test_without_the_seam_jaxs_rule_cannot_batch_mla(cpu_cudnn):
  q, k, v, _ = _operands("stages")
  with pytest.raises(TypeError, match=r"cannot reshape array of shape \(3, 2, 8, 2, 16\)"):
    jax.jit(jax.vmap(_cudnn))(q, k, v)


def test_equal_head_sizes_batch_as_before(cpu_cudnn, seam):
  """They go to jax's rule, which folds them right."""
  q, k, _, _ = _operands("stages")
  v = 0.5 * q  # [.., H_QK]
  loss = lambda attention: lambda q, k, v: jnp.sum(jax.vmap(attention)(q, k, v) ** 2)  # noqa: E731
  got = jax.jit(jax.grad(loss(_cudnn), argnums=(0, 1, 2)))(q, k, v)
  for name, g, w in zip("qkv", got, jax.grad(loss(_reference), argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_the_seam_checks_jax_and_undo_restores_its_rules():
  fwd = fa._dot_product_attention_fwd_p_wrapper  # pylint: disable=protected-access
  bwd = fa._dot_product_attention_bwd_p_wrapper  # pylint: disable=protected-access
  before = batching.fancy_primitive_batchers[fwd], batching.fancy_primitive_batchers[bwd]
  with pytest.raises(UpstreamMismatch, match=r"targets jax 0\.11\.2 .* but jax 0\.12\.0 is installed; install jax=="):
    cudnn_mla_vmap.SEAM.check(installed_version="0.12.0")
  try:
    cudnn_mla_vmap.apply()
    cudnn_mla_vmap.apply()  # a no-op
    assert cudnn_mla_vmap.applied()
    assert batching.fancy_primitive_batchers[fwd] is not before[0]
    assert batching.fancy_primitive_batchers[bwd] is not before[1]
  finally:
    cudnn_mla_vmap.undo()
  assert (batching.fancy_primitive_batchers[fwd], batching.fancy_primitive_batchers[bwd]) == before
  assert not cudnn_mla_vmap.applied()


_COMPILE_FOR_H200 = """
import os, re
from MaxText.plan import gpu_target
device = gpu_target.enter("h200", 1, 8)[0]
import jax, jax.numpy as jnp
from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
if os.environ["WITH_SEAM"] == "1":
  from patches import cudnn_mla_vmap
  cudnn_mla_vmap.apply()
s = jax.sharding.SingleDeviceSharding(device)
arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=s)
attn = lambda q, k, v: dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL, scale=1.0, qkv_layout="BTNH")
loss = lambda q, k, v: jax.vmap(attn)(q, k, v).astype(jnp.float32).sum()
STAGES, B, T, N = 2, 2, 256, 4
try:
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
      arg(STAGES, B, T, N, 192), arg(STAGES, B, T, N, 192), arg(STAGES, B, T, N, 128)).compile().as_text()
except TypeError as e:
  print("error:", e)
else:
  for line in text.splitlines():
    if "custom_call_target=\\"__cudnn$fmha" in line:
      print("cudnn:", re.search(r'custom_call_target="([^"]+)"', line)[1], *re.findall(r"bf16\\[[\\d,]+\\]", line))
"""


@pytest.mark.slow
def test_the_vmapped_mla_call_compiles_to_cudnn_for_an_h200():
  """Compile-only H200 (XLA's GPU pipeline, no GPU): jax's rule stops at the values' reshape; with the seam the
  forward and backward are one cuDNN call each over stages x batch sequences, the values at their own 128."""
  require_gpu_plan("h200")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  out = {}
  for with_seam in ("0", "1"):
    run = subprocess.run([sys.executable, "-c", _COMPILE_FOR_H200], cwd=REPO, env={**env, "WITH_SEAM": with_seam},
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    out[with_seam] = run.stdout
  assert "error: cannot reshape array of shape (2, 2, 256, 4, 128)" in out["0"], out["0"]
  calls = [line for line in out["1"].splitlines() if line.startswith("cudnn:")]
  assert len(calls) == 2, out["1"]  # the forward and the backward
  forward, backward = sorted(calls, key=lambda line: "Backward" in line)
  assert "Backward" not in forward and "Backward" in backward
  # stages x batch = 4 sequences a call; the queries and keys at 192, the values and the output at 128
  assert {"bf16[4,256,4,192]", "bf16[4,256,4,128]"} <= set(forward.split()[2:]), forward
  assert {"bf16[4,256,4,192]", "bf16[4,256,4,128]"} <= set(backward.split()[2:]), backward
