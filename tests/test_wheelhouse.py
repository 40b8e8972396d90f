"""scripts/wheelhouse: what a GPU node lacks, and nothing it already has.

All of these run without the network: the planner reads Requires-Dist from the
project venv (installed from the same lock), our own wheel builds offline, and
the packages the manifest leaves out are blocked while the training chain loads.
tests/test_container.py installs a real wheelhouse.
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


def fake_index(graph: dict[str, list[str]]):
  """requires_of over a made-up package graph; records what was asked."""
  asked = []

  def requires_of(name, version):
    asked.append((name, version))
    return graph.get(name, [])

  return requires_of, asked


def plan(roots, lock, image, graph, **kw):
  requires_of, asked = fake_index(graph)
  return wh.make_plan([Requirement(r) for r in roots], lock, image, requires_of, ENV, **kw), asked


# ---------------------------------------------------------------------------------------------
# The planner on small made-up graphs


def test_stops_at_what_the_image_provides():
  p, asked = plan(["app"], {"app": "1", "lib": "2", "deep": "3"}, {"lib": "2.0"},
                  {"app": ["lib>=1"], "lib": ["deep"]})
  assert p.carry == {"app": "1"}
  assert p.provided == {"lib": "2.0"}
  assert ("lib", "2") not in asked, "the image's own dependencies are the image's business"


def test_carries_the_lock_version_when_the_image_version_is_rejected():
  p, _ = plan(["app", "other"], {"app": "1", "other": "1", "lib": "5"}, {"lib": "4.0"},
              {"app": ["lib>=3"], "other": ["lib>=5"]})
  assert p.carry == {"app": "1", "other": "1", "lib": "5"}
  assert "lib" in p.replaced and "lib>=5" in p.replaced["lib"]
  assert "lib" not in p.provided


def test_unknown_image_versions_are_trusted():
  p, _ = plan(["app"], {"app": "1", "lib": "5"}, {"lib": None}, {"app": ["lib>=5"]})
  assert p.carry == {"app": "1"} and p.provided == {"lib": None}


def test_never_carry_and_not_carried():
  p, _ = plan(["app"], {"app": "1", "jax": "9", "huge": "1"}, {},
              {"app": ["jax==9", "huge"]}, never_carry=["jax"], not_carried={"huge": "why"})
  assert p.carry == {"app": "1"}
  assert p.not_carried == {"huge": "why"}


def test_markers_and_extras_are_evaluated_for_the_node():
  graph = {"app": ["winonly; sys_platform == 'win32'", "lib[fast]", "old; python_version < '3.10'"],
           "lib": ["fastdep; extra == 'fast'", "slowdep; extra == 'slow'"]}
  p, _ = plan(["app"], {"app": "1", "lib": "1", "fastdep": "1", "slowdep": "1", "winonly": "1", "old": "1"},
              {}, graph)
  assert set(p.carry) == {"app", "lib", "fastdep"}


def test_an_extra_asked_later_is_still_walked():
  graph = {"a": ["lib"], "b": ["lib[x]"], "lib": ["xdep; extra == 'x'"]}
  p, _ = plan(["a", "b"], {"a": "1", "b": "1", "lib": "1", "xdep": "1"}, {}, graph)
  assert "xdep" in p.carry


def test_missing_lock_pin_or_a_lock_that_fails_a_requirement_stops_the_build():
  with pytest.raises(SystemExit, match="not in requirements/lock.txt"):
    plan(["app"], {"app": "1"}, {}, {"app": ["ghost"]})
  with pytest.raises(SystemExit, match="lock pins lib==1"):
    plan(["app"], {"app": "1", "lib": "1"}, {}, {"app": ["lib>=2"]})


# ---------------------------------------------------------------------------------------------
# The real plan for the reference GPU image (metadata from the project venv)


@pytest.fixture(scope="module")
def real():
  manifest = wh.load_manifest()
  lock = wh.read_lock()
  image = wh.image_from_manifest(manifest)
  p = wh.make_plan(wh.runtime_requirements(), lock, image, wh.requires_from_installed, ENV,
                   not_carried=manifest["wheelhouse"]["not_carried"], never_carry=manifest["base_provides"])
  return manifest, lock, image, p


def test_real_plan_carries_the_pins_and_nothing_the_image_has(real):
  manifest, lock, image, p = real
  for name in ("maxtext", "tokamax"):
    assert p.carry[name] == manifest["pins"][name]
  for name in ("jax", "jaxlib", "flax", "optax", "transformers", "numpy", "orbax-checkpoint", "tensorboard",
               "tensorstore", "tiktoken", "sentencepiece", "protobuf"):
    assert name not in p.carry, f"{name} is on the image"
  assert all(lock[n] == v for n, v in p.carry.items()), "carried versions are the lock's"
  assert not set(p.carry) & set(p.not_carried)
  assert {n for n in p.carry if n in image} == set(p.replaced), "only replaced names may shadow the image"


def test_real_plan_is_closed_under_requires_dist(real):
  """Every carried package's requirements are carried, on the image, or deliberately left out."""
  manifest, _, image, p = real
  base = {wh.canonicalize_name(n) for n in manifest["base_provides"]}
  for name, version in p.carry.items():
    for line in wh.requires_from_installed(name, version):
      req = Requirement(line)
      dep = wh.canonicalize_name(req.name)
      if not wh.wanted(req, ENV, ()) or dep in p.not_carried or dep in base:
        continue
      if dep in p.carry:
        assert wh._meets(p.carry[dep], req), f"{name} needs {req}, carrying {p.carry[dep]}"
      else:
        assert dep in image, f"{name} needs {req}: neither carried nor on the image"
        assert image[dep] is None or wh._meets(image[dep], req), f"{name} needs {req}, image has {image[dep]}"


def test_left_out_packages_are_never_imported_by_the_training_chain(real):
  """The manifest's not_carried list is only safe if loading MaxText.train never imports them."""
  manifest = real[0]
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
  assert {"MaxText/train.py", "MaxText/config.py", "patches/__init__.py"} <= names
  assert not any("__pycache__" in n for n in names)
  assert {Requirement(r).name for r in wh.requires_from_wheel(whl)} >= {"maxtext", "tokamax", "jax"}


def test_check_finds_two_versions_and_stale_wheels(tmp_path):
  p = wh.Plan(carry={"a": "1"}, provided={}, replaced={}, not_carried={}, required_by={})
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
