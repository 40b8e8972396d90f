"""export_hf and import_hf stopped by a real SIGTERM (a scheduler's) or SIGINT (Ctrl-C) while they write: one line,
exit 143 / 130, and nothing left at OUT_DIR, OUT_DIR.tmp or orbax's temporary folder next to it.

Slow: the run is written without training (tools/bench_hf_memory.py --write: random parameters, the trainer's
checkpoint and digest record) at widths that make each write last a few seconds, then exported once whole (the
import's input) and each CLI is started and signalled as soon as its partial output appears.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow
WIDE = ("base_emb_dim=1024", "base_moe_mlp_dim=1024", "base_mlp_dim=2048")  # 78 M parameters, 300 MiB in f32
CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Path]:
  """(run directory, its complete export)."""
  root = tmp_path_factory.mktemp("signals")
  made = subprocess.run([sys.executable, "tools/bench_hf_memory.py", "--write", "configs/deepseek3-tiny.yml",
                         str(root), *WIDE], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert made.returncode == 0, made.stderr[-3000:]
  done = subprocess.run([sys.executable, "-m", "MaxText.export_hf", str(root / "run"), str(root / "hf"), "--dtype",
                         "f32"], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return root / "run", root / "hf"


def _signalled_mid_write(cmd: list[str], out: Path, signum: int, tmp_path: Path) -> tuple[int, str]:
  """Starts cmd, sends signum once something named OUT_DIR.tmp* exists (the write has begun), returns
  (exit code, stderr). Fails if the write finished, or never began, before the signal could be sent."""
  with open(tmp_path / "stderr", "w+") as err:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    try:
      deadline = time.monotonic() + 300
      while not list(out.parent.glob(f"{out.name}.tmp*/*")):
        assert proc.poll() is None, f"ended ({proc.returncode}) before its write began"
        assert time.monotonic() < deadline, "its write never began"
        time.sleep(0.01)
      proc.send_signal(signum)
      code = proc.wait(timeout=120)
    finally:
      proc.kill()
    err.seek(0)
    return code, err.read()


@pytest.mark.parametrize("signum", sorted(CODES), ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("cli", ["export_hf", "import_hf"])
def test_a_signal_mid_write_is_one_line_and_leaves_nothing(cli, signum, written, tmp_path):
  run_dir, hf_dir = written
  out = tmp_path / "out"
  if cli == "export_hf":  # one shard per tensor: the shards appear one after another over the write
    cmd = [sys.executable, "-m", "MaxText.export_hf", str(run_dir), str(out), "--dtype", "f32", "--shard-size", "1e-9"]
  else:
    cmd = [sys.executable, "-m", "MaxText.import_hf", str(hf_dir), str(out), "configs/deepseek3-tiny.yml", *WIDE]
  code, stderr = _signalled_mid_write(cmd, out, signum, tmp_path)
  name = signal.Signals(signum).name
  assert code == CODES[signum], stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == f"{cli}: stopped by {name}; {out} not written, {out}.tmp removed"
  assert "Traceback" not in stderr, stderr[-3000:]
  assert list(tmp_path.glob("out*")) == [], list(tmp_path.glob("out*"))
