#!/usr/bin/env bash
# One host, N processes: scripts/launch_local.sh [-n NPROC] [config.yml] [key=value ...]
#
# NPROC=1 (the default): one process drives every local GPU.
# NPROC>1: NPROC processes on this host, joined through jax.distributed
# (MaxText/run/launch.py reads JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/
# JAX_PROCESS_ID: the same discovery path as SLURM and Kubernetes). With GPUs,
# each process gets GPU_COUNT/NPROC of them (JAX_LOCAL_DEVICE_IDS); on a CPU
# machine each process has its own CPU device and collectives go through gloo.
# Output lines are prefixed [p<rank>]; the exit status is the first failure's.
#
#   MAXTEXT_PORT=12345           coordinator port (default: a free one)
#   MAXTEXT_MOE_PYTHON / .venv   interpreter, as scripts/bootstrap.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nproc=1
if [ "${1:-}" = "-n" ]; then nproc="$2"; shift 2; fi
case "$nproc" in ''|*[!0-9]*|0) echo "launch_local.sh: -n needs a positive integer, got '$nproc'" >&2; exit 2;; esac
py="$("$repo/scripts/bootstrap.sh" | tail -n1)"
cd "$repo"
if [ "$nproc" = 1 ]; then exec "$py" -m MaxText.train "$@"; fi

port="${MAXTEXT_PORT:-$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi
if [ "$gpus" -gt 0 ] && [ $((gpus % nproc)) -ne 0 ]; then
  echo "launch_local.sh: $gpus GPUs do not split evenly over $nproc processes" >&2; exit 2
fi

pids=()
for ((rank = 0; rank < nproc; rank++)); do
  ids=""
  if [ "$gpus" -gt 0 ]; then
    per=$((gpus / nproc)); ids="$(seq -s, $((rank * per)) $((rank * per + per - 1)))"
  fi
  (
    export JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$nproc" JAX_PROCESS_ID="$rank"
    if [ -n "$ids" ]; then export JAX_LOCAL_DEVICE_IDS="$ids"; fi
    "$py" -m MaxText.train "$@" 2>&1 | sed -u "s/^/[p$rank] /"
    exit "${PIPESTATUS[0]}"
  ) &
  pids+=("$!")
done

status=0
for pid in "${pids[@]}"; do
  rc=0; wait "$pid" || rc=$?  # (`if ! wait` would leave $? at the negation's 0: every failure read as success)
  if [ "$rc" -ne 0 ] && [ "$status" = 0 ]; then
    status=$rc
    for other in "${pids[@]}"; do kill "$other" 2>/dev/null || true; done  # only the ranks started here
  fi
done
exit "$status"
