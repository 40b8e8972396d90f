"""Progress lines for long work (MaxText/console/progress.py), with fake clocks where time matters: the planner's
heartbeat, plan --search's ETA, the train step's compile phases (real jax compiles of a tiny function) and a
checkpoint save's report. The real runs are in test_train.py (compile and checkpoint lines), test_plan.py (the
heartbeat of a real compile) and test_launch.py (one summary in a two-process job)."""

from __future__ import annotations

import functools
import subprocess
import threading

import jax
import jax.numpy as jnp
import pytest

from MaxText.console import progress


class FakeClock:
  def __init__(self, now: float = 100.0, tick: float = 0.0):
    self.now, self.tick = now, tick

  def __call__(self) -> float:
    self.now += self.tick
    return self.now


def _child(clock: FakeClock, ends_at: float, rc: int = 0):
  """Popen.wait on the fake clock: the child exits at `ends_at` (seconds on the clock)."""

  def wait(timeout: float) -> int:
    if clock.now + timeout >= ends_at:
      clock.now = max(clock.now, ends_at)
      return rc
    clock.now += timeout
    raise subprocess.TimeoutExpired("child", timeout)

  return wait


def test_the_heartbeat_comes_every_period_until_the_child_exits():
  clock, beats = FakeClock(now=0.0), []
  rc = progress.wait_beating(_child(clock, ends_at=100.0, rc=3), timeout_s=1800, period_s=30, beat=beats.append,
                             clock=clock)
  assert rc == 3 and beats == [30.0, 60.0, 90.0] and clock.now == 100.0


def test_the_heartbeat_stops_at_the_timeout():
  clock, beats = FakeClock(now=0.0), []
  with pytest.raises(subprocess.TimeoutExpired):
    progress.wait_beating(_child(clock, ends_at=1e9), timeout_s=75, period_s=30, beat=beats.append, clock=clock)
  assert beats == [30.0, 60.0] and clock.now == 75.0  # no beat at the timeout itself: the error says it


def test_a_late_wait_does_not_queue_beats_and_zero_turns_them_off():
  clock, beats = FakeClock(now=0.0), []

  def slow_wait(timeout: float) -> int:  # the host was busy: the wait came back 70 s late
    if clock.now >= 150:
      return 0
    clock.now += timeout + 70
    raise subprocess.TimeoutExpired("child", timeout)

  progress.wait_beating(slow_wait, timeout_s=1800, period_s=30, beat=beats.append, clock=clock)
  assert beats == [100.0, 190.0]  # one beat per late wake-up, never the missed ones at once
  clock, beats = FakeClock(now=0.0), []
  assert progress.wait_beating(_child(clock, ends_at=500.0), 1800, 0, beats.append, clock) == 0 and beats == []


def test_phase_file_round_trip(tmp_path):
  path = tmp_path / "phase"
  assert progress.read_phase(path) == "starting"  # the child has not written yet
  progress.write_phase(path, "compiling")
  assert progress.read_phase(path) == "compiling" and not (tmp_path / "phase.tmp").exists()
  progress.write_phase(None, "ignored")  # a request without a phase file


def test_search_eta_is_the_mean_so_far_times_the_candidates_left():
  clock = FakeClock(now=0.0)
  eta = progress.Eta(total=5, clock=clock)
  assert eta.start("(as given)") == "candidate 1 of 5: (as given)"  # nothing measured yet: no ETA
  clock.now += 60
  assert eta.done() == 60
  line = eta.start("ici_expert_parallelism=2")
  assert line == "candidate 2 of 5: ici_expert_parallelism=2 (ETA 4m00s, 1m00s a candidate so far)"
  clock.now += 120
  eta.done()
  # mean 90 s, candidates 3, 4 and 5 left
  assert eta.start("remat_policy=full").endswith("(ETA 4m30s, 1m30s a candidate so far)")


def test_durations_and_sizes_read_as_people_write_them():
  assert [progress.fmt_seconds(s) for s in (44.1, 150, 3900, float("inf"))] == ["44s", "2m30s", "1h05m", "?"]
  assert [progress.fmt_bytes(b) for b in (512, 3 * 2**20 + 2**19, int(1.23 * 2**30))] == ["512 B", "3.50 MiB",
                                                                                           "1.23 GiB"]


# --- compile phases from jax's own events ---------------------------------------------


def _tiny_step(state, batch):
  return state + jnp.sin(batch).sum(), {"loss": batch.mean()}


def _named(name: str):
  fn = functools.partial(_tiny_step)
  fn.__name__ = name  # as upstream names its jitted step (maxtext_utils.get_functional_train_with_signature)
  return jax.jit(fn, donate_argnums=0)


@pytest.fixture
def watch():
  phases, compiled = [], []
  w = progress.CompileWatch("train_step", phases.append, compiled.append, clock=FakeClock(tick=1.0)).start()
  w.phases, w.compiled = phases, compiled
  yield w
  w.stop()


def test_an_ahead_of_time_compile_reports_its_phases_and_time(watch):
  step = _named("train_step")
  x = jnp.arange(5.0)  # made before: its own small compiles are not the step's
  lowered = step.lower(x, x)
  assert watch.phases == ["tracing", "lowering"] and watch.compiled == []
  lowered.compile()
  assert watch.phases == ["tracing", "lowering", "compiling"]
  assert watch.compiled == [1.0] == watch.compiles  # the fake clock ticks once at the trace, once at the end


def test_a_compile_at_the_first_call_reports_once_and_other_functions_not_at_all(watch):
  state, x = jnp.arange(6.0), jnp.ones(6)  # made before: their own small compiles are not the step's
  _named("eval_step")(state, x)
  assert watch.phases == []
  step = _named("train_step")
  state, _ = step(jnp.arange(6.0), x)
  step(state, x)  # compiled already: nothing new
  assert watch.phases == ["tracing", "lowering", "compiling"] and len(watch.compiled) == 1


def test_a_stopped_watch_hears_nothing():
  phases = []
  w = progress.CompileWatch("train_step", phases.append).start()
  w.stop()
  w.stop()  # twice is harmless
  _named("train_step").lower(jnp.ones(7), jnp.ones(7)).compile()
  assert phases == []


def test_jax_names_of_one_function():
  assert {progress.base_name(n) for n in ("train_step", "jit(train_step)", "jit_train_step")} == {"train_step"}


# --- a checkpoint save's report -------------------------------------------------------


def test_a_save_is_reported_once_its_step_directory_is_final(tmp_path):
  """orbax writes under a temporary name and renames to the step number when the save is complete."""
  clock, reported, done = FakeClock(now=10.0), [], threading.Event()
  tmp = tmp_path / "4.orbax-checkpoint-tmp-123"
  (tmp / "items").mkdir(parents=True)
  (tmp / "items" / "a").write_bytes(b"x" * 1000)
  (tmp / "b").write_bytes(b"y" * 24)

  def on_saved(seconds, nbytes):
    reported.append((seconds, nbytes))
    done.set()

  stop = threading.Event()
  thread = progress.watch_save(tmp_path / "4", began=10.0, on_saved=on_saved, stop=stop, clock=clock)
  assert not done.wait(0.3) and reported == []  # still the temporary name
  clock.now = 13.5
  tmp.rename(tmp_path / "4")
  assert done.wait(10)
  thread.join(10)
  assert reported == [(3.5, 1024)]


def test_a_save_that_never_completes_ends_unreported(tmp_path):
  stop, reported = threading.Event(), []
  thread = progress.watch_save(tmp_path / "9", 0.0, lambda s, b: reported.append(s), stop)
  stop.set()
  thread.join(10)
  assert not thread.is_alive() and reported == []


def test_polling_is_five_percent_of_the_wait_within_bounds():
  assert [progress.save_poll_s(t) for t in (0.0, 4.0, 600.0)] == [0.05, 0.2, 1.0]


class _Stream:
  def __init__(self, terminal: bool):
    self.terminal, self.text = terminal, ""

  def isatty(self) -> bool:
    return self.terminal

  def write(self, s: str) -> None:
    self.text += s

  def flush(self) -> None:
    pass


def test_a_status_line_is_rewritten_in_place_on_a_terminal_and_a_line_a_minute_in_a_log():
  """13 minutes of heartbeats: one line on a terminal (carriage returns, ended once), 13 lines in a log."""
  now = [0.0]
  for terminal, lines in ((True, 1), (False, 13)):
    stream = _Stream(terminal)
    status = progress.StatusLine("[plan] ", log_every_s=60.0, stream=stream, clock=lambda: now[0])
    assert status.period_s == (progress.TERMINAL_REFRESH_S if terminal else 60.0)
    for second in range(0, 13 * 60, int(status.period_s)):
      now[0] = float(second)
      status.update(f"compiling (lowering): {second} s elapsed")
    status.close()
    assert stream.text.count("\n") == lines, stream.text[:300]
    if terminal:
      assert stream.text.count("\r\033[K[plan] compiling") == 13 * 60 // 2 and stream.text.endswith("778 s elapsed\n")
    else:
      assert "\r" not in stream.text and stream.text.splitlines()[1] == "[plan] compiling (lowering): 60 s elapsed"


def test_a_line_is_said_in_one_write():
  """A save's line comes from its watch thread while the main thread writes its own: print() writes a text and its
  newline apart, and the save's line once landed between them (tests/test_train.py in CI's slow tier)."""

  class Stream:
    def __init__(self):
      self.writes, self.flushes = [], 0

    def write(self, text):
      self.writes.append(text)

    def flush(self):
      self.flushes += 1

  stream = Stream()
  progress.say("[progress] step 5/5 (100%)", stream)
  progress.say("[maxtext-moe] a\n[maxtext-moe] b", stream)
  assert stream.writes == ["[progress] step 5/5 (100%)\n", "[maxtext-moe] a\n[maxtext-moe] b\n"]
  assert stream.flushes == 2
