#!/usr/bin/env bash
# Builds the torch + transformers environment the Hugging Face parity tests compare against (.venv-hf), and prints
# its python path on stdout. Separate from .venv: the project's environment never needs torch.
#
#   MAXTEXT_MOE_HF_VENV=/path       put it elsewhere (default <repo>/.venv-hf)
#   MAXTEXT_MOE_HF_PYTHON=/path     the interpreter (default python3.11, then python3.12)
#
# Everything comes from the package index by name, pinned (requirements/hf.txt). torch is pinned to 2.13.0: pip
# takes its CPU build (a 190 MB wheel for CPython 3.11) where the machine's pip finds it (this project's CI
# machines have it on disk); where it does not, PyPI's Linux x86_64 torch is the CUDA build, several GB: point pip
# at a CPU-only index with PIP_EXTRA_INDEX_URL if one is reachable. Re-run: instant once built (a stamp of the pins).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MAXTEXT_MOE_HF_VENV:-$repo/.venv-hf}"
pins="$repo/requirements/hf.txt"
say() { echo "[hf_env] $*" >&2; }
want="$(sha256sum < "$pins" | cut -d' ' -f1)"

if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.stamp" 2>/dev/null)" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi

py="${MAXTEXT_MOE_HF_PYTHON:-}"
if [ -z "$py" ]; then
  # pyenv's shims refuse a version that is installed but not selected: its versions folder is looked at too.
  for cand in python3.11 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11*/bin/python3 /usr/bin/python3.11 \
              python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 /usr/bin/python3.12; do
    if "$cand" -c 'import venv' >/dev/null 2>&1; then py="$cand"; break; fi
  done
fi
[ -n "$py" ] || { say "error: no python3.11 or python3.12 found; set MAXTEXT_MOE_HF_PYTHON"; exit 3; }

start=$SECONDS
say "creating $venv with $py and installing requirements/hf.txt (torch CPU, transformers, safetensors)"
"$py" -m venv --clear "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored: it is neither" >&2 || true
"$venv/bin/python" -m pip install -q -r "$pins" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
"$venv/bin/python" -c 'import torch, transformers, safetensors' || { say "error: the install above failed"; exit 4; }
if "$venv/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is None)'; then
  say "warning: pip installed a CUDA build of torch (several GB); the tests only need its CPU build"
fi
echo "$want" > "$venv/.stamp"
say "ready in $((SECONDS - start)) s, $(du -sm "$venv" | cut -f1) MB: $venv"
echo "$venv/bin/python"
