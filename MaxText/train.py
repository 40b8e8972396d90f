"""Entry point: `python -m MaxText.train [config.yml] [key=value ...]` (the run: MaxText/run/)."""

from MaxText.run.main import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
  cli()
