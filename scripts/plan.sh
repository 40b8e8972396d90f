#!/usr/bin/env bash
# Plan a run before the cluster: scripts/plan.sh <config.yml> [key=value ...] [--json PATH] [--search]
# Compiles the recipe's train step for its full GPU count on this machine, no GPU needed for an
# H100/H200 target (XLA's GPU compiler on compile-only devices), and prints memory per GPU, the
# verdict, the collectives per step and the estimated step time. See `python -m MaxText.plan --help`.
# Creates .venv on first use, with jax's CUDA compiler plugin (scripts/bootstrap.sh --gpu-plan).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$("$repo/scripts/bootstrap.sh" --gpu-plan | tail -n1)"
exec "$py" -m MaxText.plan "$@"
