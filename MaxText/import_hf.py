"""Entry point: `python -m MaxText.import_hf ...`: published Hugging Face weights into a run's checkpoint (MaxText/hf/import_cli.py)."""

import sys

from MaxText.hf.import_cli import main

__all__ = ["main"]

if __name__ == "__main__":
  sys.exit(main())
