"""moe_gmm_backend: the megablox seam, the upstream config it needs, and training with it.

The last test trains the tiny DeepSeek-V3 twice (ours through the patched seam,
then upstream's own ragged_dot path) and compares the loss curves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import patches
from conftest import REPO
from gmm_reference import CASES, dense_gmm, rel_err
from MaxText import config as fork_config
from patches import megablox_gmm

TINY = "configs/deepseek3-tiny.yml"
UPSTREAM_BLOCK = ("moe_block=upstream",)  # the tiny config runs ours; these tests are about upstream's sparse_matmul

# What upstream's sparse_matmul `gmm` closure passes to mblx.gmm off TPU (layers/moe.py ~2319).
_UPSTREAM_KWARGS = dict(
    tiling=(512, 1024, 1024) * 3,
    lhs_quantize_dtype=None,
    rhs_quantize_dtype=None,
    use_qwix_quantization=False,
    use_tokamax_backend=False,
    weight_gather_axes=[],
    lhs_vma_axes=(),
    rhs_vma_axes=(),
    use_gmm_v2=False,
    use_gmm_v2_heuristic_tiling=False,
    partial_sum=None,
    interpret=True,
)


@pytest.fixture
def patched_xla():
  from maxtext.kernels import megablox  # pylint: disable=import-outside-toplevel

  original = megablox.gmm
  megablox_gmm.apply(fork_config.ForkConfig(moe_gmm_backend="xla"))
  try:
    yield megablox
  finally:
    patches.undo_module(megablox_gmm)
  assert megablox.gmm is original


@pytest.mark.parametrize("case", [CASES[4], CASES[5]], ids=lambda c: c.name)
def test_patched_megablox_gmm_runs_our_backend_with_upstreams_arguments(patched_xla, case):
  lhs, rhs, gs = case.arrays(jnp.bfloat16)
  before = megablox_gmm.call_counts().get("xla", 0)
  out = patched_xla.gmm(
      lhs=lhs, rhs=rhs, group_sizes=gs, preferred_element_type=jnp.bfloat16, group_offset=case.group_offset,
      **_UPSTREAM_KWARGS,
  )
  assert megablox_gmm.call_counts()["xla"] == before + 1
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, dense_gmm(lhs, rhs, gs, case.group_offset)) < 1e-2


def test_patched_gmm_adds_partial_sum_and_refuses_what_it_does_not_do(patched_xla):
  lhs, rhs, gs = CASES[0].arrays()
  partial = jnp.ones((lhs.shape[0], rhs.shape[2]), jnp.float32)
  kwargs = {**_UPSTREAM_KWARGS, "partial_sum": partial}
  out = patched_xla.gmm(lhs=lhs, rhs=rhs, group_sizes=gs, group_offset=0, **kwargs)
  assert rel_err(out, dense_gmm(lhs, rhs, gs) + 1.0) < 1e-5
  with pytest.raises(NotImplementedError, match="quantization.*moe_gmm_backend=upstream"):
    patched_xla.gmm(lhs=lhs, rhs=rhs, group_sizes=gs, lhs_quantize_dtype=jnp.int8)
  with pytest.raises(NotImplementedError, match="existing_out"):
    patched_xla.gmm(lhs=lhs, rhs=rhs, group_sizes=gs, existing_out=jnp.zeros((16, 6)))


def test_seam_targets_the_installed_upstream():
  megablox_gmm.SEAM.check()  # hash of maxtext 0.2.5's megablox.gmm source
  assert megablox_gmm.wanted(fork_config.ForkConfig(moe_gmm_backend="xla"))
  assert not megablox_gmm.wanted(fork_config.ForkConfig())


# --- the upstream config our backends need ------------------------------------------


def test_our_backend_turns_the_config_files_megablox_off_into_on():
  assert fork_config.load([TINY]).upstream["megablox"] is False  # the CPU config's choice
  run = fork_config.load([TINY, *UPSTREAM_BLOCK, "moe_gmm_backend=xla"])
  assert run.upstream["megablox"] is True and run.upstream["sparse_matmul"] is True


@pytest.mark.parametrize(
    "override, key",
    [("megablox=false", "megablox"), ("sparse_matmul=false", "sparse_matmul"),
     ("use_tokamax_gmm=true", "use_tokamax_gmm"), ("te_moe_block=true", "te_moe_block"),
     ("quantization=int8", "quantization")],
)
def test_conflicting_upstream_keys_are_config_errors_naming_the_key(override, key):
  with pytest.raises(fork_config.ConfigError, match=f"config key '{key}' = .* conflicts with moe_gmm_backend=xla"):
    fork_config.load([TINY, *UPSTREAM_BLOCK, "moe_gmm_backend=xla", override])
  fork_config.load([TINY, *UPSTREAM_BLOCK, override])  # fine for upstream's own path


# --- training: patched against unpatched --------------------------------------------

# Trains in a fresh process, then prints our backends' call counts.
_DRIVER = (
    "import json, sys\n"
    "from MaxText import train\n"
    "from patches import megablox_gmm\n"
    "code = train.main(sys.argv[1:])\n"
    "print('GMM_CALLS=' + json.dumps(megablox_gmm.call_counts()), flush=True)\n"
    "sys.exit(code)\n"
)


def _start(tmp_path, run_name, *args):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  argv = [TINY, *UPSTREAM_BLOCK, "steps=5", "enable_checkpointing=false", f"base_output_directory={tmp_path}",
          f"run_name={run_name}", *args]
  return subprocess.Popen([sys.executable, "-c", _DRIVER, *argv], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc, tmp_path, run_name):
  out, err = proc.communicate(timeout=600)  # generous: CI machines may be shared
  assert proc.returncode == 0, err[-3000:]
  calls = json.loads(next(line for line in out.splitlines() if line.startswith("GMM_CALLS="))[10:])
  losses = json.loads((tmp_path / run_name / "summary.json").read_text())["losses"]
  return out, calls, np.array([losses[str(step)] for step in range(5)])


@pytest.mark.slow
def test_tiny_model_trains_through_our_xla_backend_like_upstreams_ragged_path(tmp_path):
  # Both at once: each is mostly single-threaded Python start-up and tracing.
  ours = _start(tmp_path, "ours", "moe_gmm_backend=xla")
  upstream = _start(tmp_path, "upstream")  # megablox=false: upstream's jax.lax.ragged_dot
  log, calls, ours_loss = _finish(ours, tmp_path, "ours")
  _, upstream_calls, upstream_loss = _finish(upstream, tmp_path, "upstream")

  # w0, w1, wo of the MoE layers (scanned: traced once); jit may trace the step again.
  assert calls.get("xla", 0) >= 3 and calls["xla"] % 3 == 0, calls
  assert upstream_calls == {}
  assert "grouped-GEMM backend xla" in log  # the call counts above show the seam ran (its name prints with verbose)
  assert np.all(np.isfinite(ours_loss)) and ours_loss[4] < ours_loss[0] - 0.1
  # Same model, same data; bf16 activations round differently in the two paths.
  np.testing.assert_allclose(ours_loss, upstream_loss, rtol=2e-3)
