#!/usr/bin/env python3
"""End-to-end training benchmark: upstream's MoE paths against ours, in one run.

Each variant is one `python -m MaxText.train <proxy config> <overrides>` run in
its own process (a fresh backend, its own run directory under --out); a
failure or out-of-memory in one variant is reported in its row and the rest go
on. A dense bf16 GEMM timed at the start calibrates MFU for this GPU.

  python3 tools/bench_train.py --steps 12 --out outputs/bench_train \
      --variants upstream_tokamax,ours,dense_equivalent
  python3 tools/bench_train.py --steps 200 --variants ours_load,ours_load_no_bias_update
  python3 tools/bench_train.py --config configs/bench/mixtral-proxy-1xh200.yml \
      --variants upstream_tokamax,ours,dense_equivalent      # another family's proxy: the same variants

Prints one table last: median step time after warm-up, TFLOP/s/device as
MaxText counts it, MFU against the measured dense-GEMM peak and against the
989 TF/s datasheet figure, tokens/s per device, peak device memory, and whether the
variant is dropless.

--profile: each variant also traces --profile-steps late steps (upstream's
xplane profiler) and dumps its optimized HLO into its run directory; the
step breakdown of each (grouped GEMM, dispatch/combine, routing, attention,
rest: tools/profile_breakdown.py) is printed before the table. The traced
steps run with the profiler on (and upstream blocks on the state around them),
so take the table's step times from a run without --profile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import profile_breakdown  # tools/ is sys.path[0] when run as a script
import yaml

REPO = Path(__file__).resolve().parent.parent
DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, NVIDIA datasheet
DEFAULT_CONFIG = "configs/bench/proxy-1xh200.yml"

# name -> (overrides, dropless?). Upstream keys are maxtext 0.2.5's; ours are
# MaxText/config/keys.py's. The upstream variants name moe_block=upstream: the family
# proxies' run configs run ours. "dense_equivalent" makes every layer a dense MLP
# of the same active width (here the DeepSeek-V3 proxy's 18432 = 8 routed x 2048
# + 1 shared x 2048): the FLOPs the MoE should cost; for another config it is
# computed from its model (dense_equivalent below).
VARIANTS: dict[str, tuple[list[str], bool]] = {
    "upstream_ragged": (["moe_block=upstream", "sparse_matmul=true", "megablox=false", "use_tokamax_gmm=false"], True),
    "upstream_tokamax": (["moe_block=upstream", "sparse_matmul=true", "megablox=false", "use_tokamax_gmm=true"], True),
    "upstream_capacity": (["moe_block=upstream", "sparse_matmul=false", "capacity_factor=1.0"], False),
    # moe_block=ours alone: grouped GEMM auto (mgpu on Hopper), dispatch auto (local without EP).
    "ours": (["moe_block=ours"], True),
    # The cost of the in-step MoE statistics (moe_metrics_every_n_steps, default 1): "ours" has them on.
    "ours_no_moe_metrics": (["moe_block=ours", "moe_metrics_every_n_steps=0"], True),
    # The proxy config pins remat_policy=full, which would win over the preset's custom.
    "ours_offload": (["moe_block=ours", "xla_presets=[host_offload]", "remat_policy=custom"], True),
    "ours_minimal": (["moe_block=ours", "remat_policy=minimal"], True),
    # The offload drift split (docs/cluster.md "Host offload, measured"): "ours" run twice is the run-to-run floor on this GPU;
    # custom remat keeping host_offload's saved names on the device separates what is recomputed from the host copy.
    "ours_repeat": (["moe_block=ours"], True),
    "ours_custom": (["moe_block=ours", "remat_policy=custom", "decoder_layer_input=device", "moe_mlpwi_0=device",
                     "moe_mlpwi_1=device"], True),
    # The 671B recipes' policy (configs/recipes/deepseek3-671b-common.yml): custom remat keeping only the layer inputs,
    # what full remat keeps; its loss against full remat's is what the recipes' Remat comment asks before a long run.
    "ours_custom_inputs": (["moe_block=ours", "remat_policy=custom", "decoder_layer_input=device", "moe_mlpwi_0=remat",
                            "moe_mlpwi_1=remat"], True),
    # Upstream's block with our grouped GEMM behind its gmm seam (patches/megablox_gmm.py).
    "ours_gmm_seam": (["moe_block=upstream", "moe_gmm_backend=auto"], True),
    # FP8 end to end (BENCHMARKS.md "FP8 end to end"): our block with its expert GEMMs in blockwise FP8 (mgpu_fp8),
    # against "ours" in bf16 in the same invocation. TFLOP/s counts the same (bf16-equivalent) FLOPs.
    "ours_fp8": (["moe_block=ours", "moe_fp8=blockwise"], True),
    "dense_equivalent": (["first_num_dense_layers=4", "base_mlp_dim=18432"], True),
    # Upstream's own DeepSeek-V3 routing (its model_name check, none of our seams), on its best
    # grouped GEMM: the reference for our V3 router's loss curve. override_model_config keeps our
    # keys; upstream's 671B file adds only YaRN keys that plain RoPE ignores.
    "upstream_deepseek3": (["moe_block=upstream", "model_name=deepseek3-671b", "override_model_config=true",
                            "moe_router=upstream",
                            "sparse_matmul=true", "megablox=false", "use_tokamax_gmm=true"], True),
    # Expert load (max/mean tokens per expert) with and without V3's bias update, on our block. The
    # load callback syncs the host once per MoE layer call: take step times from "ours".
    "ours_load": (["moe_block=ours", "moe_dispatch_backend=local", "moe_gmm_backend=auto",
                   "moe_log_expert_load=true"], True),
    "ours_load_no_bias_update": (["moe_block=ours", "moe_dispatch_backend=local", "moe_gmm_backend=auto",
                                  "moe_log_expert_load=true", "routed_bias_update_rate=0"], True),
}


def model_view(config_path: str) -> dict:
  """The model keys a run config resolves to: upstream's model file (model_name) under the run's own keys."""
  from MaxText import config as fork_config  # pylint: disable=import-outside-toplevel

  up = fork_config.load([config_path]).upstream
  name = up.get("model_name", "default")
  model_file = fork_config.upstream_configs_dir() / "models" / f"{name}.yml"
  return {**(yaml.safe_load(model_file.read_text()) if name != "default" else {}), **up}


def dense_equivalent(c: dict) -> list[str]:
  """Overrides that make a model dense at its MoE layers' active width: the K routed and the shared experts of
  width F become one MLP of (K + shared) x F, with the same attention, the FLOPs its MoE should cost (every layer
  at that width: the proxies have an MoE in every layer past DeepSeek's leading dense ones). Each family's dense
  sibling in upstream, one expert (num_experts 1) so that upstream checks no MoE widths: Qwen3's dense layer (the
  same QK-norm attention), Mistral's for Mixtral, Llama's for Llama 4 (its NoPE layers and chunked attention
  differ in no FLOP at the proxy's 4096 tokens, under its 8192 window: a Llama 4 layer cannot be dense in every
  layer, upstream makes the last of each interleave step MoE). GPT-OSS has no dense layer upstream: its stand-in
  is one expert of that width that every token takes (the dispatch still sorts, an identity)."""
  block, layers = c.get("decoder_block", "default"), c["base_num_decoder_layers"]
  k, shared = c["num_experts_per_tok"], c.get("shared_experts", 0)
  width = (k + shared) * c["base_moe_mlp_dim"]
  one_expert = ["num_experts=1", "num_experts_per_tok=1"]
  per_family = {
      "deepseek": [f"first_num_dense_layers={layers}"],  # DeepSeek-V2/V3, Kimi-K2: its leading dense layers
      "qwen3_moe": ["decoder_block=qwen3", *one_expert],
      "mixtral": ["decoder_block=mistral", *one_expert],
      # upstream scans num_decoder_layers / inhomogeneous_layer_cycle_interval blocks (nnx_decoders.py's
      # _init_scanned_generic); Llama 4's interval of 4 made Llama 2's one-layer block one layer of four.
      "llama4": ["decoder_block=llama2", *one_expert, "inhomogeneous_layer_cycle_interval=1"],
      "gpt_oss": [*one_expert, f"base_moe_mlp_dim={width}"],  # its MoE reads moe_mlp_dim
  }
  if block not in per_family:
    raise ValueError(f"no dense equivalent known for decoder_block {block!r}; one of {', '.join(per_family)}")
  return [*per_family[block], f"base_mlp_dim={width}"]


def variant_overrides(name: str, config_path: str) -> list[str]:
  """VARIANTS[name]'s overrides; the dense equivalent is computed from the config's model."""
  if name == "dense_equivalent":
    return ["moe_block=upstream", *dense_equivalent(model_view(config_path))]
  if name.startswith("upstream") and model_view(config_path).get("decoder_block") == "gpt_oss":
    # Upstream alone refuses GPT-OSS's attention sinks in cudnn_flash_jax (patches/attention_sinks.py runs them in
    # our fused kernel): without Transformer Engine its GPU path for them is dot_product.
    return [*VARIANTS[name][0], "attention=dot_product"]
  return VARIANTS[name][0]


def dense_gemm_peak_tflops(size: int = 8192, reps: int = 20) -> float | None:
  """Median bf16 TF/s of an N^3 matmul on random data (never zeros), or None
  off GPU. Measured in a child process: a JAX client in this process would
  hold most of the GPU's memory (preallocation) while the variants run."""
  code = f"""
import statistics, time, jax, jax.numpy as jnp
if jax.default_backend() != "gpu":
  raise SystemExit(0)
ka, kb = jax.random.split(jax.random.PRNGKey(0))
a = jax.random.normal(ka, ({size}, {size}), jnp.bfloat16)
b = jax.random.normal(kb, ({size}, {size}), jnp.bfloat16)
matmul = jax.jit(lambda x, y: x @ y)
matmul(a, b).block_until_ready()
times = []
for _ in range({reps}):
  start = time.perf_counter()
  matmul(a, b).block_until_ready()
  times.append(time.perf_counter() - start)
print(2 * {size}**3 / statistics.median(times) / 1e12)
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
  lines = proc.stdout.strip().splitlines()
  return float(lines[-1]) if proc.returncode == 0 and lines else None


def profile_overrides(args) -> list[str]:
  """Upstream's xplane profiler over late steps, and an HLO dump of the step
  (our entry point puts it in the run directory and sets the flags before the
  backend starts)."""
  skip = max(args.steps - args.profile_steps - 1, 1)
  # With XLA's command buffers on, a CUDA graph of many fusions is traced as one event
  # (an H200 trace put 58% of ours' step in "command_buffer_*"), so the traced run turns
  # them off to attribute each kernel; its step time is then not the table's.
  return ["xla_presets=[no_command_buffers]", "profiler=xplane", f"skip_first_n_steps_for_profiler={skip}", f"profiler_steps={args.profile_steps}",
          "dump_hlo=true", "dump_hlo_local_module_name=jit_train_step"]


def run_variant(name: str, overrides: list[str], args) -> dict:
  run_name = f"{name}-{time.strftime('%H%M%S')}"
  if args.profile:
    overrides = [*overrides, *profile_overrides(args)]
  cmd = [sys.executable, "-m", "MaxText.train", args.config, *overrides, *args.extra,
         f"steps={args.steps}", f"base_output_directory={args.out}", f"run_name={run_name}",
         "enable_checkpointing=false"]
  log_path = Path(args.out) / f"{run_name}.log"
  log_path.parent.mkdir(parents=True, exist_ok=True)
  started = time.monotonic()
  with open(log_path, "w") as log:
    try:
      proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                            check=False)
      returncode = proc.returncode
    except subprocess.TimeoutExpired:
      returncode = "timeout"
  row = {"variant": name, "returncode": returncode, "wall_s": time.monotonic() - started, "log": str(log_path)}
  summary_path = Path(args.out) / run_name / "summary.json"
  if returncode == 0 and summary_path.exists():
    row.update(json.loads(summary_path.read_text()))
    if args.profile:
      try:
        row["breakdown"] = profile_breakdown.breakdown(Path(args.out) / run_name)
      except (OSError, ValueError, RuntimeError) as e:  # a missing trace must not cost the table
        row["breakdown_error"] = f"{type(e).__name__}: {e}"
  else:
    tail = log_path.read_text(errors="replace").strip().splitlines()[-200:]
    oom = any("RESOURCE_EXHAUSTED" in line or "out of memory" in line.lower() for line in tail)
    row["error"] = "out of memory" if oom else (tail[-1][:160] if tail else "no output")
    if returncode == "timeout":
      row["error"] = timeout_note(args.timeout, tail)
  return row


def timeout_note(limit_s: int, tail: list[str]) -> str:
  """What a variant cut by --timeout had reached: its limit beside the last step it trained, or that it was still
  compiling (a fresh machine's first compile autotunes every GEMM: 100-150 s for the proxy on an H200)."""
  steps = [line for line in tail if line.startswith("[progress] step")]
  reached = steps[-1].split(":")[0].replace("[progress] ", "reached ") if steps else "still compiling"
  return f"ran past --timeout {limit_s} s ({reached})"



def steady_stats(row: dict, warmup: int) -> dict:
  """Median step time and TFLOP/s over steps after `warmup`, from the run's losses/timings."""
  out = {}
  if "median_step_time_s" in row:
    out["step_s"] = row["median_step_time_s"]
    out["tflops"] = row.get("median_tflops_per_device")
  del warmup  # the run summary already excludes the compile step
  return out


# The calibration GEMM read 524-655 TF/s in three calls on one H200 (BENCHMARKS.md D6, E0, D7): a row is held to
# the run's reading with that spread allowed.
CALIBRATION_SPREAD = 1.25


def above_peak_note(tflops: float | None, peak: float | None) -> str:
  """A row faster than the dense GEMM measured in the same run (past its spread) did not run the FLOPs MaxText
  counts for it (the Llama 4 dense equivalent once ran one layer of four: 1,024 TFLOP/s/device, a 524 TF/s GEMM)."""
  if not tflops or not peak or tflops <= CALIBRATION_SPREAD * peak:
    return ""
  return f"{tflops:.0f} TFLOP/s is above the dense GEMM measured in this run ({peak:.0f}): its count is not what ran"


def format_table(rows: list[dict], peak: float | None, tokens_per_step: int | None) -> str:
  header = f"{'variant':<20} {'step s':>8} {'TFLOP/s':>8} {'MFU/meas':>9} {'MFU/989':>8} {'tok/s/dev':>9} {'peak GiB':>9} {'dropless':>8}  note"
  lines = [header, "-" * len(header)]
  for row in rows:
    stats = steady_stats(row, 0)
    if not stats:
      lines.append(f"{row['variant']:<20} {'-':>8} {'-':>8} {'-':>9} {'-':>8} {'-':>9} {'-':>9} {str(row['dropless']):>8}  {row.get('error', '')}")
      continue
    tflops = stats.get("tflops") or 0.0
    # MaxText's own tokens/s/device (summary.json); --tokens-per-step only for older summaries.
    tok_s = row.get("median_tokens_per_s_per_device") or (
        tokens_per_step / stats["step_s"] if tokens_per_step else float("nan"))
    mfu_meas = f"{tflops / peak:.3f}" if peak else "-"
    peak_gib = row.get("peak_device_memory_gib")
    lines.append(
        f"{row['variant']:<20} {stats['step_s']:>8.3f} {tflops:>8.1f} {mfu_meas:>9} {tflops / DATASHEET_BF16_TFLOPS:>8.3f} "
        f"{tok_s:>9.0f} {(f'{peak_gib:.1f}' if peak_gib else '-'):>9} {str(row['dropless']):>8}  "
        f"{above_peak_note(tflops, peak)}".rstrip()
    )
  if peak:
    lines.append(f"dense bf16 GEMM 8192^3 measured in this run: {peak:.0f} TF/s (MFU/meas is against this)")
  return "\n".join(lines)


def format_losses(rows: list[dict], loss_ref: str | None = None) -> str:
  """Per-step losses of every variant that trained, and each one's largest |difference| from
  `loss_ref` (default: the first upstream variant in the run; same data and seed; dense_equivalent is
  another model, so its difference is not a correctness figure). Gradient norms, where the runs logged
  them, follow the losses: a difference at step 0 is the backward's, before any update compounds it."""
  trained = [r for r in rows if r.get("losses")]
  if not trained:
    return ""
  ref = next((r for r in trained if r["variant"] == loss_ref), None) or next(
      (r for r in trained if r["variant"].startswith("upstream")), trained[0])
  steps = sorted({int(s) for r in trained for s in r["losses"]})
  lines = ["loss by step " + " ".join(f"{r['variant']:>17}" for r in trained)]
  for step in steps:
    cells = (r["losses"].get(str(step)) for r in trained)
    lines.append(f"{step:>12} " + " ".join(f"{v:>17.4f}" if v is not None else f"{'-':>17}" for v in cells))
  if ref.get("grad_norms"):
    first = min(ref["grad_norms"], key=int)
    lines.append(f"gradient norm at step {first}: " + ", ".join(
        f"{r['variant']} {r['grad_norms'][first]:.6g}" for r in trained if first in r.get("grad_norms", {})))
  for r in trained:
    if r is ref:
      continue
    common = sorted((s for s in r["losses"] if s in ref["losses"]), key=int)
    if common:
      worst = max(abs(r["losses"][s] - ref["losses"][s]) for s in common)
      lines.append(f"max |loss - {ref['variant']}| over {len(common)} steps, {r['variant']}: {worst:.4f}")
      # DeepSeek-V3 states FP8 against bf16 as a relative loss error (< 0.25%): per step, same batches,
      # over the last tenth of the run, where the curves have left their first fall.
      tail = common[-max(1, len(common) // 10):]
      rel = [(r["losses"][s] - ref["losses"][s]) / ref["losses"][s] for s in tail]
      lines.append(f"(loss - {ref['variant']}) / {ref['variant']} over the last {len(tail)} steps, {r['variant']}: "
                   f"mean {100 * sum(rel) / len(rel):+.3f}%, largest |.| {100 * max(map(abs, rel)):.3f}%")
  return "\n".join(lines)


def format_expert_load(rows: list[dict]) -> str:
  """Max/mean tokens per expert at the start and the end of each run that logged it (moe_log_expert_load)."""
  lines = [f"expert load {r['variant']}: max/mean tokens per expert {load['max_over_mean_first_tenth']:.2f} "
           f"(first tenth of {load['layer_calls']} MoE layer calls) -> {load['max_over_mean_last_tenth']:.2f} (last tenth)"
           for r in rows if (load := r.get("expert_load"))]
  return "\n".join(lines)


def main() -> int:
  # Lines reach a redirected log even when a time limit kills the run.
  sys.stdout.reconfigure(line_buffering=True)
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=DEFAULT_CONFIG)
  parser.add_argument("--variants", default="upstream_tokamax,ours,dense_equivalent",
                      help=f"comma-separated, from: {', '.join(VARIANTS)}")
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--out", default="outputs/bench_train")
  parser.add_argument("--timeout", type=int, default=900,
                      help="seconds per variant, compile included (a fresh machine's first compile autotunes: allow 150+)")
  parser.add_argument("--tokens-per-step", type=int, default=16384,
                      help="global tokens per step (batch x seq); only used when a run's summary lacks MaxText's "
                           "tokens/s/device")
  parser.add_argument("--profile", action="store_true", help="trace late steps and print each variant's step breakdown")
  parser.add_argument("--profile-steps", type=int, default=3, help="steps traced per variant with --profile")
  parser.add_argument("--loss-ref", default=None, help="the variant the losses are compared with (default: the first "
                      "upstream variant)")
  parser.add_argument("extra", nargs="*", help="key=value overrides applied to every variant")
  args = parser.parse_args()
  args.out = str(Path(args.out).absolute())

  names = [n.strip() for n in args.variants.split(",") if n.strip()]
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    parser.error(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")

  peak = dense_gemm_peak_tflops()
  rows = []
  for name in names:
    overrides, dropless = variant_overrides(name, args.config), VARIANTS[name][1]
    print(f"[bench_train] {name}: {' '.join(overrides)}", flush=True)
    row = run_variant(name, overrides, args)
    row["dropless"] = dropless
    rows.append(row)
    print(f"[bench_train] {name}: rc={row['returncode']} {row.get('error', '')}", flush=True)

  Path(args.out).mkdir(parents=True, exist_ok=True)
  (Path(args.out) / "bench_train.json").write_text(json.dumps({"peak_tflops": peak, "rows": rows}, indent=2, default=str))
  if args.profile:  # before the table, so the table stays the last thing printed
    for row in rows:
      if "breakdown" in row:
        print(profile_breakdown.format_breakdown(row["breakdown"], title=row["variant"]) + "\n")
      else:
        print(f"step breakdown {row['variant']}: none ({row.get('breakdown_error') or row.get('error', 'run failed')})\n")
  print(format_losses(rows, args.loss_ref) + "\n")
  if format_expert_load(rows):
    print(format_expert_load(rows) + "\n")
  print(format_table(rows, peak, args.tokens_per_step))
  return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  sys.exit(main())
