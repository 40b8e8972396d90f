"""tools/gpu_selftest.py works on CPU, and fails a backend that leaves rows unwritten."""

from __future__ import annotations


import pytest

from conftest import load_script
from MaxText.moe.gmm import xla as xla_backend


def _selftest():
  return load_script("gpu_selftest", "tools/gpu_selftest.py")


def test_selftest_passes_xla_on_the_small_cases():
  selftest = _selftest()
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  for i, case in enumerate(selftest.small_cases()[:6]):
    errs = selftest.run_case(gmm_lib, "xla", case, seed=i)
    assert set(errs) == {"out", "dlhs", "drhs"} and max(errs.values()) < selftest.TOLERANCE, (case, errs)


def test_selftest_catches_a_kernel_that_leaves_padding_rows_unwritten(monkeypatch):
  selftest = _selftest()
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel

  def unmasked_gmm(lhs_MK, rhs_GKN, group_sizes_G, *, group_offset, transpose_rhs, out_dtype):
    # Every row times group 0's weights: rows outside the groups (NaN there) are written too.
    del group_sizes_G, group_offset
    rhs_KN = rhs_GKN[0].T if transpose_rhs else rhs_GKN[0]
    return (lhs_MK @ rhs_KN).astype(out_dtype)

  monkeypatch.setattr(xla_backend, "gmm", unmasked_gmm)
  padding_case = next(c for c in selftest.small_cases() if c.name == "padding_rows")
  with pytest.raises(AssertionError, match="out: .*"):
    selftest.run_case(gmm_lib, "xla", padding_case, seed=0)


def test_selftest_picks_cases_and_an_unrun_case_is_not_a_pass(capsys):
  selftest = _selftest()
  assert selftest.main(["--cpu-smoke", "--cases", "m37_untiled"]) == 0  # xla and xla_fp8
  assert "ALL PASS (2 pass" in capsys.readouterr().out
  assert selftest.main(["--cpu-smoke", "--deadline-s", "0"]) == 3  # nothing ran: not green
  assert "INCOMPLETE: 14 not run" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    selftest.main(["--cpu-smoke", "--cases", "no_such_case"])
  assert "valid: balanced" in capsys.readouterr().err


def test_fwd_tiling_override_applies_to_every_forward_tiling_and_names_a_bad_field(monkeypatch):
  from MaxText.moe.gmm.mgpu import tiling as mgpu_tiling  # pylint: disable=import-outside-toplevel

  selftest = _selftest()
  monkeypatch.setattr(mgpu_tiling, "TABLE", dict(mgpu_tiling.TABLE))
  monkeypatch.setattr(mgpu_tiling, "DEFAULTS", dict(mgpu_tiling.DEFAULTS))
  selftest._override_fwd_tilings("chain=1,stages=4")  # pylint: disable=protected-access
  fwd = [t for t in mgpu_tiling.TABLE.values() if isinstance(t, mgpu_tiling.FwdTiling)]
  assert fwd and all(t.chain and t.stages == 4 for t in fwd + [mgpu_tiling.DEFAULTS["fwd"]])
  assert not mgpu_tiling.DEFAULTS["tgmm"].warp_specialized  # other ops untouched
  with pytest.raises(SystemExit, match="'chan=1' is not field=integer"):
    selftest._override_fwd_tilings("chan=1")  # pylint: disable=protected-access
  with pytest.raises(SystemExit, match="'stages=four'"):
    selftest._override_fwd_tilings("stages=four")  # pylint: disable=protected-access


def test_selftest_holds_fp8_backends_to_their_quantization(monkeypatch):
  """xla_fp8 (mgpu_fp8's reference) passes on CPU; an FP8 backend that silently skipped quantizing
  (here: xla_fp8's forward and dlhs replaced by the unquantized product) fails the same case."""
  selftest = _selftest()
  from MaxText.moe import gmm as gmm_lib  # pylint: disable=import-outside-toplevel
  from MaxText.moe.gmm import xla_fp8  # pylint: disable=import-outside-toplevel

  case = next(c for c in selftest.small_cases() if c.name == "m1000_k320_n200")
  errs = selftest.run_case(gmm_lib, "xla_fp8", case, seed=0)
  assert max(errs.values()) < selftest.TOLERANCE, errs

  reference = xla_fp8.gmm
  calls = []

  def unquantized(*args, **kwargs):
    calls.append(1)
    if len(calls) <= 2:  # the backend under test (its forward and dlhs); later calls are the reference's
      kwargs.pop("lhs_gathered")  # an FP8 backend's argument (which pass quantizes lhs), not the xla backend's
      kwargs.pop("rhs_blocks")  # the weight's blocks (the forward's, kept for dlhs): FP8 backends' only
      return xla_backend.gmm(*args, **kwargs)
    return reference(*args, **kwargs)

  monkeypatch.setattr(xla_fp8, "gmm", unquantized)
  errs = selftest.run_case(gmm_lib, "xla_fp8", case, seed=0)
  assert errs["out"] > selftest.TOLERANCE and errs["dlhs"] > selftest.TOLERANCE, errs
