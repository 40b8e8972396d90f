"""Hugging Face export and import (docs/huggingface.md): MaxText/hf/export_cli.py, MaxText/hf/import_cli.py.

  checkpoint.py   a run's orbax checkpoint, read one slice at a time and checked against our record's digests
  safetensors.py  sharded safetensors written header-first (one tensor in memory at a time), and read
  layout.py       the transforms between a stored slice and an HF tensor (transpose, heads, RoPE column order)
  deepseek.py     DeepSeek-V3: the released checkpoint's tensor names and config.json
  gqa.py          Qwen3-MoE and Mixtral: grouped-query attention and a routed MoE in every layer
  run.py          a run directory's model config, rebuilt from the run's own record
  errors.py       the exit codes, one per cause
  output.py       OUT_DIR claimed (a lock), written into OUT_DIR.tmp, fsynced, renamed; partial output removed
  stop.py         SIGTERM and SIGINT: one line, 143 / 130, partial output removed
  quiet.py        our lines only: the libraries' chatter off, a failed write's thread tracebacks dropped
"""
