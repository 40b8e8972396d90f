#!/usr/bin/env python3
"""Rebuild a wheel from an unpacked tree, regenerating RECORD (sha256, size).
usage: repack_wheel.py TREE OUT.whl"""
import base64, hashlib, os, sys, zipfile
tree, out = sys.argv[1], sys.argv[2]
files = []
for d, _, names in os.walk(tree):
    for n in names:
        files.append(os.path.relpath(os.path.join(d, n), tree))
record = [f for f in files if f.endswith('.dist-info/RECORD')][0]
files.remove(record)
files.sort(key=lambda f: ('.dist-info/' in f, f))  # dist-info last, as wheels do
lines = []
with zipfile.ZipFile(out, 'w', zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for f in files:
        data = open(os.path.join(tree, f), 'rb').read()
        h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
        lines.append(f'{f},sha256={h},{len(data)}')
        zi = zipfile.ZipInfo(f, date_time=(2026, 1, 1, 0, 0, 0))
        zi.compress_type = zipfile.ZIP_DEFLATED
        zi.external_attr = (os.stat(os.path.join(tree, f)).st_mode & 0xFFFF) << 16
        z.writestr(zi, data, compresslevel=9)
    lines.append(f'{record},,')
    z.writestr(zipfile.ZipInfo(record, date_time=(2026, 1, 1, 0, 0, 0)), '\n'.join(lines) + '\n')
print(out, os.path.getsize(out))
