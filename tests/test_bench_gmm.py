"""tools/bench_gmm.py on CPU, tiny M: the rows it records and the compile reuse across
cases that keeps a GPU sweep inside one device call."""

from __future__ import annotations

import argparse

import pytest

from conftest import REPO, load_script

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


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_fp8_rows_are_quantized_and_held_to_their_own_bound(monkeypatch):
  """xla_fp8 (the CPU stand-in for mgpu_fp8, the same quantization): its GEMM and FFN rows are further from
  the float32 reference than bf16's 1e-2 (FP8's own error) and pass under FP8_TOL."""
  monkeypatch.setattr(bench, "ARGS", argparse.Namespace(xla_bwd=False, ffn_dims="256,128"), raising=False)
  bks = bench.backends(["xla_fp8"])
  rows = []
  bench.run_gemm_case("tiny", 512, 4, "zipf1.2", bks, ["fwd", "bwd"], 0, rows)
  bench.run_ffn_case(512, 4, "zipf1.2", bks, 1, rows)
  fp8 = [r for r in rows if r["backend"] == "xla_fp8"]
  assert [r["pass_"] for r in fp8] == ["fwd", "bwd", "ffn"]
  errs = [float(r["err"]) for r in fp8]  # a "FAIL ..." string would not parse
  bounds = [bench.FP8_TOL["gemm"]] * 2 + [bench.FP8_TOL["ffn"]]
  assert all(bench.TOL < e < bound for e, bound in zip(errs, bounds)), errs


@pytest.mark.slow  # long on CPU (interpreted kernels / several simulated devices): --all only
def test_ffn_only_runs_the_ffn_cases_alone(monkeypatch, tmp_path, capsys):
  """gpu_checks.sh fp8-gmm's run (the expert FFN rows, FP8 and bf16): no GEMM case is started before or after them."""
  import json
  import sys

  monkeypatch.setattr(sys, "argv", ["bench_gmm.py", "--ffn-only", "--m", "512", "--g", "4", "--dists", "zipf1.2",
                                    "--ffn-dims", "256,128", "--backends", "xla_fp8", "--out", str(tmp_path)])
  bench.main()
  rows = json.loads((tmp_path / "results.json").read_text())["rows"]
  assert {(r["backend"], r["pass_"]) for r in rows} == {("dense", "ffn"), ("xla_fp8", "ffn")}
  assert "ffn M=512 G=4 zipf1.2" in capsys.readouterr().out


def test_float32_references_per_group_with_empty_groups_and_rows_past_the_groups():
  """ref_fwd/ref_tgmm (one product shape for every group) against NumPy group by group, and ffn_reference's
  hand-written backward against jax autodiff of the same per-group FFN."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(0)
  sizes = np.array([0, 700, 3, 0, 1100, 1], np.int32)  # empty groups, one hot, 196 rows past sum(sizes)
  m, k, f = 2000, 24, 16
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((6, k, 2 * f)).astype(np.float32)
  w2 = rng.standard_normal((6, f, k)).astype(np.float32)
  dy = rng.standard_normal((m, k)).astype(np.float32)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  want = np.zeros((m, 2 * f), np.float32)
  want_dw = np.zeros((6, k, k), np.float32)
  for g in range(6):
    lo, hi = bounds[g], bounds[g + 1]
    want[lo:hi] = x[lo:hi] @ w[g]
    want_dw[g] = x[lo:hi].T @ dy[lo:hi]
  np.testing.assert_allclose(bench.ref_fwd(x, w, sizes), want, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(bench.ref_fwd(want, w, sizes, transpose=True)[:bounds[-1]],
                             np.concatenate([want[bounds[g]:bounds[g + 1]] @ w[g].T for g in range(6)]),
                             rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(bench.ref_tgmm(x, dy, sizes), want_dw, rtol=1e-5, atol=1e-3)

  def ffn(x, w01, w2):
    outs = []
    for g in range(6):
      h = x[bounds[g]:bounds[g + 1]] @ w01[g]
      outs.append((jax.nn.silu(h[:, :f]) * h[:, f:]) @ w2[g])
    return jnp.concatenate(outs + [jnp.zeros((m - bounds[-1], k))])
  y, pull = jax.vjp(ffn, x, w, w2)
  for got, ref in zip(bench.ffn_reference(x, w, w2, dy, sizes), (y,) + pull(dy)):
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-3)


@pytest.mark.slow  # compiles a family's GEMMs and FFN on CPU
def test_family_runs_its_expert_shapes_and_ffn(monkeypatch, tmp_path):
  """--family: the family's up (D -> F) and down at M = tokens x top-k and its G, balanced and zipf1.2, fwd and
  bwd, and the FFN at those dims; each against the dense GEMM and within the error bound."""
  import json
  import sys

  # The plumbing at CPU size: qwen3-moe's entry shrunk (its real shape is a GPU's: tests/test_moe_families.py checks
  # FAMILIES against the proxies), M = 32 tokens x top-8 = 256 rows.
  monkeypatch.setitem(bench.FAMILIES, "qwen3-moe", (128, 48, 16, 8))
  monkeypatch.setitem(bench.SHAPES, "qwen3-moe_up", (128, 48))
  monkeypatch.setitem(bench.SHAPES, "qwen3-moe_down", (48, 128))
  monkeypatch.setattr(bench, "PROXY_TOKENS", 32)
  monkeypatch.setattr(sys, "argv", ["bench_gmm.py", "--family", "qwen3-moe", "--backends", "xla_vjp",
                                    "--out", str(tmp_path)])
  bench.main()
  rows = json.loads((tmp_path / "results.json").read_text())["rows"]
  cases = {(r["case"], r["backend"], r["pass_"]) for r in rows}
  for side in ("up", "down"):
    for dist in ("balanced", "zipf1.2"):
      for p in ("fwd", "bwd"):
        assert (f"qwen3-moe_{side} M=256 G=16 {dist}", "xla_vjp", p) in cases
  assert ("ffn 128->48 M=256 G=16 zipf1.2", "xla_vjp", "ffn") in cases
  assert all(float(r["err"]) < bench.TOL for r in rows if r["backend"] == "xla_vjp"), rows


def test_tune_gmm_family_problems_are_the_six_products_at_its_expert_shape():
  """tools/tune_gmm.py --family: up, down, both dlhs (transposed) and both dW at the family's (D, F)."""
  import sys

  sys.path.insert(0, str(REPO / "tools"))
  tune = load_script("tune_gmm", "tools/tune_gmm.py")
  d, f, _, _ = bench.FAMILIES["qwen3-moe"]
  got = tune.family_problems("qwen3-moe")
  base = {name: (op, k, n, t) for name, (op, k, n, t) in tune.PROBLEMS.items()}  # DeepSeek-V3's six, 7168 -> 2048
  assert {name.removeprefix("qwen3-moe_") for name in got} == set(base)
  for name, (op, k, n, transpose) in got.items():
    op0, k0, n0, t0 = base[name.removeprefix("qwen3-moe_")]
    assert (op, transpose) == (op0, t0) and (k, n) == ((d, f) if (k0, n0) == (7168, 2048) else (f, d)), name
