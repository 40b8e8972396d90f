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
              constant with its source (MaxText/hardware.py); and the
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

Bad input (one line naming the key, exit 2): a mesh that does not multiply to
the GPU count, experts that do not split over EP, a config upstream or the
compiler rejects. SIGINT (Ctrl-C) and SIGTERM end the compile child and remove
the temporary folders (/tmp/maxtext-plan-*), with one line: exit 130 or 143.
A plan whose one account is violated (MaxText/plan/account.py: the rows against
the walk, the loops against the config's microbatches) is printed and written
whole, then exits 9 with one line: its figures are not to be trusted. A search
(--search, --search-layouts --compile) marks such a plan, leaves it out of the
best, and exits 9 the same way.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from MaxText import config as fork_config
from MaxText.config import command_line
from MaxText.plan import account, layout_search, planner, search

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended
EXIT_INVARIANT = account.EXIT_VIOLATED  # 9
EXIT_CODES = {
    command_line.EXIT_OK: "planned (the report printed), or --help",
    command_line.EXIT_ERROR: "anything unexpected (a traceback on stderr)",
    command_line.EXIT_CONFIG: "bad config or option, or a compile that failed or ran past --timeout: one `plan error:` line",
    command_line.EXIT_ABORTED: "Ctrl-C (SIGINT): the compile child stopped and the temporary folder removed, one line",
    EXIT_TERMINATED: "SIGTERM: the same",
    EXIT_INVARIANT: "planned, but the one account is violated (rows against the walk, loops against the microbatches): "
                    "the report and --json are written, each violation named; one line. --search and "
                    "--search-layouts --compile: a plan among them violated, marked and left out of the best",
}


def parser() -> argparse.ArgumentParser:
  """The planner's options; the config and its key=value overrides are the other arguments (parse_known_args)."""
  intro, _, rest = __doc__.strip().partition("\n\n")
  p = command_line.command_line_parser("python -m MaxText.plan", "%(prog)s <config.yml> [key=value ...] [options]",
                                    f"{intro}\n\n{rest}", EXIT_CODES)
  p.add_argument("--json", metavar="PATH", help="also write the report as JSON (to PATH.tmp, then renamed)")
  p.add_argument("--timeout", metavar="S", help=f"give up a compile after S seconds (default {planner.DEFAULT_TIMEOUT_S:.0f})")
  p.add_argument("--heartbeat", metavar="S", help="while a compile runs, a status line naming its phase: on a terminal "
                 f"rewritten in place, in a log a line every S seconds (default {planner.HEARTBEAT_S:.0f}; 0: none)")
  p.add_argument("--hlo", metavar="PATH", help="keep the compiled HLO text")
  p.add_argument("--mock", action="store_true", help="compile on this machine's GPU with a mocked topology, even "
                 "where a compile-only target exists (a cross-check of the two)")
  p.add_argument("--cpu", action="store_true", help="simulated CPU devices only (lowered only past 64): a quick check "
                 "that every sharding fits its array, no GPU compiler")
  p.add_argument("--search", action="store_true", help="try other layouts in the same GPU count and rank those that "
                 "fit (MaxText/plan/search.py)")
  p.add_argument("--search-layouts", action="store_true", help="enumerate pipeline x EP x FSDP/data x ZeRO-1 x batch x "
                 "remat x FP8 layouts of the same GPU count and rank them by arithmetic, no compile "
                 "(MaxText/plan/layout_search.py)")
  p.add_argument("--top", metavar="N", help=f"--search-layouts: print the best N (default {layout_search.TOP})")
  p.add_argument("--compile", metavar="N", help="--search-layouts: plan the best N for real, printed beside their "
                 "arithmetic (default 0)")
  p.add_argument("-h", "--help", action="store_true", help="this text")
  return p


class Stopped(BaseException):
  """SIGINT or SIGTERM, raised in the main thread wherever it is. Not an Exception, so no `except Exception` on
  its way catches it: the `with` blocks and compile_in_child's handler clean up as it passes (the compile child,
  in a session of its own, never sees the terminal's Ctrl-C)."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def _stop(signum: int, frame: Any) -> None:  # pylint: disable=unused-argument
  for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not interrupt the clean-up
    signal.signal(sig, signal.SIG_IGN)
  raise Stopped(signum)


def _seconds(flag: str, value: str) -> float:
  try:
    seconds = float(value)
  except ValueError:
    seconds = -1.0
  if not seconds >= 0:
    raise fork_config.ConfigError(f"{flag} {value}: give seconds, a number >= 0")
  return seconds


def _count(flag: str, value: str | None, default: int, least: int = 0) -> int:
  if value is None:
    return default
  if not value.isdigit() or int(value) < least:
    raise fork_config.ConfigError(f"{flag} {value}: give a whole number >= {least}")
  return int(value)


def _output(flag: str, value: str | None) -> str | None:
  """An output path, checked before the compile (a directory there failed only after it, leaving PATH.tmp)."""
  if value is None:
    return None
  path = Path(value)
  if path.is_dir():
    raise fork_config.ConfigError(f"{flag} {value}: is a directory; give a file path")
  parent = next((p for p in path.absolute().parents if p.exists()), Path("/"))
  if not parent.is_dir() or not _can_create_in(parent):
    raise fork_config.ConfigError(f"{flag} {value}: cannot be written ({parent} is not a writable directory)")
  return value


def _can_create_in(directory: Path) -> bool:
  """By trying (os.access says yes to root on a read-only mount); leaves nothing behind."""
  try:
    with tempfile.TemporaryFile(dir=directory):
      return True
  except OSError:
    return False


def main(argv: list[str] | None = None) -> int:
  """Plans; returns one of EXIT_CODES. SIGINT and SIGTERM stop it cleanly (Stopped), while main runs."""
  previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    return _main(sys.argv[1:] if argv is None else list(argv))
  except Stopped as e:
    name = signal.Signals(e.signum).name
    print(f"maxtext-moe: plan stopped by {name}: the compile was ended and its temporary files removed",
          file=sys.stderr, flush=True)
    return command_line.EXIT_ABORTED if e.signum == signal.SIGINT else EXIT_TERMINATED
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _main(args: list[str]) -> int:
  try:
    options, args = parser().parse_known_args(args)
    if options.help or not args:
      print(parser().format_help())
      return command_line.EXIT_OK
    if unknown := [a for a in args if a.startswith("--")]:
      raise command_line.CommandLineError(f"option '{unknown[0]}' is not one of the planner's (--help lists them); "
                                       "overrides are key=value without dashes")
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
    json_path, hlo_path = _output("--json", options.json), _output("--hlo", options.hlo)
    if options.mock and options.cpu:
      raise fork_config.ConfigError("--mock and --cpu exclude each other")
    timeout_s = planner.DEFAULT_TIMEOUT_S if options.timeout is None else _seconds("--timeout", options.timeout)
    heartbeat_s = planner.HEARTBEAT_S if options.heartbeat is None else _seconds("--heartbeat", options.heartbeat)
    if options.search and options.search_layouts:
      raise fork_config.ConfigError("--search and --search-layouts exclude each other")
    if (options.top or options.compile) and not options.search_layouts:
      raise fork_config.ConfigError("--top and --compile go with --search-layouts")
    if options.search:
      return search.main(args, timeout_s, json_path, heartbeat_s)
    if options.search_layouts:
      top = _count("--top", options.top, layout_search.TOP, least=1)
      return layout_search.main(args, top, _count("--compile", options.compile, 0), timeout_s, json_path, heartbeat_s,
                                mode="mock" if options.mock else "cpu" if options.cpu else "auto")
    report = planner.plan(args, timeout_s, hlo_path, mode="mock" if options.mock else "cpu" if options.cpu else "auto",
                          heartbeat_s=heartbeat_s)
  except ValueError as e:  # ConfigError, PlanError, a bad option
    print(f"maxtext-moe: plan error: {e}", file=sys.stderr, flush=True)
    return command_line.EXIT_CONFIG
  planner.print_report(report)
  if json_path:
    planner.write_json(report, json_path)
    planner.log(f"wrote {json_path}")
  violations = account.violations_of(report)
  if violations:
    print(f"maxtext-moe: plan invariant violated ({len(violations)}): {violations[0]}", file=sys.stderr, flush=True)
    return EXIT_INVARIANT
  return command_line.EXIT_OK


if __name__ == "__main__":
  sys.exit(main())
