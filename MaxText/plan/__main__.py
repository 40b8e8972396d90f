"""Plan a run before the cluster: `python -m MaxText.plan <config.yml> [key=value ...] [options]`.

Compiles the train step `python -m MaxText.train` would run with the same
arguments (our config, presets and patches; MaxText/plan/aot.py) for the recipe's
full GPU count (`recipe_num_gpus`) on this machine, and prints
  memory      per device from the compiler (arguments, outputs, temporaries,
              aliases, host-offloaded) and whether it fits `target_gpu`'s HBM
  collectives per step: count, bytes and wire bytes per kind and mesh axis,
              and whether each crosses nodes (`gpus_per_node`)
  estimate    step time and TFLOP/s/GPU read off the scheduled HLO
              (MaxText/plan/schedule.py): compute, memory-bound work,
              collectives exposed and overlapped, the critical path; every
              constant with its source (MaxText/plan/hardware.py); and the
              analytic memory cross-check (MaxText/plan/analytic_memory.py)
For a target GPU with a shipped XLA target config (target_gpu: h100, h200), the
step is compiled by XLA's GPU compiler for compile-only devices of that GPU, on
any machine, no GPU needed (MaxText/plan/gpu_target.py; `scripts/bootstrap.sh
--gpu-plan` installs jax's CUDA compiler plugin): memory is the compiler's,
against the target's own HBM. Otherwise, on a GPU machine, the GPU client is
mocked to the recipe's topology (scheduled against the target's memory), and
without a GPU simulated CPU devices stand in (up to 64): the collectives are the
program's, but there is no GPU memory figure and GPU-only kernels are swapped
for CPU ones (each swap is printed). Past 64 simulated devices the step is only
lowered: every sharding is checked against its array (a mesh a parameter cannot
be split over is an error naming the parameter), nothing is compiled.

Options:
  --json PATH       also write the report as JSON (to PATH.tmp, then renamed)
  --timeout S       give up a compile after S seconds (default 1800)
  --heartbeat S     while a compile runs, a line every S seconds naming its phase (default 30; 0: none)
  --hlo PATH        keep the compiled HLO text
  --mock            compile on this machine's GPU with a mocked topology, even where a
                    compile-only target exists (a cross-check of the two)
  --cpu             simulated CPU devices only (lowered only past 64): a quick check that every
                    sharding fits its array, no GPU compiler
  --search          try other layouts in the same GPU count and rank those that fit
                    (MaxText/plan/search.py)
Bad input (one line naming the key, exit 2): a mesh that does not multiply to
the GPU count, experts that do not split over EP, a config upstream or the
compiler rejects.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from MaxText import config as fork_config
from MaxText.plan import planner, search


def _take(args: list[str], flag: str, has_value: bool = True) -> Any:
  if flag not in args:
    return None
  i = args.index(flag)
  if not has_value:
    del args[i]
    return True
  if i + 1 >= len(args):
    raise fork_config.ConfigError(f"{flag} needs a value")
  value = args[i + 1]
  del args[i : i + 2]
  return value


def _seconds(flag: str, value: str) -> float:
  try:
    seconds = float(value)
  except ValueError:
    seconds = -1.0
  if not seconds >= 0:
    raise fork_config.ConfigError(f"{flag} {value}: give seconds, a number >= 0")
  return seconds


def main(argv: list[str] | None = None) -> int:
  args = sys.argv[1:] if argv is None else list(argv)
  if not args or args[0] in ("-h", "--help"):
    print(__doc__.strip())
    return 0
  os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
  try:
    json_path = _take(args, "--json")
    hlo_path = _take(args, "--hlo")
    timeout = _take(args, "--timeout")
    heartbeat = _take(args, "--heartbeat")
    do_search = _take(args, "--search", has_value=False)
    mock, cpu = (bool(_take(args, flag, has_value=False)) for flag in ("--mock", "--cpu"))
    if mock and cpu:
      raise fork_config.ConfigError("--mock and --cpu exclude each other")
    timeout_s = float(timeout) if timeout else planner.DEFAULT_TIMEOUT_S
    heartbeat_s = planner.HEARTBEAT_S if heartbeat is None else _seconds("--heartbeat", heartbeat)
    if do_search:
      return search.main(args, timeout_s, json_path, heartbeat_s)
    report = planner.plan(args, timeout_s, hlo_path, mode="mock" if mock else "cpu" if cpu else "auto",
                          heartbeat_s=heartbeat_s)
  except ValueError as e:  # ConfigError, PlanError, a bad --timeout
    print(f"maxtext-moe: plan error: {e}", file=sys.stderr, flush=True)
    return 2
  planner.print_report(report)
  if json_path:
    planner.write_json(report, json_path)
    planner.log(f"wrote {json_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
