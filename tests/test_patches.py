"""The seam mechanism: version/hash guard, idempotence, undo."""

from __future__ import annotations

import pytest

import patches
from patches._seam import Seam, UpstreamMismatch, source_sha256
from MaxText.config import ForkConfig


def test_every_registered_seam_matches_installed_upstream():
  patches.check_all()  # maxtext 0.2.5 as pinned: every target hashes as recorded


def test_apply_is_idempotent_and_undo_restores_upstream():
  from maxtext.common import metric_logger
  from maxtext.utils import max_utils

  original_write = metric_logger.MetricLogger.write_metrics
  original_writer = max_utils.initialize_summary_writer
  try:
    first = patches.apply_all(ForkConfig())
    patched_write = metric_logger.MetricLogger.write_metrics
    assert patched_write is not original_write
    assert patches.apply_all(ForkConfig()) == first  # second apply: no-op
    assert metric_logger.MetricLogger.write_metrics is patched_write
  finally:
    patches.undo_all()
  assert metric_logger.MetricLogger.write_metrics is original_write
  assert max_utils.initialize_summary_writer is original_writer


def test_refuses_a_different_upstream_version():
  seam = Seam(name="probe", module="maxtext.utils.max_utils", attr="initialize_summary_writer", sha256=None)
  with pytest.raises(UpstreamMismatch, match=r"targets maxtext 0\.2\.5 .* but maxtext 0\.3\.0 is installed"):
    seam.check(installed_version="0.3.0")


def test_refuses_a_changed_target_even_at_the_same_version():
  from maxtext.utils import max_utils

  real = source_sha256(max_utils.initialize_summary_writer)
  seam = Seam(name="probe", module="maxtext.utils.max_utils", attr="initialize_summary_writer", sha256="0" * 16)
  with pytest.raises(UpstreamMismatch, match=f"source hash {real}, expected 0000000000000000"):
    seam.apply(lambda original: original)
  assert not seam.applied


def test_refuses_a_missing_target():
  seam = Seam(name="probe", module="maxtext.utils.max_utils", attr="no_such_function", sha256="0" * 16)
  with pytest.raises(UpstreamMismatch, match="cannot be read"):
    seam.check()
