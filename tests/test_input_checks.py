"""Everything checkable is checked before anything is written: real data and its tokenizer
(MaxText/config/data_checks.py), upstream's choice keys and the ranges that crashed later (MaxText/config/checks.py),
our backends on this platform, YAML the loader choked on, the planner's options, and TensorBoard on a full disk
(patches/tensorboard.py). Each is one ConfigError line naming the key, value or path."""

from __future__ import annotations

import dataclasses
import errno
import json
import random
import re
import threading
import types
from pathlib import Path

import pytest

import text_fixture
import patches
from MaxText import config as fork_config
from MaxText.config import checks as config_checks
from MaxText.config import data_checks
from MaxText.config import environment
from MaxText.run import loop

TINY = str(Path(__file__).resolve().parent.parent / "configs/deepseek3-tiny.yml")


@pytest.fixture(scope="module")
def upstream_patched():
  from patches import config_errors  # pylint: disable=import-outside-toplevel

  patches.apply_module(config_errors)  # upstream's config errors raise instead of exiting
  yield
  patches.undo_module(config_errors)


BAD_VALUES = {
    "remat_policy=nosuch": "'remat_policy' = 'nosuch' (as set): not a remat policy upstream MaxText knows; one of none",
    "log_period=0": "'log_period' = 0 (as set): must be > 0",
    "steps=100000000000000000000": "'steps' = 100000000000000000000 (as set): more than 2147483647",
    "learning_rate_schedule_steps=3000000000": "'learning_rate_schedule_steps' = 3000000000 (as set): more than",
    "mlp_activations=[silu,nosuch]": "'mlp_activations' names 'nosuch' (as set): not an activation upstream MaxText",
    "run_name=../escape": "'run_name' = '../escape': must be one directory name inside base_output_directory",
    "run_name=a/b": "'run_name' = 'a/b': must be one directory name",
    f"run_name={'x' * 300}": "is 300 bytes long; the filesystem of base_output_directory",
    # Upstream took .inf to the first step, after the compile; 0 trains at a learning rate of 0 from step 0 on.
    "learning_rate=.inf": "'learning_rate' = inf (as set): must be a finite number >= 0",
    "learning_rate_schedule_steps=0": "'learning_rate_schedule_steps' = 0 (as set): must be > 0, or -1",
    # Only remat_policy=custom reads a remat location: the offload asked for would never happen.
    "moe_mlpwi_0=offload": "'moe_mlpwi_0' = 'offload' (command line) does nothing under remat_policy = 'full'",
    # It was accepted and did nothing: synthetic data never runs out, so a run asked to stop there never would.
    "data_exhausted=stop": "'data_exhausted' = 'stop' (command line) applies to grain data only, and dataset_type is "
                           "'synthetic': synthetic data never runs out; leave data_exhausted unset",
}


# Three in the fast tier (a config load each); the rest, and every one through the command line
# (tests/reliability_bad_inputs.py), in the slow tier.
FAST_BAD_VALUES = ("log_period=0", "remat_policy=nosuch", "run_name=../escape", "moe_mlpwi_0=offload",
                   "data_exhausted=stop")


@pytest.mark.parametrize("override", [o if o in FAST_BAD_VALUES else pytest.param(o, marks=pytest.mark.slow)
                                      for o in sorted(BAD_VALUES)])
def test_values_upstream_accepts_and_then_crashes_on_are_refused(override, upstream_patched, tmp_path):  # pylint: disable=unused-argument,redefined-outer-name
  run = fork_config.load([TINY, f"base_output_directory={tmp_path}", override])
  with pytest.raises(fork_config.ConfigError, match=BAD_VALUES[override].replace("(", r"\(").replace(")", r"\)")
                     .replace("[", r"\[")):
    environment.validate_with_upstream(run)


@pytest.mark.slow  # four config loads
def test_the_tiny_config_passes_the_new_checks(upstream_patched, tmp_path):  # pylint: disable=unused-argument,redefined-outer-name
  for policy in ("full", "minimal", "custom", "none"):
    environment.validate_with_upstream(fork_config.load([TINY, f"base_output_directory={tmp_path}", f"remat_policy={policy}"]))


@pytest.mark.parametrize("override,says", [
    ("moe_gmm_backend=mgpu", "'moe_gmm_backend' = 'mgpu' (as set) cannot run on this CPU machine: no GPU"),
    ("moe_gmm_backend=te", "'moe_gmm_backend' = 'te' (as set) cannot run on this CPU machine: "),
])
def test_a_backend_this_platform_cannot_run_is_a_config_error(override, says):
  with pytest.raises(fork_config.ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
    config_checks.check_backends(fork_config.load([TINY, override]))
  config_checks.check_backends(fork_config.load([TINY, "moe_gmm_backend=xla"]))


def test_yaml_the_loader_choked_on_is_one_line_naming_the_file_or_key(tmp_path):
  for text, says in (("base_config: 42\n", "base_config must be a path or a list of paths, not 42"),
                     ("base_config: [a.yml, 7]\n", r"not \['a.yml', 7\]"),
                     (f"base_config: {TINY}\nsteps: ${{nosuch}}\n", r"config key 'steps' = '\$\{nosuch\}' \(.*\): "
                                                                    "Interpolation key 'nosuch' not found")):
    (tmp_path / "c.yml").write_text(text)
    with pytest.raises(fork_config.ConfigError, match=says):
      fork_config.load([str(tmp_path / "c.yml")])
  with pytest.raises(fork_config.ConfigError, match=r"'steps' = '\$\{oc.env:NO_SUCH_VAR_9\}' \(command line\): "):
    fork_config.load([TINY, "steps=${oc.env:NO_SUCH_VAR_9}"])


def test_the_planner_refuses_its_bad_options_before_compiling(tmp_path, capsys):
  from MaxText.plan import __main__ as plan  # pylint: disable=import-outside-toplevel

  for args, says in (([ "--json", str(tmp_path)], f"--json {tmp_path}: is a directory; give a file path"),
                     (["--json", "/proc/no/such.json"], "cannot be written (/proc is not a writable directory)"),
                     (["--timeout", "abc"], "--timeout abc: give seconds, a number >= 0")):
    assert plan.main([TINY, *args]) == 2
    assert says in capsys.readouterr().err
  assert not list(tmp_path.iterdir())  # no PATH.tmp left


# --- real data and its tokenizer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  folder = tmp_path_factory.mktemp("data")
  good = text_fixture.write_arrayrecord(folder / "good.array_record", text_fixture.documents(20))
  raw = good.read_bytes()
  (folder / "empty.array_record").write_bytes(b"")
  (folder / "random.array_record").write_bytes(random.Random(0).randbytes(len(raw)))
  (folder / "truncated.array_record").write_bytes(raw[: len(raw) // 2])
  (folder / "garbage.model").write_bytes(random.Random(1).randbytes(2048))
  (folder / "mixture.json").write_text(json.dumps({"a": {"path": str(good), "weight": 1}}))
  return folder


def _grain(data_dir: Path, **changes):
  values = {"dataset_type": types.SimpleNamespace(value="grain"), "grain_file_type": "arrayrecord",
            "grain_train_files": str(data_dir / "good.array_record"), "grain_train_mixture_config_path": "",
            "train_data_columns": ["text"], "tokenize_train_data": True, "eval_interval": -1, "grain_eval_files": "",
            "tokenizer_type": "sentencepiece", "tokenizer_path": str(text_fixture.tokenizer_path()), "add_bos": True,
            "add_eos": True, "hf_access_token": "", "vocab_size": 32000}
  return types.SimpleNamespace(**{**values, **changes})


@pytest.mark.parametrize("changes,says", [
    ({"grain_train_files": "{d}/nope.array_record"}, "'grain_train_files' = '{d}/nope.array_record' (as set): no file"),
    ({"grain_train_files": "{d}/*.nosuch"}, "no file matches it"),
    ({"grain_train_files": "{d}/empty.array_record"}, "{d}/empty.array_record is empty"),
    ({"grain_train_files": "{d}/random.array_record"}, "random.array_record cannot be read as arrayrecord: "),
    ({"grain_train_files": "{d}/truncated.array_record"}, "truncated.array_record cannot be read as arrayrecord"),
    ({"grain_train_files": "{d}/good.array_record,1;{d}/nope.array_record,1"}, "nope.array_record' (as set): no file"),
    ({"grain_train_files": "{d}/good.array_record;{d}/good.array_record"}, "is not 'pattern,weight'"),
    ({"train_data_columns": ["content"]}, "Column 'content' not found in dataset"),
    ({"grain_file_type": "tfrecord"}, "cannot be read as tfrecord"),
    ({"grain_file_type": "nosuch"}, "'grain_file_type' = 'nosuch'"),
    ({"grain_train_mixture_config_path": "{d}/nope.json"}, "not a readable mixture config"),
    ({"tokenizer_path": "{d}/nope.model"}, "'tokenizer_path' = '{d}/nope.model' (as set): no such file"),
    ({"tokenizer_path": "{d}/garbage.model"}, "does not load as a sentencepiece tokenizer"),
    ({"tokenizer_path": ""}, "needs a tokenizer"),
    ({"vocab_size": 1024}, "'vocab_size' = 1024 (as set) is smaller than the 32000 tokens of tokenizer_path"),
])
def test_bad_data_and_tokenizers_are_one_line_naming_the_key(data, changes, says):  # pylint: disable=redefined-outer-name
  run = dataclasses.replace(fork_config.load([TINY]), explicit=frozenset(changes), origins={})  # each "as set"
  config = _grain(data, **{k: v.format(d=data) if isinstance(v, str) else v for k, v in changes.items()})
  with pytest.raises(fork_config.ConfigError, match=re.escape(says.format(d=data))):
    data_checks.check(run, config)


def test_good_data_and_a_larger_vocabulary_pass(data):  # pylint: disable=redefined-outer-name
  run = fork_config.load([TINY])
  data_checks.check(run, _grain(data))
  data_checks.check(run, _grain(data, vocab_size=32768, grain_train_mixture_config_path=str(data / "mixture.json")))
  data_checks.check(run, types.SimpleNamespace(dataset_type="synthetic"))  # synthetic data: nothing to check
  hub = _grain(data, dataset_type=types.SimpleNamespace(value="hf"), tokenizer_path="meta-llama/Llama-2-7b-hf")
  data_checks.check(run, hub)  # an hf dataset's tokenizer from the Hub: the run downloads it


# --- TensorBoard on a full disk -------------------------------------------------------------------


def test_tensorboard_writes_in_the_callers_thread_and_a_full_disk_names_the_event_file(tmp_path):
  """tensorboardX's writer thread died on ENOSPC and its queue then blocked the run for good; ours raises in the
  caller's thread (a buffered write's OSError names no file: ours names the event file)."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # pylint: disable=import-outside-toplevel

  from patches import tensorboard  # pylint: disable=import-outside-toplevel

  threads = threading.active_count()
  writer = tensorboard.summary_writer(str(tmp_path / "tb"))
  for step in range(3):
    writer.add_scalar("learning/loss", 2.0 - step, step)
  writer.flush()
  assert threading.active_count() == threads  # no writer thread, no atexit queue
  events = EventAccumulator(str(tmp_path / "tb"))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("learning/loss")] == [(0, 2.0), (1, 1.0), (2, 0.0)]

  class Full:  # the write seam of a full disk
    def write_event(self, event):  # pylint: disable=unused-argument
      raise OSError(errno.ENOSPC, "No space left on device")

    flush = close = lambda self: None

  event_file = writer._get_file_writer().event_writer  # pylint: disable=protected-access
  event_file._writer = Full()  # pylint: disable=protected-access
  with pytest.raises(OSError) as e:
    writer.add_scalar("learning/loss", 0.5, 3)
  assert e.value.errno == errno.ENOSPC and e.value.filename.startswith(str(tmp_path / "tb" / "events.out.tfevents"))


def test_only_process_0_reads_the_data_and_every_process_stops_on_its_verdict(monkeypatch):
  """The data checks stat every shard: process 0 alone runs them. With two processes (the all-gather of each one's
  verdict simulated by index), bad data stops process 0 with its line and process 1 with one naming process 0."""
  from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

  calls = []

  def bad_data(run, config):
    calls.append(run)
    raise fork_config.ConfigError("config key 'grain_train_files' = '/x*': no file matches it")

  monkeypatch.setattr(data_checks, "check", bad_data)
  process_0_ok = []

  def all_gather(ok):  # the first call is process 0's: its verdict is what every process then receives
    if not process_0_ok:
      process_0_ok.append(ok)
    return [process_0_ok[0], True]

  monkeypatch.setattr(checkpoint_restore, "agree", all_gather)
  with pytest.raises(fork_config.ConfigError, match="grain_train_files"):
    loop.check_data_on_process_0("run", None, process_id=0)
  with pytest.raises(fork_config.ConfigError, match="the data checks failed on process 0"):
    loop.check_data_on_process_0("run", None, process_id=1)
  assert calls == ["run"]  # process 1 read nothing
