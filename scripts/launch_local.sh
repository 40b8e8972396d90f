#!/usr/bin/env bash
# One host, N processes: scripts/launch_local.sh [-n NPROC] [config.yml] [key=value ...]
#
# NPROC=1 (the default): one process drives every local GPU.
# NPROC>1: NPROC processes on this host, joined through jax.distributed
# (MaxText/run/launch.py reads JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/
# JAX_PROCESS_ID: the same discovery path as SLURM and Kubernetes). With GPUs,
# each process gets GPU_COUNT/NPROC of them (JAX_LOCAL_DEVICE_IDS); on a CPU
# machine each process has its own CPU device and collectives go through gloo.
# Output lines are prefixed [p<rank>].
#
# Every rank is watched at once: the first to fail (exit non-zero) is named in one line
# (rank, pid, exit code), the others are sent SIGTERM, and any still running MAXTEXT_LAUNCH_GRACE_S
# later are killed (a peer that died at start leaves the others blocked in jax.distributed's start,
# deaf to signals, for its whole timeout), as the line says; the exit status is the first failure's.
# SIGTERM, SIGINT, SIGUSR1 or SIGHUP to this script goes to every rank (their keepers pass it on:
# they save and exit 75) and it waits for all of them: none is left behind.
#
#   MAXTEXT_PORT=12345           coordinator port (default: a free one)
#   MAXTEXT_LAUNCH_GRACE_S=30    how long the other ranks have to end after a failure
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

grace="${MAXTEXT_LAUNCH_GRACE_S:-30}"
case "$grace" in ''|*[!0-9]*) echo "launch_local.sh: MAXTEXT_LAUNCH_GRACE_S needs whole seconds, got '$grace'" >&2; exit 2;; esac
say() { echo "launch_local.sh: $*" >&2; }
fifos="$(mktemp -d)"
trap 'rm -rf "$fifos"' EXIT
declare -A rank_of=()  # a rank's pid (its keeper: python -m MaxText.train) -> its rank
live=() prefixers=() forwarded=""
forward() {  # a signal to this script: to every rank still running, each time it comes
  forwarded="$1"
  if [ "${#live[@]}" -gt 0 ]; then kill -s "$1" "${live[@]}" 2>/dev/null || true; fi
}
for sig in TERM INT USR1 HUP; do trap "forward $sig" "$sig"; done
for ((rank = 0; rank < nproc; rank++)); do
  ids=""
  if [ "$gpus" -gt 0 ]; then
    per=$((gpus / nproc)); ids="$(seq -s, $((rank * per)) $((rank * per + per - 1)))"
  fi
  # The rank runs as this script's own child (env execs python), so that a signal reaches it; its lines are
  # prefixed on their way out by a sed deaf to the job's signals, which must not cut a stopping rank's output.
  mkfifo "$fifos/$rank"
  (trap '' TERM INT HUP USR1; exec sed -u "s/^/[p$rank] /") < "$fifos/$rank" &
  prefixers+=("$!")
  vars=(JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$nproc" JAX_PROCESS_ID="$rank")
  if [ -n "$ids" ]; then vars+=(JAX_LOCAL_DEVICE_IDS="$ids"); fi
  env "${vars[@]}" "$py" -m MaxText.train "$@" > "$fifos/$rank" 2>&1 &
  live+=("$!"); rank_of[$!]=$rank
done

forget() { local p kept=(); for p in "${live[@]}"; do [ "$p" = "$1" ] || kept+=("$p"); done; live=("${kept[@]}"); }
names() { local p s=""; for p in "$@"; do s+="${s:+, }rank ${rank_of[$p]} (pid $p)"; done; echo "$s"; }
status=0 deadline=""
while [ "${#live[@]}" -gt 0 ]; do
  done_pid="" rc=0
  if [ -n "$deadline" ]; then
    left=$((deadline - SECONDS))
    if [ "$left" -le 0 ]; then
      say "$(names "${live[@]}") still running ${grace} s after SIGTERM (MAXTEXT_LAUNCH_GRACE_S): killed (SIGKILL)"
      kill -KILL "${live[@]}" 2>/dev/null || true
      deadline=""
      continue
    fi
    sleep "$left" &  # `wait -n` has no timeout: a sleep beside the ranks ends the wait when the grace is over
    timer=$!
    wait -n -p done_pid "${live[@]}" "$timer" || rc=$?
    if [ "${done_pid:-}" != "$timer" ]; then kill "$timer" 2>/dev/null || true; wait "$timer" 2>/dev/null || true; fi
    if [ "${done_pid:-}" = "$timer" ]; then continue; fi
  else
    wait -n -p done_pid "${live[@]}" || rc=$?
  fi
  if [ -z "${done_pid:-}" ]; then continue; fi  # a trapped signal ended the wait: it was forwarded; wait again
  forget "$done_pid"
  if [ "$rc" -ne 0 ] && [ "$status" = 0 ]; then
    status=$rc
    if [ -n "$forwarded" ]; then continue; fi  # the ranks were asked to stop: each saves, exits 75, and is waited for
    ending=""
    if [ "${#live[@]}" -gt 0 ]; then
      ending="; ending $(names "${live[@]}") (SIGTERM, then SIGKILL after ${grace} s)"
      kill -TERM "${live[@]}" 2>/dev/null || true
      deadline=$((SECONDS + grace))
    fi
    how="exited $rc"
    if [ "$rc" -gt 128 ]; then how="was killed by SIG$(kill -l "$((rc - 128))" 2>/dev/null || echo "NAL $((rc - 128))") (exit $rc)"; fi
    say "rank ${rank_of[$done_pid]} (pid $done_pid) $how, the job's first failure$ending"
  fi
done
wait "${prefixers[@]}" 2>/dev/null || true  # the ranks' last lines out before this script ends
exit "$status"
