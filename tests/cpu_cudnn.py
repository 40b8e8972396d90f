"""jax's two cuDNN attention primitives given a CPU kernel of their contract, so that the code around them (jax's
own wrapper and custom VJP, our custom VJPs and batching rules) runs on CPU as it does on the GPU.

    with cpu_cudnn.kernels(monkeypatch, fwd, bwd) as fa: ...   # fa: jax's fused_attention_stablehlo module

fwd and bwd take the primitives' operands and parameters and return what cuDNN returns (the forward: the output and
its log-sum-exp; the backward: dq, dk, dv and the bias's gradient slot). The version and capability checks answer as
on an H200 with cuDNN 9.10.
"""

from __future__ import annotations

import contextlib

from jax._src.cudnn import fused_attention_stablehlo as fa
from jax._src.interpreters import mlir


@contextlib.contextmanager
def kernels(monkeypatch, fwd, bwd):
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
  monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda capability: False)
  monkeypatch.setattr(fa, "check_layout", lambda *args: None)  # bf16/fp16 only on the GPU
  cpu = mlir._platform_specific_lowerings["cpu"]  # pylint: disable=protected-access
  core = (fa._dot_product_attention_fwd_p, fa._dot_product_attention_bwd_p)  # pylint: disable=protected-access
  for primitive, kernel in zip(core, (fwd, bwd)):
    mlir.register_lowering(primitive, mlir.lower_fun(kernel, multiple_results=True), platform="cpu")
  try:
    yield fa
  finally:
    for primitive in core:
      cpu.pop(primitive)
