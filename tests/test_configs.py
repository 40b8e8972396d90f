"""Every shipped YAML loads through our validator and upstream's; model files hold architecture only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import patches
from conftest import REPO
from MaxText import config as fork_config
from MaxText.plan import analytic_memory
from MaxText.config import parallelism
from MaxText.config import environment
from MaxText.config import xla_presets

CONFIGS = sorted((REPO / "configs").rglob("*.yml"))
MODELS = sorted((REPO / "configs/models").glob("*.yml"))
RECIPES = sorted((REPO / "configs/recipes").glob("deepseek3-671b-*x*.yml"))
GPUS_PER_NODE = 8
# Keys that describe a run, a mesh or a cluster: never in a model file.
RUN_KEY = re.compile(
    r"^(ici_|dcn_|num_slices|hardware|per_device_batch|max_target_length|steps|dataset|remat_policy|weight_dtype|"
    r"grad_dtype|mu_dtype|attention$|sparse_matmul|megablox|use_tokamax|learning_rate|enable_checkpointing|"
    r"xla_presets|recipe_num_gpus|base_output_directory|run_name)"
)


def _id(path: Path) -> str:
  return str(path.relative_to(REPO / "configs"))


def test_the_shipped_configs_are_the_ones_this_test_knows():
  names = {_id(p) for p in CONFIGS}
  assert {"models/deepseek3-671b.yml", "models/deepseek3-proxy-1gpu.yml", "models/deepseek3-proxy-2gpu.yml",
          "models/deepseek3-proxy-8gpu.yml", "models/deepseek3-tiny.yml", "bench/proxy-1xh200.yml"} <= names
  assert len(RECIPES) == 7  # 128 / 256 / 1024 x H100 / H200, 256 x B200


def _cpu_safe_overrides(run: fork_config.RunConfig, out_dir: Path) -> list[str]:
  """What makes a GPU-cluster config validate on this CPU machine (what changes is listed)."""
  extra = [f"base_output_directory={out_dir}"]
  if "hardware" not in run.upstream:  # a model file alone: upstream's default is a TPU job
    extra += ["hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=synthetic"]
  if run.fork.recipe_num_gpus and run.fork.recipe_num_gpus > GPUS_PER_NODE:
    # upstream checks DCN axes against the slices it sees; on GPU a slice is a node
    extra.append(f"num_slices={run.fork.recipe_num_gpus // GPUS_PER_NODE}")
  return extra


@pytest.fixture(scope="module")
def upstream_patched():
  from patches import config_errors  # pylint: disable=import-outside-toplevel

  patches.apply_module(config_errors)  # upstream's config errors raise instead of exiting (the only seam validation needs)
  yield
  patches.undo_module(config_errors)


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_config_validates_with_ours_and_upstreams(path, upstream_patched, tmp_path):  # pylint: disable=unused-argument,redefined-outer-name
  """Our loader (unknown keys, types), presets (names, flags), upstream's pydantic + cross-field checks.

  Not checked here: the mesh against real devices (test_recipe_mesh_fits_its_gpu_count does
  that with the recipe's own GPU count) and anything that needs a GPU to compile.
  """
  run = fork_config.load([str(path)])
  composed = xla_presets.compose_for(run, {})
  run = xla_presets.with_upstream_defaults(run, composed)
  run = fork_config.load([str(path), *_cpu_safe_overrides(run, tmp_path)])
  run = xla_presets.with_upstream_defaults(run, composed)
  config = environment.validate_with_upstream(run)
  for key in ("num_experts", "base_emb_dim", "base_num_decoder_layers"):
    if key in run.upstream:
      assert getattr(config, key) == run.upstream[key], key  # upstream's model_name did not override ours


def test_unknown_key_in_a_config_is_rejected(tmp_path):
  bad = tmp_path / "bad.yml"
  bad.write_text("base_config: models/deepseek3-proxy-1gpu.yml\nnum_expert: 8\n")
  with pytest.raises(fork_config.ConfigError, match=r"unknown config key 'num_expert' .*did you mean 'num_experts'"):
    fork_config.load([str(bad)])


NAME = "tiny-🚀-训练"  # an emoji (outside the BMP: JSON writes it as a surrogate pair) and CJK (inside it)


@pytest.mark.parametrize("where", ["command line", "yaml"])
def test_unicode_in_a_value_reaches_the_config_and_upstream_intact(where, upstream_patched, tmp_path):  # pylint: disable=unused-argument,redefined-outer-name
  if where == "yaml":
    path = tmp_path / "named.yml"
    path.write_text(f"base_config: deepseek3-tiny.yml\nrun_name: {NAME}\n", encoding="utf-8")
    run = fork_config.load([str(path), f"base_output_directory={tmp_path}"])
  else:
    run = fork_config.load(["configs/deepseek3-tiny.yml", f"run_name={NAME}", f"base_output_directory={tmp_path}"])
  assert run.upstream["run_name"] == NAME and run.run_dir == tmp_path / NAME
  argv = run.upstream_argv()
  assert all(a.isascii() for a in argv)
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  config = pyconfig.initialize(argv)  # upstream parses its argv with OmegaConf.from_cli, as a run's does
  assert config.run_name == NAME and config.jax_cache_dir == str(tmp_path / NAME / "jax_cache")


@pytest.mark.parametrize("value", [NAME, "nel\x85", "🚀\x85\u2028", "\\ud83d\\ude80 as typed", "\\\U0001F600", "é\x7f\x9f"])
def test_cli_value_is_read_back_exactly_by_omegaconfs_command_line_parser(value):
  import omegaconf  # pylint: disable=import-outside-toplevel

  assert omegaconf.OmegaConf.from_cli([f"k={fork_config.cli_value(value)}"])["k"] == value


def test_print_config_writes_an_emoji_as_key_value_reads_it_back(upstream_patched, tmp_path):  # pylint: disable=unused-argument,redefined-outer-name
  """--print-config's values are what key=value reads back: an emoji as YAML's \\U escape (before, JSON's surrogate
  pair, "\\ud83d\\ude80", which YAML refuses)."""
  import omegaconf  # pylint: disable=import-outside-toplevel

  from MaxText.config import report  # pylint: disable=import-outside-toplevel

  run = fork_config.load(["configs/deepseek3-tiny.yml", f"run_name={NAME}", f"base_output_directory={tmp_path}"])
  lines = dict(line.split("  # ")[0].split(" = ", 1) for line in report.print_config(run) if not line.startswith("#"))
  assert "\\ud83d" not in lines["run_name"] and yaml.safe_load(lines["run_name"]) == NAME
  assert omegaconf.OmegaConf.from_cli([f"jax_cache_dir={lines['jax_cache_dir']}"])["jax_cache_dir"] == str(
      tmp_path / NAME / "jax_cache")


@pytest.mark.parametrize("text, says", [
    ("base_config: deepseek3-tiny.yml\nsteps: 3\n\tlog_period: 1\n",
     "line 3 is indented with a tab; YAML indents with spaces only"),  # before: "while scanning a plain scalar"
    ("base_config: deepseek3-tiny.yml\nsteps: [3\n", "line 3, column 1: did not find expected ',' or ']'"),
])
def test_a_yaml_that_does_not_parse_is_one_line_naming_the_line(text, says, tmp_path):
  path = tmp_path / "bad.yml"
  path.write_text(text)
  with pytest.raises(fork_config.ConfigError) as e:
    fork_config.load([str(path)])
  assert str(e.value) == f"cannot parse {path}: {says}"


def test_an_override_that_is_not_utf8_is_one_line():
  with pytest.raises(fork_config.ConfigError, match=r"override 'run_name=a\\udcff' is not UTF-8 text"):
    fork_config.load(["configs/deepseek3-tiny.yml", b"run_name=a\xff".decode("utf-8", "surrogateescape")])


@pytest.mark.parametrize("path", MODELS, ids=_id)
def test_model_files_hold_architecture_only(path):
  keys = [k for k in yaml.safe_load(path.read_text()) if k != "base_config"]
  assert not [k for k in keys if RUN_KEY.match(k)], path


def test_671b_is_deepseek_v3_as_published():
  c = fork_config.load([str(REPO / "configs/models/deepseek3-671b.yml")]).upstream
  assert (c["base_num_decoder_layers"], c["first_num_dense_layers"]) == (61, 3)
  assert (c["num_experts"], c["shared_experts"], c["num_experts_per_tok"]) == (256, 1, 8)
  assert (c["routed_score_func"], c["routed_bias"], c["routed_scaling_factor"]) == ("sigmoid", True, 2.5)
  assert (c["base_emb_dim"], c["base_mlp_dim"], c["base_moe_mlp_dim"]) == (7168, 18432, 2048)
  assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]) == (
      1536, 512, 128, 64, 128)
  assert (c["vocab_size"], c["mtp_num_layers"]) == (129280, 1)
  p = analytic_memory.count_params(c)
  assert round((p.total - p.mtp) / 1e9, 1) == 671.0


def test_benchmark_proxy_is_the_measured_7_36b_model():
  run = fork_config.load([str(REPO / "configs/bench/proxy-1xh200.yml")])
  c = run.upstream
  assert (c["base_num_decoder_layers"], c["first_num_dense_layers"], c["num_experts"], c["num_experts_per_tok"]) == (
      4, 1, 32, 8)
  assert (c["max_target_length"], c["per_device_batch_size"], c["weight_dtype"], c["remat_policy"]) == (
      4096, 4, "bfloat16", "full")
  assert (c["attention"], c["dataset_type"], c["hardware"]) == ("cudnn_flash_jax", "synthetic", "gpu")
  assert analytic_memory.count_params(c).total == 7_358_880_864


@pytest.mark.slow
def test_parameter_count_matches_upstreams_own_model():
  """Our analytic count == upstream's abstract model (jax.eval_shape, no weights) for the proxy."""
  path = str(REPO / "configs/models/deepseek3-proxy-1gpu.yml")
  assert analytic_memory.upstream_param_count(path) == 7_358_880_864


def test_ep_proxies_keep_32_experts_per_gpu():
  for name, gpus, nodes in (("proxy-2xh200-ep2.yml", 2, 1), ("proxy-8xh200-ep8.yml", 8, 1),
                            ("proxy-16xh200-ep16.yml", 16, 2)):
    run = fork_config.load([str(REPO / "configs/bench" / name)])
    ep = run.upstream["ici_expert_parallelism"] * run.upstream.get("dcn_expert_parallelism", 1)
    assert run.fork.recipe_num_gpus == gpus == ep
    assert run.upstream["num_experts"] // gpus == 32
    parallelism.check_topology(run.upstream, gpus, gpus, nodes)
  # Across the two nodes: V3's group-limited routing (4 of its 8 groups on each node), not node-limited (M = 4 of
  # 2 nodes would limit nothing, and node-limited routing needs the groups to be the nodes).
  assert run.fork.moe_dispatch_backend == "hierarchical" and not run.fork.moe_node_limited_routing
  assert run.upstream["n_routing_groups"] == 8 and run.upstream["topk_routing_group"] == 4


@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_mesh_fits_its_gpu_count_and_its_stated_memory(path):
  run = fork_config.load([str(path)])
  gpus = run.fork.recipe_num_gpus
  assert f"{gpus}x" in path.name
  assert f"x{run.fork.target_gpu}" in path.name  # the planner's verdict is against the recipe's own GPU
  parallelism.check_topology(run.upstream, gpus, gpus, gpus // GPUS_PER_NODE)  # one slice per 8-GPU node
  _, est, _ = analytic_memory.estimate(run.upstream, gpus)
  hbm = {"h100": 80e9, "h200": 141e9, "b200": 180e9}[run.fork.target_gpu]
  assert est.device_total < hbm  # the analytic cross-check
  # The header records the compiled plan (python -m MaxText.plan), which fits the GPU's usable HBM.
  planned = re.search(r"^# Memory: ([\d.]+) GiB a GPU of ([\d.]+) usable: fits", path.read_text(), re.M)
  assert planned and float(planned[1]) <= float(planned[2]), path.name  # the same as its summary: test_recipe_plans


def test_the_128_gpu_recipe_keeps_the_experts_resident_across_nodes():
  """Not NVIDIA's reference layout (ICI FSDP 8 x DCN FSDP 2 x ICI EP 8, which gathers the experts over the nodes every
  microbatch): EP 64 over 8 nodes, fsdp 2 for the rest, the two-level dispatch with V3's node-limited routing (the
  re-lay of docs/planner.md "The 671B recipes", 64.8 -> 170.1 TFLOP/s/GPU planned)."""
  c = fork_config.load([str(REPO / "configs/recipes/deepseek3-671b-128xh100.yml")])
  up = c.upstream
  assert (up["ici_expert_parallelism"], up["dcn_expert_parallelism"], up["dcn_fsdp_parallelism"]) == (8, 8, 2)
  assert c.fork.moe_dispatch_backend == "hierarchical" and c.fork.moe_node_limited_routing
  assert up["n_routing_groups"] == 8 and up["topk_routing_group"] == 4  # V3's groups are the 8 EP nodes
  # NVIDIA's reference batch is 6 sequences per GPU; on 80 GB one fits (the recipe's plan).
  assert (up["max_target_length"], up["per_device_batch_size"], up["remat_policy"]) == (4096, 1, "custom")
  # NVIDIA offloads the experts' up-projections; ours recomputes them until the custom-remat loss drift is
  # explained (docs/cluster.md "Host offload, measured"), and offloads the layer inputs only.
  assert up["moe_mlpwi_0"] == up["moe_mlpwi_1"] == "remat" and up["decoder_layer_input"] == "offload"


def test_moe_block_ours_alone_picks_the_fast_grouped_gemm():
  assert fork_config.load(["moe_block=ours"]).fork.moe_gmm_backend == "auto"  # mgpu on Hopper, logged
  assert fork_config.load(["moe_block=upstream"]).fork.moe_gmm_backend == "upstream"  # upstream's block untouched
  # Our block never reaches upstream's sparse_matmul: its grouped-GEMM keys (the recipes' tokamax) don't clash.
  assert fork_config.load(["moe_block=ours", "use_tokamax_gmm=true"]).fork.moe_gmm_backend == "auto"


@pytest.mark.parametrize("args,keys", [
    (["moe_block=ours", "moe_gmm_backend=upstream"], ("moe_block", "moe_gmm_backend")),
    (["moe_block=te", "moe_gmm_backend=mgpu"], ("moe_block", "moe_gmm_backend")),
    (["moe_block=upstream", "moe_dispatch_backend=te_ncclep"], ("moe_block", "moe_dispatch_backend")),
    (["moe_block=te", "moe_dispatch_backend=ring"], ("moe_block", "moe_dispatch_backend")),
])
def test_contradicting_moe_keys_are_one_error_naming_both(args, keys):
  with pytest.raises(fork_config.ConfigError) as err:
    fork_config.load(args)
  message = str(err.value)
  assert "\n" not in message and all(f"'{k}'" in message for k in keys) and "contradict" in message, message


def test_every_bench_train_variant_is_a_config_we_accept(monkeypatch):
  """tools/bench_train.py's variants are override lists on the proxy config: each must load (our keys'
  checks included), so a GPU session never spends its time on a variant that a typo or a key clash
  refuses at start."""
  from conftest import REPO, load_script  # pylint: disable=import-outside-toplevel

  monkeypatch.syspath_prepend(str(REPO / "tools"))  # bench_train imports its sibling profile_breakdown
  bench_train = load_script("bench_train", "tools/bench_train.py")
  proxy = str(REPO / bench_train.DEFAULT_CONFIG)
  for name, (overrides, _) in bench_train.VARIANTS.items():
    run = fork_config.load([proxy, *overrides])
    assert run.fork is not None, name
  assert fork_config.load([proxy, *bench_train.VARIANTS["ours_fp8"][0]]).fork.moe_fp8 == "blockwise"
