"""tools/bench_gmm.py on CPU, tiny M: the rows it records and the compile reuse across
cases that keeps a GPU sweep inside one device call."""

from __future__ import annotations

import argparse

import pytest

from conftest import load_script

bench = load_script("bench_gmm", "tools/bench_gmm.py")


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_cases_of_one_shape_share_compiled_functions(monkeypatch):
  monkeypatch.setattr(bench, "ARGS", argparse.Namespace(xla_bwd=False), raising=False)
  bks = bench.backends(["xla_vjp"])
  fwd, bwd = bks["xla_vjp"]
  rows = []
  for seed, dist in enumerate(("zipf1.2", "some_empty")):
    bench.run_gemm_case("up", 256, 4, dist, bks, ["fwd", "bwd"], seed, rows)
  # One trace/compile for both group-size draws (sizes are traced values).
  assert fwd._cache_size() == 1 and bwd._cache_size() == 1
  assert bench._DENSE["fwd"]._cache_size() == 1
  ours = [r for r in rows if r["backend"] == "xla_vjp"]
  assert len(ours) == 4 and all(float(r["err"]) < bench.TOL for r in ours)
  assert {r["backend"] for r in rows} == {"dense", "xla_vjp"}
