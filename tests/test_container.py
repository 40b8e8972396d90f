"""The container's (and the GPU node's) Python install step, exercised for real.

No container engine runs in CI, so the image is mirrored instead:
- "the image": a fresh virtual environment that sees only the packages the
  manifest says the image provides (jax, flax, optax, orbax, transformers, ...)
  and their own dependencies, linked file by file from the project venv, so
  nothing else leaks in (nothing the wheelhouse carries or leaves out);
- the install step: scripts/wheelhouse builds the wheelhouse (the packages the
  image lacks, downloaded at the lock's versions, plus our own wheel), and
  `pip install --no-index --no-deps` puts it into that venv, which sees the image
  beside it, as INSTALL.txt tells a node to (the Dockerfile runs the same wheels
  through pip);
- then, from a neutral directory: `scripts/wheelhouse --verify`, docker/check_image.py's
  checks (manifest pins,
  MaxText resolving to the installed wheel, the training chain importing) and a
  2-step training run of the tiny config.
A package the plan wrongly leaves out fails the import or the run. What this
cannot show: the image's own versions (the mirror holds the lock's); the GPU run
from the wheelhouse covers those.

The wheelhouse step downloads about 55 MiB from PyPI (pip's cache makes
repeats cheap); a failed download is retried once.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
MANIFEST = yaml.safe_load((REPO / "docker" / "manifest.yaml").read_text())


def build_wheelhouse(out: Path) -> subprocess.CompletedProcess:
  cmd = [sys.executable, str(REPO / "scripts" / "wheelhouse"), "--out", str(out)]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode != 0 and "FAIL" not in proc.stderr:  # a network hiccup, not a finding
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  return proc


def image_closure(exclude: set[str]) -> list[str]:
  """The manifest's image packages plus what they need, as installed in this venv.

  The real image brings its packages' own dependencies (huggingface-hub's HTTP
  client, say), whether or not the manifest names them. `exclude` (what the
  wheelhouse carries, what it leaves out on purpose) never comes from the mirror.
  """
  env = {"extra": ""}
  todo = [canonicalize_name(n) for n in (*MANIFEST["wheelhouse"]["image_provided"], *MANIFEST["base_provides"])]
  seen: set[str] = set()
  while todo:
    name = todo.pop()
    if name in seen or name in exclude:
      continue
    try:
      dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
      continue  # on the image, not in our CPU venv (CUDA plugins, TE, ...): not needed on CPU
    seen.add(name)
    for line in dist.requires or []:
      req = Requirement(line)
      if req.marker is None or req.marker.evaluate(env):
        todo.append(canonicalize_name(req.name))
  return sorted(seen)


def mirror_image(view: Path, names: list[str]) -> None:
  """Links every file of these distributions (as installed in this venv) under `view`."""
  for name in names:
    dist = importlib.metadata.distribution(name)
    for f in dist.files or []:
      if ".." in Path(str(f)).parts:
        continue  # scripts in bin/
      src, dst = Path(dist.locate_file(f)), view / str(f)
      if src.exists() and not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src)


@pytest.mark.slow
def test_wheelhouse_on_a_mirror_of_the_image_imports_and_trains(tmp_path):
  wheelhouse = tmp_path / "wheelhouse"
  proc = build_wheelhouse(wheelhouse)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  wheels = sorted(wheelhouse.glob("*.whl"))
  assert any(w.name.startswith("maxtext_moe-") for w in wheels)
  assert not any(w.name.split("-")[0] in ("jax", "jaxlib", "flax", "numpy") for w in wheels)
  total = sum(w.stat().st_size for w in wheels)
  assert total <= MANIFEST["wheelhouse"]["max_mib"] * 2**20
  notes = (wheelhouse / "INSTALL.txt").read_text()
  assert "--no-index --no-deps" in notes and "venv --system-site-packages" in notes

  # The node's venv (no pip, no system site-packages) that sees only the image's packages.
  node = tmp_path / "node"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(node)], check=True)
  node_py = node / "bin" / "python"
  site_dir = Path(subprocess.run([node_py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 capture_output=True, text=True, check=True).stdout.strip())
  carried = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
  left_out = {canonicalize_name(n) for n in MANIFEST["wheelhouse"]["not_carried"]}
  image = image_closure(exclude=carried | left_out)
  assert {"jax", "flax", "transformers", "orbax-checkpoint"} <= set(image)
  mirror_image(tmp_path / "image", image)
  (site_dir / "image.pth").write_text(str(tmp_path / "image") + "\n")

  # The install step, as on the node: into the venv, no index, no dependency resolution.
  subprocess.run([sys.executable, "-m", "pip", "--python", str(node_py), "install", "-q", "--no-index", "--no-deps",
                  "--no-compile", *map(str, wheels)], check=True, capture_output=True)
  env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "home"), "PYTHONNOUSERSITE": "1"}
  proc = subprocess.run([node_py, str(REPO / "scripts" / "wheelhouse"), "--verify", "--out", str(wheelhouse)],
                        env=env, capture_output=True, text=True, check=False)
  assert proc.returncode == 0 and "verify: PASS" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]

  run_dir = tmp_path / "run"
  run_dir.mkdir()
  code = textwrap.dedent(f"""
      import sys, yaml
      sys.path.insert(0, {str(REPO / "docker")!r})
      import check_image
      manifest = yaml.safe_load(open({str(REPO / "docker" / "manifest.yaml")!r}))
      problems = check_image.problems(manifest, check_te=False)
      assert not problems, problems
      import MaxText
      assert MaxText.__file__.startswith({str(site_dir)!r}), MaxText.__file__
      from MaxText.run import main as train
      sys.exit(train.main([{str(REPO / "configs" / "deepseek3-tiny.yml")!r}, "steps=2", "checkpoint_period=2",
                           "base_output_directory={run_dir / "out"}", "run_name=tiny"]))
  """)
  proc = subprocess.run([node_py, "-c", code], cwd=run_dir, env=env, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  summary = json.loads((run_dir / "out" / "tiny" / "summary.json").read_text())
  assert summary["steps_completed"] == 2
  assert summary["final_loss"] < summary["first_loss"]


def test_the_image_check_accepts_only_the_te_series_the_adapters_were_checked_against(monkeypatch):
  monkeypatch.syspath_prepend(str(REPO / "docker"))
  import check_image  # pylint: disable=import-outside-toplevel

  want = check_image.Version("2.20.2")
  assert check_image.te_release_holds(want, "2.20.2") and check_image.te_release_holds(want, "2.20.5")
  assert not any(check_image.te_release_holds(want, v) for v in ("2.20.1", "2.21.0", "2.8.0", "not-a-version"))
  manifest = {"transformer_engine": "2.20.2"}
  assert check_image.te_warnings(manifest, {"transformer-engine": "2.20.2", "transformer-engine-jax": "2.20.3"}) == []
  (line,) = check_image.te_warnings(manifest, {"transformer-engine": "2.9.0.dev0"})
  assert line.startswith("transformer-engine 2.9.0.dev0 is not the 2.20.x series") and "will refuse it" in line
