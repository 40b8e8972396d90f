#!/usr/bin/env bash
# Train a model: scripts/train.sh [config.yml] [key=value ...]
# With no config, trains the tiny DeepSeek-V3 (configs/deepseek3-tiny.yml) on CPU.
# Creates .venv on first use (scripts/bootstrap.sh).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$("$repo/scripts/bootstrap.sh" | tail -n1)"
exec "$py" -m MaxText.train "$@"
