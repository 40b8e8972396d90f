"""Tilings for the Mosaic-GPU grouped GEMMs (`mgpu.py`), chosen per problem shape.

Pure Python (no jax import) so that the table and its lookup are testable on CPU.

The table is keyed by (op, K, N) where K is the contraction length and N the output width
of one group's product:
  op="fwd"  : out_MN = lhs_MK @ rhs[g]_KN          (up/down projection, and dlhs with
                                                    transpose_rhs=True: K and N are then the
                                                    forward's N and K)
  op="tgmm" : drhs[g]_KN = lhs_g^T @ dout_g         (dW; the contraction runs over rows)
A shape missing from the table falls back to the op's default entry. `tools/tune_gmm.py`
is where a sweep would regenerate `TABLE`; the entries below come from the team's H200
measurement of JAX's ragged_dot_mgpu (block 128x128x64, 4-6 stages, grid_block_n 4-8 best:
581 TF/s up-proj, 552 down-proj) and from the shared-memory budget of the warp-specialized
kernel (see `FwdTiling.smem_bytes`).
"""

from __future__ import annotations

import dataclasses

# Hopper: 227 KiB of shared memory per block (opt-in maximum on sm_90).
SMEM_LIMIT_BYTES = 227 * 1024
BF16_BYTES = 2
# Mosaic GPU lowers a TMA load into swizzled, (8, 64)-tiled SMEM only from a row provably a
# multiple of 8 (layout inference rejects other dynamic row indices).
TMA_ROW_ALIGN = 8
# Rows per compute warpgroup: one m64 wgmma. Its 64x128 f32 running sum and the 64x128 partial
# of the current step are 64 registers per thread each. A warpgroup of 128 rows (the bf16 kernel's
# tile) would hold 256 and spill: measured on the H200, 0.27-0.30 of a dense FP8 GEMM (docs/kernels.md, "Tried, and why it did not help").
FP8_WG_ROWS = 64
# The widest TMA swizzle: 16-byte chunks permuted within each 128-byte row, by row mod 8.
EPI_SWIZZLE_BYTES = 128


# A TMA store reads shared memory from a 128-byte aligned address, and a piece of a tile window can start at any row
# of an epilogue buffer, so the buffer's rows must be a multiple of 128 B. 64-byte rows (epi_n=32 with a bf16 output)
# stopped the H200 with "misaligned address" twice: in a profile run of this kernel (tools/tune_gmm.py) and in the
# FP8 kernel on a group of odd size (tools/bench_fp8.py, 2026-12-03).
TMA_SMEM_ALIGN_BYTES = 128


def check_epilogue_rows(tiling, epi_n: int, out_itemsize: int) -> None:
  if epi_n * out_itemsize % TMA_SMEM_ALIGN_BYTES:
    raise ValueError(f"{tiling}: epilogue rows of {epi_n} x {out_itemsize} B are not a multiple of "
                     f"{TMA_SMEM_ALIGN_BYTES} B")


def _check_smem(tiling, out_itemsize: int) -> None:
  if tiling.smem_bytes(out_itemsize) > SMEM_LIMIT_BYTES:
    raise ValueError(f"{tiling} needs {tiling.smem_bytes(out_itemsize)} B of shared memory > {SMEM_LIMIT_BYTES}")


@dataclasses.dataclass(frozen=True)
class FwdTiling:
  """Tiling of the warp-specialized grouped GEMM (one memory + two compute warpgroups).

  block_m:   rows per tile; group boundaries are quantized to this (a boundary inside a
             tile computes that tile twice, once per group).
  block_n:   columns per compute warpgroup; the block's tile is block_m x (2 * block_n).
  block_k:   contraction step per pipeline stage (64 bf16 = one 128-byte swizzle row).
  stages:    pipeline depth (shared-memory buffers in flight).
  epi_n:     columns per epilogue store (the epilogue buffer is unswizzled so that any row
             range can be stored; a narrow one keeps shared memory for the pipeline).
  grid_block_n: column tiles per band: the persistent loop walks down all row pieces
             within a band of this many column tiles, then the next band back up
             (`plgpu.planar_snake`). A band as wide as N reads each row piece once; a
             narrower one keeps fewer of a group's weight columns live in L2.
  group_aligned: cut each group's rows into tiles from its first row (aligned down to 8),
             so only its last tile is partial, instead of at multiples of block_m (a boundary
             inside a block costs the block twice). `mgpu_schedule.work_table`.
  half_tiles: a piece that fits in the first block_m/2 rows of its window (a short group
             tail) runs block_m/2-row MMAs, so a partial tile wastes < 64 rows, not < 128.
  chain:     run an SM's consecutive tiles as one pipeline (`pipeline_state` of
             emit_pipeline_warp_specialized): the memory warpgroup loads the next tile's
             first stages while the compute warpgroups finish this tile and store it, instead
             of every tile starting from an empty pipeline. Needs K/block_k to be a multiple
             of stages (the chained pipelines must reuse the same slots). Off: no measured
             gain (TABLE note), so the pipeline fill is not what a tile waits on.
  epi_swizzle: store the epilogue buffer 128-byte swizzled (its rows must then be exactly
             128 bytes: epi_n = 128 / itemsize, see fit_output). Unswizzled, the 128-byte
             rows of the buffer all start in the same four banks, so each 8x8 stmatrix of the
             accumulator's layout takes 8 shared-memory wavefronts instead of 1. The TMA
             store reads the swizzled rows back from any row (it unswizzles by address).
             Measured (tools/tune_gmm.py; docs/kernels.md, "Tried, and why it did not help"): no faster, the epilogue was not bank-bound; off.
  pingpong:  each compute warpgroup computes its own block_m x block_n tiles, the two taking
             an SM's tiles in turn, so one's epilogue runs under the other's MMAs
             (`pingpong.py`); stages is then per warpgroup (two rings). Off: 13-29%
             slower on the H200 (tools/tune_gmm.py): a ring's slots run too little ahead of
             the load latency.
  multicast: with pingpong, a 2-SM cluster takes neighbouring column tiles of the same row
             window; each SM TMA-loads half of every lhs slot and multicasts it to both, so
             an SM reads 24 KiB per 128x128x64 step, the shared-tile kernel's bytes per FLOP.
             Off: no faster than pingpong alone, so L2 traffic was not its limit.
  group_aligned is on by default; half_tiles, chain, epi_swizzle, pingpong and multicast
  are off (measured: the TABLE note and docs/kernels.md, "Tried, and why it did not help").
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  epi_n: int = 64
  grid_block_n: int = 4
  group_aligned: bool = True
  half_tiles: bool = False
  chain: bool = False
  epi_swizzle: bool = False
  pingpong: bool = False
  multicast: bool = False

  @property
  def cta_n(self) -> int:
    """Output columns per tile: one compute warpgroup's with pingpong, else both's."""
    return self.block_n if self.pingpong else 2 * self.block_n

  @property
  def n_multiple(self) -> int:
    """N must be a multiple of this: a tile's columns, or a cluster's two tiles'."""
    return self.cta_n * (2 if self.multicast else 1)

  @property
  def window_align(self) -> int:
    """Row multiple every tile window starts at: TMA into the (8, 64)-tiled SMEM needs 8."""
    return TMA_ROW_ALIGN if self.group_aligned else self.block_m

  def smem_bytes(self, out_itemsize: int = BF16_BYTES) -> int:
    stage = (self.block_m * self.block_k + self.block_k * self.cta_n) * BF16_BYTES
    rings = 2 if self.pingpong else 1
    epilogue = 2 * self.block_m * self.epi_n * out_itemsize
    return rings * self.stages * stage + epilogue

  def fit_output(self, out_itemsize: int) -> "FwdTiling":
    """This tiling for an output dtype: a swizzled epilogue takes 128-byte rows (epi_n 32
    for f32); then fewer stages if the epilogue still needs the room (and then unchained:
    a chain's stage count must divide the K steps)."""
    tiling = self
    if tiling.epi_swizzle and tiling.epi_n * out_itemsize != EPI_SWIZZLE_BYTES:
      tiling = dataclasses.replace(tiling, epi_n=EPI_SWIZZLE_BYTES // out_itemsize)
    if tiling.smem_bytes(out_itemsize) > SMEM_LIMIT_BYTES:
      tiling = dataclasses.replace(tiling, chain=False)
    while tiling.stages > 2 and tiling.smem_bytes(out_itemsize) > SMEM_LIMIT_BYTES:
      tiling = dataclasses.replace(tiling, stages=tiling.stages - 1)
    return tiling

  def validate(self, k: int, n: int, out_itemsize: int = BF16_BYTES) -> None:
    if k % self.block_k:
      raise ValueError(f"K={k} must be a multiple of block_k={self.block_k}")
    if self.multicast and not self.pingpong:
      raise ValueError("multicast is an option of the pingpong kernel (set pingpong too)")
    if n % self.n_multiple:
      per_tile = "2*block_n" if self.n_multiple == 2 * self.block_n else "block_n"
      raise ValueError(f"N={n} must be a multiple of {per_tile}={self.n_multiple}")
    if self.pingpong and (self.chain or self.half_tiles):
      raise ValueError("pingpong runs its own pipeline: chain and half_tiles do not apply to it")
    if self.pingpong and self.stages < 2:
      raise ValueError(f"pingpong needs stages >= 2 (a slot is released one MMA late), "
                       f"got {self.stages}")
    if self.block_n % self.epi_n:
      raise ValueError(f"block_n={self.block_n} must be a multiple of epi_n={self.epi_n}")
    if self.epi_swizzle and self.epi_n * out_itemsize != EPI_SWIZZLE_BYTES:
      raise ValueError(f"epi_swizzle needs {EPI_SWIZZLE_BYTES}-byte epilogue rows: epi_n="
                       f"{EPI_SWIZZLE_BYTES // out_itemsize} for {out_itemsize}-byte outputs, "
                       f"got epi_n={self.epi_n}")
    check_epilogue_rows(self, self.epi_n, out_itemsize)
    if self.half_tiles and self.block_m % 128:
      raise ValueError(f"half_tiles needs block_m a multiple of 128 (wgmma is 64 rows), got {self.block_m}")
    if self.chain and (k // self.block_k) % self.stages:
      raise ValueError(f"chain needs K/block_k={k // self.block_k} (K={k}) to be a multiple of "
                       f"stages={self.stages}")
    if self.chain and self.half_tiles:
      raise ValueError("chain and half_tiles together are not supported (a half tile's "
                       "pipeline would join the chain with another accumulator shape)")
    _check_smem(self, out_itemsize)


@dataclasses.dataclass(frozen=True)
class TgmmTiling:
  """Tiling of the transposed grouped GEMM (dW): output tiles of block_m x block_n of the
  [K, N] per-group result, contraction over rows in steps of block_k.

  warp_specialized: False = one warpgroup per block (JAX's structure); True = one memory +
  two compute warpgroups on block_m x (2 * block_n) tiles. Timed on the H200 (tune_gmm.py,
  Zipf-1.2, commit a8585d2): dW up 3.079 vs 3.116 ms (1%, noise), dW down 3.246 vs 3.158
  (3% slower), so not the default.
  exact_start: a group's row window starts at its first row aligned down to 8 (TMA's need,
  see TMA_ROW_ALIGN), not to block_k: about block_k/2 fewer wasted rows per group.
  largest_first: visit groups largest first, in alternating-direction rounds over the SMs,
  so that skewed group sizes do not leave some SMs one large tile behind the others.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  grid_block_n: int = 4
  warp_specialized: bool = False
  exact_start: bool = True
  largest_first: bool = True

  @property
  def cta_n(self) -> int:
    return self.block_n * (2 if self.warp_specialized else 1)

  @property
  def window_align(self) -> int:
    """Row multiple a group's row window starts at (see exact_start)."""
    return TMA_ROW_ALIGN if self.exact_start else self.block_k

  def smem_bytes(self, out_itemsize: int = BF16_BYTES) -> int:
    stage = (self.block_k * self.block_m + self.block_k * self.cta_n) * BF16_BYTES
    return self.stages * stage + self.block_m * self.cta_n * out_itemsize

  def validate(self, k: int, n: int, out_itemsize: int = BF16_BYTES) -> None:
    if k % self.block_m:
      raise ValueError(f"K={k} must be a multiple of block_m={self.block_m}")
    if n % self.cta_n:
      raise ValueError(f"N={n} must be a multiple of {self.cta_n} (block_n x compute warpgroups)")
    _check_smem(self, out_itemsize)


@dataclasses.dataclass(frozen=True)
class JaxFwdTiling:
  """Arguments of JAX's own `ragged_dot_mgpu.ragged_dot` (the baseline path)."""

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 4


DEFAULTS = {
    "fwd": FwdTiling(),
    "tgmm": TgmmTiling(),
    "jax_fwd": JaxFwdTiling(),
}

# Options for uneven group sizes, A/B'd by tune_gmm.py on one H200 (M=65536, G=32, Zipf-1.2,
# commit a8585d2, ms, the same inputs within each problem):
#   dW exact_start + largest_first (the TgmmTiling defaults): up 3.412 -> 3.116, down
#     3.357 -> 3.158.
#   fwd group_aligned + half_tiles: up 3.052 -> 3.035, down 2.975 -> 3.186, single samples
#     inside the drift of back-to-back timings. Re-timed
#     in 7 interleaved rounds at commit 1aa745a (median ms, table -> group_aligned -> both
#     -> chain): down 3.273 -> 3.200 -> 3.203 -> 3.278; dlhs of up (K=2048, N=7168
#     transposed) 3.077 -> 3.000 -> 3.030 -> 3.100; round spreads 1.6-6.1%. The profile
#     (tools/tune_gmm.py --profile-dir) says why: every tile costs ~36 kc (SM kilocycles) whatever its group, so time follows the
#     tile count, 543 -> 528 row pieces (x28 column tiles) with group-aligned cuts (-2.8%).
#     Hence group_aligned on; half tiles and chain gained nothing and stay off.
#   fwd epi_swizzle / epi_n=128 with 3 stages / epi_swizzle + chain, 5 interleaved rounds at
#     1056e03 (down, dlhs of up (K=2048, N=7168 transposed), up; ms): table 3.206, 3.206,
#     3.046 -> 3.201, 3.183, 3.026 / 3.254, 3.237, 3.072 / 3.233, 3.258, 3.083; spreads
#     1.8-5.0%. None is a gain (the profile: the K loop is at the tensor cores' peak; the loss is
#     the ~3 kc per tile outside it). At M=16384 G=64: half_tiles 1.118 vs 1.104 ms.
# (op, K, N) -> tiling. DeepSeek-V3 expert shapes: hidden 7168, expert width 2048
# (4096 with w0/w1 fused); the dlhs products appear as fwd with K and N swapped.
TABLE: dict[tuple[str, int, int], object] = {
    # tune_gmm.py, H200, M=65536 G=32 Zipf-1.2, commit 4b9dbe7 (up-proj, ms / TF/s):
    #   stages 3 gbn 4: 3.03/635, 3 gbn 16: 2.73/705, 4 gbn 4: 3.12/617, 4 gbn 16: 2.78/691.
    # A band of 16 column tiles (all of N<=4096) sweeps each row block across N while its
    # lhs rows are in L2. The other entries take gbn 16 by analogy (not swept: budget).
    ("fwd", 7168, 2048): FwdTiling(stages=3, grid_block_n=16),
    ("fwd", 7168, 4096): FwdTiling(stages=3, grid_block_n=16),
    ("fwd", 2048, 7168): FwdTiling(stages=4, grid_block_n=16),
    ("fwd", 4096, 7168): FwdTiling(stages=4, grid_block_n=16),
    ("jax_fwd", 7168, 2048): JaxFwdTiling(max_concurrent_steps=4, grid_block_n=4),
    ("jax_fwd", 7168, 4096): JaxFwdTiling(max_concurrent_steps=4, grid_block_n=8),
    ("jax_fwd", 2048, 7168): JaxFwdTiling(max_concurrent_steps=6, grid_block_n=4),
    ("jax_fwd", 4096, 7168): JaxFwdTiling(max_concurrent_steps=6, grid_block_n=4),
}


def lookup(op: str, k: int, n: int):
  """The tiling for `op` on a K x N per-group product (falls back to the op's default)."""
  if op not in DEFAULTS:
    raise ValueError(f"unknown op {op!r}; valid: {sorted(DEFAULTS)}")
  tiling = TABLE.get((op, k, n))
  if tiling is None:
    tiling = DEFAULTS[op]
  return tiling
