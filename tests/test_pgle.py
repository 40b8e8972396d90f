"""The planner's costs as XLA's scheduling profile (MaxText/plan/pgle.py): each op's seconds at the walk's rates,
written as a ProfiledInstructionsProto; on a real compile for compile-only H200s, the profile reaches the scheduler
(tools/overlap_probe.py --pgle is the slow test's program)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import SUBPROCESS_PYTHONPATH, require_gpu_plan
from MaxText.plan import pgle
from test_schedule import DOT, DOT_S, GATHER_S, GPU, MESH, ONE_NODE, _gather_module

HERE = Path(__file__).resolve().parent


def test_op_seconds_are_the_walks_rates_and_the_profile_is_in_microseconds():
  text = textwrap.dedent(_gather_module(between=DOT, after=""))
  seconds = pgle.op_seconds(text, GPU, MESH, ONE_NODE)
  assert seconds == {"ags": pytest.approx(GATHER_S), "d": pytest.approx(DOT_S)}  # parameters, bitcasts: XLA's own
  profile = pgle.profile_text(seconds)
  assert profile.splitlines() == [f'costs {{ name: "ags" cost_us: {GATHER_S * 1e6:.3f} }}',
                                  f'costs {{ name: "d" cost_us: {DOT_S * 1e6:.3f} }}']


def test_no_dump_before_the_scheduler_is_an_error_not_an_empty_profile(tmp_path):
  class CpuLowered:  # a compile that dumps nothing before the GPU scheduler (XLA:CPU has none)
    def compile(self, compiler_options=None):
      return None

  with pytest.raises(RuntimeError, match="no module was dumped before XLA's latency-hiding-scheduler"):
    pgle.compile_with_profile(CpuLowered(), GPU, MESH, ONE_NODE, tmp_path)


@pytest.mark.slow  # two compiles of a V3-width MoE layer for 16 compile-only H200s: --all only
def test_the_probe_compiles_with_the_profile():
  require_gpu_plan("h200")
  proc = subprocess.run([sys.executable, "tools/overlap_probe.py", "--devices", "16", "--layers", "1",
                         "--microbatches", "2", "--loops", "combined", "--pgle"], cwd=HERE.parent, capture_output=True, text=True,
                        timeout=900, check=False, env={**os.environ, "PYTHONPATH": SUBPROCESS_PYTHONPATH})
  assert proc.returncode == 0, proc.stderr[-3000:]
  profiled = [int(line.split("profile of ")[1].split()[0]) for line in proc.stdout.splitlines() if "profile of" in line]
  assert len(profiled) == 1 and profiled[0] > 100, proc.stdout
  rows = {line.split()[0]: [float(v) for v in line.split()[1:7]] for line in proc.stdout.splitlines()
          if line.split() and line.split()[0] in ("plain", "combined")}
  assert set(rows) == {"combined"} and all(r[0] > 0 and r[4] >= 0 for r in rows.values()), proc.stdout


@pytest.mark.slow  # the tiny model compiled twice for 8 compile-only H100s: --all only
def test_a_plan_with_the_pgle_preset_is_scheduled_with_the_planners_costs(tmp_path):
  require_gpu_plan("h100")
  path = tmp_path / "plan.json"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  proc = subprocess.run([sys.executable, "-m", "MaxText.plan", "configs/deepseek3-tiny.yml", "target_gpu=h100",
                         "recipe_num_gpus=8", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "moe_block=ours",
                         "per_device_batch_size=2", "max_target_length=64", "xla_presets=[pgle]", "--json", str(path)],
                        cwd=HERE.parent, env={**env, "PYTHONPATH": SUBPROCESS_PYTHONPATH}, capture_output=True,
                        text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(path.read_text())
  assert report["pgle_ops"] > 100 and f"scheduled with the planner's costs as XLA's profile ({report['pgle_ops']} ops" in proc.stdout
  assert report["estimate"]["step_s"] > 0 and report["account"]["ok"]
