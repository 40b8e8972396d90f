"""tools/fp8_account.py: the per-step account of FP8's time, from bench_fp8.py runs on the H200 (their speed rows as
measured, the tilings' rows left out): tests/data/bench_fp8_h200_2026-12-02_34e0f12.json, before the one-pass
kernels, and tests/data/bench_fp8_h200_2026-12-03_12197c1.json, with the one-pass 1x128 kernel beside XLA's."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, load_script

account = load_script("fp8_account", "tools/fp8_account.py")
MEASURED = json.loads((REPO / "tests/data/bench_fp8_h200_2026-12-02_34e0f12.json").read_text())


ONE_PASS = json.loads((REPO / "tests/data/bench_fp8_h200_2026-12-03_12197c1.json").read_text())


def _totals(measured=MEASURED, **kw):
  rows = account.account(account.times(measured, "balanced"), rows=131072, tokens=16384, moe_layers=3, remat="full", **kw)
  return sum(r[1] for r in rows), sum(r[2] for r in rows), dict((r[0], r[2] - r[1]) for r in rows)


def test_the_account_in_benchmarks_is_this_scripts():
  """The account of 34e0f12's run (the proxy, before the backward's FP8 exchange), as BENCHMARKS.md recorded it
  then: 219.5 ms of routed GEMMs in bf16 against 209.9 ms with FP8 and its quantization; the dW operands'
  quantization is the largest pass."""
  bf16, fp8, parts = _totals(fp8_backward_exchange=False, one_pass_lhs=False)
  assert bf16 == pytest.approx(219.5, abs=0.05) and fp8 == pytest.approx(209.9, abs=0.05)
  dw_operands = [name for name in parts if name.startswith("quantize: dW")]
  assert len(dw_operands) == 3 and sum(parts[n] for n in dw_operands) == pytest.approx(29.5, abs=0.05)
  x, dy = (parts[f"quantize: dW's {o}, 128x1 (gathered from token rows: XLA)"] for o in ("x", "dy"))
  assert x == dy  # both XLA's, at K = 7168


def test_the_one_pass_kernel_costs_the_materialized_operands_where_the_file_has_it():
  """A scratch run on the H200 (2026-12-02, per operand at 65,536 rows): the one-pass kernel 0.456 ms at K = 7168
  and 0.150 at 2048, where XLA took 1.100 and 0.325. Added as bench_fp8's pair rows, the three materialized
  operands cost 0.46x as much; the gathered ones do not change."""
  kernel = {"up": 0.456 + 0.150, "down": 0.150 + 0.456}
  with_kernel = [dict(r) for r in MEASURED] + [
      dict(kind="speed", case=f"{shape} M=65536 G=32 balanced", what="dW quantize x and dout (one-pass kernel)", ms=ms)
      for shape, ms in kernel.items()]
  rows = {r[0]: r[2] for r in account.account(account.times(with_kernel, "balanced"), rows=131072, tokens=16384,
                                              moe_layers=3, remat="full", one_pass_lhs=False)}
  base = {r[0]: r[2] for r in account.account(account.times(MEASURED, "balanced"), rows=131072, tokens=16384,
                                              moe_layers=3, remat="full", one_pass_lhs=False)}
  gathered = "quantize: dW's dy, 128x1 (gathered from token rows: XLA)"
  materialized = "quantize: dW operands materialized, 128x1 (h, dh0, dh1: one pass)"
  assert rows[gathered] == base[gathered]
  xla_pair = sum(r["ms"] for r in MEASURED if r.get("what") == "dW quantize x and dout (128x1)"
                 and r["case"].endswith("balanced"))
  assert rows[materialized] / base[materialized] == pytest.approx(sum(kernel.values()) / xla_pair, rel=1e-9)


def test_the_backward_fp8_exchange_adds_one_pass_over_the_token_rows():
  without, with_exchange = _totals(fp8_backward_exchange=False)[1], _totals(cotangent_tiles=False)[1]
  assert 0.4 < with_exchange - without < 0.8  # x's 1x128 pass at K = 7168 over 16,384 rows, per layer


def test_a_file_without_the_cases_says_so(tmp_path):
  path = tmp_path / "b.json"
  path.write_text("[]")
  with pytest.raises(SystemExit, match="no up and down speed rows"):
    account.main([str(path)])
  path.write_text("{not json")
  with pytest.raises(SystemExit, match=f"fp8_account: {path}: Expecting"):
    account.main([str(path)])
  with pytest.raises(SystemExit, match="fp8_account: .*missing.json: .*No such file"):
    account.main([str(tmp_path / "missing.json")])


def test_kernels_at_dense_fp8_replaces_only_the_fp8_kernels_times():
  """--kernels-at-dense-fp8 (what the proxy's step at 1.12x bf16 would take; BENCHMARKS.md "FP8 end to end"): the FP8
  GEMM rows at the dense FP8 time of their case, the bf16 rows and every quantization pass as measured."""
  t = account.times(MEASURED, "balanced")
  kw = dict(rows=131072, tokens=16384, moe_layers=3, remat="full")
  measured = {r[0]: r[1:] for r in account.account(t, **kw)}
  ceiling = {r[0]: r[1:] for r in account.account(account.at_dense_fp8(t), **kw)}
  for what, (bf16, fp8) in ceiling.items():
    assert bf16 == measured[what][0]
    assert (fp8 < measured[what][1]) if what.startswith("routed GEMMs") else (fp8 == measured[what][1]), what
  up, down = t["up"]["dense fp8"], t["down"]["dense fp8"]
  assert ceiling["routed GEMMs: dW"][1] == pytest.approx((2 * up + down) * 131072 / 65536 * 3)


def test_the_one_pass_lhs_saves_what_its_kernels_measured():
  """12197c1's file (the H200): the one-pass 1x128 kernel beside XLA's. With it, the SwiGLU output and dh0, dh1
  go to the kernel as a product's lhs, and dW's x to the requantization of the dispatch's tiles: 6.9 ms a step
  less than XLA's passes; dy, a gather of token rows, stays XLA's."""
  bf16, before, parts_before = _totals(ONE_PASS, one_pass_lhs=False)
  _, after, parts = _totals(ONE_PASS, cotangent_tiles=False)
  assert before - after == pytest.approx(6.9, abs=0.1)
  assert parts["quantize: dW's dy, 128x1 (gathered from token rows: XLA)"] == parts_before[
      "quantize: dW's dy, 128x1 (gathered from token rows: XLA)"]
  assert parts["quantize: SwiGLU output, per forward pass"] < 0.5 * parts_before["quantize: SwiGLU output, per forward pass"]


def test_wo_taking_the_cotangents_tiles_saves_xlas_two_passes_over_dy():
  """fp8_dispatch.expert_output_combine: wo's dlhs multiplies the combine's cotangent tiles as they crossed, and its
  dW requantizes them in one pass, at the same cost as x's (both K = 7168). From 12197c1's file: 8.5 ms a step
  less, the prediction for bench_train's step."""
  _, before, parts_before = _totals(ONE_PASS, cotangent_tiles=False)
  _, after, parts = _totals(ONE_PASS)
  assert before - after == pytest.approx(8.5, abs=0.1)
  assert parts["quantize: dW's dy, 128x1 (from the combine's tiles: one pass)"] == parts[
      "quantize: dW's x, 128x1 (from the dispatch's tiles: one pass)"]
  assert parts["quantize: dlhs douts (dh0 and dh1; dy moved as tiles)"] < parts_before[
      "quantize: dlhs douts (dy gathered, dh0 and dh1)"] / 3
  # Without the FP8 backward exchange there are no cotangent tiles: the same account either way.
  assert _totals(ONE_PASS, fp8_backward_exchange=False)[1] == _totals(
      ONE_PASS, fp8_backward_exchange=False, cotangent_tiles=False)[1]
