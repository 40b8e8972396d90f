#!/usr/bin/env bash
# Plan a run before the cluster: scripts/plan.sh <config.yml> [key=value ...] [--json PATH] [--search]
# Compiles the recipe's train step for its full GPU count on this machine (one GPU is enough;
# without one, simulated CPU devices for small meshes) and prints memory per GPU, the verdict,
# the collectives per step and the estimated step time. See `python -m MaxText.plan --help`.
# Creates .venv on first use (scripts/bootstrap.sh).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$("$repo/scripts/bootstrap.sh" | tail -n1)"
exec "$py" -m MaxText.plan "$@"
