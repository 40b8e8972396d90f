#!/usr/bin/env bash
# Run the test suite: scripts/test.sh [pytest args ...]
# Creates .venv on first use (scripts/bootstrap.sh).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$("$repo/scripts/bootstrap.sh" | tail -n1)"
cd "$repo"
exec "$py" -m pytest "$@"
