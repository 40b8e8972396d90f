"""Entry point: `python -m MaxText.import_hf ...`: published Hugging Face weights into a run's checkpoint (MaxText/hf/import_cli.py)."""

if __name__ == "__main__":
  from MaxText.console import ending
  from MaxText.hf import quiet

  quiet.hush()  # before the CLI's imports bring in jax, transformers and upstream's modules
  from MaxText.hf.import_cli import main

  code = main()
  if code:  # a failure: its one line is printed, nothing is left to wait for
    ending.exit_now(code)
