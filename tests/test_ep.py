"""Expert parallelism on 4 simulated CPU devices, in subprocesses.

The device count must be fixed before JAX starts, so each check runs
tests/ep_check.py (block level) or `python -m MaxText.train` (a short run)
with `--xla_force_host_platform_device_count=4`, and both backends are held
to the one-device numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FOUR_CPUS = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def _ep_check(case: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, str(HERE / "ep_check.py"), case], cwd=HERE.parent, env=env,
                        capture_output=True, text=True, timeout=300, check=False)


def _json_lines(proc) -> list[dict]:
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_ring_and_a2a_padded_match_one_device_forward_and_grads():
  """(1,4) and (2,2) (data, expert) meshes; top-k 2, 8, and every token to one expert."""
  rows = _json_lines(_ep_check("match"))
  assert len(rows) == 6 and {r["backend"] for r in rows} == {"ring", "a2a_padded"}
  for r in rows:
    assert r["loss_err"] < 1e-4 and r["grad_err"] < 1e-4 and not r["overflow"], r


def test_a2a_padded_overflow_is_flagged_on_the_device():
  """All 6 rows of a shard to one peer, bound 2: flagged, not silent (the train step stops the run on it:
  tests/test_train.py)."""
  proc = _ep_check("overflow")
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert row["overflow"] is True


def test_ragged_a2a_refuses_cpu_but_traces_forward_and_backward():
  (row,) = _json_lines(_ep_check("ragged_a2a_cpu"))
  assert "XLA:CPU does not implement ragged-all-to-all" in row["resolve_raised"]
  assert row["ragged_ops_in_hlo"] == 4  # dispatch, combine, and their reverses (ragged_exchange's VJP)


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_ragged_a2a_emulated_matches_one_device_forward_and_grads():
  """ragged_a2a with its exchange emulated by all_to_all (XLA:CPU has no ragged
  one): the dispatch/combine plans and their reverses (the custom VJP) give the
  one-device loss and gradients on (1,4) and (2,2) meshes, top-k 2, 8, skewed."""
  example, *rows = _json_lines(_ep_check("ragged_a2a_emulated"))
  assert example["docstring_example"] == [[1, 3, 0, 0], [2, 2, 4, 0]]  # the emulation keeps jax's semantics
  assert len(rows) == 3 and {r["backend"] for r in rows} == {"ragged_a2a"}
  for r in rows:
    assert r["loss_err"] < 1e-4 and r["grad_err"] < 1e-4 and not r["overflow"], r


def test_ragged_a2a_backward_has_no_psum_over_the_expert_axis():
  """The 2026-11-30 GPU bug, seen in the grad jaxpr of the real primitive.

  jax 0.11.2 types ragged_all_to_all's result like its `output` buffer, so a
  fresh zeros buffer makes autodiff psum float cotangents over the expert axis
  (the raw call shows it; the old block had two such psums, and with the
  primitive lowered through the emulation its grads were off by exactly the GPU
  errors). ragged_exchange and the whole ragged_a2a block backward must have none.
  """
  (row,) = _json_lines(_ep_check("ragged_a2a_vma"))
  assert len(row["raw"]) == 1 and "psum" in row["raw"][0], row  # the checker sees the bug on the raw primitive
  assert row["ours"] == [] and row["block"] == [], row


@pytest.mark.slow  # long on CPU (several simulated devices): --all only
def test_every_mesh_matches_one_device():
  """The block on fsdp=4, data2 x fsdp2, ep=4, fsdp2 x ep2 and data2 x ep2 (each dispatch backend that
  runs on CPU) against one device: loss and every gradient. FSDP meshes split the tokens and share the
  weights, so their dW is summed over the token shards inside gmm's VJP (MaxText/moe/vma.py).
  The fast tier's share is tests/test_expert_grad_sharding.py's: local on data x fsdp, a2a_padded on
  data x fsdp x expert and ring on fsdp x tensor x expert, each against one device and the dense reference."""
  rows = _json_lines(_ep_check("meshes"))
  assert len(rows) == 8
  for r in rows:
    assert r["loss_err"] < 1e-4 and r["grad_err"] < 1e-4 and not r["overflow"], r


@pytest.mark.parametrize("case, n", [pytest.param("kernel_typing", 22, marks=pytest.mark.slow),
                                     ("kernel_typing_quick", 8)])
def test_gpu_kernel_typing_traces_on_every_mesh(case, n):
  """The 2xH200 crash ("manual axis types do not match"), reproduced on CPU by tracing the block's
  gradient with the mgpu and mgpu_fp8 backends: Pallas kernel outputs carry no varying manual axes, so
  the custom VJP's cotangents were typed unlike their primals on every mesh of more than one device.
  The fast tier traces data2 x fsdp2 and fsdp2 x ep2 (every dispatch backend); the slow tier all five."""
  rows = _json_lines(_ep_check(case))
  assert len(rows) == n and {r["backend"] for r in rows} == {"local", "ring", "a2a_padded", "ragged_a2a"}
  assert {r["gmm"] for r in rows} == {"mgpu", "mgpu_fp8"}
  assert [r for r in rows if r["error"]] == []


# The fast tier keeps the FP8 dispatch on 3 devices (FP8 experts included); the rest run in the slow tier, where
# meshes_fp8's 8 rows hold meshes_fp8_quick's 3 (tests/ep_check.py: QUICK_MESHES is two of MESHES).
@pytest.mark.parametrize("case, n", [pytest.param("meshes_fp8", 8, marks=pytest.mark.slow),
                                     pytest.param("meshes_fp8_dispatch", 8, marks=pytest.mark.slow),
                                     ("meshes_fp8_dispatch_quick", 3)])
def test_fp8_experts_on_every_mesh_match_one_device(case, n):
  """moe_fp8=blockwise's CPU backend (xla_fp8, the kernel's quantization emulated) on a mesh against one
  device. The forward's and dlhs's tiles (one row, 128 columns) and weight blocks are the same on every
  shard, so the loss and the token and router gradients are the one-device ones. dW's 128-row tiles are
  cut from each shard's rows of a group, so where a group's rows are split over token shards the expert
  gradients are another quantization of the same sum: within FP8's error (each is ~3.5% from the
  unquantized sum; measured 2.3-3.1%). With EP alone a group's rows all reach one shard: exact.
  With the FP8 dispatch on both (tokens, and the combine's cotangent in the backward, quantized before they
  move; on one device the moves are local gathers) every shard quantizes the same token rows, so the same
  holds."""
  rows = _json_lines(_ep_check(case))
  assert len(rows) == n and {r["gmm"] for r in rows} == {"xla_fp8"}
  assert {r["fp8_dispatch"] for r in rows} == {"dispatch" in case}
  for r in rows:
    assert r["loss_err"] < 1e-4 and r["x_and_router_grad_err"] < 1e-4 and not r["overflow"], r
    if set(r["mesh"]) == {"expert"}:  # every group's rows meet on its expert's shard
      assert r["expert_grad_rel_err"] < 1e-5, r
    else:
      assert 0 < r["expert_grad_rel_err"] < 0.06, r


def test_the_block_adds_no_host_callback_and_no_all_reduce_for_the_overflow():
  """a2a_padded's compiled block gradient on 4 devices, with and without the FP8 dispatch: no host callback (one
  per layer call, forward and remat, before) and no all-reduce (each shard's flag was agreed by one per call)."""
  rows = _json_lines(_ep_check("callbacks"))
  assert rows == [{"fp8_dispatch": False, "callbacks": 0, "all_reduces": 0},
                  {"fp8_dispatch": True, "callbacks": 0, "all_reduces": 0}]


# The entry point on 4 simulated CPU devices: (mesh keys, dispatch backend). One MoE layer (3 dense + 1)
# and 64 tokens per sequence keep the runs short; each uses the same global batch of 8 sequences.
ENTRY_MESHES = [
    (("ici_fsdp_parallelism=4",), "local"),
    *[(mesh, backend) for mesh in (("ici_expert_parallelism=4",),
                                   ("ici_fsdp_parallelism=2", "ici_expert_parallelism=2"),
                                   ("ici_data_parallelism=2", "ici_expert_parallelism=2"))
      for backend in ("ring", "a2a_padded")],
]
ENTRY_COMMON = ("steps=4", "enable_checkpointing=false", "moe_block=ours", "base_num_decoder_layers=4",
                "max_target_length=64")


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory):
  from conftest import run_train  # pylint: disable=import-outside-toplevel

  one = run_train(tmp_path_factory.mktemp("one"), *ENTRY_COMMON, "per_device_batch_size=8", run_name="one")
  assert one.returncode == 0, one.stderr[-3000:]
  return one.losses()


@pytest.mark.slow
@pytest.mark.parametrize("mesh,backend", ENTRY_MESHES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_training_on_four_devices_matches_one_device(train, one_device_losses, mesh, backend):
  """`python -m MaxText.train` on the mesh vs one device, same global batch: the losses agree to 2%
  (bf16 activations; the mesh changes the order of the float32 reductions, nothing else)."""
  run = train(*ENTRY_COMMON, f"moe_dispatch_backend={backend}", *mesh, run_name="mesh", env=FOUR_CPUS)
  assert run.returncode == 0, run.stderr[-3000:]
  ep = 4 if "ici_expert_parallelism=4" in mesh else 2 if any("expert" in m for m in mesh) else 1
  assert f"(dispatch {backend}, gmm xla, EP {ep})" in run.stdout
  losses = run.losses()
  assert sorted(losses) == sorted(one_device_losses) and len(losses) == 4
  for step, loss in one_device_losses.items():
    assert abs(losses[step] - loss) < 0.02 * max(1.0, abs(loss)), (step, losses, one_device_losses)
