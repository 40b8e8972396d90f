#!/usr/bin/env bash
# GPU checks recorded in BENCHMARKS.md, run on one H200 with the project's
# wheelhouse installed (scripts/wheelhouse; the node's image provides JAX/CUDA)
# into the venv that wheelhouse/INSTALL.txt makes, and that venv active:
#   source /tmp/venv/bin/activate && bash tools/gpu_checks.sh ...
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
#   plan-honesty    the planner on the 1xH200 proxy (ours) next to a real bench_train.py run of it:
#                   compiler memory / measured peak, estimated / measured step time
#   plan-ep         the planner on the proxy's multi-GPU layouts with moe_block=ours, each on this one
#                   GPU: FSDP 2, EP 2, FSDP 2 x EP 2, EP 8
#   plan-fp8        the planner with moe_fp8=blockwise on the proxy's EP=2 and EP=8 layouts, on this GPU with a mocked
#                   topology (its own autotuning and memory; EP=8 compiles for over 190 s, so its limit is
#                   GPU_CHECK_PLAN_FP8_S, default 420 s)
#   plan-recipes    every shipped recipe re-planned compile-only, GPU_CHECK_PLAN_JOBS (default 12) at a time
#                   (tools/replan_recipes.py): the summaries to $GPU_CHECK_OUT/summaries, for configs/recipes/plans/
#   te        Transformer Engine (source tools/te_offline/install.sh first): te_ncclep up to ep_bootstrap
#             (tools/te_ep_probe.py), the self-test for te and mgpu, and bench_gmm's DeepSeek-V3 set for
#             both in one process (its own limit, GPU_CHECK_TE_BENCH_S, default 540 s)
#   fp8       the blockwise-FP8 kernels (the self-test's cases for mgpu_fp8; tools/bench_fp8.py: PASS/FAIL per case, speed against dense bf16/FP8
#             and our bf16 kernels), then the proxy with FP8 experts against ours in bf16 (bench_train.py
#             --variants ours,ours_fp8, 100 steps: step time and the loss curves side by side)
#   fp8-profile  the proxy with FP8 experts, 8 steps, 2 of them traced (bench_train.py --profile): the step's
#             breakdown, and each trace copied to $GPU_CHECK_OUT/traces/ (the device tool returns files at most
#             a few folders deep; the run's own trace sits seven down). The tool returns at most 8 files: run this
#             item alone, or with GPU_CHECK_OUT apart from $OUT for the others (a run once lost the trace to a 9th file)
#   fp8-gmm   bench_gmm's FFN run: --quick --ffn-only (the expert FFN fwd+bwd, Zipf-1.2) for mgpu and mgpu_fp8
#             in one process, FP8 quantization inside the timed calls (its own limit, GPU_CHECK_FP8_GMM_S, default 540 s;
#             the GEMM rows: bench_gmm.py --quick --backends mgpu,mgpu_fp8 without --ffn-only)
#   fp8-text  FP8's loss tolerance on text it cannot memorize: the proxy with FP8 experts against ours
#             in bf16, 100 steps each, on real text (tools/text_corpus.py: this machine's Python standard library, or
#             the ArrayRecord file GPU_CHECK_CORPUS names), Llama 2's tokenizer from the maxtext wheel (vocab 32,000);
#             its own limit, GPU_CHECK_FP8_TEXT_S, default 540 s
#   fp8-quant the one-pass FP8 quantization kernels at the proxy's shapes against XLA's x * 2, and the weights'
#             blocks in both layouts, the step's one-pass kernel against XLA's passes (tools/bench_quant.py)
#   sinks     attention with sinks (GPT-OSS's heads and window) through jax's cuDNN and our custom VJP against a
#             float32 reference, forward and gradients (tools/sinks_selftest.py: PASS/FAIL per case); with
#             Transformer Engine installed, TE's learnable softmax too
#   te-block  the 1xH200 proxy on upstream's te_moe_block path (TE's MoE block; it bootstraps NCCL EP, so
#             one process is refused by our config check: this item shows that refusal on one GPU)
#
# Each item has a time limit (GPU_CHECK_LIMIT_S, default 240 s); logs go to
# $GPU_CHECK_OUT (default outputs/gpu_checks under the repository), and a table of results is printed last.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${GPU_CHECK_OUT:-$repo/outputs/gpu_checks}"
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
  grep -E "\[progress\] step|RESOURCE_EXHAUSTED|Error" "$out/$name.log" | tail -n 3
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
    plan-honesty)
      ours=(moe_block=ours moe_dispatch_backend=local moe_gmm_backend=auto)
      (cd "$repo" && timeout "$limit" python3 -m MaxText.plan configs/bench/proxy-1xh200.yml "${ours[@]}" \
          --json "$out/plan-proxy.json") >"$out/plan-proxy.log" 2>&1
      echo "[gpu_checks] plan exit $?"; grep -E "verdict|estimate:|TFLOP/s/GPU|device_total" "$out/plan-proxy.log"
      (cd "$repo" && python3 tools/bench_train.py --variants ours --steps 20 --out "$out/bt") >"$out/bt.log" 2>&1
      echo "[gpu_checks] bench_train exit $?"; tail -n 4 "$out/bt.log"
      rows+=("$(python3 - "$out/plan-proxy.json" "$out/bt/bench_train.json" <<'PY'
import json, sys
plan, bench = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
row = bench["rows"][0]
mem = plan["memory"]["device_total"] / 2**30
est = plan["estimate"]
print(f"plan-honesty  compiler {mem:.1f} GiB / measured peak {row['peak_device_memory_gib']:.1f} GiB = "
      f"{mem / row['peak_device_memory_gib']:.3f};  estimated step {est['step_s']:.3f} s (compute "
      f"{est['compute_s']:.3f}, collectives {est['collectives_s']:.3f}) / measured {row['step_s']:.3f} s = "
      f"{est['step_s'] / row['step_s']:.3f};  TFLOP/s est {est['tflops_per_gpu']:.1f} / measured {row['tflops']:.1f}")
PY
)")
      ;;
    plan-ep)
      ours=(moe_block=ours moe_gmm_backend=mgpu)
      for layout in "fsdp2 proxy-1xh200.yml recipe_num_gpus=2 ici_fsdp_parallelism=2" \
                    "ep2 proxy-2xh200-ep2.yml" \
                    "fsdp2xep2 proxy-2xh200-ep2.yml recipe_num_gpus=4 ici_fsdp_parallelism=2" \
                    "ep8 proxy-8xh200-ep8.yml"; do
        set -- $layout; name=$1; cfg=$2; shift 2
        (cd "$repo" && timeout "$limit" python3 -m MaxText.plan "configs/bench/$cfg" "${ours[@]}" "$@" \
            --json "$out/plan-$name.json") >"$out/plan-$name.log" 2>&1
        rc=$?
        rows+=("plan-$name exit $rc  $(grep -E "verdict|^estimate|compiled on|plan error" "$out/plan-$name.log" | tr '\n' ' ' | cut -c1-300)")
      done
      ;;
    plan-fp8)
      for cfg in proxy-2xh200-ep2 proxy-8xh200-ep8; do
        (cd "$repo" && timeout "${GPU_CHECK_PLAN_FP8_S:-420}" python3 -m MaxText.plan "configs/bench/$cfg.yml" moe_block=ours \
            moe_fp8=blockwise --mock --timeout $((${GPU_CHECK_PLAN_FP8_S:-420} - 20)) --json "$out/plan-$cfg-fp8.json") \
            >"$out/plan-$cfg-fp8.log" 2>&1
        rc=$?
        rows+=("plan-$cfg-fp8 exit $rc  $(grep -E "verdict|^estimate|compiled on|plan error" "$out/plan-$cfg-fp8.log" | tr '\n' ' ' | cut -c1-300)")
      done
      ;;
    plan-recipes)
      # All twelve at once, compile-only (no GPU used): one core and ~2.5 GB of host memory a plan.
      (cd "$repo" && python3 tools/replan_recipes.py --jobs "${GPU_CHECK_PLAN_JOBS:-12}" --timeout $((limit - 60)) \
          --plans "$out/plans" --out "$out/summaries") 2>&1 | tee "$out/plan-recipes.log"
      rows+=("plan-recipes exit ${PIPESTATUS[0]}  $(grep -c "account holds" "$out/plan-recipes.log") of 12 planned, account holds")
      ;;
    te)
      (cd "$repo" && timeout "$limit" python3 tools/te_ep_probe.py) 2>&1 | tee "$out/te_ep_probe.log" | grep -E "^(PASS|FAIL)|bootstrap"
      (cd "$repo" && timeout "$limit" python3 tools/gpu_selftest.py --backends te,mgpu) 2>&1 | tee "$out/selftest-te.log" | grep -E "^case|^[a-z].*(PASS|FAIL)" | tail -n 16
      (cd "$repo" && timeout "${GPU_CHECK_TE_BENCH_S:-540}" python3 tools/bench_gmm.py --quick --backends mgpu,te \
          --passes fwd,bwd --out "$out/gmm-te") 2>&1 | tee "$out/bench_gmm-te.log" | grep -E " (dense|mgpu|te) " | tail -n 24
      ;;
    fp8)
      (cd "$repo" && timeout "$limit" python3 tools/gpu_selftest.py --backends mgpu_fp8) 2>&1 | tee "$out/selftest-fp8.log" \
          | grep -E "^(PASS|FAIL|ALL|[0-9]+ FAILED|INCOMPLETE)"
      (cd "$repo" && timeout "$limit" python3 tools/bench_fp8.py --out "$out/fp8") 2>&1 | tee "$out/bench_fp8.log" \
          | grep -E "^(FAIL|checks)|M=65536|dW:"
      python3 "$repo/tools/fp8_account.py" "$out/fp8/bench_fp8.json"  # the proxy's per-step account from those times
      (cd "$repo" && timeout "${GPU_CHECK_FP8_TRAIN_S:-540}" python3 tools/bench_train.py --variants ours,ours_fp8 \
          --steps 100 --out "$out/bt-fp8") >"$out/bt-fp8.log" 2>&1
      echo "[gpu_checks] bench_train fp8 exit $?"; tail -n 6 "$out/bt-fp8.log"
      ;;
    fp8-profile)
      (cd "$repo" && timeout "$limit" python3 tools/bench_train.py --variants ours_fp8 --steps 8 --profile \
          --profile-steps 2 --timeout $((limit - 10)) --out "$out/prof-fp8") >"$out/prof-fp8.log" 2>&1
      echo "[gpu_checks] bench_train fp8 profile exit $?"; grep -A 8 "^step breakdown" "$out/prof-fp8.log"
      mkdir -p "$out/traces"
      find "$out/prof-fp8" -name '*.trace.json.gz' -exec cp {} "$out/traces/" \;
      ls "$out/traces"
      ;;
    fp8-gmm)
      # The FFN rows alone (BENCHMARKS.md "FP8 end to end"), in a call of its own. The case once printed nothing in
      # 330 s, then in 530 s: its float32 reference had a product shape per Zipf group for XLA to compile and
      # autotune; since 05de17b one shape per product, and each phase's time is printed.
      (cd "$repo" && timeout "${GPU_CHECK_FP8_GMM_S:-540}" python3 tools/bench_gmm.py --quick --ffn-only \
          --backends mgpu,mgpu_fp8 --out "$out/gmm-fp8") 2>&1 | tee "$out/bench_gmm-fp8.log" \
          | grep -E " (dense|mgpu|mgpu_fp8) " | tail -n 24
      ;;
    fp8-text)
      corpus="${GPU_CHECK_CORPUS:-$out/text.array_record}"
      [ -f "$corpus" ] || python3 "$repo/tools/text_corpus.py" "$corpus"
      tok=$(cd "$repo/tests" && python3 -c "import text_fixture; print(text_fixture.tokenizer_path())")
      (cd "$repo" && timeout "${GPU_CHECK_FP8_TEXT_S:-540}" python3 tools/bench_train.py --variants ours,ours_fp8 \
          --steps 100 --timeout 260 --out "$out/bt-fp8-text" dataset_type=grain grain_file_type=arrayrecord \
          grain_train_files="$corpus" grain_worker_count=1 tokenizer_type=sentencepiece tokenizer_path="$tok" \
          vocab_size=32000) >"$out/bt-fp8-text.log" 2>&1
      echo "[gpu_checks] bench_train fp8 on text exit $?"
      grep -E "^(max|\(loss)" "$out/bt-fp8-text.log"; tail -n 5 "$out/bt-fp8-text.log"
      ;;
    fp8-quant)
      (cd "$repo" && timeout "$limit" python3 tools/bench_quant.py --out "$out/quant") 2>&1 | tee "$out/bench_quant.log" \
          | tail -n 12
      ;;
    sinks)
      kernels=cudnn; python3 -c "import transformer_engine.jax" 2>/dev/null && kernels=cudnn,te
      (cd "$repo" && timeout "$limit" python3 tools/sinks_selftest.py --kernels "$kernels") 2>&1 | tee "$out/sinks.log" \
          | grep -E "^(jax|PASS|FAIL|ALL|[0-9]+ FAILED|sinks_selftest)"
      rows+=("sinks $(tail -n 1 "$out/sinks.log")")
      ;;
    te-block)
      # The keys upstream's te_moe_block requires. Two of them depart from DeepSeek-V3 as published
      # (no bias update, no top-k renormalisation): TE's block supports neither. In one process our
      # config check refuses it (TE's NCCL EP needs >= 2 processes), which is what one GPU can show.
      proxy_run proxy_te_block moe_block=te te_moe_block=true prefuse_moe_weights=true \
          te_gmm_quantization=te_no_quant routed_bias_update_rate=0.0 norm_topk_prob=false
      ;;
    *) echo "unknown item '$item' (tiny, selftest, selftest-small, tokamax, offload, ours, block, plan-honesty, plan-ep, plan-fp8, plan-recipes, te, fp8, fp8-profile, fp8-gmm, fp8-text, sinks, te-block)"; exit 2 ;;
  esac
done

echo "[gpu_checks] === results ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1), $(python3 -c 'import jax; print("jax", jax.__version__)')) ==="
printf '%s\n' "${rows[@]}"
