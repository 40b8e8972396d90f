#!/usr/bin/env python3
"""Keep only one GPU architecture's code in a CUDA shared library's fatbins.

    prune_fatbin.py IN.so OUT.so 90 [--sections .nv_fatbin,__nv_relfatbin]

Transformer Engine's core library (transformer-engine-cu13 2.20.2) carries cubins for eight
SM generations and no PTX: 251 of its 343 MB, of which sm_90 is 17.5 MiB. Every fatbin
container stays at its address (the host-side __fatBinC_Wrapper_t pointers are not
touched): the wanted entries are moved to the container's start, its size field shrunk,
and the freed tail zeroed, so the file keeps its layout and compresses to a fraction (the
wheel: 276 MB -> 32 MB). A container without the wanted architecture is left whole. The
pruned library ran TE's grouped GEMM on the H200 (docs/container.md "Transformer Engine, measured").
"""

from __future__ import annotations

import argparse
import collections
import struct

FATBIN_MAGICS = (0xBA55ED50, 0x466243B1)


def prune(data: bytearray, sections: list[str], archs: set[int]) -> dict[str, int]:
  e_shoff, = struct.unpack_from("<Q", data, 0x28)
  e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
  headers = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
  strtab = headers[e_shstrndx][4]

  def name(sh) -> str:
    return data[strtab + sh[0]: data.index(b"\0", strtab + sh[0])].decode()

  stats = collections.Counter()
  for sec in (sh for sh in headers if name(sh) in sections):
    pos, end = sec[4], sec[4] + sec[5]
    while pos < end:
      magic, _, header_size, body_size = struct.unpack_from("<IHHQ", data, pos)
      if magic not in FATBIN_MAGICS:  # alignment padding between containers
        pos += 8
        continue
      stats["containers"] += 1
      entry, body_end, kept, seen = pos + header_size, pos + header_size + body_size, [], 0
      while entry < body_end:
        _, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
        arch, = struct.unpack_from("<I", data, entry + 28)
        seen += 1
        if arch in archs:
          kept.append(bytes(data[entry:entry + entry_header + payload]))
        entry += entry_header + payload
      if entry != body_end:
        raise ValueError(f"fatbin container at {pos:#x} does not end where its header says")
      if kept:
        body = b"".join(kept)
        struct.pack_into("<Q", data, pos + 8, len(body))
        data[pos + header_size:body_end] = body + bytes(body_size - len(body))
        stats["kept"] += len(kept)
        stats["dropped"] += seen - len(kept)
      else:
        stats["untouched"] += 1
      pos = body_end
  return dict(stats)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("src")
  parser.add_argument("dst")
  parser.add_argument("archs", help="comma-separated SM numbers, e.g. 90")
  parser.add_argument("--sections", default=".nv_fatbin")
  args = parser.parse_args()
  data = bytearray(open(args.src, "rb").read())
  stats = prune(data, args.sections.split(","), {int(a) for a in args.archs.split(",")})
  open(args.dst, "wb").write(data)
  print(args.dst, stats)


if __name__ == "__main__":
  main()
