"""Checkpoints verified, not trusted (MaxText/checkpoints/records.py, patches/checkpoint_restore.py): the content
digest against a numpy reference and under sharding, flipped bits, orbax's own damage errors, and upstream's
restore falling back through damaged checkpoints (real orbax, real upstream load_state_if_possible)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from MaxText.checkpoints import records as checkpoint_records


def _reference_digest(x: np.ndarray) -> str:
  """The digest in plain numpy, uint64 arithmetic reduced mod 2^32 (products of two values < 2^32 fit)."""
  bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize]).astype(np.uint64).ravel()
  i = np.arange(bits.size, dtype=np.uint64)
  weighted = int((bits * ((2 * i + 1) % 2**32) % 2**32).sum() % 2**32)
  mixed = int((bits ^ (i * 0x9E3779B1 % 2**32)).sum() % 2**32)
  return f"{weighted:08x}{mixed:08x}"


def _arrays():
  import ml_dtypes  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  return [rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((5, 3, 4)).astype(ml_dtypes.bfloat16),
          rng.standard_normal(7).astype(np.float16), np.float32(3.5).reshape(())]


def test_the_digest_matches_a_numpy_reference_and_flags_non_finite_arrays():
  arrays = _arrays()
  finite, digests = checkpoint_records.scan(arrays)
  assert finite == [True] * 4 and digests == [_reference_digest(x) for x in arrays]
  bad = arrays[0].copy()
  bad[3, 4] = np.inf
  assert checkpoint_records.scan([bad, arrays[1]])[0] == [False, True]


@pytest.mark.slow  # a digest per bit of several arrays
def test_every_single_flipped_bit_changes_the_digest():
  x = _arrays()[1]  # bf16: 16 bits an element
  base = checkpoint_records.scan([x])[1][0]
  raw = x.view(np.uint16).ravel()
  flipped = []
  for position in range(0, raw.size, 7):
    for bit in range(16):
      y = raw.copy()
      y[position] ^= np.uint16(1 << bit)
      flipped.append(y.view(x.dtype).reshape(x.shape))
  digests = checkpoint_records.scan(flipped)[1]
  assert base not in digests and len(flipped) == 16 * len(range(0, raw.size, 7))


SHARDED = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from MaxText.checkpoints import records as checkpoint_records
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
rng = np.random.default_rng(1)
host = [rng.standard_normal((8, 6, 4)).astype(np.float32), rng.standard_normal((16, 8)).astype(jnp.bfloat16)]
placed = [jax.device_put(host[0], NamedSharding(mesh, P("a", None, "b"))),
          jax.device_put(host[1], NamedSharding(mesh, P(("a", "b"), None)))]
assert all(len(x.sharding.device_set) == 4 for x in placed)
print(json.dumps([checkpoint_records.scan(host)[1], checkpoint_records.scan(placed)[1]]))
"""


@pytest.mark.slow  # simulated devices in a subprocess
def test_the_digest_is_the_same_whatever_the_sharding():
  """Four simulated devices: arrays split over a 2x2 mesh give the digests of the same arrays on one device."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", "import json\n" + SHARDED], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  one_device, sharded = json.loads(proc.stdout.strip().splitlines()[-1])
  assert one_device == sharded and len(set(one_device)) == 2


def test_a_record_that_is_garbled_or_of_another_step_is_not_one(tmp_path):
  path = checkpoint_records.write_record(tmp_path, 4, [("w", np.ones(3, np.float32))], ["00ff00ff00ff00ff"])
  assert checkpoint_records.read_record(tmp_path, 4)["arrays"]["w"] == {"shape": [3], "dtype": "float32",
                                                                         "digest": "00ff00ff00ff00ff"}
  assert not list(path.parent.glob("*.tmp*"))
  for text, why in (('{"step": 4, "arr', "cannot be read"), ("[4]", "is not a checkpoint record of step 4"),
                    (json.dumps({"step": 5, "arrays": {}}), "is not a checkpoint record of step 4")):
    path.write_text(text)
    with pytest.raises(checkpoint_records.RecordError, match=why):
      checkpoint_records.read_record(tmp_path, 4)
  with pytest.raises(checkpoint_records.RecordError, match="no record of ours"):
    checkpoint_records.read_record(tmp_path, 8)


def test_integer_arrays_and_rng_keys_are_digested_too():
  """The optimizer's step counts drive the learning-rate schedule and the RNG keys the dropout: both are in the
  record and digested (the numpy reference of a key is that of its uint32 data)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

  key = jax.random.split(jax.random.key(3, impl="unsafe_rbg"), 3)
  state = {"opt_state": {"count": jnp.int32(41)}, "rngs": {"key": key, "count": jnp.arange(3, dtype=jnp.uint32)},
           "w": jnp.ones((2, 3), jnp.float32), "mask": jnp.array([True, False, True])}
  leaves, digests = checkpoint_guard.check_finite(state, 7, None)
  named = dict(zip((n for n, _ in leaves), digests))
  assert sorted(named) == ["mask", "opt_state/count", "rngs/count", "rngs/key", "w"]
  assert named["opt_state/count"] == _reference_digest(np.asarray(41, np.int32))
  assert named["rngs/key"] == _reference_digest(np.asarray(jax.random.key_data(key)))
  assert named["mask"] == _reference_digest(np.array([1, 0, 1], np.uint8))
  assert checkpoint_guard.check_finite({**state, "opt_state": {"count": jnp.int32(42)}}, 7, None)[1] != digests


def _verdict(record_arrays: dict[str, str], restored: dict[str, str], digest=checkpoint_records.DIGEST):
  """mismatch() of a record with these {name: digest} against restored arrays with these (all finite)."""
  record = {"step": 1, "digest": digest, "arrays": {n: {"shape": [1], "dtype": "float32", "digest": d}
                                                    for n, d in record_arrays.items()}}
  named = [(n, None) for n in restored]
  return checkpoint_records.mismatch(record, named, [True] * len(named), list(restored.values()))


def test_the_restored_arrays_must_be_the_recorded_ones_name_for_name():
  """A key path that drifted would compare no digest for it: a missing or extra name fails, the first named."""
  assert _verdict({"a": "1", "b": "2"}, {"a": "1", "b": "2"}) is None
  assert _verdict({"a": "1", "b": "2"}, {"a": "1"}) == (
      "its arrays are not those recorded at save (1 missing, 0 extra; first 'b' was recorded but not restored)")
  assert _verdict({"a": "1"}, {"a": "1", "opt/count": "9"}) == (
      "its arrays are not those recorded at save (0 missing, 1 extra; first 'opt/count' was restored but not "
      "recorded)")
  assert _verdict({"a": "1", "n": "2"}, {"a": "1", "n": "3"}).startswith("the content of 1 arrays differs")


def test_a_record_from_before_integer_digests_vouches_for_its_float_arrays():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  named = [("w", jnp.ones(2)), ("count", jnp.int32(1))]
  assert checkpoint_records.covered({"digest": checkpoint_records.DIGEST_FLOATS}, named) == named[:1]
  assert checkpoint_records.covered({"digest": checkpoint_records.DIGEST}, named) == named
  assert _verdict({"w": "1"}, {"w": "2"}, checkpoint_records.DIGEST_FLOATS).startswith("the content of 1 arrays")


def test_the_processes_agree_on_a_load_before_any_sets_it_aside(monkeypatch):
  """patches/checkpoint_restore.agree: one all-gather of each process's flag; simulated here (process 1 of 3
  failed), the real collective over two processes in test_two_processes_agree_on_a_load."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

  assert checkpoint_restore.agree(True) == [True] and checkpoint_restore.agree(False) == [False]
  gathered = []
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: gathered.append(x) or np.array([int(x), 0, 1], np.int32))
  assert checkpoint_restore.agree(True) == [True, False, True]
  assert gathered == [1] and np.asarray(gathered[0]).dtype == np.int32


AGREE = r"""
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from patches import checkpoint_restore
print("AGREED", checkpoint_restore.agree(int(sys.argv[2]) == 0), flush=True)
"""


@pytest.mark.slow  # two processes, each its own jax
def test_two_processes_agree_on_a_load(tmp_path):
  """Two real processes (jax.distributed on localhost, gloo): process 1 failed to load, so both see it."""
  import socket  # pylint: disable=import-outside-toplevel

  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  procs = [subprocess.Popen([sys.executable, "-c", AGREE, f"localhost:{port}", str(i)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
  assert [out.strip().splitlines()[-1] for out, _ in outs] == ["AGREED [True, False]"] * 2


def _step_dir(run_dir: Path, name: str, committed: bool) -> None:
  (run_dir / "checkpoints" / name / "items").mkdir(parents=True)
  if committed:
    (run_dir / "checkpoints" / name / checkpoint_records.COMMIT_MARKER).write_text("")


def test_a_record_goes_only_when_orbax_deleted_its_step_never_while_a_save_is_in_flight(tmp_path):
  """async_checkpointing: orbax writes checkpoints/8.orbax-checkpoint-tmp* in the background and renames it to 8
  when it commits. Its record (and that of a step orbax may still commit) stays; that of step 2, which orbax
  deleted (max_num_checkpoints_to_keep), goes."""
  for step in (0, 2, 4, 8, 12):
    checkpoint_records.write_record(tmp_path, step, [("w", np.ones(3, np.float32))], ["00ff00ff00ff00ff"])
  _step_dir(tmp_path, "0", committed=True)
  _step_dir(tmp_path, "4", committed=True)
  _step_dir(tmp_path, "8.orbax-checkpoint-tmp-1712345678", committed=False)
  checkpoint_records.drop_stale_records(tmp_path)
  kept = sorted(int(p.stem) for p in (tmp_path / "maxtext-moe" / "checkpoints").glob("*.json"))
  assert kept == [0, 4, 8, 12]


# --- real orbax, real upstream restore ----------------------------------------------------------


def _state(step: int):
  """Random weights (zstd stores them as they are) large enough for OCDBT to keep them out of its CRC-checked
  b-tree nodes: a flipped bit there reads back as another number, as in the tiny model's checkpoints."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  w = np.random.default_rng(step).standard_normal((256, 128)).astype(np.float32)
  return {"params": {"w": jnp.asarray(w), "b": jnp.ones(8, jnp.bfloat16) * step}}


def _saved_run(run_dir: Path, steps=(0, 1, 2)):
  """Checkpoints as the trainer saves them: our record (from the guard's scan) first, then upstream's save."""
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  from patches import checkpoint_guard  # pylint: disable=import-outside-toplevel

  manager = checkpointing.create_orbax_checkpoint_manager(str(run_dir / "checkpoints"), True, False, 1)
  for step in steps:
    state = _state(step)
    leaves, digests = checkpoint_guard.check_finite(state, step, None)
    checkpoint_records.write_record(run_dir, step, leaves, digests)
    checkpointing.save_checkpoint(manager, step, state, force=True)
  checkpointing.wait_until_finished(manager)
  return manager


def _largest_data_file(step_dir: Path) -> Path:
  return max((p for p in step_dir.rglob("*") if p.is_file() and "/d/" in str(p)), key=lambda p: p.stat().st_size)


def _flip_one_bit(step_dir: Path) -> None:
  """One bit in the compressed data: it still decompresses, to other numbers (measured on the tiny model)."""
  f = _largest_data_file(step_dir)
  data = bytearray(f.read_bytes())
  data[len(data) // 2] ^= 4
  f.write_bytes(bytes(data))


@pytest.fixture
def restore(tmp_path):
  """upstream's load_state_if_possible under our seam; yields (call, restored steps seen by the hook)."""
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  import patches  # pylint: disable=import-outside-toplevel
  from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

  seen: list = []
  checkpoint_restore.apply(None, patches.Hooks(on_restored=seen.append))
  try:
    def call(manager, state=None):
      import jax  # pylint: disable=import-outside-toplevel

      abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                        state or _state(0))
      return checkpointing.load_state_if_possible(manager, None, "", "", 1, abstract, False, "synthetic")

    yield call, seen
  finally:
    checkpoint_restore.undo()


@pytest.mark.slow  # real orbax saves and restores
def test_restore_skips_damaged_checkpoints_down_to_the_last_good_one(tmp_path, restore, capsys):
  call, seen = restore
  run_dir = tmp_path / "run"
  manager = _saved_run(run_dir)
  _flip_one_bit(run_dir / "checkpoints" / "2")
  data = _largest_data_file(run_dir / "checkpoints" / "1")
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
  restored, _ = call(manager)
  np.testing.assert_array_equal(np.asarray(restored["items"]["params"]["w"]), np.asarray(_state(0)["params"]["w"]))
  assert seen == [0]
  out = capsys.readouterr().out
  assert (f"WARNING: checkpoint 2 of {run_dir} is damaged (the content of 1 arrays differs from its digest at save "
          "(first params/w): bytes changed on disk); set aside as checkpoints/2.unusable; trying checkpoint 1") in out
  assert f"WARNING: checkpoint 1 of {run_dir} is damaged (it does not load: " in out
  assert "OUT_OF_RANGE" in out and "set aside as checkpoints/1.unusable; trying checkpoint 0" in out
  assert "resumed from checkpoint step 0 instead (loaded, finite, digests as at save)" in out
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["0", "1.unusable", "2.unusable"]
  assert [c.step for c in manager.checkpoints] == [0]  # orbax's own list agrees: its next save is not refused


@pytest.mark.slow
def test_a_checkpoint_another_process_could_not_load_is_set_aside_by_all(tmp_path, restore, capsys, monkeypatch):
  """Simulated: process 1 of 2 failed to load checkpoint 2 (this one loaded it); the agreement says so, and this
  process sets it aside too and restores checkpoint 1, without checking digests the other would never join."""
  from patches import checkpoint_restore  # pylint: disable=import-outside-toplevel

  call, seen = restore
  run_dir = tmp_path / "run"
  manager = _saved_run(run_dir)
  asked = []
  monkeypatch.setattr(checkpoint_restore, "agree", lambda ok: asked.append(ok) or [ok, len(asked) > 1])
  restored, _ = call(manager)
  np.testing.assert_array_equal(np.asarray(restored["items"]["params"]["w"]), np.asarray(_state(1)["params"]["w"]))
  assert asked == [True, True] and seen == [1]
  assert (f"WARNING: checkpoint 2 of {run_dir} is damaged (it does not load on process 1 (its log says why)); set "
          "aside as checkpoints/2.unusable; trying checkpoint 1") in capsys.readouterr().out


@pytest.mark.slow
def test_with_every_checkpoint_damaged_the_run_starts_from_scratch_and_says_so(tmp_path, restore, capsys):
  call, seen = restore
  run_dir = tmp_path / "run"
  manager = _saved_run(run_dir, steps=(0, 1))
  shutil.rmtree(run_dir / "checkpoints" / "1" / "items" / "d")  # the tree metadata stays, the data is gone
  _flip_one_bit(run_dir / "checkpoints" / "0")
  assert call(manager) == (None, None) and seen == [None]
  out = capsys.readouterr().out
  assert f"WARNING: none of the 2 checkpoint(s) of {run_dir} could be restored: training starts at step 0" in out


@pytest.mark.slow
def test_a_changed_model_is_a_config_error_and_sets_nothing_aside(tmp_path, restore):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from MaxText.config import ConfigError  # pylint: disable=import-outside-toplevel

  call, seen = restore
  run_dir = tmp_path / "run"
  manager = _saved_run(run_dir)
  wider = {"params": {"w": jnp.zeros((256, 256)), "b": jnp.ones(8, jnp.bfloat16)}}
  with pytest.raises(ConfigError, match=r"resuming .* from checkpoint step 2: the model's shape changed: 'params/w' "
                                        r"is \(256, 128\) float32 in the checkpoint but \(256, 256\) float32"):
    call(manager, wider)
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["0", "1", "2"] and seen == []


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's abandoned reads, unquieted here
def test_orbax_load_errors_that_are_damage_and_those_that_are_not(tmp_path):
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  run_dir = tmp_path / "run"
  manager = _saved_run(run_dir, steps=(0, 1))
  (run_dir / "checkpoints" / "1" / "items" / "_METADATA").unlink()
  import jax  # pylint: disable=import-outside-toplevel

  abstract = {"items": jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(0))}
  with pytest.raises(Exception) as e:
    manager.load_checkpointables(1, abstract)
  assert "Metadata file (named _METADATA) does not exist" in checkpoint_records.damage(e.value)
  assert checkpoint_records.damage(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 80 GiB")) is None
  assert checkpoint_records.damage(ValueError("a sharding the mesh cannot hold")) is None
  assert checkpointing.latest_step(manager) == 1  # the damage is ours to judge: orbax still lists it


def test_a_save_cut_short_is_said_to_be_incomplete_and_skipped(tmp_path):
  """A crash during an async save leaves orbax's in-flight folder (<step>.orbax-checkpoint-tmp-*) beside the
  complete checkpoints; the resume skips it (orbax never lists it) and says so in one line of ours, where before
  only orbax's own warning hinted at it."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import records  # pylint: disable=import-outside-toplevel
  from MaxText.checkpoints import resume  # pylint: disable=import-outside-toplevel

  for step in (4, 8):  # our record goes before orbax starts: the cut-short step 8 has one too
    records.write_record(tmp_path, step, [("w", np.zeros(2, np.float32))], ["0" * 16])
  (tmp_path / "checkpoints" / "4" / "items").mkdir(parents=True)
  (tmp_path / "checkpoints" / "4" / "items" / "_METADATA").write_text("{}")
  (tmp_path / "checkpoints" / "4" / records.COMMIT_MARKER).write_text("")
  (tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp-1733471234").mkdir()
  said = "WARNING: the newest save, of step 8, was incomplete (checkpoints/8.orbax-checkpoint-tmp-1733471234: the "
  assert resume.set_aside_unusable(tmp_path, dry_run=True) == [
      said + "run ended while writing it) and would be skipped; the run resumes from checkpoint 4"]
  assert resume.set_aside_unusable(tmp_path) == [said + "run ended while writing it) and is skipped; the run "
                                                 "resumes from checkpoint 4"]
  assert resume.checkpoint_steps(tmp_path) == [4]
