"""Real data and its tokenizer, checked before a run writes anything.

Upstream 0.2.5 opens the data and loads the tokenizer only when it builds its input pipeline, after
the run directory exists, and stops with a traceback: no file matching `grain_train_files`, an empty
or truncated file, random bytes, a missing `tokenizer_path`. Worse, a `vocab_size` smaller than the
tokenizer's trains without a word: token ids past the embedding are clamped by the gather, and the loss
falls (to 1.90 against 10.73 for Llama 2's 32,000 tokens at vocab_size=1024 on the tiny config).

Here, on upstream's resolved config: every local file the patterns name exists, is a non-empty file,
and the first of each pattern opens and yields its first record with the columns the run reads
(upstream's own parser, ParseFeatures); the tokenizer loads through upstream's own loader, and
`vocab_size` holds all its tokens. Remote data (gs://, hf://) and Hugging Face Hub tokenizers are
left to the run: checking them would need the network. Each problem is a ConfigError naming the key.
"""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path
from typing import Any

from MaxText.config import ConfigError, RunConfig

# grain_file_type values upstream's grain pipeline reads (input_pipeline/grain_data_processing.py get_datasets);
# anything else is a ValueError once the pipeline is built.
GRAIN_FILE_TYPES = ("arrayrecord", "tfrecord", "parquet", "mmap", "mmap_npy")
REMOTE = ("gs://", "hf://", "s3://")


def _origin(run: RunConfig, key: str) -> str:
  return run.origins.get(key, "as set" if key in run.explicit else "upstream default")


def _kind(config: Any) -> str:
  value = getattr(config, "dataset_type", "synthetic")
  return str(getattr(value, "value", value))


def check(run: RunConfig, config: Any) -> None:
  """The data files and the tokenizer of a real-data run; nothing for synthetic data."""
  if _kind(config) == "synthetic":
    return
  if _kind(config) == "grain":
    file_type = str(config.grain_file_type)
    if file_type not in GRAIN_FILE_TYPES:
      raise ConfigError(f"config key 'grain_file_type' = {file_type!r} ({_origin(run, 'grain_file_type')}): "
                        f"not one upstream's grain pipeline reads; one of {', '.join(GRAIN_FILE_TYPES)}")
    columns = list(config.train_data_columns)
    for key, pattern in _patterns(run, config, "grain_train_files", "grain_train_mixture_config_path"):
      _check_pattern(run, key, pattern, file_type, columns, bool(getattr(config, "tokenize_train_data", True)))
    if getattr(config, "eval_interval", 0) > 0 and config.grain_eval_files:
      for key, pattern in _patterns(run, config, "grain_eval_files", None):
        _check_pattern(run, key, pattern, file_type, list(config.eval_data_columns),
                       bool(getattr(config, "tokenize_eval_data", True)))
  _check_tokenizer(run, config)


def _patterns(run: RunConfig, config: Any, key: str, mixture_key: str | None) -> list[tuple[str, str]]:
  """(key, file pattern) pairs: a mixture config's paths, `a,0.3;b,0.7`, or the one pattern."""
  mixture = getattr(config, mixture_key, "") if mixture_key else ""
  if mixture:
    try:
      paths = [str(entry["path"]) for entry in json.loads(Path(mixture).read_text()).values()]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
      raise ConfigError(f"config key '{mixture_key}' = {mixture!r} ({_origin(run, mixture_key)}): not a readable "
                        f"mixture config (a JSON object of {{name: {{path, weight}}}}): {_words(e)}") from None
    return [(mixture_key, p) for p in paths]
  value = str(getattr(config, key) or "")
  if not value:
    raise ConfigError(f"config key '{key}' ({_origin(run, key)}) is empty: dataset_type=grain reads its files "
                      "from it (a path or glob; 'a,0.3;b,0.7' mixes)")
  if ";" not in value:
    return [(key, value)]
  pairs = []
  for part in value.split(";"):
    pattern, comma, weight = part.rpartition(",")
    if not comma or not pattern or not _is_number(weight):
      raise ConfigError(f"config key '{key}' = {value!r} ({_origin(run, key)}): a mixture is 'pattern,weight;"
                        f"pattern,weight', and {part!r} is not 'pattern,weight'")
    pairs.append((key, pattern))
  return pairs


def _is_number(text: str) -> bool:
  try:
    return float(text) >= 0
  except ValueError:
    return False


def _words(e: BaseException) -> str:
  return " ".join(str(e).split())[:160] or type(e).__name__


def _check_pattern(run: RunConfig, key: str, pattern: str, file_type: str, columns: list[str],
                   tokenize: bool) -> None:
  if pattern.startswith(REMOTE):
    return
  where = f"config key '{key}' = {pattern!r} ({_origin(run, key)})"
  files = sorted(glob.glob(str(Path(pattern).expanduser().resolve())))  # as upstream's find_data_files globs
  if not files:
    raise ConfigError(f"{where}: no file matches it")
  for name in files:
    path = Path(name)
    if not path.is_file():
      raise ConfigError(f"{where}: {path} is not a file")
    if path.stat().st_size == 0:
      raise ConfigError(f"{where}: {path} is empty")
  first = Path(files[0])
  try:
    record = _first_record(first, file_type, columns)
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught  # what each reader raises differs
    raise ConfigError(f"{where}: {first} cannot be read as {file_type}: {_words(e)}") from None
  if record is not None:
    from maxtext.input_pipeline import input_pipeline_utils  # pylint: disable=import-outside-toplevel

    try:
      input_pipeline_utils.ParseFeatures(columns, tokenize).map(record)
    except Exception as e:  # pylint: disable=broad-exception-caught  # DecodeError, ValueError
      raise ConfigError(f"{where}: the first record of {first} is not a tf.train.Example the run can use "
                        f"(train_data_columns={columns}): {_words(e)}") from None


def _first_record(path: Path, file_type: str, columns: list[str]) -> bytes | None:
  """The first serialized record (arrayrecord, tfrecord), after checking the file holds one; None for
  formats read by column (parquet: the columns are checked here) or memory-mapped arrays."""
  if file_type == "arrayrecord":
    from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=import-outside-toplevel

    reader = ArrayRecordReader(str(path))
    try:
      if reader.num_records() == 0:
        raise ConfigError(f"{path} holds no records (truncated, or not an ArrayRecord file)")
      return reader.read([0])[0]
    finally:
      reader.close()
  if file_type == "tfrecord":
    with path.open("rb") as f:
      header = f.read(12)
      if len(header) < 12:
        raise ValueError("shorter than one record's header")
      (length,) = struct.unpack("<Q", header[:8])
      data = f.read(length)
      if len(data) < length:
        raise ValueError(f"its first record says {length} bytes, the file ends before")
      return data
  if file_type == "parquet":
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

    meta = pq.ParquetFile(path)
    missing = [c for c in columns if c not in meta.schema_arrow.names]
    if missing:
      raise ValueError(f"no column {missing[0]!r} (train_data_columns); it has {meta.schema_arrow.names}")
    if meta.metadata.num_rows == 0:
      raise ValueError("it holds no rows")
  return None


def tokenizer_size(model: Any) -> int:
  """Tokens of a tokenizer built by upstream's input_pipeline/tokenizer.build_tokenizer."""
  if hasattr(model, "_tokenizer_model"):  # SentencePieceTokenizer
    return int(model._tokenizer_model.vocab_size())  # pylint: disable=protected-access
  if hasattr(model, "tokenizer"):  # HFTokenizer: added tokens count
    return len(model.tokenizer)
  return int(model.model.n_vocab)  # TikTokenTokenizer: its base ranks and special tokens


def _check_tokenizer(run: RunConfig, config: Any) -> None:
  path = str(config.tokenizer_path or "")
  kind = str(getattr(config.tokenizer_type, "value", config.tokenizer_type))
  if _kind(config) == "hf":
    kind = "huggingface"  # upstream's hf pipeline loads every tokenizer through transformers (base.yml)
  where = f"config key 'tokenizer_path' = {path!r} ({_origin(run, 'tokenizer_path')})"
  if not path:
    raise ConfigError(f"{where}: dataset_type={_kind(config)} tokenizes its text and needs a tokenizer")
  if path.startswith(REMOTE):
    return
  if not Path(path).exists():
    if kind == "huggingface" and not path.startswith(("/", ".", "~")) and path.count("/") == 1:
      return  # a Hub id (org/name): the run downloads it
    raise ConfigError(f"{where}: no such file (tokenizer_type={kind})")
  from maxtext.input_pipeline import tokenizer  # pylint: disable=import-outside-toplevel

  try:
    model = tokenizer.build_tokenizer(path, kind, config.add_bos, config.add_eos, config.hf_access_token)
    size = tokenizer_size(model)
  except Exception as e:  # pylint: disable=broad-exception-caught  # each library raises its own
    raise ConfigError(f"{where}: does not load as a {kind} tokenizer: {_words(e)}") from None
  if config.vocab_size < size:
    raise ConfigError(
        f"config key 'vocab_size' = {config.vocab_size} ({_origin(run, 'vocab_size')}) is smaller than the "
        f"{size} tokens of tokenizer_path {path!r}: ids past {config.vocab_size - 1} would fall outside the "
        f"embedding and train nothing meaningful; set vocab_size >= {size}")
