#!/usr/bin/env python3
"""A real-text training corpus with no download: text files (by default this interpreter's standard library, the
Python source and docstrings people wrote) written as upstream's grain pipeline reads them, one ArrayRecord of
serialized tf.train.Example protos with a bytes feature `text` (tests/text_fixture.py's format).

  python3 tools/text_corpus.py OUT.array_record [--source DIR] [--suffixes .py,.txt,.rst] [--max-mb 16]

Files are read in sorted order and cut into documents of at most --doc-chars characters at line ends, until
--max-mb of text is written; the same tree gives the same corpus. What it is for: a loss that a small model
cannot memorize within a run (the synthetic data of the benchmarks is learned to near zero in 100 steps), so two
runs that differ in precision can be compared on it (BENCHMARKS.md "FP8 end to end": FP8 experts against bf16).
Train on it with dataset_type=grain grain_file_type=arrayrecord grain_train_files=OUT tokenizer_type=sentencepiece
tokenizer_path=<the maxtext wheel's assets/tokenizers/tokenizer.llama2> vocab_size=32000 (printed at the end).
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import text_fixture  # noqa: E402  (the ArrayRecord writer and the shipped tokenizer's path)


def _cut(text: str, doc_chars: int):
  """text in documents of whole lines, each <= doc_chars (a longer line alone); a whitespace-only tail is dropped."""
  doc: list[str] = []
  size = 0
  for line in text.splitlines(keepends=True):
    if size + len(line) > doc_chars and doc:
      yield "".join(doc)
      doc, size = [], 0
    doc.append(line)
    size += len(line)
  if doc and "".join(doc).strip():
    yield "".join(doc)


def documents(source: Path, suffixes: tuple[str, ...], max_chars: int, doc_chars: int) -> list[str]:
  """Whole lines of the source tree's text files, in sorted path order, in documents of <= doc_chars."""
  docs: list[str] = []
  total = 0
  for path in sorted(p for p in source.rglob("*") if p.suffix in suffixes and p.is_file()):
    try:
      text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
      continue  # binary or unreadable: not text for this corpus
    for doc in _cut(text, doc_chars):
      docs.append(doc)
      total += len(doc)
      if total >= max_chars:
        return docs
  return docs


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("out", type=Path)
  ap.add_argument("--source", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                  help="a directory of text files (default: this Python's standard library)")
  ap.add_argument("--suffixes", default=".py,.txt,.rst")
  ap.add_argument("--max-mb", type=float, default=16.0, help="stop after this much text (MB of characters)")
  ap.add_argument("--doc-chars", type=int, default=8192)
  args = ap.parse_args(argv)
  if not args.source.is_dir():
    print(f"text_corpus: --source {args.source} is not a directory", file=sys.stderr)
    return 2
  docs = documents(args.source, tuple(args.suffixes.split(",")), int(args.max_mb * 1e6), args.doc_chars)
  if not docs:
    print(f"text_corpus: no {args.suffixes} text under {args.source}", file=sys.stderr)
    return 2
  text_fixture.write_arrayrecord(args.out, docs)
  chars = sum(map(len, docs))
  print(f"{args.out}: {len(docs)} documents, {chars / 1e6:.1f} MB of text from {args.source}")
  print(f"tokenizer_path={text_fixture.tokenizer_path()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
