"""What the Hugging Face tests share (tests/test_hf_export.py, tests/test_hf_families.py): the CLIs and both sides'
logits, each in its own process (tests/hf_logits.py), and a parameters checkpoint read back whole."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from conftest import REPO
from MaxText.hf import checkpoint


def hf_env_python() -> str:
  """.venv-hf's python (scripts/hf_env.sh builds it on first use; one builder at a time across pytest-xdist
  workers). A failed build fails the test that needs it."""
  with open(Path(tempfile.gettempdir()) / "maxtext-moe-hf-env.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    proc = subprocess.run([str(REPO / "scripts" / "hf_env.sh")], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.strip().splitlines()[-1]


def export(run_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "MaxText.export_hf", str(run_dir), str(out), *args], cwd=REPO,
                        capture_output=True, text=True, check=False)


def import_(hf_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "MaxText.import_hf", str(hf_dir), str(out), *args], cwd=REPO,
                        capture_output=True, text=True, check=False)


def ours(run_dir: Path, out: Path, *args: str, length: int | None = None) -> np.ndarray:
  more = ["--len", str(length)] if length else []
  proc = subprocess.run([sys.executable, "tests/hf_logits.py", "ours", str(run_dir), str(out), *args, *more], cwd=REPO,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return np.load(out)


def theirs(hf_python: str, hf_dir: Path, out: Path, architecture: str, length: int | None = None) -> np.ndarray:
  more = ["--len", str(length)] if length else []
  proc = subprocess.run([hf_python, "tests/hf_logits.py", "hf", str(hf_dir), str(out), *more], cwd=REPO,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"hf_logits: {architecture};" in proc.stdout, proc.stdout
  return np.load(out)


def imported(params: Path, out: Path, length: int | None = None) -> np.ndarray:
  """Our logits from what import_hf wrote (the model its import.json names)."""
  more = ["--len", str(length)] if length else []
  proc = subprocess.run([sys.executable, "tests/hf_logits.py", "imported", str(params), str(out), *more], cwd=REPO,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return np.load(out)


def make(hf_python: str, hf_dir: Path, architecture: str, **keys) -> Path:
  """A random model of transformers' `architecture` class, its config the class's defaults with `keys` over them,
  saved by transformers itself."""
  proc = subprocess.run([hf_python, "tests/hf_logits.py", "make", str(hf_dir), architecture, json.dumps(keys)],
                        cwd=REPO, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return hf_dir


def params_checkpoint(path: Path) -> dict[tuple[str, ...], np.ndarray]:
  """Every array of a parameters checkpoint (items/params/<collection>/...), keyed as a run's checkpoint is."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  meta = json.loads((path / "items" / "_METADATA").read_text())["tree_metadata"]
  out = {}
  for entry in meta.values():
    key = tuple(k["key"] for k in entry["key_metadata"])
    spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{path / 'items'}/",
                                           "path": ".".join(key) + "/"}}
    top = checkpoint.AUX if key[1] == "MoEBiasVar" else checkpoint.PARAMS
    out[top + key[2:]] = ts.open(spec).result().read().result()
  return out
