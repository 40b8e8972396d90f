#!/usr/bin/env bash
# GPU checks recorded in BENCHMARKS.md, run on one H200 with the project's
# wheelhouse installed (scripts/wheelhouse; the node's image provides JAX/CUDA).
#
#   bash tools/gpu_checks.sh [tiny] [selftest] [offload] [ours] ...
#
#   tiny      the tiny config from the wheelhouse-installed package (docker/smoke.sh)
#   selftest  tools/gpu_selftest.py for tokamax and mgpu (PASS/FAIL per case)
#   tokamax   the 1xH200 proxy on upstream's best MoE path (tokamax): the reference
#   offload   the same with the host_offload preset: step time and peak device memory
#   ours      the 1xH200 proxy with our grouped GEMM (moe_gmm_backend=mgpu)
#   block     the same with our whole MoE block (moe_block=ours)
#   selftest-small  the self-test without the DeepSeek-V3 shapes (each compiles for ~30 s)
#
# Each item has a time limit (GPU_CHECK_LIMIT_S, default 240 s); logs go to
# $GPU_CHECK_OUT (default /tmp/gpu_checks), and a table of results is printed last.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${GPU_CHECK_OUT:-/tmp/gpu_checks}"
limit="${GPU_CHECK_LIMIT_S:-240}"
steps="${GPU_CHECK_STEPS:-8}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
rows=()

summary_row() {  # summary_row NAME RUN_DIR: one table row from a run's summary.json
  python3 - "$1" "$2/summary.json" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
try:
  s = json.load(open(path))
except OSError:
  print(f"{name:<22} no summary (see its log)"); sys.exit()
mem = s.get("peak_device_memory_gib")
print(f"{name:<22} steps {s['steps_completed']:>3}  median step {s['median_step_time_s']:.3f} s  "
      f"TFLOP/s/dev {s['median_tflops_per_device'] or 0:7.1f}  peak {mem if mem is None else round(mem, 1)} GiB  "
      f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}")
PY
}

proxy_run() {  # proxy_run NAME OVERRIDES...: the 1xH200 proxy from the repo's source
  local name="$1"; shift
  (cd "$repo" && timeout "$limit" python3 -m MaxText.train configs/bench/proxy-1xh200.yml "$@" \
      steps="$steps" base_output_directory="$out/runs" run_name="$name") >"$out/$name.log" 2>&1
  echo "[gpu_checks] $name exit $?"
  grep -E "completed step|RESOURCE_EXHAUSTED|Error" "$out/$name.log" | tail -n 3
  rows+=("$(summary_row "$name" "$out/runs/$name")")
}

for item in "$@"; do
  echo "[gpu_checks] === $item ($(date -u +%H:%M:%S)) ==="
  case "$item" in
    tiny)
      SMOKE_STEPS=20 SMOKE_NO_TE=1 SMOKE_SELFTEST=0 SMOKE_OUT="$out/smoke" timeout "$limit" bash "$repo/docker/smoke.sh"
      rows+=("$(summary_row tiny "$out/smoke/runs/tiny")")
      ;;
    selftest)
      (cd "$repo" && timeout "$limit" python3 tools/gpu_selftest.py --backends mgpu,tokamax) 2>&1 | tee "$out/selftest.log" | grep -E "PASS|FAIL|^case|^ " | tail -n 40
      ;;
    tokamax)
      proxy_run proxy_tokamax use_tokamax_gmm=true
      ;;
    offload)
      # remat_policy=custom: the proxy config pins 'full', which would win over the preset.
      proxy_run proxy_tokamax_offload use_tokamax_gmm=true 'xla_presets=[host_offload]' remat_policy=custom
      ;;
    ours)
      proxy_run proxy_ours_mgpu moe_gmm_backend=mgpu
      ;;
    block)
      proxy_run proxy_block_mgpu moe_block=ours moe_gmm_backend=mgpu
      ;;
    selftest-small)
      (cd "$repo" && timeout "$limit" python3 tools/gpu_selftest.py --backends tokamax,mgpu --skip-large) 2>&1 | tee "$out/selftest-small.log" | grep -E "^(PASS|FAIL)" | tail -n 20
      ;;
    *) echo "unknown item '$item' (tiny, selftest, selftest-small, tokamax, offload, ours, block)"; exit 2 ;;
  esac
done

echo "[gpu_checks] === results ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1), $(python3 -c 'import jax; print("jax", jax.__version__)')) ==="
printf '%s\n' "${rows[@]}"
