"""What upstream's logging shows at the default verbosity (MaxText/run/quiet.py)."""

from __future__ import annotations

import logging

import pytest

from MaxText.run import quiet


def _record(level: int, message: str, path: str = "/site-packages/maxtext/trainers/pre_train/train.py"):
  return logging.LogRecord("absl", level, path, 882, message, None, None)


def test_a_replayed_step_shows_at_the_default_verbosity_and_other_info_lines_do_not():
  """Upstream says a step overflowed and was replayed only in an INFO line; its metrics come from the replay.
  Before, absl at WARNING hid it, and nothing of ours said the step ran twice."""
  quiet_filter, verbose_filter = quiet.UpstreamNoise(False), quiet.UpstreamNoise(True)
  replay = _record(logging.INFO, "Step 3: MoE ragged buffer overflow detected! Replaying step with dropless buffer...")
  chatter = _record(logging.INFO, "completed step: 3, seconds: 0.1")
  warning = _record(logging.WARNING, "something upstream warns about")
  assert quiet_filter.filter(replay) and not quiet_filter.filter(chatter) and quiet_filter.filter(warning)
  assert verbose_filter.filter(replay) and verbose_filter.filter(chatter)
  orbax = _record(logging.INFO, "Saving item to /x", path="/site-packages/orbax/checkpoint/x.py")
  assert not quiet_filter.filter(orbax) and not verbose_filter.filter(orbax)


def test_absl_keeps_info_for_its_own_logger_and_warning_for_everyone_else():
  """As in a run, where absl's app.run puts absl's handler on the root logger, so that its verbosity is the root's
  level: jax's and orbax's loggers stay at WARNING while upstream's absl lines reach UpstreamNoise at INFO."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

  root, absl = logging.getLogger(), logging.getLogger("absl")
  saved = root.level, absl.level, absl_logging.get_verbosity(), list(root.handlers)
  try:
    absl_logging.use_absl_handler()  # what app.run does before calling main
    quiet.upstream_logging(False)
    assert absl.getEffectiveLevel() == logging.INFO
    assert root.level == logging.WARNING
    assert logging.getLogger("jax._src.dispatch").getEffectiveLevel() == logging.WARNING
  finally:
    root.handlers[:] = saved[3]
    root.setLevel(saved[0])
    absl.setLevel(saved[1])
    absl_logging.set_verbosity(saved[2])


def test_after_a_damaged_read_asyncio_unretrieved_errors_of_tasks_and_futures_are_dropped():
  """orbax's abandoned reads, once a damaged checkpoint was named in one line: asyncio logs each unretrieved error
  with a traceback whenever it is collected (a task's or a bare future's); anything else asyncio logs still shows."""
  from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

  drop = checkpoint_restore._DropFailedReadEchoes()  # pylint: disable=protected-access
  for words in ("Task exception was never retrieved", "Future exception was never retrieved"):
    assert not drop.filter(logging.LogRecord("asyncio", logging.ERROR, "x", 1, words, None, None))
  assert drop.filter(logging.LogRecord("asyncio", logging.ERROR, "x", 1, "Unclosed client session", None, None))


def _logged(message: str, error: BaseException) -> logging.LogRecord:
  try:
    raise error
  except type(error):
    import sys  # pylint: disable=import-outside-toplevel

    return logging.LogRecord("absl", logging.ERROR, "/orbax/checkpoint/_src/futures/future.py", 387, message,
                             (error,), sys.exc_info())


def test_after_a_damaged_read_orbaxs_threads_logging_the_same_damage_are_dropped_and_other_errors_show():
  """orbax's _SignalingThread logs what ended it with logging.exception: the error's text (the TensorStore spec,
  about 60 lines), then its traceback. CI's slow tier printed one for a truncated data file under async saves,
  after our line had named the damage; the same thread's other errors still show, and both loggers get it."""
  from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

  drop = checkpoint_restore._DropFailedReadEchoes()  # pylint: disable=protected-access
  damage = Exception("Encountered error while reading array index: (slice(0, 4, 1),). See full TensorStore details")
  damage.__cause__ = ValueError('OUT_OF_RANGE: Error reading shard entry {0, 0}/{1, 1} in "a/c/0/0" in OCDBT '
                                'database at local file "/x/checkpoints/9/items/": Requested byte range [2, 3) is '
                                'not valid')
  said = "[process=0][thread=x][operation_id=1] _SignalingThread.run() raised an exception: %s"
  assert not drop.filter(_logged(said, damage))
  assert drop.filter(_logged(said, RuntimeError("a bug of ours")))
  assert checkpoint_restore.ECHO_LOGGERS == ("asyncio", "absl")


def test_after_a_damaged_read_its_errors_ending_a_thread_are_dropped_and_others_still_print():
  """The damage, raised again on a thread of an abandoned read, would print a traceback after our one line; an
  unrelated error on a thread still reaches the hook it had. The hooks are restored once the restore is done."""
  import threading  # pylint: disable=import-outside-toplevel

  from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

  before, seen = threading.excepthook, []
  threading.excepthook = lambda args: seen.append(args.exc_value)
  checkpoint_restore._quiet_failed_reads()  # pylint: disable=protected-access
  try:
    def raise_(error):
      raise error

    for error in (ValueError("DATA_LOSS: Error reading shard entry {0, 0}"), KeyError("unrelated")):
      thread = threading.Thread(target=raise_, args=(error,))
      thread.start()
      thread.join()
  finally:
    checkpoint_restore._unquiet()  # pylint: disable=protected-access
    restored, threading.excepthook = threading.excepthook, before
  assert [type(e) for e in seen] == [KeyError]
  assert restored is not before and restored.__name__ == "<lambda>"  # _unquiet put back the hook it replaced


def test_an_async_save_whose_commit_thread_met_a_full_disk_logs_no_traceback():
  """orbax's background commit thread logs "Failed to run N Handler Commit operations ..." at ERROR with the
  full disk only in its exc_info (about 80 lines of traceback, before our exit-6 line said it once). Seen in the
  harness's "a disk that fills mid-run" with async saves; any other failure of that thread still prints."""
  import errno  # pylint: disable=import-outside-toplevel

  path = "/site-packages/orbax/checkpoint/_src/checkpointers/async_checkpointer.py"
  said = "[process=0] Failed to run 3 Handler Commit operations or the Commit callback in background save thread"

  def commit_failed(error: BaseException) -> logging.LogRecord:
    try:
      try:
        raise error
      except OSError as e:
        raise ValueError("tensorstore write failed") from e
    except ValueError:
      import sys  # pylint: disable=import-outside-toplevel

      return logging.LogRecord("absl", logging.ERROR, path, 264, said, None, sys.exc_info())

  for verbose in (False, True):
    noise = quiet.UpstreamNoise(verbose)
    assert not noise.filter(commit_failed(OSError(errno.ENOSPC, "No space left on device", "/ckpt/8/x")))
    assert noise.filter(commit_failed(OSError(errno.EIO, "Input/output error", "/ckpt/8/x")))


def _closed_loop_error() -> RuntimeError:
  import asyncio  # pylint: disable=import-outside-toplevel

  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(print)
  except RuntimeError as e:
    return e
  raise AssertionError("a closed loop took a callback")


@pytest.mark.parametrize("verbose", [False, True])
def test_a_closed_loops_echo_on_another_thread_is_dropped_and_every_other_error_shows(monkeypatch, verbose):
  # What tensorstore's callback threads print after an async save failed (a full disk): "Event loop is closed"
  # raised in asyncio's call_soon_threadsafe, through sys.excepthook (PyErr_Print), each a traceback.
  import sys  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel

  shown = []
  monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: shown.append(("sys", value)))
  monkeypatch.setattr(threading, "excepthook", lambda args: shown.append(("thread", args.exc_value)))
  quiet.closed_loop_hooks(verbose)
  quiet.closed_loop_hooks(verbose)  # idempotent: one wrapper, not two
  closed, other, plain_closed = _closed_loop_error(), RuntimeError("boom"), RuntimeError("Event loop is closed")

  def on_another_thread():
    for value in (closed, other, plain_closed):
      sys.excepthook(type(value), value, value.__traceback__)
    raise closed

  worker = threading.Thread(target=on_another_thread)
  worker.start()
  worker.join()
  sys.excepthook(type(closed), closed, closed.__traceback__)  # the main thread's own error always shows
  if verbose:
    assert [v for _, v in shown] == [closed, other, plain_closed, closed, closed]
  else:  # the same words raised anywhere but call_soon_threadsafe still show
    assert shown == [("sys", other), ("sys", plain_closed), ("sys", closed)]


@pytest.mark.parametrize("verbose", [False, True])
def test_tensorstores_callbacks_into_a_closed_loop_print_nothing_and_other_unraisable_errors_show(monkeypatch,
                                                                                                  tmp_path, verbose):
  """What a disk that fills during an async save printed before our line (76 tracebacks of 6 lines, one a write):
  orbax closes its event loop, tensorstore completes the writes in flight and calls each one's callback,
  asyncio's call_soon_threadsafe, from C; the loop refuses it, and tensorstore reports the error as unraisable
  (sys.unraisablehook, which the hooks did not wrap). Real tensorstore writes here, their callbacks a closed loop's;
  a callback failing another way still shows, and verbose shows all."""
  import asyncio  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  shown = []
  monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: shown.append(value))
  monkeypatch.setattr(threading, "excepthook", lambda args: shown.append(args.exc_value))
  monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: shown.append(unraisable.exc_value))
  quiet.closed_loop_hooks(verbose)
  loop = asyncio.new_event_loop()
  loop.close()
  other = RuntimeError("a callback that failed another way")

  def fails_otherwise(_future):
    raise other

  spec = {"driver": "zarr", "kvstore": f"file://{tmp_path}/", "metadata": {"shape": [4096], "dtype": "<i4",
                                                                            "chunks": [1024]}}
  array = ts.open(spec, create=True).result()
  for callback in (loop.call_soon_threadsafe, loop.call_soon_threadsafe, fails_otherwise):
    write = array.write(np.arange(4096, dtype=np.int32))
    write.commit.add_done_callback(callback)
    write.commit.result()
  deadline = time.monotonic() + 10
  while len(shown) < (3 if verbose else 1) and time.monotonic() < deadline:  # a callback may run just after
    time.sleep(0.05)
  if verbose:
    assert [str(e) for e in shown] == ["Event loop is closed", "Event loop is closed", str(other)]
  else:
    assert shown == [other]


def test_orbax_removing_an_unfinished_saves_folder_is_said_once_in_our_words():
  """Orbax warns (atomicity.py) as it removes the folder of a save the last run cut short, when that step is saved
  again; the resume already said so in one line (MaxText/checkpoints/resume.py incomplete_saves). verbose shows it."""
  message = ("Attempted to create temporary directory /run/checkpoints/8.orbax-checkpoint-tmp-1796614770 which "
             "already exists. Removing existing directory since it is not finalized.")
  record = _record(logging.WARNING, message, path="/site-packages/orbax/checkpoint/_src/path/atomicity.py")
  assert not quiet.UpstreamNoise(False).filter(record) and quiet.UpstreamNoise(True).filter(record)
  other = _record(logging.WARNING, "Attempted something else", path="/site-packages/orbax/checkpoint/_src/path/atomicity.py")
  assert quiet.UpstreamNoise(False).filter(other)


@pytest.mark.parametrize("verbose", [False, True])
def test_the_resource_trackers_cleanup_of_shared_memory_is_silent_without_verbose(tmp_path, verbose):
  """A segment left linked at exit, as grain's in-flight batch buffers are when its iterator closes (a grain run
  printed "resource_tracker: There appear to be 5 leaked shared_memory objects" after our closing line): the
  tracker still unlinks it; only its warning goes, and verbose keeps it."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  from conftest import REPO  # pylint: disable=import-outside-toplevel

  child = (f"from MaxText.run import quiet; quiet.shared_memory_echo({verbose})\n"
           "from multiprocessing import shared_memory\n"
           "segment = shared_memory.SharedMemory(create=True, size=64)\n"
           "print(segment.name)\n"
           "segment.close()\n")  # not unlinked: the tracker's to clean up at shutdown
  proc = subprocess.run([sys.executable, "-c", child], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                        capture_output=True, text=True, timeout=60, check=True)
  assert not os.path.exists(f"/dev/shm/{proc.stdout.strip()}")  # unlinked either way
  assert ("leaked shared_memory" in proc.stderr) == verbose, proc.stderr
