"""Seams: maxtext.common.profiler.Profiler.maybe_activate_profiler / maybe_deactivate_profiler (maxtext 0.2.5).

Upstream's train loop (trainers/pre_train/train.py, train_loop's per-step
function) calls `prof.maybe_activate_profiler(step, state)` before it loads the
batch and runs the step, and `prof.maybe_deactivate_profiler(step, state)`
after the step, its checkpoint and its eval, before the step's metrics are
buffered: the one place upstream marks "around one train step". Its own
`profiler=xplane` starts and stops jax.profiler there; we do the same on our
steps, with the Profiler's own ProfileOptions, after upstream's call:

  - a profiled step: (step + 1) % moe_profile_every_n_steps == 0 (the steps
    whose moe/ scalars patches/metric_logger.py keeps for that interval), and
    never this process's first step, which compiles the train step, nor, under
    jax's PGLE (the `pgle` preset), the runs it profiles itself and the one that
    recompiles with their profile (jax holds one profiler session at a time);
  - around it, block_until_ready(state) on both sides (upstream's
    profile_cleanly), so the trace holds exactly that step's device work;
  - the trace goes to <run>/moe_profile/step_<s>/ (TensorBoard's profile tab
    reads it: `tensorboard --logdir <run>/moe_profile`); the newest KEEP stay;
  - a subprocess (`python -m MaxText.moe.time_split`) turns it into the split,
    so xprof's converter logs and memory stay out of the trainer and a failure
    costs one warning line, never the run; the result (with the largest
    ops left in "rest") is kept as step_<s>/time_split.json; the moe_time/ scalars join the
    step's own metrics (patches/metric_logger.add_scalars), which upstream
    writes one step later, and a one-line log is printed.

Process 0 only (upstream's default, upload_all_profiler_results=false). Eval,
checkpoint and data-pipeline programs in the window are not the train step's
program and are left out of the split (MaxText/moe/time_split.step_rows).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from MaxText.console.progress import log as _log
from patches._seam import Seam

SEAM = Seam(
    name="moe_profile",
    module="maxtext.common.profiler",
    attr="Profiler.maybe_activate_profiler",
    sha256="49c4cc72b9e6719d",
)
SEAM_STOP = Seam(
    name="moe_profile stop",
    module="maxtext.common.profiler",
    attr="Profiler.maybe_deactivate_profiler",
    sha256="1d6ff8bf62f8edbf",
)

KEEP = 5  # newest profiles kept under <run>/moe_profile (one H200 step of the proxy: tens of MB)
CONVERT_TIMEOUT_S = 600
_state: dict = {"every": 0, "run_dir": None, "first_step": None, "tracing": None, "pgle_runs": 0}


def set_run_dir(run_dir: Path) -> None:
  """Where profiles go (<run_dir>/moe_profile); MaxText/run/loop.py sets it before training."""
  _state["run_dir"] = Path(run_dir)


def profiled(step: int) -> bool:
  every, first = _state["every"], _state["first_step"]
  return every > 0 and (first is None or step > first + _state["pgle_runs"]) and (step + 1) % every == 0


def _pgle_runs() -> int:
  """The step runs jax's PGLE profiles before it recompiles (0 without PGLE)."""
  import jax  # pylint: disable=import-outside-toplevel

  return int(jax.config.jax_pgle_profiling_runs) if jax.config.jax_enable_pgle else 0


def _wrap_start(original):
  def maybe_activate_profiler(self, step, state):
    original(self, step, state)
    import jax  # pylint: disable=import-outside-toplevel

    if _state["first_step"] is None:
      _state["first_step"] = int(step)
    if not profiled(int(step)) or jax.process_index() != 0 or _state["run_dir"] is None:
      return
    out = _state["run_dir"] / "moe_profile" / f"step_{int(step)}"
    jax.block_until_ready(state)  # the previous step's work stays out of the trace
    try:
      jax.profiler.start_trace(str(out), profiler_options=self.profiling_options)
    except RuntimeError as e:  # another trace running (a profiler server's capture): skip this one, go on
      _log(f"WARNING: MoE time split, step {int(step)}: no trace: {str(e).splitlines()[0][:200]}")
      return
    _state["tracing"] = (int(step), out)

  maybe_activate_profiler.__wrapped__ = original
  return maybe_activate_profiler


def _wrap_stop(original):
  def maybe_deactivate_profiler(self, step, state):
    original(self, step, state)
    tracing = _state["tracing"]
    if tracing is None or tracing[0] != int(step):
      return
    import jax  # pylint: disable=import-outside-toplevel

    jax.block_until_ready(state)
    jax.profiler.stop_trace()
    _state["tracing"] = None
    report(*tracing)

  maybe_deactivate_profiler.__wrapped__ = original
  return maybe_deactivate_profiler


def report(step: int, out: Path) -> dict | None:
  """The split of the trace under `out`: logged, and queued as the step's moe_time/ scalars."""
  from MaxText.moe import time_split  # pylint: disable=import-outside-toplevel
  from patches import metric_logger  # pylint: disable=import-outside-toplevel

  found = sorted(glob.glob(str(out / "**" / "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  if not found:
    _log(f"WARNING: MoE time split, step {step}: no trace written under {out}")
    return None
  began = time.monotonic()
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the converter needs no accelerator
  try:
    proc = subprocess.run([sys.executable, "-m", "MaxText.moe.time_split", found[-1]], capture_output=True,
                          text=True, env=env, timeout=CONVERT_TIMEOUT_S, check=False)
    if proc.returncode != 0:
      raise ValueError((proc.stderr.strip().splitlines() or ["no output"])[-1])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
  except (subprocess.TimeoutExpired, ValueError, IndexError) as e:  # JSONDecodeError is a ValueError
    _log(f"WARNING: MoE time split, step {step}: {found[-1]} not converted: {str(e)[:300]}")
    return None
  (out / "time_split.json").write_text(json.dumps(result, indent=1))  # with the largest ops left in rest
  metric_logger.add_scalars(step, time_split.scalars(result))
  _log(f"{time_split.format_line(result, step)} [{time.monotonic() - began:.1f} s to convert]")
  _prune(out.parent)
  return result


def _prune(root: Path) -> None:
  steps = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name)))
  for _, path in steps[:-KEEP]:
    shutil.rmtree(path, ignore_errors=True)


def wanted(fork) -> bool:
  return fork.moe_profile_every_n_steps > 0


def apply(fork, hooks=None) -> None:  # pylint: disable=unused-argument
  SEAM_STOP.check()
  _state.update(every=fork.moe_profile_every_n_steps, first_step=None, tracing=None, pgle_runs=_pgle_runs())
  SEAM.apply(_wrap_start)
  SEAM_STOP.apply(_wrap_stop)


def undo() -> None:
  SEAM_STOP.undo()
  SEAM.undo()
  _state.update(every=0, run_dir=None, first_step=None, tracing=None, pgle_runs=0)
