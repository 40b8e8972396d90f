#!/usr/bin/env bash
# Smoke test inside the container (its default command): prints PASS/FAIL per
# item and exits non-zero if any failed.
#
#   docker run --gpus all --rm maxtext-moe            # or: bash docker/smoke.sh
#   SMOKE_STEPS=3 SMOKE_OUT=/tmp/smoke SMOKE_NO_TE=1 bash docker/smoke.sh
#   SMOKE_DEVICE=cpu bash docker/smoke.sh                # no GPU: the CPU items only
#
# Items:
#   pins        docker/check_image.py: manifest versions, TE release series, our MaxText
#   gpu         JAX sees a GPU backend
#   selftest    tools/gpu_selftest.py (the MoE backends' GPU checks), when this build has it
#   train-tiny  configs/deepseek3-tiny.yml for SMOKE_STEPS steps on one GPU; the run's
#               summary must hold SMOKE_STEPS steps and a finite final loss
# SMOKE_NO_TE=1 drops the TE requirement (a GPU node set up from the wheelhouse has none);
# SMOKE_SELFTEST=0 leaves the self-test out (it is run on its own, say).
# SMOKE_DEVICE=cpu (the Dockerfile's smoke-cpu stage, a machine without a GPU): the GPU items
# print "SKIP ... (skipped: no GPU)", never PASS, and train-tiny runs on the CPU (the tiny
# config's own hardware), through our MoE block all the same.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
steps="${SMOKE_STEPS:-3}"
device="${SMOKE_DEVICE:-gpu}"
case "$device" in gpu|cpu) ;; *) echo "smoke: SMOKE_DEVICE=$device: must be gpu or cpu" >&2; exit 2 ;; esac
out="${SMOKE_OUT:-$(mktemp -d /tmp/maxtext-moe-smoke.XXXXXX)}"
mkdir -p "$out"
# Run from the log folder: `python3 -m MaxText` must find the installed package,
# not a source tree that happens to be the working directory.
cd "$out" || exit 2
py="${PYTHON:-python3}"
failed=()

item() {  # item NAME COMMAND...: runs it, logs to $out/NAME.log, prints PASS/FAIL
  local name="$1"; shift
  if "$@" >"$out/$name.log" 2>&1; then
    echo "PASS $name"
  else
    echo "FAIL $name (exit $?; log: $out/$name.log)"; tail -n 15 "$out/$name.log" | sed 's/^/    /'
    failed+=("$name")
  fi
}

te_flag=(); [ "${SMOKE_NO_TE:-0}" = 1 ] && te_flag=(--no-te)
item pins "$py" "$root/docker/check_image.py" "${te_flag[@]}"
if [ "$device" = gpu ]; then
  item gpu "$py" -c 'import jax; b = jax.default_backend(); print(b, jax.devices()); assert b == "gpu", b'
else
  echo "SKIP gpu (skipped: no GPU; SMOKE_DEVICE=cpu)"
fi

# The GPU items need a GPU: without one they are not run (the gpu FAIL above
# already fails the smoke test), rather than crawling through GPU-sized cases on CPU.
gpu_ok=1; [[ " ${failed[*]} " == *" gpu "* ]] || [ "$device" = cpu ] && gpu_ok=0

if [ "$device" = cpu ]; then
  echo "SKIP selftest (skipped: no GPU)"
elif [ "$gpu_ok" = 0 ]; then
  echo "SKIP selftest (no GPU)"
elif [ "${SMOKE_SELFTEST:-1}" = 0 ]; then
  echo "SKIP selftest (SMOKE_SELFTEST=0)"
elif [ -f "$root/tools/gpu_selftest.py" ]; then
  item selftest "$py" "$root/tools/gpu_selftest.py"
else
  echo "SKIP selftest (tools/gpu_selftest.py is not in this build)"
fi

# The tiny config is written for CPU; on a GPU it needs hardware=gpu, and
# dot_product attention (autoselected would pick Pallas flash attention at
# 128 tokens, which the tiny MLA head sizes don't suit). One process, so no
# jax.distributed (the config already skips it). Synthetic data, no downloads.
train_tiny() {
  local on_gpu=(hardware=gpu attention=dot_product); [ "$device" = cpu ] && on_gpu=()
  "$py" -m MaxText.train "$root/configs/deepseek3-tiny.yml" "${on_gpu[@]}" \
    steps="$steps" checkpoint_period="$steps" base_output_directory="$out/runs" run_name=tiny || return 1
  "$py" - "$out/runs/tiny/summary.json" "$steps" <<'PY'
import json, math, sys
s = json.load(open(sys.argv[1]))
assert s["steps_completed"] == int(sys.argv[2]), s["steps_completed"]
assert math.isfinite(s["final_loss"]), s["final_loss"]
print(f"steps {s['steps_completed']}, final loss {s['final_loss']:.4f}, median step {s['median_step_time_s']}")
PY
}
if [ "$gpu_ok" = 1 ] || [ "$device" = cpu ]; then
  item train-tiny train_tiny
  tail -n 1 "$out/train-tiny.log"
else
  echo "SKIP train-tiny (no GPU)"
fi

if [ "${#failed[@]}" -gt 0 ]; then
  echo "smoke: FAIL (${failed[*]})"
  exit 1
fi
echo "smoke: PASS (logs in $out)"
