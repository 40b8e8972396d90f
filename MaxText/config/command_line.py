"""The command line every entry point shares: the exit codes and one argparse that says a bad argument in one
line (python -m MaxText.train, python -m MaxText.plan).

Exit codes of `python -m MaxText.train` (README "Exit codes"):
"""

from __future__ import annotations

import argparse

EXIT_OK = 0  # trained to `steps` (or the run had already finished: nothing to do)
EXIT_ERROR = 1  # anything unexpected: upstream's traceback
EXIT_CONFIG = 2  # bad input: one line naming the key or path; nothing written for a new run
EXIT_UPSTREAM = 3  # the installed maxtext is not the one our patches were written for
EXIT_NONFINITE = 4  # the state went non-finite; it was not saved (the last checkpoint is finite)
EXIT_LOCKED = 5  # another live job holds the run directory
EXIT_SAVE_FAILED = 6  # a checkpoint could not be written (disk full, unwritable); the last good one is kept
EXIT_OUT_OF_MEMORY = 7  # an allocation failed: device or host memory (XLA's RESOURCE_EXHAUSTED, numpy's MemoryError)
EXIT_MOE_OVERFLOW = 8  # a bounded MoE dispatch buffer dropped rows (on_overflow=error); that step was not saved
EXIT_PROCESS_LOST = 10  # another process of a multi-process job died: this one stopped too (MaxText/run/keeper.py)
# The data ran out with data_exhausted=stop; the last step trained was saved. Not 9: the planner's 9 is a plan
# whose account is violated (MaxText/plan/account.py), and one code should not mean two things.
EXIT_DATA_EXHAUSTED = 11
EXIT_PREEMPTED = 75  # SIGTERM/SIGUSR1/SIGINT: checkpoint saved at the next step boundary (EX_TEMPFAIL: rerun)
EXIT_ABORTED = 130  # a second SIGINT: stopped at once, nothing saved since the last checkpoint

# What each code means, one line each: `--help` prints these (exit_code_lines), the documents explain them.
EXIT_CODES = {
    EXIT_OK: "done: trained to `steps`, or the run had already finished; --print-config / --dry-run passed",
    EXIT_ERROR: "anything unexpected (a traceback on stderr)",
    EXIT_CONFIG: "bad config or launch environment: one line naming the key, value or path; also a resume that "
                 "would change the model's shape, its schedule or its data",
    EXIT_UPSTREAM: "the installed upstream MaxText is not the version a patch was written for",
    EXIT_NONFINITE: "the state went non-finite (step, arrays, loss named); not saved, the last checkpoint is finite",
    EXIT_LOCKED: "another live job holds the run directory (host, pid, start time named)",
    EXIT_SAVE_FAILED: "the run's storage refused a write (full, read-only); the last complete checkpoint is kept",
    EXIT_OUT_OF_MEMORY: "the train step does not fit in device memory, or the run in the host's (the figure named)",
    EXIT_MOE_OVERFLOW: "a bounded MoE dispatch buffer dropped rows; that step was not saved",
    EXIT_PROCESS_LOST: "another process of the job died or went silent (named): this one stopped too, within the "
                       "heartbeat timeout; run the job again to resume from the last complete checkpoint",
    EXIT_DATA_EXHAUSTED: "the data ran out before `steps` (data_exhausted=stop): the files and the step named, the "
                         "last step trained saved",
    EXIT_PREEMPTED: "stopped by SIGTERM, SIGUSR1 or a first Ctrl-C after saving the step in flight: run again to resume",
    EXIT_ABORTED: "a second Ctrl-C: stopped at once, nothing saved since the last checkpoint",
}

__doc__ += "\n".join(f"  {value:>3}  {name}" for name, value in sorted(
    ((k, v) for k, v in globals().items() if k.startswith("EXIT_") and isinstance(v, int)), key=lambda kv: kv[1]))


def exit_code_lines(codes: dict[int, str] | None = None) -> list[str]:
  """`  code  meaning` lines, in code order (default: every code of `python -m MaxText.train`)."""
  return [f"  {code:>3}  {text}" for code, text in sorted((EXIT_CODES if codes is None else codes).items())]


class CommandLineError(ValueError):
  """A command line an entry point refuses (argparse's verdict, or an option it does not know): one line naming
  the argument, exit EXIT_CONFIG."""


class _OneLineParser(argparse.ArgumentParser):
  def error(self, message: str):  # argparse would print its usage and exit; the entry point says one line
    raise CommandLineError(message)


def command_line_parser(prog: str, usage: str, description: str,
                        codes: dict[int, str] | None = None) -> argparse.ArgumentParser:
  """An entry point's argparse (python -m MaxText.train, python -m MaxText.plan): its exit codes as the epilog,
  no abbreviated options, no help of argparse's own (each adds its -h/--help as a flag), and CommandLineError
  where argparse would print its usage and exit."""
  return _OneLineParser(prog=prog, usage=usage, description=description, add_help=False, allow_abbrev=False,
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n".join(["exit codes:", *exit_code_lines(codes)]))

