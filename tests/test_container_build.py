"""scripts/build_container.sh's choices and refusals, with every engine it can see controlled by the test, and
(slow, where podman and mmdebstrap are installed) the real build on the CPU stand-in base with its smoke stage.

The engine tests put only fakes and the tools the script itself uses on PATH: a test that kept /usr/bin on PATH
would see whatever docker or podman the machine has (podman installed once made the old test pick it and try to
pull the NGC base).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "build_container.sh"
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
# What build_container.sh runs besides an engine (bash itself is started by absolute path).
SCRIPT_TOOLS = ("dirname", "awk", "sed", "head", "mktemp", "stat", "grep", "tee", "rm", "cat", "realpath", "tail")


def fake_bin(tmp_path: Path, engines: dict[str, str]) -> dict[str, str]:
  """A PATH holding the script's tools and, per engine name, a fake whose body is the given shell text."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  for tool in SCRIPT_TOOLS:
    if not (bin_dir / tool).exists() and shutil.which(tool):
      (bin_dir / tool).symlink_to(shutil.which(tool))
  for name, body in engines.items():
    (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / name).chmod(0o755)
  return {"PATH": str(bin_dir), "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}


def build(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["/bin/bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, check=False,
                        timeout=60)


DOCKER_DOWN = "echo 'Cannot connect to the Docker daemon' >&2; exit 1"
PODMAN_BROKEN = "echo 'cannot set up namespace' >&2; exit 125"


def test_no_engine_answering_is_one_line_naming_each_engine_seen(tmp_path):
  proc = build(fake_bin(tmp_path, {"docker": DOCKER_DOWN}))
  assert proc.returncode == 1
  assert "docker CLI is installed but no Docker engine answers" in proc.stderr, proc.stderr
  assert "podman" not in proc.stderr.split("Build on")[0]  # none on this PATH, so none named

  proc = build(fake_bin(tmp_path, {"podman": PODMAN_BROKEN}))
  assert proc.returncode == 1 and "podman is installed but 'podman info' fails" in proc.stderr, proc.stderr

  (tmp_path / "bin" / "docker").unlink()
  (tmp_path / "bin" / "podman").unlink()
  proc = build(fake_bin(tmp_path, {}))
  assert proc.returncode == 1 and "neither docker nor podman is installed" in proc.stderr, proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1


def test_podman_is_chosen_when_docker_is_down_and_builds_the_runtime_target(tmp_path):
  calls = tmp_path / "podman-calls"
  env = fake_bin(tmp_path, {"docker": DOCKER_DOWN, "podman": f'echo "$*" >> {calls}; exit 0'})
  proc = build(env, "--isolation", "chroot")
  assert proc.returncode == 0, proc.stderr
  builds = [line for line in calls.read_text().splitlines() if line.startswith("build ")]
  assert len(builds) == 1, builds  # no smoke stage unless asked
  assert "--isolation=chroot" in builds[0] and "--target runtime" in builds[0]
  assert "BASE_IMAGE=ghcr.io/nvidia/jax:" in builds[0]  # the real base stays the default


def test_standin_builds_the_image_then_its_cpu_smoke_stage_under_a_name_apart(tmp_path):
  calls = tmp_path / "podman-calls"
  env = fake_bin(tmp_path, {"podman": f'echo "$*" >> {calls}; exit 0'})  # `image exists` answers yes
  proc = build(env, "--standin")
  assert proc.returncode == 0, proc.stderr
  builds = [line for line in calls.read_text().splitlines() if line.startswith("build ")]
  assert [b.split("--target ")[1].split()[0] for b in builds] == ["runtime", "smoke-cpu"]
  assert all("BASE_IMAGE=localhost/maxtext-moe-standin-base:" in b for b in builds)
  assert "-t maxtext-moe-standin:" in builds[0] and "-t maxtext-moe:" not in builds[0]
  # The smoke's RUN always runs: a cached one prints nothing (CI once built a --no-cache runtime whose layers
  # hashed to the cached ones, and the smoke stage came from the cache).
  assert "SMOKE_RUN=" in builds[1] and "SMOKE_RUN=" not in builds[0]


@pytest.mark.parametrize("args, says", [
    (["--engine", "containerd"], "--engine containerd: must be docker or podman"),
    (["--isolation", "vm"], "--isolation vm: must be chroot or oci"),
    (["--engine", "docker", "--isolation", "chroot"], "--isolation is podman's"),
    (["--standin", "--base", "debian:12"], "--standin and --base both name the base"),
    (["--frobnicate"], "unknown argument: --frobnicate"),
    (["--engine"], "--engine needs a value: docker or podman"),  # before: bash's "2: parameter null or not set"
    (["--engine", "--dry-run"], "--engine needs a value: docker or podman"),
    (["--isolation"], "--isolation needs a value: chroot or oci"),
    (["--base"], "--base needs an image"),
    (["--sqsh"], "--sqsh needs a file name"),
])
def test_wrong_input_is_one_line_with_exit_2(tmp_path, args, says):
  proc = build(fake_bin(tmp_path, {}), *args)
  assert proc.returncode == 2 and says in proc.stderr, proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""


def test_standin_without_podman_speaks_of_podman_alone(tmp_path):
  """--standin builds with podman: its absence is the line, not docker's daemon (before: "no container engine
  available: the docker CLI is installed but no Docker engine answers ...")."""
  proc = build(fake_bin(tmp_path, {"docker": DOCKER_DOWN}), "--standin")
  assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert "--standin (it builds with podman): podman is not installed" in proc.stderr
  assert "docker" not in proc.stderr.lower()
  proc = build(fake_bin(tmp_path, {"docker": DOCKER_DOWN, "podman": PODMAN_BROKEN}), "--standin")
  assert proc.returncode == 1 and "--standin (it builds with podman): 'podman info' fails" in proc.stderr
  assert "docker" not in proc.stderr.lower()
  (tmp_path / "bin" / "docker").unlink()
  proc = build(fake_bin(tmp_path, {"podman": "exit 0"}), "--engine", "docker")
  assert proc.returncode == 1 and "--engine docker: docker is not installed" in proc.stderr, proc.stderr


def test_the_build_labels_the_image_with_its_version_and_commit():
  """The Dockerfile's last step labels the image with the release and the commit the script passes: the checkout's
  HEAD, with -dirty when it has changes not committed."""
  proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True, timeout=60)
  head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                        check=True).stdout.strip()
  dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"], check=False).returncode != 0
  version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
  assert f"--build-arg VERSION={version} --build-arg REVISION={head}{'-dirty' if dirty else ''} " in proc.stdout
  runtime = DOCKERFILE.split("FROM base AS runtime")[1].split("\nFROM ")[0]
  assert 'org.opencontainers.image.version="${VERSION}"' in runtime
  assert 'org.opencontainers.image.revision="${REVISION}"' in runtime


def test_the_entrypoint_runs_a_command_as_given_and_trains_on_a_config(tmp_path):
  runtime = DOCKERFILE.split("FROM base AS runtime")[1].split("\nFROM ")[0]
  assert 'ENTRYPOINT ["/opt/maxtext-moe/docker/entrypoint.sh"]' in runtime and "COPY docker/ docker/" in runtime
  entrypoint = REPO / "docker" / "entrypoint.sh"
  assert os.access(entrypoint, os.X_OK)
  env = fake_bin(tmp_path, {"python3": 'echo "python3 $*"'})
  env["PATH"] += ":" + os.path.dirname(shutil.which("bash"))
  run = lambda *args: subprocess.run([str(entrypoint), *args], capture_output=True, text=True, env=env,  # noqa: E731
                                     check=False, timeout=30)
  assert run("configs/deepseek3-tiny.yml", "steps=3").stdout == "python3 -m MaxText.train " \
                                                               "configs/deepseek3-tiny.yml steps=3\n"
  assert run("python3", "-m", "MaxText.plan", "x").stdout == "python3 -m MaxText.plan x\n"
  proc = run()
  assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "no command given" in proc.stderr


def test_a_failed_build_is_one_line_with_its_known_cause(tmp_path):
  for output, cause in [
      ("maxtext-moe: the base image has Python 3.11; maxtext 0.2.5 needs 3.12", "has Python 3.11"),
      ("write /var/lib/containers/storage/x: no space left on device", "no space left on device"),
  ]:
    podman = f'case "$1" in build) echo "STEP 3/9: RUN ..."; echo "{output}"; exit 1 ;; *) exit 0 ;; esac'
    proc = build(fake_bin(tmp_path, {"podman": podman}), "--engine", "podman")
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("build_container: error: the image's build failed: ") and cause in last, last


def test_the_dockerfile_refuses_a_base_without_python_312_in_one_line_the_script_repeats():
  dockerfile = (REPO / "docker" / "Dockerfile").read_text()
  base_stage = dockerfile.split("FROM ${BASE_IMAGE} AS base")[1].split("\nFROM ")[0]
  assert "sys.version_info" in base_stage and '"maxtext-moe: the base image has Python' in base_stage
  smoke = dockerfile.split("FROM runtime AS smoke-cpu")[1]
  assert "SMOKE_DEVICE=cpu" in smoke and "docker/smoke.sh" in smoke


@pytest.mark.slow  # two imports of the whole training chain: 15 s
def test_check_image_on_the_standin_skips_te_and_still_checks_every_pin(tmp_path):
  marker = tmp_path / "maxtext-moe-standin"
  marker.write_text("stand-in\n")
  check = [sys.executable, str(REPO / "docker" / "check_image.py")]
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  on_standin = subprocess.run([*check, "--standin-marker", str(marker)], capture_output=True, text=True, env=env,
                              check=False, timeout=300)
  assert "check_image: SKIP: transformer-engine on the stand-in base" in on_standin.stdout
  assert "transformer-engine: not installed" not in on_standin.stdout
  # Any other pin is still held: a manifest that pins another jax fails there too.
  manifest = (REPO / "docker" / "manifest.yaml").read_text().replace('jax: "0.11.2"', 'jax: "0.11.1"')
  (tmp_path / "manifest.yaml").write_text(manifest)
  wrong_jax = subprocess.run([*check, "--standin-marker", str(marker), "--manifest", str(tmp_path / "manifest.yaml")],
                             capture_output=True, text=True, env=env, check=False, timeout=300)
  assert wrong_jax.returncode == 1 and "check_image: FAIL: jax: manifest pins 0.11.1" in wrong_jax.stdout


def test_smoke_refuses_an_unknown_device_before_running_anything(tmp_path):
  proc = subprocess.run(["bash", str(REPO / "docker" / "smoke.sh")], capture_output=True, text=True, check=False,
                        env={**os.environ, "SMOKE_DEVICE": "tpu", "SMOKE_OUT": str(tmp_path)}, timeout=60)
  assert proc.returncode == 2 and "SMOKE_DEVICE=tpu: must be gpu or cpu" in proc.stderr and proc.stdout == ""


CAN_BUILD = bool(shutil.which("podman") and shutil.which("mmdebstrap")) and os.geteuid() == 0


@pytest.mark.slow
@pytest.mark.skipif(not CAN_BUILD, reason="needs root, podman and mmdebstrap (apt-get install podman mmdebstrap)")
def test_the_real_build_on_the_standin_passes_check_image_and_the_cpu_smoke(tmp_path):
  # docs/container.md's command, in a copy of this checkout (the build's wheelhouse/ is the full set, which
  # would replace a GPU call's). --no-cache: cached layers print nothing, and the checks must run. About 4
  # minutes on 2 cores once the stand-in base exists (scripts/standin_base.sh, about 2 more).
  repo = tmp_path / "repo"
  at_root = {".git", ".venv", "wheelhouse", "outputs", ".pytest_cache"}  # scripts/wheelhouse stays
  shutil.copytree(REPO, repo, symlinks=True, ignore=lambda folder, names: [
      n for n in names if n == "__pycache__" or (Path(folder) == REPO and n in at_root)])
  subprocess.run([sys.executable, "scripts/wheelhouse", "--image", "none", "--no-size-cap"], cwd=repo, check=True,
                 capture_output=True, timeout=900)
  proc = subprocess.run(["bash", "scripts/build_container.sh", "--standin", "--offline", "--no-cache"], cwd=repo,
                        capture_output=True, text=True, check=False, timeout=1800)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-3000:]
  assert "check_image: PASS: {'maxtext': '0.2.5', 'jax': '0.11.2'" in out
  assert "check_image: SKIP: transformer-engine on the stand-in base" in out
  for line in ("PASS pins", "SKIP gpu (skipped: no GPU", "SKIP selftest (skipped: no GPU)", "PASS train-tiny",
               "smoke: PASS"):
    assert line in out, line
  assert "PASS gpu" not in out and "PASS selftest" not in out
