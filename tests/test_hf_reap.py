"""A signalled export or import leaves nothing behind even while writer threads still write: tensorstore's threads
create the folders of each file they write, so a folder removed while they live comes back (CI's slow tier found
`OUT_DIR.tmp.orbax-checkpoint-tmp` after an import signalled mid-write). The removal runs in reap.py, after an
exec has ended every other thread.

Here a thread writes into orbax's temporary folder in a tight loop, as tensorstore's do, when SIGTERM arrives.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO

WRITER = r"""
import os, signal, sys, threading, time
from pathlib import Path
from MaxText.hf import output, stop

out = Path(sys.argv[1])
with stop.on_signals("import_hf", out):
  with output.writing(out) as tmp:
    folder = tmp.with_name(tmp.name + ".orbax-checkpoint-tmp") / "items" / "d"

    def write_forever():
      while True:
        try:
          folder.mkdir(parents=True, exist_ok=True)
          (folder / "chunk").write_bytes(b"x" * 4096)
        except OSError:  # removed under it
          pass

    threading.Thread(target=write_forever, daemon=True).start()
    while not (folder / "chunk").exists():
      time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
"""


def test_a_signal_while_a_thread_writes_leaves_nothing_and_exits_143(tmp_path):
  out = tmp_path / "out"
  done = subprocess.run([sys.executable, "-c", WRITER, str(out)], cwd=REPO, capture_output=True, text=True,
                        timeout=60, check=False)
  assert done.returncode == 143, done.stderr[-2000:]
  assert done.stderr.strip().splitlines()[-1] == f"import_hf: stopped by SIGTERM; {out} not written, {out}.tmp removed"
  assert sorted(tmp_path.glob("out*")) == []
