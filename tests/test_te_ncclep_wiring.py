"""te_ncclep from the entry point: config keys, the no-TE error, and a short run
with the stand-in TE of tests/test_te_ncclep.py.

The run (`python tests/test_te_ncclep_wiring.py train ...`, 4 simulated CPU
devices, EP 4) changes two things that only hold on a GPU: te_ncclep's
platform check is lifted (the stand-in is plain jnp), and the stand-in's
global_shard_guard(MeshResource(dp_resource="data", ep_resource="expert")) is
held around the run, as upstream's run() holds TE's on GPU
(max_utils.transformer_engine_context). Everything between the command line
and TE's calls is ours and upstream's, unchanged.

What this cannot show: that a real TE accepts these calls (its signature,
NCCL EP's bootstrap on >= 2 GPUs, one process each, its custom partitioning
while compiling).
"""

from __future__ import annotations

import json
import os
import sys
import types

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

from conftest import REPO, run_rejected  # noqa: E402

TE_ERROR = ("maxtext-moe: config error: config key 'moe_dispatch_backend' = 'te_ncclep' (as set) cannot run on this CPU "
            "machine: transformer_engine.jax.ep")
TINY_EP4 = ("moe_block=ours", "moe_dispatch_backend=te_ncclep", "ici_expert_parallelism=4", "steps=2",
            "enable_checkpointing=false", "base_num_decoder_layers=4", "max_target_length=64")


def _fake_config(**kw):
  """The upstream config fields te_ncclep's plan reads (deepseek3-tiny on 4 devices, batch 8 x 64)."""
  base = dict(global_batch_size_to_load=8, gradient_accumulation_steps=1, micro_batch_size_to_train_on=8,
              eval_interval=-1, micro_batch_size_to_eval_on=16, max_target_length=64, num_experts=8,
              num_experts_per_tok=4, emb_dim=64)
  return types.SimpleNamespace(**{**base, **kw})


def test_keys_validate():
  from MaxText.config import ConfigError, load  # pylint: disable=import-outside-toplevel

  run = load(["moe_te_ncclep_recv_capacity_per_rank=640", "moe_te_ncclep_alignment=64"])
  assert (run.fork.moe_te_ncclep_recv_capacity_per_rank, run.fork.moe_te_ncclep_alignment) == (640, 64)
  default = load([]).fork
  assert default.moe_te_ncclep_recv_capacity_per_rank is None and default.moe_te_ncclep_alignment == 128
  for arg, why in (("moe_te_ncclep_alignment=96", "power of two"), ("moe_te_ncclep_alignment=0", "greater than or equal to 1"),
                   ("moe_te_ncclep_recv_capacity_per_rank=0", "greater than or equal to 1")):
    with pytest.raises(ConfigError, match=f"'{arg.split('=')[0]}'.*{why}"):
      load([arg])


def test_plan_derives_the_dropless_capacity_or_takes_the_key():
  from MaxText.moe.dispatch import te_ncclep  # pylint: disable=import-outside-toplevel
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from patches import routed_moe, te_ncclep_bootstrap  # pylint: disable=import-outside-toplevel

  cfg, mesh = _fake_config(), {"data": 2, "fsdp": 1, "expert": 2}
  p = te_ncclep_bootstrap.plan(cfg, mesh, recv_capacity_per_rank=None, alignment=8)
  assert (p.ep_size, p.num_ranks, p.max_tokens_per_rank, p.alignment) == (2, 4, 128, 8)
  assert p.recv_capacity_per_rank == te_ncclep.dropless_recv_capacity(
      tokens_per_rank=128, top_k=4, ep_size=2, num_local_experts=4, alignment=8) == 1024  # 4 zones of at most 256 rows
  # eval's microbatch counts when eval runs (upstream's maybe_bootstrap_te_moe rule)
  assert te_ncclep_bootstrap.plan(_fake_config(eval_interval=5), mesh, recv_capacity_per_rank=None,
                                  alignment=8).max_tokens_per_rank == 256
  fork = routed_moe.settings_from(fork_config.ForkConfig(
      moe_block="ours", moe_dispatch_backend="te_ncclep", moe_gmm_backend="xla",
      moe_te_ncclep_recv_capacity_per_rank=640, moe_te_ncclep_alignment=64))
  assert fork["te_ncclep_options"] == {"recv_capacity_per_rank": 640, "alignment": 64}
  assert te_ncclep_bootstrap.plan(cfg, mesh, **fork["te_ncclep_options"]).dispatch_options() == \
      fork["te_ncclep_options"]


def test_plan_refuses_meshes_and_batches_te_cannot_split():
  from patches import te_ncclep_bootstrap  # pylint: disable=import-outside-toplevel

  plan = lambda mesh, **kw: te_ncclep_bootstrap.plan(_fake_config(**kw), mesh, recv_capacity_per_rank=None,  # noqa
                                                     alignment=128)
  with pytest.raises(ValueError, match="'data' and 'expert' only.*'fsdp': 2"):
    plan({"data": 1, "fsdp": 2, "expert": 2})
  with pytest.raises(ValueError, match="'expert' >= 2"):
    plan({"data": 4, "expert": 1})
  with pytest.raises(ValueError, match="num_experts=6 is not divisible by the expert axis size 4"):
    plan({"expert": 4}, num_experts=6)
  with pytest.raises(ValueError, match="189 tokens per model call do not split over 8 ranks"):
    plan({"data": 4, "expert": 2}, global_batch_size_to_load=3, micro_batch_size_to_train_on=3, max_target_length=63)


def test_without_te_the_run_stops_with_one_config_error_before_writing(tmp_path):
  result = run_rejected(tmp_path, "moe_block=ours", "moe_dispatch_backend=te_ncclep", run_name="no-te")
  assert result.returncode == 2, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("maxtext-moe: config error:")]
  assert len(errors) == 1 and errors[0].startswith(TE_ERROR), result.stderr[-2000:]
  assert "pip install 'maxtext-moe[te]'" in errors[0]
  assert not result.run_dir.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_run_bootstraps_once_then_dispatches_with_the_configured_options(tmp_path):
  """EP 4 on 4 CPU devices, stand-in TE: bootstrap before the first trace with
  the plan's numbers, dispatch.make and every ep_dispatch with the same capacity
  and the configured alignment; the run trains (finite losses)."""
  import subprocess  # pylint: disable=import-outside-toplevel

  out = tmp_path / "outputs"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "train", *TINY_EP4,
                         "moe_te_ncclep_recv_capacity_per_rank=1100", "moe_te_ncclep_alignment=4",
                         f"base_output_directory={out}", "run_name=ep4"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  (rec,) = [json.loads(line[len("WIRING "):]) for line in proc.stdout.splitlines() if line.startswith("WIRING ")]
  assert rec["rc"] == 0
  (boot,) = rec["bootstrap"]  # once per process
  assert boot == {"num_experts": 8, "max_tokens_per_rank": 128, "recv_capacity_per_rank": 1100, "hidden_dim": 64,
                  "max_token_dtype": "bfloat16"}
  assert rec["made"] and all(m == {"name": "te_ncclep", "num_experts": 8, "axis_name": "expert", "ep_size": 4,
                                   "recv_capacity_per_rank": 1100, "alignment": 4} for m in rec["made"])
  ops = [c["op"] for c in rec["te_calls"]]
  assert ops[0] == "bootstrap" and ops.count("bootstrap") == 1 and "dispatch" in ops and "combine" in ops
  for c in rec["te_calls"]:
    if c["op"] == "dispatch":  # the global batch (8 x 64 tokens), bf16, the bootstrapped capacity
      assert c["capacity"] == 1100 and c["alignment"] == 4 and c["tokens"] == [[512, 64], "bfloat16"], c
  assert "(dispatch te_ncclep, gmm xla, EP 4)" in proc.stdout
  losses = json.loads((out / "ep4" / "summary.json").read_text())["losses"]
  assert len(losses) == 2 and all(0 < v < 20 for v in losses.values()), losses


def _train_with_stand_in(argv: list[str]) -> None:
  import test_te_ncclep  # pylint: disable=import-outside-toplevel  (after XLA_FLAGS: it imports jax)

  from MaxText.run import main as train  # pylint: disable=import-outside-toplevel
  from MaxText.moe import dispatch  # pylint: disable=import-outside-toplevel
  from MaxText.moe.dispatch import te_ncclep  # pylint: disable=import-outside-toplevel

  te_calls, made, boots = [], [], []
  modules = test_te_ncclep.stand_in_te(ep_size=4, num_ep_groups=1, with_total_recv=True, calls=te_calls)
  sys.modules.update(modules)
  te_ncclep.unavailable_reason = lambda: None  # CPU: NCCL EP's GPU checks do not apply to the stand-in
  make, bootstrap = dispatch.make, te_ncclep.bootstrap

  def record_make(name, **kw):
    made.append({"name": name, **kw})
    return make(name, **kw)

  def record_bootstrap(**kw):
    boots.append({**kw, "max_token_dtype": str(kw["max_token_dtype"].dtype)})
    return bootstrap(**kw)

  dispatch.make, te_ncclep.bootstrap = record_make, record_bootstrap
  sh = modules["transformer_engine.jax.sharding"]
  with sh.global_shard_guard(sh.MeshResource(dp_resource="data", ep_resource="expert")):
    rc = train.main(argv)
  print("WIRING " + json.dumps({"rc": rc, "bootstrap": boots, "made": made, "te_calls": te_calls}), flush=True)
  sys.exit(rc)


if __name__ == "__main__":
  assert sys.argv[1] == "train", sys.argv
  _train_with_stand_in(sys.argv[2:])
