"""The GPUs we know, each figure with where it came from: HBM, GEMM and attention rates, links, and the datasheet
peaks MFU is measured against. Below both the run (MaxText/run/loop.py's MFU) and the planner; imports neither.

MaxText/plan/planner.py turns a compiled step into a verdict, and MaxText/plan/schedule.py
into a step time, with these:
  fits        compiler bytes per device <= HBM x XLA_PYTHON_CLIENT_MEM_FRACTION
  GEMMs       FLOPs / the measured dense bf16 GEMM rate; with moe_fp8=blockwise
              our grouped GEMMs at the measured FP8 rate instead
  attention   cuDNN flash attention's FLOPs / its measured rate
  memory      bytes read and written by every other op / the HBM rate XLA's
              fusions reach
  collectives wire bytes per device / the link's bandwidth (NVLink inside a
              node, InfiniBand across), per kind where a kind was measured;
              host offload's copies at PCIe's
A collective whose group spans nodes moves its wire bytes over InfiniBand: a
ring (all-gather, reduce-scatter, all-reduce) at the rate of its members' NICs
on a node together (one NIC a GPU; hlo_inventory.nics_per_member), an
all-to-all or a permute at its own NIC's. Simplification: the ring's hops
inside a node are not the bound (NVLink is faster than the NICs they share).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

GpuName = Literal["h100", "h200", "b200"]
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Figure:
  value: float
  source: str


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU model in an HGX/DGX node (8 GPUs, one 400 Gb/s NIC each).

  Attributes:
    hbm_bytes: device memory (jax's allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION of it).
    gemm_flops: dense bf16 GEMM rate, FLOP/s.
    nvlink_bytes: per-GPU NVLink bandwidth, one direction, B/s.
    ib_bytes: per-GPU InfiniBand bandwidth, one direction, B/s.
    a2a_nvlink_bytes: jax.lax.all_to_all inside a node, B/s (None: nvlink_bytes).
    ragged_a2a_bytes: jax.lax.ragged_all_to_all, B/s (None: as all_to_all).
    fp8_grouped_flops: the routed experts' GEMMs under moe_fp8=fp8_recipe, FLOP/s, their quantization passes
      included (None: no FP8 grouped GEMM runs on this GPU).
    fp8_recipe: the moe_fp8 this GPU runs: "blockwise" (our sm_90a kernels) or "mxfp8" (TE on Blackwell).
    hbm_bandwidth: bytes read + written per second by memory-bound XLA fusions, B/s.
    attention_flops: cuDNN flash attention, FLOP/s.
    host_bytes: host offload's copies, one direction, B/s.
    a2a_ib_share: an all-to-all across nodes, the share of ib_bytes it reaches (None: 1).
  """

  name: str
  hbm_bytes: Figure
  gemm_flops: Figure
  nvlink_bytes: Figure
  ib_bytes: Figure
  a2a_nvlink_bytes: Figure | None = None
  ragged_a2a_bytes: Figure | None = None
  fp8_grouped_flops: Figure | None = None
  hbm_bandwidth: Figure | None = None
  attention_flops: Figure | None = None
  host_bytes: Figure | None = None
  a2a_ib_share: Figure | None = None
  fp8_recipe: str | None = None

  def figures(self) -> dict[str, Figure]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Figure)}


# Measured on one H200 by tools/bench_train.py (BENCHMARKS.md "End to end on one H200", its
# calibration GEMM; commit 7dd98d6): dense bf16 GEMM 8192^3 at 648 TF/s (562-716 across runs).
_H200_GEMM = Figure(648e12, "measured: dense bf16 GEMM 8192^3 on one H200, BENCHMARKS.md (7dd98d6)")
_IB_NDR = Figure(50 * GB, "datasheet: one 400 Gb/s NDR ConnectX-7 per GPU (HGX/DGX), one direction")
# Measured on 2xH200 (NVLink), jax 0.11.2, 0.47 GB per device, balanced: all_to_all 3 ms,
# ragged_all_to_all 88 ms for the same bytes (team measurement of 2026-12-01).
_A2A_H200 = Figure(150 * GB, "measured: jax.lax.all_to_all, 2xH200 NVLink, 0.47 GB/device")
_RAGGED_H200 = Figure(5.3 * GB, "measured: jax.lax.ragged_all_to_all, 2xH200 NVLink, 0.47 GB/device")
# What moe_fp8 costs end to end, on the scale of the bf16 rate above: what a step gains, not the kernels' rate
# (820-915 TF/s alone promised 45 ms per step on 2026-12-02, where 6 came). The proxy's routed GEMMs take 219.5 ms
# per step with our bf16 kernels (its profile, tools/bench_train.py --profile). On one H200 at b891976 (2026-12-03;
# bench_train.py --variants ours,ours_fp8, 100 steps, the local dispatch moving e4m3 rows as uint32 words;
# BENCHMARKS.md "Planner accuracy"): 0.7666 -> 0.7086 s per step, 58.0 ms saved, all of it charged to the routed
# GEMMs with the quantization passes FP8 adds.
_H200_FP8_GROUPED = Figure(_H200_GEMM.value * 219.5 / (219.5 - 58.0), "measured: the routed GEMMs with their FP8 "
                           "quantization at 1.36x our bf16 kernels on one H200 (the proxy step 1.082x, b891976; "
                           "BENCHMARKS.md \"Planner accuracy\"), on the dense bf16 rate's scale")

# Memory-bound work (every XLA fusion that is not a GEMM) at the rate XLA's own fusions reach on one H200:
# bf16 x * 2 over [131072, K], 2 B read and 2 B written a value, 3.3 TB/s (tools/bench_quant.py's reference
# pass, BENCHMARKS.md "FP8 kernels"); the datasheet's 4.8 TB/s HBM3e is a roof XLA's fusions do not reach.
_H200_XLA_HBM = Figure(3.3e12, "measured: XLA's bf16 x * 2 over [131072, K] on one H200 (tools/bench_quant.py, "
                       "BENCHMARKS.md FP8 kernels); datasheet 4.8 TB/s")
_XLA_HBM_SHARE = 3.3 / 4.8
# cuDNN flash attention in the 1xH200 proxy's step: 120.0 ms per step in its profile (BENCHMARKS.md, the op-by-op
# table of ours against dense, efee304: `bench_train.py --variants ours,dense_equivalent --profile`, then
# tools/diff_profiles.py) for the 47.83 TFLOP that schedule.attention_flops reads in the compiled step
# (causal; batch 4, 128 heads, 4,096 tokens, Dqk 192, Dv 128; 7 forward and 4 backward calls).
_H200_ATTENTION = Figure(47.83e12 / 0.1200, "measured: cuDNN flash attention in the 1xH200 proxy's profile, 120.0 ms "
                         "per step for 47.83 TFLOP (causal, Dqk 192, Dv 128; BENCHMARKS.md, efee304)")
_PCIE5 = Figure(64 * GB, "datasheet: PCIe Gen5 x16, 128 GB/s bidirectional (host offload's copies)")
_A2A_IB = Figure(1.0, "assumed, not measured: an all-to-all across nodes at the NIC's full rate (the plan's "
                 "sensitivity line shows 0.5)")

GPUS: dict[str, Gpu] = {
    "h100": Gpu(
        "H100 SXM 80 GB",
        hbm_bytes=Figure(80 * 2**30, "datasheet: 80 GB HBM3 (80 GiB)"),
        gemm_flops=Figure(648e12, "the H200's measured rate: same GH100 SMs and clocks (989 TF/s datasheet both)"),
        nvlink_bytes=Figure(450 * GB, "datasheet: NVLink 4, 900 GB/s bidirectional"),
        ib_bytes=_IB_NDR,
        a2a_nvlink_bytes=Figure(150 * GB, "the H200's measured all_to_all (same NVLink 4)"),
        ragged_a2a_bytes=Figure(5.3 * GB, "the H200's measured ragged_all_to_all (same NVLink 4)"),
        fp8_grouped_flops=Figure(_H200_FP8_GROUPED.value, "the H200's measured moe_fp8 rate (same GH100 SMs and clocks)"),
        hbm_bandwidth=Figure(3.35e12 * _XLA_HBM_SHARE, "not measured: datasheet 3.35 TB/s x the share of its datasheet "
                             "the H200's XLA fusions reach (3.3 of 4.8 TB/s)"),
        attention_flops=Figure(_H200_ATTENTION.value, "the H200's measured cuDNN attention rate (same GH100 SMs and clocks)"),
        host_bytes=_PCIE5,
        a2a_ib_share=_A2A_IB,
        fp8_recipe="blockwise",
    ),
    "h200": Gpu(
        "H200 SXM 141 GB",
        hbm_bytes=Figure(141 * GB, "datasheet: 141 GB HBM3e"),
        gemm_flops=_H200_GEMM,
        nvlink_bytes=Figure(450 * GB, "datasheet: NVLink 4, 900 GB/s bidirectional"),
        ib_bytes=_IB_NDR,
        a2a_nvlink_bytes=_A2A_H200,
        ragged_a2a_bytes=_RAGGED_H200,
        fp8_grouped_flops=_H200_FP8_GROUPED,
        hbm_bandwidth=_H200_XLA_HBM,
        attention_flops=_H200_ATTENTION,
        host_bytes=_PCIE5,
        a2a_ib_share=_A2A_IB,
        fp8_recipe="blockwise",
    ),
    "b200": Gpu(
        "B200 180 GB",
        hbm_bytes=Figure(180 * GB, "datasheet: 180 GB HBM3e (DGX B200: 1,440 GB / 8); it reports 191.5e9 B (XLA's B200 "
                         "spec, MaxText/data/gpu_targets/b200.txtpb)"),
        gemm_flops=Figure(2250e12 * 648 / 989, "datasheet, not measured: 2,250 TF/s dense bf16 x the H200's "
                          "measured/datasheet (648 / 989)"),
        nvlink_bytes=Figure(900 * GB, "datasheet: NVLink 5, 1.8 TB/s bidirectional (18 links)"),
        ib_bytes=Figure(_IB_NDR.value, "datasheet: one 400 Gb/s ConnectX-7 per GPU (DGX B200), one direction"),
        a2a_nvlink_bytes=Figure(_A2A_H200.value * 900 / 450, "not measured: the H200's measured all_to_all share of "
                                "its NVLink (150 of 450 GB/s) x NVLink 5's 900 GB/s"),
        ragged_a2a_bytes=Figure(_RAGGED_H200.value * 900 / 450, "not measured: the H200's measured ragged_all_to_all "
                                "x NVLink 5's / NVLink 4's bandwidth (900 / 450)"),
        fp8_grouped_flops=Figure(2250e12 * 648 / 989 * 4500 / 2250, "datasheet, not measured: MXFP8 through "
                                 "Transformer Engine at the bf16 rate above x the dense FP8/bf16 datasheets' ratio "
                                 "(4,500 / 2,250), its quantization passes not counted (the H200's blockwise FP8 "
                                 "reached 1.36x its bf16 end to end)"),
        hbm_bandwidth=Figure(8e12 * _XLA_HBM_SHARE, "not measured: datasheet 8 TB/s x the share of its datasheet the "
                             "H200's XLA fusions reach (3.3 of 4.8 TB/s)"),
        attention_flops=Figure(_H200_ATTENTION.value * 2250 / 989, "datasheet, not measured: the H200's cuDNN "
                               "attention rate x the dense bf16 datasheets' ratio (2,250 / 989)"),
        host_bytes=_PCIE5,
        a2a_ib_share=_A2A_IB,
        fp8_recipe="mxfp8",
    ),
}
DEFAULT_MEM_FRACTION = Figure(0.75, "jax's default XLA_PYTHON_CLIENT_MEM_FRACTION")
# Compute beside a collective is not free: NCCL's kernels (and DeepEP's) run on SMs the GEMMs then lack. The planner's
# walk runs a kernel at (1 - this) of its rate while any NCCL transfer is in flight (host offload's copies, on the
# copy engines, take none).
COLLECTIVE_SM_SHARE = Figure(0.20, "reported: ~20% of GEMM efficiency lost beside the EP exchange, DeepEP reserving "
                             "20 of 132 SMs (Megatron-LM docs, features/moe_a2a_overlap.md, DeepSeek-V3 on H100)")


# Model FLOPs utilization (MFU) is measured against the datasheet dense bf16 peak (the convention of
# MFU figures elsewhere), not the measured GEMM rate above.
PEAK_BF16_FLOPS: dict[str, Figure] = {
    "h100": Figure(989e12, "datasheet: H100 SXM dense bf16"),
    "h200": Figure(989e12, "datasheet: H200 SXM dense bf16"),
    "b200": Figure(2250e12, "datasheet: B200 dense bf16"),
}


def mfu_peak(device_kind: str, override_tflops: float | None = None) -> tuple[float | None, str]:
  """(peak FLOP/s per device or None, the words the progress line uses for it)."""
  if override_tflops:
    return override_tflops * 1e12, f"{override_tflops:g} TF/s (mfu_peak_tflops)"
  gpu = gpu_from_device_name(device_kind)
  if gpu is None:
    return None, f"n/a: no dense bf16 peak known for {device_kind!r}; set mfu_peak_tflops"
  peak = PEAK_BF16_FLOPS[gpu]
  return peak.value, f"{GPUS[gpu].name.split()[0]} dense bf16 {peak.value / 1e12:g} TF/s"


def gpu_from_device_name(name: str) -> str | None:
  """'NVIDIA H200' -> 'h200' (None: not one we know)."""
  lowered = name.lower()
  return next((key for key in GPUS if key in lowered), None)


def link_bytes(gpu: Gpu, kind: str, crosses_nodes: bool) -> Figure:
  """Bandwidth one collective's wire bytes move at."""
  if crosses_nodes:
    if kind in ("all-to-all", "ragged-all-to-all") and gpu.a2a_ib_share and gpu.a2a_ib_share.value != 1.0:
      return Figure(gpu.ib_bytes.value * gpu.a2a_ib_share.value, f"{gpu.ib_bytes.source} x {gpu.a2a_ib_share.source}")
    return gpu.ib_bytes
  if kind == "ragged-all-to-all" and gpu.ragged_a2a_bytes:
    return gpu.ragged_a2a_bytes
  if kind in ("all-to-all", "ragged-all-to-all") and gpu.a2a_nvlink_bytes:
    return gpu.a2a_nvlink_bytes
  return gpu.nvlink_bytes
