"""Every Python process of a test session (tests/conftest.py puts this directory first on PYTHONPATH) compiles
XLA's CPU code without LLVM's optimizations. The tests' programs are tiny and run a few steps, so compiling is most
of their CPU: a tiny DeepSeek-V3 run of 5 steps, cold cache, 33.5 -> 24.5 s of CPU; its step 0.05 -> 0.15 s.

A process that replaces XLA_FLAGS whole (a preset's own flags) compiles as it asks; one that appends keeps this.
The compile-only H100/H200 plans take the flag too (their LLVM lowers to PTX at -O0); their figures come from the
cost model over the scheduled HLO, which the flag does not touch: tests/test_gpu_target.py's committed recipe
summary still equals its plan."""

import os

_FLAG = "--xla_backend_optimization_level=0"
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} {_FLAG}".strip()
