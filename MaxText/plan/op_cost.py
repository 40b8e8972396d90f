"""What one op of a compiled step costs, read from its HLO: the FLOPs of a GEMM or an attention call, the bytes a
memory-bound op reads and writes. MaxText/plan/schedule.py walks the step and times each with these.

  GEMM         dots, convolutions, cuBLAS custom calls (gemm_flops_of), our Mosaic GPU grouped GEMMs by their
               shapes (grouped_gemm_flops)
  attention    cuDNN flash attention from Q, K, V and the mask (attention_flops)
  memory-bound operands read and output written (op_bytes; a fusion's through read_bytes and written_bytes):
               a value only sliced is read for the slice, a buffer updated in place costs the update
"""

from __future__ import annotations

import math
import re

from MaxText.plan import hlo_inventory
from MaxText.plan.hlo_inventory import Computation, Instr, arrays, nbytes

SLICING = {"dynamic-slice", "slice", "gather"}  # read only the part they return
IN_PLACE = {"dynamic-update-slice", "scatter"}  # write only the update into operand 0's buffer
# Custom calls read as GEMMs or attention, or known to be memory-bound; any other (a Triton kernel, Transformer
# Engine's) is opaque: costed by its bytes, and the FLOPs the HLO does not show are added (estimate's counted_flops).
READ_TARGETS = re.compile(r"cublas|__cudnn\$fmha|mosaic_gpu|cub|[Ss]ort|callback|Sharding|SPMD|AllocateBuffer|"
                          r"SliceToDynamic|PadToStatic|Host")


def users_of(comp: Computation) -> dict[str, list[Instr]]:
  """Each value's users in one computation."""
  uses: dict[str, list[Instr]] = {}
  for i in comp.instrs:
    for o in i.operands:
      uses.setdefault(o, []).append(i)
  return uses


def read_bytes(value: str, comp: Computation, uses: dict[str, list[Instr]]) -> float:
  """Bytes a fused computation reads of `value`: the slices its slicing users take, nothing for a buffer
  updated in place, all of it otherwise (through bitcasts)."""
  full = nbytes(comp.shapes.get(value, ""))
  total = 0.0
  for user in uses.get(value, []):
    if user.opcode == "bitcast":
      total += read_bytes(user.name, comp, uses)
    elif user.opcode in SLICING and user.operands[0] == value:
      total += nbytes(user.type_text)
    elif user.opcode in IN_PLACE and user.operands[0] == value:
      continue
    else:
      return full
  return min(full, total)


def written_bytes(root: Instr, comp: Computation) -> float:
  """Bytes a fused computation writes from its root: an in-place update's update, a tuple's elements each."""
  if root.opcode == "tuple":
    by_name = {i.name: i for i in comp.instrs}
    return sum(written_bytes(by_name[o], comp) if o in by_name else nbytes(comp.shapes.get(o, ""))
               for o in root.operands)
  if root.opcode == "dynamic-update-slice":
    return nbytes(comp.shapes.get(root.operands[1], ""))
  if root.opcode == "scatter":
    return nbytes(comp.shapes.get(root.operands[-1], ""))
  if root.opcode == "bitcast":
    inner = next((i for i in comp.instrs if i.name == root.operands[0]), None)
    return written_bytes(inner, comp) if inner is not None else nbytes(root.type_text)
  return nbytes(root.type_text)


def op_bytes(instr: Instr, comp: Computation) -> float:
  """Bytes an unfused op reads and writes (slices read what they return, in-place updates their update)."""
  out = nbytes(instr.type_text)
  operands = [nbytes(comp.shapes.get(o, "")) for o in instr.operands]
  if instr.opcode in SLICING:
    return 2 * out + sum(operands[1:])
  if instr.opcode in IN_PLACE:
    return 2 * operands[-1] + sum(operands[1:-1])
  return out + sum(operands)


def gemm_flops_of(instr: Instr, comp: Computation) -> tuple[float, bool]:
  """(FLOPs, is our grouped GEMM) of one unfused instruction; (0, False) for anything but a GEMM."""
  if instr.opcode == "dot" or (instr.opcode == "custom-call" and re.search(r"cublas.*(gemm|matmul)", instr.attrs)):
    return hlo_inventory._dot_flops(instr, comp), False  # pylint: disable=protected-access
  if instr.opcode == "convolution":
    return convolution_flops(instr, comp), False
  if instr.opcode == "custom-call" and 'custom_call_target="mosaic_gpu' in instr.attrs:
    flops = grouped_gemm_flops([arrays(comp.shapes.get(o, "")) for o in instr.operands], arrays(instr.type_text))
    return flops, flops > 0
  return 0.0, False


def convolution_flops(instr: Instr, comp: Computation) -> float:
  """2 x output elements x (kernel elements / output features)."""
  labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
  out, kernel = arrays(instr.type_text), arrays(comp.shapes.get(instr.operands[1], "")) if len(instr.operands) > 1 else []
  if not out or not kernel or not labels or "o" not in labels[1]:
    return 0.0
  return 2.0 * math.prod(out[0][1]) * math.prod(kernel[0][1]) / kernel[0][1][labels[1].index("o")]


def grouped_gemm_flops(operands: list[list[tuple[str, tuple[int, ...]]]], outputs: list[tuple[str, tuple[int, ...]]],
                       vmaps: int = 2) -> float:
  """FLOPs of a Mosaic GPU kernel if its shapes are one of our grouped GEMMs' (MaxText/moe/gmm/mgpu/), else 0
  (a quantization kernel: memory-bound). Data operands are bf16 or e4m3 (f32 ones are FP8 scales):
    gmm         x [M, K] and w [G, K, N] (or [G, N, K]) -> [M, N]
    tgmm (dW)   x [M, K] and dy [M, N] -> [G, K, N]; in FP8 as P blocks of r rows, [P, K, r] and [P, N, r]
  all 2 M K N: every row meets one group's weights (M = P r). Under a vmap (upstream's pipeline vmaps its stages:
  a stage's kernel reads [1, M, K] and [1, G, K, N] and writes [1, M, N]) every data array leads with the vmapped
  dimension: one slice's FLOPs times its size, through at most `vmaps` nested vmaps."""
  flops = _slice_grouped_gemm_flops(operands, outputs)
  if flops or not vmaps or not outputs or len(outputs[0][1]) < 3:
    return flops
  b = outputs[0][1][0]
  data = [s for arr in operands for d, s in arr if d.startswith(("bf16", "f16", "f8"))]
  if not data or any(s[:1] != (b,) for s in data):
    return 0.0
  peel = lambda arr: [(d, s[1:]) if s[:1] == (b,) else (d, s) for d, s in arr]  # noqa: E731
  return b * grouped_gemm_flops([peel(arr) for arr in operands], peel(outputs), vmaps - 1)


def _slice_grouped_gemm_flops(operands: list[list[tuple[str, tuple[int, ...]]]],
                              outputs: list[tuple[str, tuple[int, ...]]]) -> float:
  """grouped_gemm_flops of a kernel outside any vmap."""
  data = [s for arr in operands for d, s in arr if len(s) in (2, 3) and d.startswith(("bf16", "f16", "f8"))]
  if not outputs:
    return 0.0
  out = outputs[0][1]
  if len(out) == 2:
    m, n = out
    for x in (s for s in data if len(s) == 2 and s[0] == m):
      if any(len(w) == 3 and x[1] in w[1:] and n in w[1:] and x[1] * n == w[1] * w[2] for w in data):
        return 2.0 * m * x[1] * n
  if len(out) == 3:
    _, a, b = out
    for x in data:
      for dy in data:
        if x is not dy and len(x) == len(dy) and x[0] == dy[0] and (x[1], dy[1]) == (a, b) and x[2:] == dy[2:]:
          return 2.0 * (math.prod(x) // a) * a * b  # M = x[0] (2-D) or P r (blocks)
  return 0.0


def attention_flops(instr: Instr, comp: Computation) -> float:
  """cuDNN flash attention: 2 B H Sq Sk (Dqk + Dv) forward; the backward recomputes QK^T and forms dV, dP,
  dQ, dK: 2 B H Sq Sk (3 Dqk + 2 Dv). A causal mask halves both."""
  scores = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]', instr.attrs)
  q = arrays(comp.shapes.get(instr.operands[0], "")) if instr.operands else []
  v = arrays(comp.shapes.get(instr.operands[2], "")) if len(instr.operands) > 2 else []
  if not scores or not q or not v:
    return 0.0
  b, h, sq, sk = (int(x.strip().strip('"')) for x in scores[1].split(","))
  d_qk, d_v = math.prod(q[0][1]) // (b * h * sq), math.prod(v[0][1]) // (b * h * sk)  # Q [B, Sq, H, Dqk], V [B, Sk, H, Dv]
  per_dim = 2.0 * b * h * sq * sk * (0.5 if '"mask_type": "CAUSAL"' in instr.attrs.replace('":"', '": "') else 1.0)
  backward = "Backward" in instr.attrs.split("custom_call_target=")[1][:40]
  return per_dim * ((3 * d_qk + 2 * d_v) if backward else (d_qk + d_v))
