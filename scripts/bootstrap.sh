#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and prints
# its python path on stdout. Sourced-free: call it, capture the last line.
#
#   MAXTEXT_MOE_PYTHON=/path/to/python3.12   choose the interpreter explicitly
#   MAXTEXT_MOE_VENV=/path/to/venv            put the environment elsewhere
#   --gpu-plan   also install jax's CUDA compiler plugin into <venv>/gpu-plan
#                (requirements/gpu-plan.txt): `python -m MaxText.plan` then compiles
#                for an H100/H200 target without a GPU (MaxText/plan/gpu_target.py)
#
# The environment is installed from requirements/lock.txt (resolved for
# CPython 3.12, x86_64 Linux) and re-installed whenever the lock or
# pyproject.toml changes.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MAXTEXT_MOE_VENV:-$repo/.venv}"
lock="$repo/requirements/lock.txt"
say() { echo "[bootstrap] $*" >&2; }
gpu_plan=0
[ "${1:-}" = "--gpu-plan" ] && gpu_plan=1

# Site-wide pip settings (extra indexes, find-links) can be noisy; keep the
# user's settings but drop pip's "location ignored" chatter.
pipq() { "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2; return "${PIPESTATUS[0]}"; }

install_gpu_plan() {  # idempotent: the plugin in <venv>/gpu-plan, outside site-packages
  local site="$venv/gpu-plan" want
  want="$(sha256sum < "$repo/requirements/gpu-plan.txt" | cut -d' ' -f1)"
  [ "$(cat "$site/.stamp" 2>/dev/null)" = "$want" ] && return 0
  say "installing requirements/gpu-plan.txt into $site (jax's CUDA compiler plugin, ~410 MB)"
  rm -rf "$site"
  pipq install -q --no-deps --require-hashes --target "$site" -r "$repo/requirements/gpu-plan.txt"
  echo "$want" > "$site/.stamp"
}

is_py312() {  # prints the path when $1 runs CPython 3.12
  local exe="$1"
  [ -n "$exe" ] && "$exe" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
    && "$exe" -c 'import sys; print(sys.executable)'
}

find_python() {
  local cand
  if [ -n "${MAXTEXT_MOE_PYTHON:-}" ]; then
    is_py312 "$MAXTEXT_MOE_PYTHON" && return 0
    say "MAXTEXT_MOE_PYTHON=$MAXTEXT_MOE_PYTHON is not a working Python 3.12 interpreter."
    return 1
  fi
  for cand in python3.12 python3 python; do
    is_py312 "$(command -v "$cand" 2>/dev/null || true)" && return 0
  done
  # pyenv shims refuse versions that are installed but not selected, so look
  # at pyenv's versions folder directly.
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 \
              /usr/local/bin/python3.12 /usr/bin/python3.12 /opt/python3.12/bin/python3; do
    [ -x "$cand" ] && is_py312 "$cand" && return 0
  done
  if command -v uv >/dev/null 2>&1; then
    cand="$(uv python find 3.12 2>/dev/null || true)"
    is_py312 "$cand" && return 0
  fi
  return 1
}

stamp_of() { cat "$lock" "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1; }

if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.maxtext-moe-stamp" 2>/dev/null)" = "$(stamp_of)" ]; then
  [ "$gpu_plan" = 1 ] && install_gpu_plan
  echo "$venv/bin/python"
  exit 0
fi

if ! py="$(find_python)"; then
  cat >&2 <<'MSG'
[bootstrap] error: no Python 3.12 interpreter found (maxtext 0.2.5 needs >= 3.12;
[bootstrap] our lock file is resolved for 3.12). Install one, then re-run:
[bootstrap]   pyenv install 3.12            (pyenv users; no need to select it)
[bootstrap]   uv python install 3.12        (uv users)
[bootstrap]   apt-get install python3.12 python3.12-venv   (Debian/Ubuntu with 3.12 packaged)
[bootstrap] or point us at one:  MAXTEXT_MOE_PYTHON=/path/to/python3.12 <same command>
MSG
  exit 3
fi

say "creating $venv with $py"
"$py" -m venv --clear "$venv"
pipq install -q --upgrade pip
say "installing requirements/lock.txt (about 130 packages, 1.6 GB: a few minutes the first time)"
pipq install -q --no-deps -r "$lock"
pipq install -q --no-deps --no-build-isolation -e "$repo"
pipq check || say "warning: pip check reported the conflicts above"
stamp_of > "$venv/.maxtext-moe-stamp"
[ "$gpu_plan" = 1 ] && install_gpu_plan
say "environment ready: $venv"
echo "$venv/bin/python"
