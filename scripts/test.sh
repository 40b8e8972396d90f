#!/usr/bin/env bash
# Run the tests: scripts/test.sh [--all] [pytest args ...]
#
# Without --all: the fast tier (-m "not slow"): everything but the tests that
# start a real training run; about 4 minutes on two cores. With --all: every test
# (the slow tier adds about 55 minutes). A -m of your own replaces the tier's. Tests run on
# two pytest-xdist workers unless a -n of your own says otherwise.
# Creates .venv on first use (scripts/bootstrap.sh).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() {
  cat <<'USAGE'
usage: scripts/test.sh [--all] [pytest args ...]

  (no args)      the fast tier: every test but those that start a real training
                 run (pytest -m "not slow"); about 4 minutes on two cores
  --all          every test: the slow tier adds the training runs (about 55 minutes); installs jax's CUDA
                 compiler plugin first, which the compile-only H100/H200 plans need (they fail, not skip)
  pytest args    passed on: a file (tests/test_configs.py), -k WORD, -x, -n 0, ...;
                 a -m of your own replaces the tier's; tests run on two pytest-xdist
                 workers (-n 2) unless you give -n, --pdb or a single test (file::name)
  -h, --help     this text (pytest's own options: .venv/bin/python -m pytest --help)

Creates .venv on first use (scripts/bootstrap.sh).
USAGE
}
tier=(-m "not slow")
# Two workers: the fast tier's tests are mostly one-threaded (a subprocess's start, tracing, a small compile), so
# the second core halves its time; one named test, a debugger or a -n of the user's own runs as asked.
workers=(-n 2)
args=()
all=0
prev=""
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --all) tier=(); all=1 ;;
    -m|-m*) tier=(); args+=("$arg") ;;
    -n|-n*|--numprocesses|--numprocesses=*|--pdb|--trace|-pno:xdist|*::*) workers=(); args+=("$arg") ;;
    no:xdist) [ "$prev" = -p ] && workers=(); args+=("$arg") ;;
    *) args+=("$arg") ;;
  esac
  prev="$arg"
done
if [ "$all" = 1 ]; then
  # Every test: the compile-only H100/H200 plans need jax's CUDA compiler plugin, and must run, not skip
  # (tests/conftest.py require_gpu_plan).
  py="$("$repo/scripts/bootstrap.sh" --gpu-plan | tail -n1)"
  export MAXTEXT_MOE_REQUIRE_GPU_PLAN=1
else
  py="$("$repo/scripts/bootstrap.sh" | tail -n1)"
fi
cd "$repo"
exec "$py" -m pytest ${tier[@]+"${tier[@]}"} ${workers[@]+"${workers[@]}"} ${args[@]+"${args[@]}"}
