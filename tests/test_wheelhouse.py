"""scripts/wheelhouse: what a GPU node lacks, and nothing it already has.

All but the two real-plan tests (slow: pip resolves against PyPI) run without the
network: pip's resolver runs offline over made-up find-links indexes, our own wheel
builds offline, and the packages the manifest leaves out are blocked while the
training chain loads. tests/test_container.py installs a real wheelhouse.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from conftest import load_script

REPO = Path(__file__).resolve().parent.parent


def load_wheelhouse():
  """scripts/wheelhouse (an executable without .py) as a module."""
  return load_script("wheelhouse_script", "scripts/wheelhouse")


wh = load_wheelhouse()
ENV = wh.target_environment("3.12")


TARGET = wh.pip_target("3.12", ["manylinux2014_x86_64"])


def fake_index(folder: Path, graph: dict[str, list[str]], versions: dict[str, list[str]]) -> Path:
  """A find-links folder of metadata-only wheels: name -> Requires-Dist, at every version listed."""
  folder.mkdir()
  for name, vs in versions.items():
    for v in vs:
      dist = f"{name.replace('-', '_')}-{v}"
      with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        requires = "".join(f"Requires-Dist: {r}\n" for r in graph.get(name, []))
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n{requires}")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
  return folder


def plan(tmp_path, roots, lock, image, graph, base=(), not_carried=None):
  """pip's real resolve, offline, over a made-up index holding every lock version and 1, 4.0, 5."""
  index = fake_index(tmp_path / "index", graph, {n: sorted({v, "1", "4.0", "5"}) for n, v in lock.items()})
  return wh.make_plan([Requirement(r) for r in roots], lock, image, list(base), not_carried or {}, TARGET,
                      [index], offline=True)


# ---------------------------------------------------------------------------------------------
# The plan: pip's resolver on small made-up indexes (no network)


def test_stops_at_what_the_image_provides_and_trusts_unknown_versions(tmp_path):
  graph = {"app": ["lib>=1", "known>=4", "deep-needer"], "lib": ["deep"], "known": ["deep"], "deep-needer": []}
  p = plan(tmp_path, ["app"], {"app": "1", "lib": "5", "deep": "1", "known": "5", "deep-needer": "1"},
           {"lib": None, "known": "4.0"}, graph)
  assert p.carry == {"app": "1", "deep-needer": "1"}, "the image's own dependencies are the image's business"
  assert p.provided == {"lib": None, "known": "4.0"} and not p.replaced


def test_carries_the_lock_version_when_the_image_version_is_rejected(tmp_path):
  p = plan(tmp_path, ["app", "other"], {"app": "1", "other": "1", "lib": "5"}, {"lib": "4.0"},
           {"app": ["lib>=3"], "other": ["lib>=5"]})
  assert p.carry == {"app": "1", "other": "1", "lib": "5"}
  assert "lib" in p.replaced and "4.0" in p.replaced["lib"]
  assert "lib" not in p.provided


def test_base_and_not_carried_are_never_carried_nor_walked(tmp_path):
  graph = {"app": ["jax==9", "huge[gcs]", "winonly; sys_platform == 'win32'"], "jax": ["jaxdep"],
           "huge": ["hugedep", "gcsdep; extra == 'gcs'"]}
  lock = {"app": "1", "jax": "9", "jaxdep": "1", "huge": "1", "hugedep": "1", "gcsdep": "1", "winonly": "1"}
  p = plan(tmp_path, ["app"], lock, {}, graph, base=["jax"], not_carried={"huge": "why"})
  assert p.carry == {"app": "1"}
  assert p.not_carried == {"huge": "why"}


def test_an_unlocked_package_or_a_lock_that_fails_a_requirement_stops_the_build(tmp_path):
  with pytest.raises(SystemExit, match="ghost is needed but not in requirements/lock.txt"):
    wh.make_plan([Requirement("app")], {"app": "1"}, {}, [], {}, TARGET,
                 [fake_index(tmp_path / "a", {"app": ["ghost"]}, {"app": ["1"], "ghost": ["1"]})], offline=True)
  with pytest.raises(SystemExit, match="pip cannot resolve"):
    plan(tmp_path, ["app"], {"app": "1", "lib": "1"}, {}, {"app": ["lib>=2"]})


def test_stand_ins_prefer_the_image_and_skip_what_pip_cannot_name(tmp_path):
  given = wh.stand_ins({"a": "1", "jax": "0.11.2", "big": "3"}, {"a": "2", "b": None, "jax": "0.11.2.dev1+cuda",
                                                               "odd": "not a version"}, ["jax"], {"big": "why"})
  assert given == {"a": "2", "jax": "0.11.2", "big": "3"}, "base at the lock's version; unknown, unlocked b: none"
  wh.write_stand_in(tmp_path, "some-pkg", "1.0.dev1+local", wh.best_tag(TARGET))
  (whl,) = tmp_path.glob("*.whl")
  assert whl.name == "some_pkg-1.0.dev1+local-0given-cp312-cp312-manylinux2014_x86_64.whl"
  assert wh.requires_from_wheel(whl) == []


# ---------------------------------------------------------------------------------------------
# The real plan for the reference GPU image (pip resolves against PyPI)


@pytest.fixture(scope="module")
def real():
  manifest = wh.load_manifest()
  lock = wh.read_lock()
  image = wh.image_from_manifest(manifest)
  p = wh.make_plan(wh.runtime_requirements(), lock, image, manifest["base_provides"],
                   manifest["wheelhouse"]["not_carried"], wh.pip_target("3.12", manifest["wheelhouse"]["platforms"]))
  return manifest, lock, image, p


@pytest.mark.slow  # reaches PyPI
def test_real_plan_carries_the_pins_and_nothing_the_image_has(real):
  manifest, lock, image, p = real
  for name in ("maxtext", "tokamax"):
    assert p.carry[name] == manifest["pins"][name]
  for name in ("jax", "jaxlib", "flax", "optax", "transformers", "numpy", "orbax-checkpoint", "tensorboard",
               "tensorstore", "tiktoken", "sentencepiece", "protobuf", "scipy"):
    assert name not in p.carry, f"{name} is on the image"
  assert all(lock[n] == v for n, v in p.carry.items()), "carried versions are the lock's"
  assert not set(p.carry) & set(p.not_carried)
  assert {n for n in p.carry if n in image} == set(p.replaced), "only replaced names may shadow the image"


@pytest.mark.slow  # reaches PyPI
def test_real_plan_is_closed_under_requires_dist(real):
  """Every carried package's requirements (as installed here, from the same lock) are
  carried, on the image, or deliberately left out: pip's answer, checked independently."""
  manifest, _, image, p = real
  base = {wh.canonicalize_name(n) for n in manifest["base_provides"]}
  for name, version in p.carry.items():
    assert wh.importlib.metadata.version(name) == version
    for line in wh.importlib.metadata.requires(name) or []:
      req = Requirement(line)
      dep = wh.canonicalize_name(req.name)
      if not wh.wanted(req, ENV) or dep in p.not_carried or dep in base:
        continue
      if dep in p.carry:
        assert wh._meets(p.carry[dep], req), f"{name} needs {req}, carrying {p.carry[dep]}"
      else:
        assert dep in image, f"{name} needs {req}: neither carried nor on the image"
        assert image[dep] is None or wh._meets(image[dep], req), f"{name} needs {req}, image has {image[dep]}"


@pytest.mark.slow  # imports the whole training chain in a child, 30 s: the slow tier (scripts/test.sh --all, CI) runs it
def test_left_out_packages_are_never_imported_by_the_training_chain():
  """The manifest's not_carried list is only safe if loading MaxText.train never imports them."""
  manifest = wh.load_manifest()
  blocked = sorted(top_level_modules(n) for n in manifest["wheelhouse"]["not_carried"])
  assert blocked, "nothing left out?"
  code = textwrap.dedent(f"""
      import importlib.abc, sys
      BLOCKED = {sorted(m for mods in blocked for m in mods)!r}
      class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
          if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{{name}} is left out of the wheelhouse but was imported")
      sys.meta_path.insert(0, Block())
      import MaxText.train, patches, tokamax
      from maxtext.trainers.pre_train import train
      from maxtext.layers import moe
      print("imported", len(sys.modules), "modules")
  """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]


def top_level_modules(dist_name: str) -> list[str]:
  """The importable packages a distribution installs, from its RECORD (namespace-aware)."""
  dist = wh.importlib.metadata.distribution(dist_name)
  packages = set()
  for f in dist.files or []:
    parts = Path(str(f)).parts
    if ".." in parts or parts[0].endswith((".dist-info", ".data")):
      continue
    if parts[-1] == "__init__.py":
      packages.add(".".join(parts[:-1]))
    elif len(parts) == 1 and parts[0].endswith(".py"):
      packages.add(parts[0][:-3])
  return sorted(p for p in packages if p.rpartition(".")[0] not in packages)


def test_top_level_modules_of_a_namespace_package_is_the_subpackage():
  mods = top_level_modules("google-cloud-storage")
  assert "google.cloud.storage" in mods
  assert not {"google", "google.cloud"} & set(mods), "blocking those would block protobuf too"


# ---------------------------------------------------------------------------------------------
# Our own wheel and the install notes


def test_own_wheel_builds_offline_from_a_clean_copy(tmp_path):
  whl = wh.build_own_wheel(tmp_path)
  assert wh.wheel_name(whl)[0] == wh.OWN_NAME
  with zipfile.ZipFile(whl) as zf:
    names = set(zf.namelist())
  assert {"MaxText/train.py", "MaxText/config/loader.py", "patches/__init__.py"} <= names
  assert not any("__pycache__" in n for n in names)
  assert {Requirement(r).name for r in wh.requires_from_wheel(whl)} >= {"maxtext", "tokamax", "jax"}


def test_check_finds_two_versions_and_stale_wheels(tmp_path):
  p = wh.Plan(carry={"a": "1"}, provided={}, replaced={}, not_carried={})
  for name in ("a-1-py3-none-any.whl", "a-2-py3-none-any.whl", "zzz-1-py3-none-any.whl"):
    with zipfile.ZipFile(tmp_path / name, "w") as zf:
      zf.writestr(f"{name.split('-')[0]}-{name.split('-')[1]}.dist-info/METADATA", "Name: x\n")
  problems = wh.check_wheelhouse(tmp_path, p, {}, ENV, own=False)
  assert any("two versions of a" in m for m in problems)
  assert any("unplanned wheel zzz" in m for m in problems)


def test_verify_reports_requirements_the_node_does_not_meet(tmp_path):
  def wheel(name, requires):
    with zipfile.ZipFile(tmp_path / f"{name}-1-py3-none-any.whl", "w") as zf:
      meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
      zf.writestr(f"{name}-1.dist-info/METADATA", f"Name: {name}\n{meta}")

  wheel("ok", ["packaging", "absent-left-out", "winonly; sys_platform == 'win32'"])
  assert wh.verify_installed(tmp_path, {"absent-left-out": "why"}) == []
  wheel("bad", ["packaging>=999", "surely-not-installed-anywhere"])
  problems = wh.verify_installed(tmp_path, {"absent-left-out": "why"})
  assert len(problems) == 2 and "packaging>=999" in problems[0] and "not installed" in problems[1]
