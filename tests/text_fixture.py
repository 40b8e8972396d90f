"""A small text corpus written as upstream's grain pipeline reads it: an
ArrayRecord file of serialized tf.train.Example protos with a bytes feature
`text` (upstream's own proto module, no TensorFlow), tokenized by the run with
a SentencePiece model that ships inside the maxtext wheel."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = ("the expert routes each token to a few of many feed forward networks while a shared expert sees every "
         "token and the router learns a bias that balances the load across devices in the cluster").split()


def tokenizer_path() -> Path:
  """Upstream's Llama 2 SentencePiece model (32,000 pieces), in the wheel: no download."""
  import maxtext  # pylint: disable=import-outside-toplevel

  return Path(maxtext.__file__).resolve().parent / "assets" / "tokenizers" / "tokenizer.llama2"


def documents(n: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))).capitalize() + "." for _ in range(n)]


def write_arrayrecord(path: Path, docs: list[str]) -> Path:
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=import-outside-toplevel
  from maxtext.input_pipeline.protos import example_pb2  # pylint: disable=import-outside-toplevel

  path.parent.mkdir(parents=True, exist_ok=True)
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for doc in docs:
    example = example_pb2.Example()
    example.features.feature["text"].bytes_list.value.append(doc.encode())
    writer.write(example.SerializeToString())
  writer.close()
  return path


if __name__ == "__main__":  # python tests/text_fixture.py OUT.array_record [N]
  import sys

  out = write_arrayrecord(Path(sys.argv[1]), documents(int(sys.argv[2]) if len(sys.argv) > 2 else 200))
  print(f"{out}  (tokenizer_path={tokenizer_path()})")
