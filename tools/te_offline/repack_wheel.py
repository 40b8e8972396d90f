#!/usr/bin/env python3
"""Zip an unpacked wheel tree back into a wheel, with its RECORD rewritten (sha256 and size per file).

    repack_wheel.py TREE OUT.whl

For the sm_90-pruned Transformer Engine core (build.sh): pip checks RECORD's hashes on install,
so the pruned libraries need new entries. Fixed timestamps keep the output reproducible.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile

EPOCH = (2026, 1, 1, 0, 0, 0)


def repack(tree: str, out: str) -> None:
  files = sorted((os.path.relpath(os.path.join(d, n), tree) for d, _, names in os.walk(tree) for n in names),
                 key=lambda f: (".dist-info/" in f, f))  # dist-info last, as wheels have it
  record = next(f for f in files if f.endswith(".dist-info/RECORD"))
  files.remove(record)
  lines = []
  with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for name in files:
      path = os.path.join(tree, name)
      data = open(path, "rb").read()
      digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
      lines.append(f"{name},sha256={digest},{len(data)}")
      info = zipfile.ZipInfo(name, date_time=EPOCH)
      info.compress_type = zipfile.ZIP_DEFLATED
      info.external_attr = (os.stat(path).st_mode & 0xFFFF) << 16  # keep the libraries' mode bits
      z.writestr(info, data, compresslevel=9)
    lines.append(f"{record},,")
    z.writestr(zipfile.ZipInfo(record, date_time=EPOCH), "\n".join(lines) + "\n")
  print(out, os.path.getsize(out))


if __name__ == "__main__":
  repack(sys.argv[1], sys.argv[2])
