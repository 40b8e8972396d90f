"""Host memory that runs out is one line with exit 7, whatever status code XLA puts before its words: allocations
that really fail, under an address-space limit (RLIMIT_AS) in a process of their own, not a fed string."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

import conftest
from conftest import REPO

# Two real failures of the CPU client: a program whose temporary does not fit (the error at the step itself), and
# the next computation on that failed program's outputs (how the train step's failure reached the finite check
# before a save, as "INTERNAL: Error dispatching computation: ..."); and numpy's MemoryError.
PROBE = r"""
import json, resource, sys
import jax, jax.numpy as jnp, numpy as np
from MaxText.run import main
x = jnp.ones((1024,)); x.block_until_ready()
resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
step = jax.jit(lambda a: jnp.sort(jnp.tile(a, 2**24))[:4])  # a 64 GiB temporary a sort must hold
lines = {}
for name, fail in (("at the step", lambda: step(x).block_until_ready()),
                   ("on its outputs", lambda: np.asarray(jax.jit(lambda v: v + 1)(step(x)))),
                   ("numpy", lambda: np.ones(2**34))):
  try:
    fail()
    lines[name] = "no error"
  except Exception as e:
    lines[name] = [type(e).__name__, str(e).splitlines()[0], main.out_of_memory_line(e, None)]
print(json.dumps(lines))
"""


def test_every_real_host_allocation_failure_is_one_out_of_host_memory_line():
  proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300,
                        check=False, env={"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = json.loads(proc.stdout.strip().splitlines()[-1])
  assert lines["at the step"][1].startswith("RESOURCE_EXHAUSTED: Out of memory allocating"), lines
  assert lines["on its outputs"][1].startswith("INTERNAL: Error dispatching computation: Out of memory allocating"), lines
  for name, (_, said, line) in lines.items():
    assert line is not None and line.startswith(f"out of host memory: {said[:60]}"), (name, line)


def _address_space(limit: int):
  return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@pytest.mark.slow
def test_a_train_step_beyond_the_hosts_memory_exits_7_in_one_line(tmp_path):
  """The tiny config at a batch whose step needs about 100 GiB, under a 12 GB address-space limit: the compile
  fits, the step does not (16 s here)."""
  cmd, env, _ = conftest.train_command(tmp_path, "configs/deepseek3-tiny.yml", "steps=2", "per_device_batch_size=512",
                                       "max_target_length=2048")
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
                        preexec_fn=_address_space(12 * 10**9))
  said = [line for line in proc.stderr.splitlines() if line.startswith("maxtext-moe:")]
  assert proc.returncode == 7 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert len(said) == 1 and said[0].startswith("maxtext-moe: out of host memory: ") and "Out of memory allocating" in said[0]
