"""What export_hf and import_hf exit with: one code per cause, each with one line naming the path, key or value.

0 written; 1 anything unexpected (a traceback); 2 bad input: arguments, a model the target layout cannot hold, an HF
directory of another architecture, a config whose widths disagree with the weights, an output that already exists
or that another live run is writing; 6 the output could not be written: a parent that refuses a new file, a full
disk (its temporary directories and lock are removed, MaxText/hf/output.py); 7 no such checkpoint: a run without
checkpoints, a step that does not exist or was never completed; 8 damaged input: a checkpoint that fails the check a
resume makes (unreadable, non-finite, or not the bytes its digests were taken from), missing or unreadable shards,
a shard whose header does not parse or fit its file; 130 stopped by SIGINT (Ctrl-C), 143 stopped by SIGTERM (a
scheduler's stop): OUT_DIR.tmp and orbax's temporary folders next to it removed (MaxText/hf/stop.py).
"""

from __future__ import annotations

BAD_INPUT = 2
NOT_WRITTEN = 6
NO_CHECKPOINT = 7
DAMAGED = 8
INTERRUPTED = 130  # SIGINT: 128 + 2, as a shell reports a process Ctrl-C ended
TERMINATED = 143  # SIGTERM: 128 + 15


class HFError(Exception):
  """One line for the user, and the exit code of its cause."""

  code = 1

  def __init__(self, message: str):
    super().__init__(" ".join(str(message).split()))


class BadInput(HFError):
  code = BAD_INPUT


class NotWritten(HFError):
  code = NOT_WRITTEN


class NoCheckpoint(HFError):
  code = NO_CHECKPOINT


class Damaged(HFError):
  code = DAMAGED
