"""Entry point: `python -m MaxText.export_hf ...`: a trained run out to Hugging Face's layout (MaxText/hf/export_cli.py)."""

import sys

from MaxText.hf.export_cli import main

__all__ = ["main"]

if __name__ == "__main__":
  sys.exit(main())
