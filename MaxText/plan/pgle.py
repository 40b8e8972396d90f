"""The planner's op costs as a profile for XLA's latency-hiding scheduler (PGLE), and a compile that uses it.

XLA:GPU's scheduler decides what to issue between a collective's start and its done from its own latency estimate.
Without a profile that estimate knows nothing of the links: on the DeepSeek-V3 layer it left most EP all-to-alls
with one or two kernels beside them (tools/overlap_probe.py). Given a profile ("PGLE": profile-guided latency
estimation, `xla_gpu_pgle_profile_file_or_directory_path`) it schedules by the costs it reads there. On a GPU the
profile comes from a run (jax's `jax_enable_pgle`); for a plan, from the planner's own model: each collective's
transfer at its link's rate, each GEMM's FLOPs and each memory-bound op's bytes at the target's rates
(MaxText/plan/schedule.py's walk), so the schedule is what XLA would build knowing those costs.

  compiled = pgle.compile_with_profile(lowered, gpu, mesh_shape, nodes, workdir)

compiles twice: once to read the module as the scheduler sees it (XLA's dump just before
`latency-hiding-scheduler`: names change after it, so the final module's would not match), then with the profile.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from MaxText import hardware
from MaxText.plan import schedule

SCHEDULER_PASS = "latency-hiding-scheduler"


def op_seconds(text: str, gpu: hardware.Gpu, mesh_shape: dict[str, int], nodes: list[int]) -> dict[str, float]:
  """Each instruction's seconds by the walk's rates, by name: a collective's transfer at its link's rate, a GEMM's
  FLOPs, a memory-bound op's bytes. Ops the walk reads as free, or whose cost this text does not show, are left out
  (the scheduler estimates those itself)."""
  module = schedule.parse(text)
  walk = schedule._Walk(module, gpu, mesh_shape, nodes, fp8_experts=False)  # pylint: disable=protected-access
  seconds: dict[str, float] = {}
  for comp in module.comps.values():
    for instr in comp.instrs:
      inner = walk._collective_of(instr)  # pylint: disable=protected-access
      if inner is not None:
        if (moved := walk.transfer(inner)) is not None:
          seconds[instr.name] = moved[2]
      elif instr.opcode in ("fusion", "custom-call", "dot", "convolution"):
        try:
          kind, amount, _ = walk._cost(instr, comp)  # pylint: disable=protected-access
        except (IndexError, KeyError, ValueError):  # a shape this dump does not print: left to XLA's estimate
          continue
        seconds[instr.name] = amount / walk.rate(kind)
  return seconds


def profile_text(seconds: dict[str, float]) -> str:
  """A ProfiledInstructionsProto in text form: one `costs` entry per instruction, in microseconds."""
  return "".join(f'costs {{ name: "{name}" cost_us: {s * 1e6:.3f} }}\n' for name, s in sorted(seconds.items()))


def scheduler_inputs(dump_dir: Path) -> list[Path]:
  """The modules XLA dumped just before its latency-hiding scheduler (one per scheduled computation group)."""
  return sorted(dump_dir.glob(f"*before_{SCHEDULER_PASS}*.txt"))


def compile_with_profile(lowered: Any, gpu: hardware.Gpu, mesh_shape: dict[str, int], nodes: list[int],
                         workdir: Path) -> tuple[Any, dict[str, Any]]:
  """jax's Lowered compiled with the planner's costs as the scheduler's profile: (compiled, what it used)."""
  dump = workdir / "pgle-dump"
  lowered.compile(compiler_options={"xla_dump_to": str(dump), "xla_dump_hlo_pass_re": re.escape(SCHEDULER_PASS)})
  seconds: dict[str, float] = {}
  for path in scheduler_inputs(dump):
    seconds.update(op_seconds(path.read_text(), gpu, mesh_shape, nodes))
  if not seconds:
    raise RuntimeError(f"no module was dumped before XLA's {SCHEDULER_PASS} in {dump}: is this a GPU compile?")
  profile = workdir / "pgle-profile.pbtxt"
  profile.write_text(profile_text(seconds))
  compiled = lowered.compile(compiler_options={"xla_gpu_pgle_profile_file_or_directory_path": str(profile)})
  return compiled, {"profile": str(profile), "instructions": len(seconds)}
