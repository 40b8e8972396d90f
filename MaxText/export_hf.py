"""Entry point: `python -m MaxText.export_hf ...`: a trained run out to Hugging Face's layout (MaxText/hf/export_cli.py)."""

if __name__ == "__main__":
  from MaxText.console import ending
  from MaxText.hf import quiet

  quiet.hush()  # before the CLI's imports bring in jax, transformers and upstream's modules
  from MaxText.hf.export_cli import main

  code = main()
  if code:  # a failure: its one line is printed, nothing is left to wait for
    ending.exit_now(code)
