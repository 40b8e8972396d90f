"""DeepSeek-V3 under upstream's pipeline (patches/pipeline_v3.py) on 8 simulated CPU devices, against one device.

The runs: the tiny V3 with its dense-then-MoE mix (1 dense + 4 MoE layers), MTP, V3's router and a
moving bias, in float32, 4 steps of a global batch of 16 sequences. A pipelined run cannot start
from a one-device run's random init (the pipeline splits its parameter keys per stage), so every
run starts from the same weights: one step of a one-device seed run, rewritten into each layout
(tests/pipeline_layout.py), biases included (nonzero after that step, so the bias selects from
step 0). Each pipelined run is then held to the one-device run of the same block:
  - the loss of every step to 1e-5 relative: float32 everywhere and the same weights and data, so
    the mesh changes only the order of float32 reductions (measured: 4.7e-7 over the 4 steps, on
    every layout); 1e-5 is 20x that and 1,000x below one step's change of the loss (> 1%);
  - every routing bias after the 4 steps (the 4 MoE layers' and MTP's) to rate / 2: each step moves
    an entry by exactly +-rate or 0, so this is "every sign decision of every step the same"
    (measured: identical).
The layouts: PP2 x EP2 x FSDP2 with 2 scanned layers per stage; PP4 x EP2 under 2 accumulated
microbatches (gradient_accumulation_steps; upstream then feeds 2 batches a step, so its one-device run
accumulates too); the circular schedule PP2 x EP2 x FSDP2, 2 repeats of 1
layer, 4 microbatches (more than the stages: the last stage's outputs wait in upstream's circular
storage); PP2 x EP2 x FSDP2 pipelining 2 of the 4 MoE layers (the other 2 run before it, as V3's 58
MoE layers must for 8 or 16 stages). Upstream's block runs its ring-of-experts EP
(use_ring_of_experts; XLA:CPU has no ragged all-to-all).
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from conftest import REPO, run_train
from pipeline_layout import routing_biases, write_params

EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
MODEL = ("base_num_decoder_layers=5", "first_num_dense_layers=1", "base_mlp_dim=32", "max_target_length=64",
         "mtp_num_layers=1", "dtype=float32")
RATE = 0.001  # routed_bias_update_rate of configs/models/deepseek3-tiny.yml
# Upstream's block: our grouped GEMM (xla), which honours the ring's group offset (upstream's ragged_dot does not).
BLOCKS = {"ours": ("moe_block=ours",), "upstream": ("moe_block=upstream", "moe_gmm_backend=xla")}
EP = {"ours": (), "upstream": ("use_ring_of_experts=true",)}  # with expert parallelism (upstream: EP > 1 only)
# Upstream's accumulation feeds each step its steps x the batch: the one-device run accumulates as well.
ACCUMULATE = "gradient_accumulation_steps=2"
PP2_EP2_FSDP2 = ("ici_pipeline_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2")
# name: (mesh and pipeline keys, (stages, repeats, layers per stage, MoE layers before the pipeline)); every one
# on 8 devices, 2 sequences each. A pipeline microbatch splits over a stage's devices: 4 sequences at least
# (EP2 x FSDP2), 2 under PP4 x EP2.
LAYOUTS = {
    "pp2_ep2_fsdp2": (PP2_EP2_FSDP2 + ("num_pipeline_microbatches=2", "num_layers_per_pipeline_stage=2",
                                       "scan_layers_per_stage=true"), (2, 1, 2, 0)),
    "pp4_ep2_accumulated": (("ici_pipeline_parallelism=4", "ici_expert_parallelism=2", "num_pipeline_microbatches=4",
                             ACCUMULATE), (4, 1, 1, 0)),
    "circular": (PP2_EP2_FSDP2 + ("num_pipeline_microbatches=4",), (2, 2, 1, 0)),
    "pp2_two_moe_outside": (PP2_EP2_FSDP2 + ("num_pipeline_microbatches=2", "pipeline_parallel_layers=2"),
                            (2, 1, 1, 2)),
}


# --- fast: the schedule and the reductions ------------------------------------------------------


@pytest.mark.parametrize("stages, repeats, micro, delay", [(2, 1, 2, 1), (4, 1, 4, 1), (2, 2, 4, 1), (2, 3, 2, 2),
                                                           (4, 2, 8, 1)])
def test_schedule_mask_is_upstreams_schedule(stages, repeats, micro, delay):
  """Upstream's own get_microbatch_and_repeat_ids: the mask keeps, for each (repeat, stage), the iterations that
  ran each of its microbatches exactly once, and the iteration count is upstream's."""
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext.layers import pipeline  # pylint: disable=import-outside-toplevel

  from patches import pipeline_v3  # pylint: disable=import-outside-toplevel

  stub = types.SimpleNamespace(num_stages=stages, forwarding_delay=delay, mesh=jax.make_mesh((1,), ("stage",)),
                               config=types.SimpleNamespace(num_pipeline_microbatches=micro,
                                                            num_pipeline_repeats=repeats),
                               _maybe_shard_with_name=lambda x, _: x)
  mask_TRS = pipeline_v3.schedule_mask(stages, repeats, micro, delay)
  assert mask_TRS.shape == (micro * repeats + delay * (stages - 1), repeats, stages)  # pipeline.py ~870
  seen = {(r, s): [] for r in range(repeats) for s in range(stages)}
  for t in range(mask_TRS.shape[0]):
    micro_S, repeat_S = (np.asarray(a) for a in pipeline.PipelineBase.get_microbatch_and_repeat_ids(stub, t))
    for r, s in zip(*np.nonzero(mask_TRS[t])):
      assert repeat_S[s] == r
      seen[(r, s)].append(int(micro_S[s]))
  assert all(sorted(m) == list(range(micro)) for m in seen.values()), seen


def test_sown_values_reduce_over_real_iterations_only():
  """Bubble entries and (circular) other repeats' slots hold garbage: none of it reaches the result."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from patches import pipeline_v3  # pylint: disable=import-outside-toplevel

  cfg = types.SimpleNamespace(num_pipeline_microbatches=2, gradient_accumulation_steps=1, routed_bias_update_rate=RATE)
  mask = pipeline_v3.schedule_mask(2, 2, 2)  # T=5, R=2, S=2
  counts = np.full((5, 2, 2, 4), 1000, np.int32)  # garbage everywhere ...
  lb = np.full((5, 2, 2), 1e6, np.float32)
  for t, r, s in zip(*np.nonzero(mask)):  # ... but where stage s ran repeat r
    counts[t, r, s] = [1 + t, 0, 2, 3]
    lb[t, r, s] = t
  want_RSE = np.zeros((2, 2, 4), np.int32)
  for t, r, s in zip(*np.nonzero(mask)):
    want_RSE[r, s] += counts[t, r, s]
  update = pipeline_v3.reduce_sown("moe_bias_updates", jnp.asarray(counts), mask, cfg)
  assert np.allclose(update, RATE * np.sign(want_RSE.mean(-1, keepdims=True) - want_RSE), rtol=0, atol=1e-9)
  loss = np.asarray(pipeline_v3.reduce_sown("moe_lb_loss", jnp.asarray(lb), mask, cfg))
  assert np.allclose(loss, [[np.mean(np.nonzero(mask[:, r, s])[0]) for s in range(2)] for r in range(2)])
  flags = np.zeros((5, 2, 2), bool)
  flags[~mask] = True  # overflow only in the bubble and other repeats' slots: none
  assert not np.asarray(pipeline_v3.reduce_sown("moe_has_overflow", jnp.asarray(flags), mask, cfg)).any()
  cfg.gradient_accumulation_steps = 2  # under accumulation the counts stay counts (its own code takes the sign)
  assert np.array_equal(np.asarray(pipeline_v3.reduce_sown("moe_bias_updates", jnp.asarray(counts), mask, cfg)),
                        want_RSE)


def test_every_value_our_layers_sow_has_a_reduction_and_an_unknown_one_is_refused():
  """A statistic reduced over microbatches the wrong way would be wrong in TensorBoard with nothing to say so."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from MaxText.moe import stats  # pylint: disable=import-outside-toplevel
  from patches import pipeline_v3  # pylint: disable=import-outside-toplevel

  ours = {stats.COUNTS, stats.ENTROPY, stats.BIAS, stats.OVERFLOW, stats.BUFFER, "moe_lb_loss", "moe_bias_updates"}
  assert ours <= set(pipeline_v3.REDUCTIONS)
  cfg = types.SimpleNamespace(num_pipeline_microbatches=2, gradient_accumulation_steps=1, routed_bias_update_rate=RATE)
  mask = pipeline_v3.schedule_mask(2, 1, 2)
  with pytest.raises(ValueError, match="no reduction over microbatches is known for the value 'moe_new_statistic'"):
    pipeline_v3.reduce_sown("moe_new_statistic", jnp.zeros(mask.shape[:1] + mask.shape[2:], jnp.float32), mask, cfg)


@pytest.mark.parametrize("args, match", [
    # Upstream's prefetching circular pipeline drops what the MoE layers sow: measured, moe_lb_loss 0.000000 at every
    # step, and no bias update.
    (("moe_block=ours", "pipeline_fsdp_ag_per_repeat=true"),
     r"^config key 'pipeline_fsdp_ag_per_repeat' = True .*drops what the MoE layers sow"),
    # Upstream's block before the pipeline counts one stage's share of the batch: measured, those 2 layers' biases
    # differ from one device's in 4 of 16 entries after the first step (the pipelined layers' and MTP's: equal).
    (("moe_block=upstream", "pipeline_parallel_layers=2"),
     r"^config key 'pipeline_parallel_layers' = 2 .*leaves 2 MoE layers before the pipeline.*moe_block=ours"),
])
def test_pipeline_settings_that_cannot_work_are_one_config_error(tmp_path, args, match):
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.config import environment  # pylint: disable=import-outside-toplevel

  run = fork_config.load(["configs/deepseek3-tiny.yml", *MODEL[:2], "ici_pipeline_parallelism=2",
                          "num_pipeline_microbatches=2", f"base_output_directory={tmp_path}", *args])
  with pytest.raises(fork_config.ConfigError, match=match) as e:
    environment.validate_with_upstream(run)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("args", [
    ("moe_block=ours", "pipeline_parallel_layers=2"),
    # MLA's unequal head sizes (24 and 16 here) under the stages' vmap: patches/cudnn_mla_vmap.py batches them
    # (tests/test_cudnn_mla_vmap.py); refused before it.
    ("attention=cudnn_flash_jax",),
])
def test_pipeline_settings_that_work_validate(tmp_path, args):
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.config import environment  # pylint: disable=import-outside-toplevel

  environment.validate_with_upstream(fork_config.load(["configs/deepseek3-tiny.yml", *MODEL[:2], "ici_pipeline_parallelism=2",
                                                 "num_pipeline_microbatches=2", f"base_output_directory={tmp_path}",
                                                 *args]))


# --- slow: real runs against one device -----------------------------------------------------------


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
  """One step on one device: the checkpoint every run starts from (its biases already moved once)."""
  root = tmp_path_factory.mktemp("seed")
  run = run_train(root, *MODEL, *BLOCKS["ours"], "steps=1", "per_device_batch_size=8", "checkpoint_period=1",
                  run_name="seed")
  assert run.returncode == 0, run.stderr[-3000:]
  return run.run_dir / "checkpoints" / "0"


@pytest.fixture(scope="module")
def weights(seed, tmp_path_factory):
  """load_parameters_path of the seed's weights in a layout: (stages, repeats, layers per stage)."""
  made: dict[tuple, str] = {}

  def get(layout=(1, 1, 1, 0)):
    if layout not in made:
      out = tmp_path_factory.mktemp("weights") / "-".join(map(str, layout))
      made[layout] = str(write_params(seed, out, *layout) / "items")
    return made[layout]

  return get


@pytest.fixture(scope="module")
def one_device(weights, tmp_path_factory):
  """The reference run of a block (with gradient accumulation or not): (losses, routing biases after the last step)."""
  done: dict[tuple, tuple] = {}

  def get(block: str, accumulate: bool = False):
    if (block, accumulate) not in done:
      run = run_train(tmp_path_factory.mktemp("one"), *MODEL, *BLOCKS[block], "steps=4", "per_device_batch_size=16",
                      *([ACCUMULATE] if accumulate else []), "checkpoint_period=3",
                      f"load_parameters_path={weights()}", run_name=f"one-{block}")
      assert run.returncode == 0, run.stderr[-3000:]
      done[(block, accumulate)] = (run.losses(), routing_biases(run.run_dir / "checkpoints" / "3"))
    return done[(block, accumulate)]

  return get


def _assert_matches(run, reference, steps=range(4)) -> None:
  losses, biases = reference
  got = run.losses()
  for step in steps:
    assert abs(got[step] - losses[step]) <= 1e-5 * abs(losses[step]), (step, got, losses)
  final = routing_biases(run.run_dir / "checkpoints" / "3")
  for part in ("decoder", "mtp"):
    assert final[part].shape == biases[part].shape
    assert np.abs(final[part] - biases[part]).max() < RATE / 2, (part, final[part], biases[part])


@pytest.mark.slow
@pytest.mark.parametrize("layout, block", [("pp2_ep2_fsdp2", "ours"), ("pp4_ep2_accumulated", "ours"),
                                           ("circular", "upstream"), ("pp2_two_moe_outside", "ours")])
def test_pipelined_v3_matches_one_device(tmp_path, weights, one_device, seed, layout, block):
  """Loss and routing biases of the pipelined run are the one-device run's (module docstring: tolerances).
  On upstream's pipeline without patches/pipeline_v3.py every one of these stops at its assertion
  "Non-RngState variable found in layers_mutables" (pipeline.py ~904). The circular layout on our block is held to
  the same by the resume test below, whose two halves are that run."""
  keys, split = LAYOUTS[layout]
  run = run_train(tmp_path, *MODEL, *BLOCKS[block], *EP[block], *keys, "steps=4", "per_device_batch_size=2",
                  "checkpoint_period=3", f"load_parameters_path={weights(split)}", run_name=layout, env=EIGHT)
  assert run.returncode == 0, run.stderr[-3000:]
  if block == "ours":
    assert "(dispatch ring, gmm xla, EP 2)" in run.stdout  # our block ran in the stages, with EP
  _assert_matches(run, one_device(block, ACCUMULATE in keys))
  _assert_biases_moved(run, seed)


def _assert_biases_moved(run, seed) -> None:
  """The biases moved every step: the seed's bias is not the final one anywhere it could have moved."""
  start = routing_biases(seed)
  assert (routing_biases(run.run_dir / "checkpoints" / "3")["decoder"] != start["decoder"]).mean() > 0.5


@pytest.mark.slow
def test_resume_matches_and_another_pipeline_split_is_refused(tmp_path, weights, one_device, seed):
  """The circular layout on our block, stopped after 2 steps and resumed: its first 2 steps and, resumed, steps 2-3
  and the routing biases are the one-device run's (the unbroken circular run's check: its two halves are that
  run); resuming it as PP4 (upstream stores the layers [repeats, stages, ...] and restores only that layout) is one
  config error naming the keys, before anything is written."""
  keys, split = LAYOUTS["circular"]
  # The schedule pinned to the whole run's 4 steps, as the one-device run's (a resume may not stretch it).
  common = (*MODEL, *BLOCKS["ours"], "per_device_batch_size=2", "checkpoint_period=1", "learning_rate_schedule_steps=4",
            f"load_parameters_path={weights(split)}")
  first = run_train(tmp_path, *common, *keys, "steps=2", run_name="r", env=EIGHT)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "(dispatch ring, gmm xla, EP 2)" in first.stdout  # our block ran in the stages, with EP
  losses, _ = one_device("ours")
  assert sorted(first.losses()) == [0, 1]
  for step, loss in first.losses().items():
    assert abs(loss - losses[step]) <= 1e-5 * abs(losses[step]), (step, first.losses(), losses)
  resumed = run_train(tmp_path, *common, *keys, "steps=4", run_name="r", env=EIGHT)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resuming from checkpoint step 1" in resumed.stdout
  _assert_matches(resumed, one_device("ours"), steps=(2, 3))
  _assert_biases_moved(resumed, seed)
  saved = sorted(p.name for p in (resumed.run_dir / "checkpoints").iterdir())
  pp4 = ("ici_pipeline_parallelism=4", "ici_expert_parallelism=2", "num_pipeline_microbatches=4")
  other = run_train(tmp_path, *common, *pp4, "steps=4", run_name="r", env=EIGHT)
  assert other.returncode == 2
  errors = [line for line in other.stderr.splitlines() if "config error" in line]
  assert len(errors) == 1, other.stderr[-2000:]
  assert "ici_pipeline_parallelism x dcn_pipeline_parallelism) 2 -> 4" in errors[0]
  assert "num_pipeline_repeats 2 -> 1" in errors[0]
  assert sorted(p.name for p in (resumed.run_dir / "checkpoints").iterdir()) == saved


@pytest.mark.slow
def test_without_pipeline_the_seam_changes_nothing(tmp_path):
  """At ici/dcn_pipeline_parallelism = 1 the train step lowers to the same program with patches/pipeline_v3.py and
  patches/pipeline_mtp.py applied as without them (none of their targets acts)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  code = ("import sys, patches\n"
          "if sys.argv[1] == 'without':\n"
          "  patches.SEAM_MODULES = tuple(m for m in patches.SEAM_MODULES if not m.startswith('patches.pipeline_'))\n"
          "sys.path.insert(0, 'tests')\n"
          "from lower_train_step import lowered_train_step\n"
          "sys.stdout.write(lowered_train_step(sys.argv[2:]))\n")
  texts = {}
  for which in ("with", "without"):
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
    proc = subprocess.run([sys.executable, "-c", code, which, "configs/deepseek3-tiny.yml", "steps=1",
                           "enable_checkpointing=false", f"base_output_directory={tmp_path}", f"run_name={which}",
                           "moe_block=ours"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts[which] = proc.stdout
  assert len(texts["with"]) > 10_000 and texts["with"] == texts["without"]


# Stages over nodes (DCN) with EP inside the node, and with EP across nodes as well: nodes of 2 simulated devices.
PLAN_LAYOUTS = {
    "ep_inside": ("recipe_num_gpus=4", "gpus_per_node=2", "dcn_pipeline_parallelism=2", "ici_expert_parallelism=2"),
    "ep_across_nodes": ("recipe_num_gpus=8", "gpus_per_node=2", "dcn_pipeline_parallelism=2",
                        "dcn_expert_parallelism=2", "ici_expert_parallelism=2"),
}


def _plan(tmp_path, *args):
  """`python -m MaxText.plan` on simulated CPU devices: (the JSON report, the compiled HLO text)."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
  proc = subprocess.run([sys.executable, "-m", "MaxText.plan", "configs/deepseek3-tiny.yml", *args, "moe_block=ours",
                         "--cpu", "--json", str(tmp_path / "plan.json"), "--hlo", str(tmp_path / "plan.hlo")],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((tmp_path / "plan.json").read_text()), (tmp_path / "plan.hlo").read_text(), proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(PLAN_LAYOUTS))
def test_plan_reports_the_bubble_and_the_stage_permutes(tmp_path, layout):
  """`python -m MaxText.plan` on a PP layout without a GPU: the stages over the nodes (DCN), EP inside the node or
  across nodes too; the compiled pipeline loop runs upstream's iteration count, its point-to-point transfers are
  collective-permutes over the stage axis, crossing nodes, and with EP across nodes the experts' all-to-all crosses
  nodes as well."""
  report, _, stdout = _plan(tmp_path, *MODEL[:2], *PLAN_LAYOUTS[layout], "num_pipeline_microbatches=2",
                            "per_device_batch_size=1", "max_target_length=32")
  p = report["pipeline"]
  assert (p["stages"], p["repeats"], p["microbatches"], p["iterations"]) == (2, 2, 2, 5)
  assert p["bubble_fraction"] == pytest.approx(1 / 5) and p["agrees"] and p["compiled_trip_counts"] == [5]
  assert 0.5 < p["pipelined_share"] < 1 and p["bubble_s"] > 0
  permutes = [r for r in report["collectives"] if r["kind"] == "collective-permute"]
  assert permutes and all(r["axes"] == ["stage"] and r["crosses_nodes"] for r in permutes), permutes
  assert "pipeline: 2 stages x 2 repeats, 2 microbatches: 5 iterations, bubble 20.0%" in stdout
  exchanges = [r for r in report["collectives"] if r["kind"] == "all-to-all" and "expert" in r["axes"]]
  assert exchanges and all(r["crosses_nodes"] == (layout == "ep_across_nodes") for r in exchanges), exchanges


@pytest.mark.slow
def test_a_device_gathers_across_stages_only_its_stages_share(tmp_path):
  """The 1,024 x H100 PP8 x EP8 x FSDP16 layout in small (docs/pipeline.md): stages and FSDP over the nodes, EP inside,
  MTP after the pipeline. No all-gather over a group spanning the stage axis returns more than a stage's share of
  the batch's logits. Without patches/pipeline_mtp.py the MTP's logits gradient of the whole batch, f32[8, 64, 1024],
  is all-gathered over all 8 devices (stage x fsdp x expert): at 1,024 GPUs that is bf16[1024, 4096, 129280], 1,010
  GiB a GPU. The pipelined layers' weights are gathered over fsdp and expert only, one stage's at a time."""
  from MaxText.plan import hlo_inventory  # pylint: disable=import-outside-toplevel

  stages, batch, length, vocab = 2, 8, 64, 1024  # 8 devices x 1 sequence; MODEL's length; the tiny vocabulary
  report, hlo, _ = _plan(tmp_path, *MODEL, "recipe_num_gpus=8", "gpus_per_node=2", "dcn_pipeline_parallelism=2",
                         "dcn_fsdp_parallelism=2", "ici_expert_parallelism=2", "num_pipeline_microbatches=2",
                         "per_device_batch_size=1")
  comps, _ = hlo_inventory.parse_module(hlo)
  across = []  # (bytes a device receives, result type, axes) of every all-gather whose group spans stages
  for instr in (i for comp in comps.values() for i in comp.instrs if hlo_inventory._kind(i.opcode) == "all-gather"):  # pylint: disable=protected-access
    described = hlo_inventory.collective(instr, report["mesh"], report["nodes"], set())
    if described and "stage" in described[0][1]:
      across.append((described[2], instr.type_text, described[0][1]))
  assert across, "the pipeline's own gathers over stage (its microbatch inputs) are missing: nothing was read"
  share = batch * length * vocab * 4 / stages  # float32 logits of one stage's share of the batch
  largest = max(across)
  assert largest[0] <= share, (largest, share)


# --- fast: the planner's reading of a pipeline ---------------------------------------------------

PIPELINE_HLO = """\
HloModule m

%layer (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %w = f32[8,8]{1,0} constant({...})
  %d = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%p, %d)
}

%iteration (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %layers = (s32[], f32[4,8]{1,0}) while(%p), condition=%cond, body=%layer, backend_config={"known_trip_count":{"n":"3"}}
  %x = f32[4,8]{1,0} get-tuple-element(%layers), index=1
  %cp = f32[4,8]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  %ep = f32[4,8]{1,0} collective-permute(%x), channel_id=2, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%p, %cp)
}

%other (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %ep = f32[4,8]{1,0} collective-permute(%x), channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%p, %ep)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %x = (s32[], f32[4,8]{1,0}) parameter(0)
  %pipe = (s32[], f32[4,8]{1,0}) while(%x), condition=%cond, body=%iteration, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %o = (s32[], f32[4,8]{1,0}) while(%pipe), condition=%cond, body=%other, backend_config={"known_trip_count":{"n":"7"}}
}
"""


def test_inventory_finds_the_pipeline_loop_by_its_stage_permutes():
  """The loop whose own body permutes over `stage` is the pipeline's (not the layer loop inside it, nor a loop
  permuting over another axis); its dots are counted over every trip, nested loops included."""
  from MaxText.plan import hlo_inventory  # pylint: disable=import-outside-toplevel

  inv = hlo_inventory.inventory(PIPELINE_HLO, {"stage": 2, "expert": 2}, nodes=[0, 0, 1, 1])
  assert inv["pipeline_loops"] == [{"trip_count": 5, "step": 1, "count": 1, "dot_flops": 5 * 3 * 2 * 4 * 8 * 8}]
  # XLA's while-loop double buffering (the GPU presets): two iterations a trip, the induction variable steps by 2.
  unrolled = PIPELINE_HLO.replace('{"known_trip_count":{"n":"5"}}',
                                  '{"known_trip_count":{"n":"2"},"known_init_step":{"init":"0","step":"2"}}')
  assert hlo_inventory.inventory(unrolled, {"stage": 2, "expert": 2}, [0, 0, 1, 1])["pipeline_loops"][0]["step"] == 2
  rows = {(r["kind"], tuple(r["axes"])): r for r in inv["collectives"]}
  stage = rows[("collective-permute", ("stage",))]
  assert (stage["count"], stage["crosses_nodes"], stage["wire_bytes"]) == (5, True, 5 * 4 * 8 * 4)
  assert rows[("collective-permute", ("expert",))]["count"] == 5 + 7
  assert hlo_inventory.inventory(PIPELINE_HLO, {"stage": 1, "expert": 4}, [0] * 4)["pipeline_loops"] == []
  # Under gradient accumulation the pipeline loop runs in the accumulation loop, which XLA may give no trip count
  # and whose body also permutes over `stage` (the iteration double buffering peeled off): only the inner loop is
  # the pipeline's (the 1,024 x H100 PP2 compile reported the accumulation loop as one with no trip count).
  accumulate = """\
%accumulate (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %pipe = (s32[], f32[4,8]{1,0}) while(%p), condition=%cond, body=%iteration, backend_config={"known_trip_count":{"n":"5"}}
  %x = f32[4,8]{1,0} get-tuple-element(%pipe), index=1
  %peeled = f32[4,8]{1,0} collective-permute(%x), channel_id=4, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%p, %peeled)
}

"""
  accumulated = PIPELINE_HLO.replace("ENTRY %main", accumulate + "ENTRY %main").replace(
      'while(%x), condition=%cond, body=%iteration, backend_config={"known_trip_count":{"n":"5"}}',
      "while(%x), condition=%cond, body=%accumulate")
  loops = hlo_inventory.inventory(accumulated, {"stage": 2, "expert": 2}, [0, 0, 1, 1])["pipeline_loops"]
  assert [(l["trip_count"], l["dot_flops"]) for l in loops] == [(5, 5 * 3 * 2 * 4 * 8 * 8)]


def test_bubble_is_upstreams_formula_and_costs_the_pipelined_share():
  from MaxText.plan import bubble  # pylint: disable=import-outside-toplevel

  config = types.SimpleNamespace(ici_pipeline_parallelism=4, dcn_pipeline_parallelism=2, num_pipeline_repeats=2,
                                 num_pipeline_microbatches=16, pipeline_delay_activation_forwarding=False)
  sched = bubble.schedule(config)
  assert sched["iterations"] == 2 * 16 + 7 and sched["bubble_fraction"] == pytest.approx(7 / 39)
  config.pipeline_delay_activation_forwarding = True  # the bubble doubles (pipeline.py ~869)
  assert bubble.schedule(config)["bubble_fraction"] == pytest.approx(14 / 46)
  assert bubble.schedule(types.SimpleNamespace(ici_pipeline_parallelism=1, dcn_pipeline_parallelism=1)) is None
  # Loops of 39 iterations executing 780 dot FLOPs (a bubble of 140), 220 outside: useful 860, 640 pipelined.
  loops = [{"trip_count": 39, "count": 1, "dot_flops": 780.0}]
  r = bubble.report(sched, loops, 1000.0, path_s=2.0, fallback_share=0.5)
  assert r["agrees"] and r["compiled_iterations"] == [39] and not r["note"]
  assert r["pipelined_share"] == pytest.approx(640 / 860)
  # The path runs every iteration: the bubble's part of it is its part of the 1,000 executed FLOPs, 140.
  assert r["bubble_s"] == pytest.approx(2.0 * 140 / 1000)
  # Double buffered: 19 trips of 2 iterations in the loop, the 39th outside it; its FLOPs scaled to all 39.
  unrolled = bubble.report(sched, [{"trip_count": 19, "step": 2, "count": 1, "dot_flops": 760.0}], 1000.0, 2.0, 0.5)
  assert unrolled["agrees"] and "38 iterations inside, 1 outside" in unrolled["note"]
  assert unrolled["pipelined_share"] == pytest.approx(640 / 860)
  odd = bubble.report(sched, [{"trip_count": 38, "count": 1, "dot_flops": 0.0}], 1000.0, 2.0, 0.5)
  assert not odd["agrees"] and "38" in odd["note"] and odd["pipelined_share"] == 0.5  # no dots seen: the fallback
  # A pipeline loop XLA gave no trip count (the 1,024 x H100 PP8 recipe's compile): reported, not a crash, and
  # not checked (the known loop agrees; the other is held to nothing), rather than a disagreement.
  unknown = bubble.report(sched, [{"trip_count": None, "count": 1, "dot_flops": 780.0}, loops[0]], 1000.0, 2.0, 0.5)
  assert unknown["agrees"] and unknown["unchecked"] and "no known trip count" in unknown["note"]
  assert unknown["compiled_trip_counts"] == [39] and bubble.verdict(unknown) == "not checked"


def test_a_resume_onto_another_pipeline_layout_names_the_keys(tmp_path):
  """The record written at a run's start against the config of the resume; no checkpoint or no record: no check."""
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel
  from MaxText.checkpoints import compat as checkpoint_compat  # pylint: disable=import-outside-toplevel
  from MaxText.checkpoints import records as checkpoint_records  # pylint: disable=import-outside-toplevel

  run = fork_config.load(["configs/deepseek3-tiny.yml", f"base_output_directory={tmp_path}", "run_name=r"])
  layout = lambda stages, repeats, per_stage=1: types.SimpleNamespace(  # noqa: E731
      ici_pipeline_parallelism=stages, dcn_pipeline_parallelism=1, num_pipeline_repeats=repeats,
      num_layers_per_pipeline_stage=per_stage, scan_layers_per_stage=per_stage > 1, pipeline_parallel_layers=4)
  checkpoint_compat.record_pipeline_layout(run, layout(2, 2))
  checkpoint_compat.check_pipeline_resume(run, layout(4, 1))  # nothing saved yet: nothing to refuse
  # A complete step: orbax's commit marker and metadata, and our record of it (MaxText/checkpoints/records.py).
  (run.run_dir / "checkpoints" / "3" / "items").mkdir(parents=True)
  (run.run_dir / "checkpoints" / "3" / "items" / "_METADATA").write_text("{}")
  (run.run_dir / "checkpoints" / "3" / checkpoint_records.COMMIT_MARKER).write_text("")
  checkpoint_records.write_record(run.run_dir, 3, [], [])
  checkpoint_compat.check_pipeline_resume(run, layout(2, 2))
  with pytest.raises(fork_config.ConfigError, match=r"repeats 2 -> 1, num_layers_per_pipeline_stage 1 -> 2"):
    checkpoint_compat.check_pipeline_resume(run, layout(2, 1, 2))  # the same shapes, the layers in another order
  with pytest.raises(fork_config.ConfigError, match=r"stages \(ici_pipeline_parallelism x dcn_pipeline_parallelism\) "
                     r"2 -> 1, num_pipeline_repeats 2 -> \(no pipeline\)"):
    checkpoint_compat.check_pipeline_resume(run, layout(1, 1))
