"""One TE series across the adapters' guard, the container manifest and the [te] extra: a TE bump
that changes one of them and not the others fails here, not on a GPU node."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from MaxText.moe import te_release

ROOT = Path(__file__).resolve().parent.parent


def test_manifest_and_te_extra_name_the_supported_series():
  (series,) = te_release.SUPPORTED_TE
  pinned = str(yaml.safe_load((ROOT / "docker/manifest.yaml").read_text())["transformer_engine"])
  assert pinned.startswith(f"{series}."), pinned
  extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["te"]
  (spec,) = extra
  lower, upper = re.fullmatch(r"transformer-engine\[jax\]>=([\d.]+),<([\d.]+)", spec).groups()
  assert lower == pinned  # the extra installs at least what the manifest pins, which is what ran
  major, minor = map(int, series.split("."))
  assert upper == f"{major}.{minor + 1}"  # and stops before the next series


@pytest.mark.parametrize("version, supported", [("2.20.2", True), ("2.20.0", True), ("2.21.0", False),
                                                ("2.200.1", False), ("2.2", False), ("unknown", False)])
def test_unsupported_names_the_series(version, supported):
  why = te_release.unsupported(version)
  assert (why is None) == supported
  if not supported:
    assert why == f"supports Transformer Engine 2.20.x; {version} is installed"
