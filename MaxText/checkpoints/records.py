"""What makes a step directory a checkpoint we resume from, and how its content is checked.

A step counts only when orbax's commit marker (`checkpoints/<step>/commit_success.txt`, written last,
before the rename that makes the step final), its tree metadata (`items/_METADATA`) and our own record
(`<run>/maxtext-moe/checkpoints/<step>.json`) are all there. The record is written by
patches/checkpoint_guard.py before orbax starts the save, from the very state it saves: each array's
shape, dtype and content digest. A directory that lacks any of these (an empty `checkpoints/99/`, a
deleted `items/`, a save killed before its commit) is never resumed from; a run sets it aside
(`<step>.unusable`, its files kept) so that neither orbax's step list nor its next save trips on it.

The digest is two 32-bit sums over an array's bits, each element weighted by its row-major position
(uint32 arithmetic, so modulo 2^32): exact whatever the sharding or the order XLA reduces in, and one
flipped bit anywhere changes the first sum (it moves by 2^k times an odd weight, never 0 mod 2^32).
It is computed in the same pass as the finite check the guard already made before each save (one
variadic reduction per array, which reads it once), and again on the restored arrays
(patches/checkpoint_restore.py). That pass is faster than the finite check alone was
(tools/bench_checkpoint_digest.py at 9df0284, which measured it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

RUN_FILES = "maxtext-moe"  # MaxText/checkpoints/resume.py's folder of our files in the run directory
RECORDS = "checkpoints"  # <run>/maxtext-moe/checkpoints/<step>.json
COMMIT_MARKER = "commit_success.txt"  # orbax's (orbax.checkpoint _src/path/atomicity_types.COMMIT_SUCCESS_FILE)
SET_ASIDE = ".unusable"  # suffix of a step directory that is not a checkpoint: no digit name, so orbax skips it
DIGEST = "u32 position-weighted sums of every array"  # what a record's digests are; another kind is not compared
# Records written before integer arrays were digested (the optimizer's step counts, RNG keys and counters): the
# same sums, of the float arrays only; a resume checks those.
DIGEST_FLOATS = "u32 position-weighted sums"


class RecordError(ValueError):
  """A checkpoint record that is missing or cannot be read."""


def record_path(run_dir: Path, step: int) -> Path:
  return run_dir / RUN_FILES / RECORDS / f"{step}.json"


def step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
  """Every directory under checkpoints/ named by a step number, oldest first (what orbax lists)."""
  root = run_dir / "checkpoints"
  if not root.is_dir():
    return []
  return sorted((int(p.name), p) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def read_record(run_dir: Path, step: int) -> dict[str, Any]:
  path = record_path(run_dir, step)
  try:
    record = json.loads(path.read_text())
  except FileNotFoundError:
    raise RecordError(f"no record of ours ({path})") from None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise RecordError(f"our record {path} cannot be read ({' '.join(str(e).split())[:80]})") from None
  arrays = record.get("arrays") if isinstance(record, dict) else None
  if not isinstance(arrays, dict) or record.get("step") != step or not all(
      isinstance(a, dict) and {"shape", "dtype", "digest"} <= set(a) for a in arrays.values()):
    raise RecordError(f"our record {path} is not a checkpoint record of step {step}")
  return record


def problem(run_dir: Path, step: int) -> str | None:
  """Why checkpoints/<step> is not a checkpoint to resume from; None when it is one."""
  step_dir = run_dir / "checkpoints" / str(step)
  if not (step_dir / COMMIT_MARKER).is_file():
    return f"no orbax commit marker ({COMMIT_MARKER}): the save never completed"
  if not (step_dir / "items" / "_METADATA").is_file():
    return "its items/_METADATA is missing"
  try:
    read_record(run_dir, step)
  except RecordError as e:
    return str(e)
  return None


def complete_steps(run_dir: Path) -> list[int]:
  return [step for step, _ in step_dirs(run_dir) if problem(run_dir, step) is None]


def set_aside(run_dir: Path, step: int) -> Path:
  """Renames checkpoints/<step> out of orbax's sight, keeping its files; returns the new path."""
  step_dir = run_dir / "checkpoints" / str(step)
  target = step_dir.with_name(f"{step}{SET_ASIDE}")
  n = 1
  while target.exists():
    n += 1
    target = step_dir.with_name(f"{step}{SET_ASIDE}{n}")
  step_dir.rename(target)
  return target


def shapes_of(record: dict[str, Any]) -> dict[str, list]:
  """{array: [shape, dtype]} (patches/checkpoint_restore.first_difference's form)."""
  return {name: [a["shape"], a["dtype"]] for name, a in record["arrays"].items()}


# --- the one pass over the state: finite flags and digests ---------------------------------------


def _position_u32(shape: tuple[int, ...]):
  """Each element's row-major index, modulo 2^32, built from iotas (keeps the array's sharding)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
    stride *= shape[dim]
  return index


def is_float(x) -> bool:
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def covered(record: dict[str, Any], named: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
  """The arrays of `named` a record vouches for: every one, or the float ones for a DIGEST_FLOATS record."""
  return [(n, x) for n, x in named if is_float(x)] if record.get("digest") == DIGEST_FLOATS else list(named)


def _as_bits(x):
  """An array whose bytes are x's, in a type bitcast takes: an RNG key's data (uint32), a bool as uint8."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(x)
  return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x


def _digest_and_nonfinite(x):
  """uint32[3]: sum(bits * (2i + 1)) and sum(bits ^ (i * golden)), both mod 2^32, and the count of non-finite
  elements, in one variadic reduction: one read of the array (three separate sums read it three times, 30x
  slower on CPU: tools/bench_checkpoint_digest.py at 9df0284)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  x = _as_bits(x)
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  bits_X = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)  # 8-byte types gain a trailing dim of 2
  i_X = _position_u32(bits_X.shape)
  nonfinite_X = (jnp.logical_not(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else
                 jnp.zeros(x.shape, bool)).astype(jnp.uint32)
  if bits_X.ndim > x.ndim:
    nonfinite_X = jnp.broadcast_to(nonfinite_X[..., None], bits_X.shape) & (i_X & 1)  # counted once per element
  zero = jnp.uint32(0)
  sums = jax.lax.reduce((bits_X * (i_X * jnp.uint32(2) + jnp.uint32(1)), bits_X ^ (i_X * jnp.uint32(0x9E3779B1)),
                         nonfinite_X), (zero, zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2]),
                        tuple(range(bits_X.ndim)))
  return jnp.stack(sums)


def _scan(arrays):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  return jnp.stack([_digest_and_nonfinite(x) for x in arrays])


_scan_jit = None


def scan(arrays: Sequence[Any]) -> tuple[list[bool], list[str]]:
  """(finite, digest as 16 hex digits) per array, in one jitted pass (jit's cache keys on shapes and
  shardings, so a run compiles it once)."""
  global _scan_jit
  if not arrays:
    return [], []
  if _scan_jit is None:
    import jax  # pylint: disable=import-outside-toplevel

    _scan_jit = jax.jit(_scan)
  import numpy as np  # pylint: disable=import-outside-toplevel

  sums_N3 = np.asarray(_scan_jit(list(arrays)))
  return [int(n) == 0 for n in sums_N3[:, 2]], [f"{int(a):08x}{int(b):08x}" for a, b in sums_N3[:, :2]]


def write_record(run_dir: Path, step: int, named: Sequence[tuple[str, Any]], digests: Sequence[str]) -> Path:
  """Atomically (temporary file, then rename): a reader sees a whole record or none."""
  path = record_path(run_dir, step)
  path.parent.mkdir(parents=True, exist_ok=True)
  arrays = {name: {"shape": list(x.shape), "dtype": str(x.dtype), "digest": d} for (name, x), d in zip(named, digests)}
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  try:
    tmp.write_text(json.dumps({"step": int(step), "digest": DIGEST, "arrays": arrays}, indent=1))
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)
  return path


IN_FLIGHT = ".orbax-checkpoint-tmp"  # orbax's name for a step it is still writing (<step>.orbax-checkpoint-tmp*)


def drop_stale_records(run_dir: Path) -> None:
  """Records of steps whose directory orbax has since deleted (max_num_checkpoints_to_keep).

  Only records of steps older than the newest committed checkpoint go, and never one whose step still has a
  directory under either name: with async_checkpointing orbax writes `<step>.orbax-checkpoint-tmp*` in the
  background and renames it to `<step>` when it commits, seconds after the save call returned. A record dropped
  then leaves a committed step that no resume takes (every checkpoint of an async run was set aside as "no record
  of ours" before this rule)."""
  root = run_dir / "checkpoints"
  committed = [step for step, path in step_dirs(run_dir) if (path / COMMIT_MARKER).is_file()]
  folder = run_dir / RUN_FILES / RECORDS
  if not committed or not folder.is_dir():
    return
  for path in folder.glob("*.json"):
    step = int(path.stem) if path.stem.isdigit() else None
    if step is None or step >= committed[-1] or (root / str(step)).exists():
      continue
    if not any(root.glob(f"{step}{IN_FLIGHT}*")):
      path.unlink(missing_ok=True)


def mismatch(record: dict[str, Any], named: Sequence[tuple[str, Any]], finite: Sequence[bool],
             digests: Sequence[str]) -> str | None:
  """Why restored arrays are not the ones the record describes; None when they are."""
  nonfinite = [name for (name, _), ok in zip(named, finite) if not ok]
  if nonfinite:
    return f"it holds non-finite values in {len(nonfinite)} arrays (first {nonfinite[0]})"
  if record.get("digest") not in (DIGEST, DIGEST_FLOATS):
    return None
  arrays = record["arrays"]
  names = [name for name, _ in named]
  missing = [name for name in arrays if name not in set(names)]
  extra = [name for name in names if name not in arrays]
  if missing or extra:  # a key path that drifted: the digests below would compare nothing for it
    first = f"'{missing[0]}' was recorded but not restored" if missing else f"'{extra[0]}' was restored but not recorded"
    return f"its arrays are not those recorded at save ({len(missing)} missing, {len(extra)} extra; first {first})"
  differ = [name for (name, _), d in zip(named, digests) if name in arrays and arrays[name]["digest"] != d]
  if differ:
    return (f"the content of {len(differ)} arrays differs from its digest at save (first {differ[0]}): "
            "bytes changed on disk")
  return None


# The words of a load failure that is the checkpoint's own damage (tensorstore's status codes through
# orbax, orbax's layout errors); anything else (out of memory, a sharding the devices cannot hold) is
# not blamed on the checkpoint.
DAMAGE_WORDS = ("OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION", "NOT_FOUND", "No valid PyTree checkpointable",
                "ZSTD", "Error reading", "Error opening", "Invalid checkpoint")
NOT_DAMAGE_WORDS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")


def damage(e: BaseException) -> str | None:
  """The checkpoint's own damage behind a restore error, in a few words; None: something else failed."""
  chain, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    chain.append(e)
    e = e.__cause__ or e.__context__
  texts = [" ".join(str(x).split()) for x in chain]
  if any(w in t for t in texts for w in NOT_DAMAGE_WORDS):
    return None
  for x, text in zip(reversed(chain), reversed(texts)):  # the innermost cause says what was wrong
    if isinstance(x, (FileNotFoundError, json.JSONDecodeError)) or any(w in text for w in DAMAGE_WORDS):
      return f"{type(x).__name__}: {text[:160]}"
  return None
