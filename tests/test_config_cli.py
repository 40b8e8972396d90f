"""Config discovery from the command line: --help, --print-config, --dry-run, and
the launch mistakes that used to end in a jax.distributed traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import patches
from conftest import REPO, run_rejected
from MaxText import config as fork_config
from MaxText.run import main as train
from MaxText.config import environment

RECIPES = sorted((REPO / "configs/recipes").glob("deepseek3-671b-*x*.yml"))
# What upstream's import-time notices start with (patches/quiet_notices.py; transformers' logging).
NOTICES = ("[DECOUPLED NO-OP]", "[NO-OP]", "[transformers]")


def _cli(tmp_path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  """`python -m MaxText.train ARGS` from an empty directory, outputs under tmp_path."""
  environ = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  environ["PYTHONPATH"] = os.pathsep.join([str(REPO), environ.get("PYTHONPATH", "")])
  cwd = tmp_path / "cwd"
  cwd.mkdir(exist_ok=True)
  return subprocess.run([sys.executable, "-m", "MaxText.train", *args], cwd=cwd, env={**environ, **(env or {})},
                        capture_output=True, text=True, timeout=300, check=False)


def _config_lines(stdout: str) -> dict[str, str]:
  """--print-config's stdout, which must hold the config alone: `# ...` headers and `key = value  # source`."""
  lines = stdout.splitlines()
  stray = [line for line in lines if not (line.startswith("# ") or re.fullmatch(r"\w+ = .+  # .+", line))]
  assert stray == [], stray[:5]
  return dict(line.split(" = ", 1) for line in lines if not line.startswith("#"))


def test_every_key_of_ours_has_a_description():
  missing = [k for k, f in fork_config.ForkConfig.model_fields.items() if not (f.description or "").strip()]
  assert missing == []


def test_help_lists_our_keys_and_the_exit_codes(tmp_path):
  proc = _cli(tmp_path, "--help")
  assert proc.returncode == 0, proc.stderr
  for name, field in fork_config.ForkConfig.model_fields.items():
    assert f"  {name} (" in proc.stdout and field.description in proc.stdout
  assert "exit codes:" in proc.stdout and "  2  bad config" in proc.stdout
  from MaxText.config import command_line  # pylint: disable=import-outside-toplevel

  for code, meaning in command_line.EXIT_CODES.items():  # every code the entry point returns, from its constants
    assert f"\n  {code:>3}  {meaning}\n" in proc.stdout, code
  assert set(command_line.EXIT_CODES) == {v for k, v in vars(command_line).items() if k.startswith("EXIT_") and isinstance(v, int)}
  assert "--print-config" in proc.stdout and "--dry-run" in proc.stdout


def test_print_config_shows_every_value_with_its_source(tmp_path):
  """From a directory without configs/: the shipped file is found; nothing is written."""
  proc = _cli(tmp_path, "--print-config", "configs/bench/proxy-1xh200.yml", "steps=7", "xla_presets=[host_offload]",
              "remat_policy=custom", "moe_mlpwi_1=device", f"base_output_directory={tmp_path / 'outputs'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = _config_lines(proc.stdout)
  shipped = fork_config.REPO_CONFIGS.resolve()
  assert lines["steps"] == "7  # command line"
  assert lines["xla_presets"] == '["host_offload"]  # command line'
  assert lines["recipe_num_gpus"] == f"1  # {shipped}/bench/proxy-1xh200.yml"
  assert lines["num_experts"] == f"32  # {shipped}/models/deepseek3-proxy-1gpu.yml"  # the chain's own file
  assert lines["moe_block"] == '"upstream"  # maxtext-moe default'
  assert lines["moe_mlpwi_0"] == '"offload"  # xla_presets host_offload'
  assert lines["remat_policy"] == '"custom"  # command line'  # over the file's full (host_offload needs custom)
  assert lines["moe_mlpwi_1"] == '"device"  # command line'  # the user wins over the preset
  assert lines["run_name"].endswith("# maxtext-moe default")
  assert lines["learning_rate"].endswith("# upstream base.yml")
  assert len(lines) > 500  # upstream's whole config, not only what the run sets
  assert not (tmp_path / "outputs").exists() and list((tmp_path / "cwd").iterdir()) == []


def test_dry_run_checks_everything_and_writes_nothing(tmp_path):
  proc = _cli(tmp_path, "--dry-run", "configs/deepseek3-tiny.yml", f"base_output_directory={tmp_path / 'outputs'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  # Quiet by default: our one line, none of upstream's import-time notices (gcloud_stub's, transformers').
  assert proc.stdout.splitlines() == ["[maxtext-moe] dry run: config, presets, launch (single, process 0 of 1) and "
                                      "upstream's checks pass; nothing compiled or written"]
  assert not [line for line in proc.stderr.splitlines() if line.startswith(NOTICES)], proc.stderr[-2000:]
  assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("args, message", [
    (["--dry-rum"], "option '--dry-rum' is not one of --print-config, --dry-run (or --help)"),
    (["--dry-run", "--steps=3"], "argument '--steps=3': overrides are key=value without dashes (steps=3)"),
    (["--print-config", "--dry-run"], "options --print-config and --dry-run: use one of them"),
])
def test_a_wrong_option_is_named(args, message, capsys):
  assert train.main(args) == 2  # refused while reading the command line: nothing loaded or started
  assert capsys.readouterr().err == f"maxtext-moe: config error: {message}\n"


def test_verbose_shows_upstreams_notices(tmp_path):
  proc = _cli(tmp_path, "--print-config", "verbose=true")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "[DECOUPLED NO-OP] gcs_storage: using stubs." in proc.stdout.splitlines()  # held back, then shown
  assert "verbose = true  # command line" in proc.stdout


def test_upstream_notices_are_held_until_verbose_is_known(monkeypatch, capsys):
  from maxtext.common import gcloud_stub  # pylint: disable=import-outside-toplevel

  from patches import quiet_notices  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv("DECOUPLE_GCLOUD", "TRUE")
  notice = "[DECOUPLED NO-OP] gcs_storage: using stubs."
  quiet_notices.apply()
  try:
    gcloud_stub.gcs_storage()
    assert capsys.readouterr().out == "" and quiet_notices.held_lines() == [notice]
    quiet_notices.release(show=True)  # verbose=true: what was held, then upstream's own print again
    gcloud_stub.gcs_storage()
    assert capsys.readouterr().out == f"{notice}\n{notice}\n"
    quiet_notices.apply()
    quiet_notices.release(show=False)  # the default: dropped, now and later
    gcloud_stub.gcs_storage()
    assert capsys.readouterr().out == "" and quiet_notices.held_lines() == []
  finally:
    quiet_notices.undo()
  assert quiet_notices.wanted(fork_config.ForkConfig()) and not quiet_notices.wanted(fork_config.ForkConfig(verbose=True))


def test_upstream_validation_error_is_one_line_naming_the_key(tmp_path):
  """A pydantic model validator of upstream's names no key (its loc is empty): ours names the one the message
  is about."""
  from patches import config_errors  # pylint: disable=import-outside-toplevel

  run = fork_config.load(["dcn_fsdp_parallelism=2", f"base_output_directory={tmp_path}"])
  patches.apply_module(config_errors)
  try:
    with pytest.raises(fork_config.ConfigError) as err:
      environment.validate_with_upstream(run)
  finally:
    patches.undo_module(config_errors)
  assert str(err.value) == ("config key 'dcn_fsdp_parallelism' = 2 (command line): rejected by upstream MaxText: "
                            "DCN parallelism requested but only one slice available.")


def test_another_model_on_cpu_names_the_distributed_key(tmp_path):
  """A Qwen3 config at small widths on CPU: upstream's own jax.distributed start read XPK's JOB_INDEX (unset: None)."""
  cfg = tmp_path / "qwen.yml"
  cfg.write_text("model_name: qwen3-30b-a3b\nhardware: cpu\noverride_model_config: true\nbase_emb_dim: 64\n"
                 "base_moe_mlp_dim: 32\nbase_mlp_dim: 32\nbase_num_decoder_layers: 2\nnum_experts: 8\n")
  result = run_rejected(tmp_path, str(cfg))
  assert result.returncode == 2 and "Traceback" not in result.stderr
  (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("maxtext-moe:")]
  assert line.startswith("maxtext-moe: config error: config key 'skip_jax_distributed_system' = False (upstream "
                         "default) with hardware=cpu: upstream MaxText then starts jax.distributed from XPK's JOB_INDEX")
  printed = _cli(tmp_path, "--print-config", str(cfg))  # printing it never starts jax.distributed
  assert printed.returncode == 0, printed.stderr[-2000:]
  assert _config_lines(printed.stdout)["skip_jax_distributed_system"] == "false  # upstream base.yml"


def test_help_states_the_moe_metrics_cost_as_measured():
  """--help's figure is BENCHMARKS.md's, from the table it names."""
  text = (REPO / "BENCHMARKS.md").read_text()
  section = text.split("\n## End to end on one H200\n", 1)[1].split("\n## ", 1)[0]
  row = next(line for line in section.splitlines() if "`moe_metrics_every_n_steps=1`" in line)
  figure = re.search(r"\*\*([\d.]+%)\*\*", row)[1]
  description = fork_config.ForkConfig.model_fields["moe_metrics_every_n_steps"].description
  assert f"{figure} of the step on one H200 (BENCHMARKS.md, \"End to end on one H200\")" in description
  assert "not yet measured" not in description


@pytest.mark.slow  # about 15 s a recipe on two cores: mostly importing upstream, twice
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_prints_and_dry_runs_without_its_gpus(tmp_path, recipe):
  """On a machine without the recipe's GPUs: the config as it will run (num_slices from its nodes), and a dry
  run that says what it checked, what it could not, and which command checks the rest."""
  shipped = f"configs/recipes/{recipe.name}"
  printed = _cli(tmp_path, "--print-config", shipped)
  assert printed.returncode == 0 and "Traceback" not in printed.stderr, printed.stderr[-2000:]
  lines = _config_lines(printed.stdout)
  gpus = int(lines["recipe_num_gpus"].split()[0])
  nodes = gpus // 8
  assert lines["num_slices"] == f"{nodes}  # recipe_num_gpus {gpus} / gpus_per_node 8"
  assert lines["moe_block"].startswith('"ours"')

  dry = _cli(tmp_path, "--dry-run", shipped, f"base_output_directory={tmp_path / 'outputs'}")
  assert dry.returncode == 0 and "Traceback" not in dry.stderr, dry.stderr[-2000:]
  assert dry.stdout.splitlines() == [
      f"[maxtext-moe] dry run: config, presets, launch (single, process 0 of 1), the mesh against the recipe's "
      f"{gpus} GPUs and upstream's checks pass; nothing compiled or written",
      f"[maxtext-moe] dry run: not checked here: the devices (the recipe is for {gpus} GPUs, {nodes} nodes of 8; "
      f"this machine has 1 CPU device) and the memory; {REPO}/scripts/plan.sh {shipped} "
      f"base_output_directory={tmp_path / 'outputs'} compiles the train step for its {gpus} GPUs and checks both"]
  assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("keys, line", [
    (["recipe_num_gpus=16", "gpus_per_node=6"], "recipe_num_gpus=16 is not whole nodes of gpus_per_node=6: give a "
     "multiple of 6 (recipe_num_gpus: command line; gpus_per_node: command line)"),  # before: "2 nodes of 6", exit 0
    (["recipe_num_gpus=12"], "recipe_num_gpus=12 is not whole nodes of gpus_per_node=8: give a multiple of 8 "
     "(recipe_num_gpus: command line; gpus_per_node: default)"),  # before: a line about the mesh
])
def test_a_recipe_of_part_nodes_is_one_line_naming_both_keys(keys, line, tmp_path):
  with pytest.raises(fork_config.ConfigError) as e:
    fork_config.load([f"configs/recipes/{RECIPES[0].name}", *keys])
  assert str(e.value) == line
  dry = _cli(tmp_path, "--dry-run", f"configs/recipes/{RECIPES[0].name}", *keys)
  assert dry.returncode == 2 and dry.stdout == "" and dry.stderr == f"maxtext-moe: config error: {line}\n"


def test_model_only_yaml_is_one_line_not_a_traceback(tmp_path):
  result = run_rejected(tmp_path, "configs/models/deepseek3-tiny.yml")
  assert result.returncode == 2
  (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("maxtext-moe:")]
  assert line.startswith("maxtext-moe: config error: hardware is not set, and upstream's default is tpu")
  assert "Traceback" not in result.stderr


def test_incomplete_upstream_launch_variables_are_one_line(tmp_path):
  result = run_rejected(tmp_path, env={"NNODES": "2", "NODE_RANK": "0"})
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert ("maxtext-moe: config error: NNODES=2, NODE_RANK=0 is set (upstream MaxText's GPU launch variables) but "
          "JAX_COORDINATOR_IP, JAX_COORDINATOR_PORT is not") in result.stderr
