"""Checks that this Python environment holds what docker/manifest.yaml pins.

  python3 docker/check_image.py [--manifest docker/manifest.yaml] [--no-te]

Run by the Dockerfile after installing, and by docker/smoke.sh. Exits 1 with
one line per mismatch:
- maxtext, jax, jaxlib and tokamax at exactly the manifest's versions (jax and
  jaxlib may also be a development build of that version, 0.11.2.dev20260910,
  which is what JAX-Toolbox's dated images report);
- Transformer Engine for JAX installed (`--no-te` skips this, for environments
  built without the [te] extra, such as CI's venv; on the stand-in base,
  which carries /etc/maxtext-moe-standin, TE is reported skipped: that base is
  CPU jax from PyPI, scripts/standin_base.sh). A TE outside the manifest's
  release series (the one our te adapters were checked against) is a WARNING,
  not a failure: the base image brings its own TE, and only the `te` grouped
  GEMM and `te_ncclep` refuse it (by name, when selected);
- `MaxText` resolving to our package (NVIDIA's images may carry an upstream
  checkout under the same import name), and the training chain importing
  (our entry point, our patches, upstream's trainer and with it tokamax).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
from pathlib import Path

import yaml
from packaging.version import Version

HERE = Path(__file__).resolve().parent
# Written by scripts/standin_base.sh into its image: a CPU stand-in for the NGC base.
STANDIN_MARKER = Path("/etc/maxtext-moe-standin")


def installed(name: str) -> str | None:
  try:
    return md.version(name)
  except md.PackageNotFoundError:
    return None


def te_versions() -> dict[str, str]:
  """Every Transformer Engine distribution (the core and its JAX binding)."""
  found = {}
  for dist in md.distributions():
    name = dist.metadata["Name"].lower().replace("_", "-")
    if name.startswith("transformer-engine"):
      found[name] = dist.version
  return found


# Pins that a development build of the same release satisfies (JAX-Toolbox
# builds jax from source between releases and reports e.g. 0.11.2.dev20260910).
DEV_BUILDS_OK = ("jax", "jaxlib")


def pin_holds(name: str, want: str, have: str | None) -> bool:
  if have is None:
    return False
  if have == want:
    return True
  try:
    version = Version(have)
  except ValueError:
    return False
  return name in DEV_BUILDS_OK and version.is_devrelease and version.base_version == Version(want).base_version


def te_release_holds(want: Version, have: str) -> bool:
  """have is want or a later patch release of the same major.minor (the adapters check 2.20's API)."""
  try:
    version = Version(have)
  except ValueError:
    return False
  return version.release[:2] == want.release[:2] and version >= want


def te_warnings(manifest: dict, te: dict[str, str]) -> list[str]:
  """Installed TE distributions outside the manifest's release series: our te paths will refuse them."""
  want = Version(str(manifest["transformer_engine"]))
  return [f"{n} {v} is not the {want.major}.{want.minor}.x series (>= {want}) the te grouped GEMM and te_ncclep "
          "were checked against; they will refuse it" for n, v in te.items() if not te_release_holds(want, v)]


def problems(manifest: dict, check_te: bool = True) -> list[str]:
  out = []
  for name, want in manifest["pins"].items():
    have = installed(name)
    if not pin_holds(name, str(want), have):
      out.append(f"{name}: manifest pins {want}, installed {have or 'nothing'}")
  if check_te:
    if not te_versions():
      out.append(f"transformer-engine: not installed (manifest: {manifest['transformer_engine']})")
  if installed("maxtext-moe") is None:
    out.append("maxtext-moe: our package is not installed")
  try:  # the whole chain MaxText.train loads: ours, our patches, upstream's trainer (tokamax too)
    import MaxText.train  # pylint: disable=import-outside-toplevel
    import patches  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import maxtext.trainers.pre_train.train  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except Exception as e:  # noqa: BLE001  any failure to import is the finding
    out.append(f"the training chain does not import: {type(e).__name__}: {e}")
  else:
    if not hasattr(MaxText.train, "cli"):
      out.append(f"MaxText resolves to {Path(MaxText.__file__).parent}, not maxtext-moe's package")
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--manifest", type=Path, default=HERE / "manifest.yaml")
  ap.add_argument("--no-te", action="store_true", help="don't require Transformer Engine")
  ap.add_argument("--standin-marker", type=Path, default=STANDIN_MARKER, help=argparse.SUPPRESS)
  args = ap.parse_args()
  manifest = yaml.safe_load(args.manifest.read_text())
  standin = args.standin_marker.exists()
  if standin:  # every pin still holds; only TE, which needs CUDA, is not there to check
    print(f"check_image: SKIP: transformer-engine on the stand-in base ({args.standin_marker}): no GPU, no TE")
  found = problems(manifest, check_te=not (args.no_te or standin))
  for line in [] if args.no_te or standin else te_warnings(manifest, te_versions()):
    print(f"check_image: WARNING: {line}")
  for line in found:
    print(f"check_image: FAIL: {line}")
  if not found:
    pins = {n: installed(n) for n in yaml.safe_load(args.manifest.read_text())["pins"]}
    import MaxText  # pylint: disable=import-outside-toplevel
    print(f"check_image: PASS: {pins}, TE {te_versions() or 'not checked'}, MaxText from {Path(MaxText.__file__).parent}")
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main())
