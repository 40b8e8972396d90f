"""Bad inputs a new user tries, and whether each gets one clean line.

  PYTHONPATH=$PWD python tests/reliability_bad_inputs.py [--subprocess] [-k WORD]

Each case runs `MaxText.train.main(args)` on the tiny config (in this process
by default, with file descriptors 1 and 2 captured, so C-level writes count;
`--subprocess`: each in its own `python -m MaxText.train`, as a user runs it).
A case is clean when the exit code is the documented one (2), stderr holds
exactly one `maxtext-moe:` line, no Python traceback, and no run directory was
created. Prints PASS/FAIL per case and the count last. The runtime failures
(NaN, preemption, full disk, twin job, resume changes) are in
tests/test_train_lifecycle.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs/deepseek3-tiny.yml")


def _files(tmp: Path) -> dict[str, str]:
  """Broken config files (written once)."""
  files = {
      "syntax.yml": "steps: [1, 2\n",
      "list.yml": "- steps\n- 3\n",
      "cycle_a.yml": "base_config: cycle_b.yml\n",
      "cycle_b.yml": "base_config: cycle_a.yml\n",
      "nobase.yml": "base_config: no-such-base.yml\nsteps: 3\n",
      "typo.yml": f"base_config: {TINY}\nnum_expertz: 4\n",
      "badtype.yml": f"base_config: {TINY}\nsteps: soon\n",
  }
  for name, text in files.items():
    (tmp / name).write_text(text)
  return {name: str(tmp / name) for name in files}


def cases(tmp: Path) -> list[list[str]]:
  f = _files(tmp)
  overrides = [
      # unknown keys and typos
      "stepz=3", "num_expertz=4", "learning_rat=1e-3", "moe_gmm_backnd=xla", "per_device_batchsize=2",
      # wrong types
      "steps=abc", "learning_rate=fast", "per_device_batch_size=two", "enable_checkpointing=maybe",
      "num_experts=4.5", "vocab_size=abc", "checkpoint_period=soon", "progress_every=often",
      # out of range
      "per_device_batch_size=0", "per_device_batch_size=-2", "per_device_batch_size=0.5", "vocab_size=-1",
      "vocab_size=0", "max_target_length=0", "max_target_length=-8", "checkpoint_period=0", "checkpoint_period=-5",
      "steps=-5", "steps=0", "learning_rate=-1", "base_emb_dim=0", "base_num_decoder_layers=0",
      "num_experts_per_tok=16", "num_experts_per_tok=0", "num_experts=0", "progress_every=-1",
      "moe_a2a_padded_capacity_factor=0", "moe_te_ncclep_alignment=3", "base_num_query_heads=0",
      # names that are not one of the choices
      "attention=nosuch", "attention_type=weird", "hardware=abacus", "moe_gmm_backend=cutlass", "moe_block=fancy",
      "moe_dispatch_backend=carrier_pigeon", "decoder_block=nosuch", "xla_presets=[nosuch]", "dataset_type=nosuch",
      # combinations
      "moe_block=te", "moe_dispatch_backend=te_ncclep", "base_config=models/deepseek3-tiny.yml",
      "hardware=tpu", "hardware=gpu", "recipe_num_gpus=8",
      # paths
      "base_output_directory=/proc/maxtext-out", "base_output_directory=/no/such/parent/out",
      "base_output_directory=/etc/hostname",
      # override syntax
      "steps", "=3", "steps:3",
  ]
  out = [[TINY, o] for o in overrides]
  # The tiny config runs our block: these contradict upstream's.
  out += [["moe_block=upstream", "moe_dispatch_backend=ring"], ["moe_block=upstream", "moe_gmm_backend=xla",
          "sparse_matmul=false"], ["moe_block=upstream", "moe_gmm_backend=xla", "megablox=false"]]
  out = [a if a[0] == TINY else [TINY, *a] for a in out]
  out += [[str(REPO / "configs/no-such-file.yml")], [f["syntax.yml"]], [f["list.yml"]], [f["cycle_a.yml"]],
          [f["nobase.yml"]], [f["typo.yml"]], [f["badtype.yml"]]]
  return out


def _run_inprocess(args: list[str]) -> tuple[int, str]:
  from MaxText import train  # pylint: disable=import-outside-toplevel

  with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryFile("w+") as out:
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
    try:
      try:
        code = train.main(args)
      except BaseException as e:  # pylint: disable=broad-exception-caught
        import traceback  # pylint: disable=import-outside-toplevel

        traceback.print_exc()
        code = -1 if not isinstance(e, SystemExit) else e.code
      sys.stdout.flush(), sys.stderr.flush()
    finally:
      os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    err.seek(0)
    return code, err.read()


def _run_subprocess(args: list[str]) -> tuple[int, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DECOUPLE_GCLOUD")}
  proc = subprocess.run([sys.executable, "-m", "MaxText.train", *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  return proc.returncode, proc.stderr


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--subprocess", action="store_true")
  parser.add_argument("-k", default="")
  opts = parser.parse_args()
  run = _run_subprocess if opts.subprocess else _run_inprocess
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    clean = total = 0
    for args in cases(tmp):
      if opts.k not in " ".join(args):
        continue
      outputs = tmp / "outputs"
      full = [*args, f"base_output_directory={outputs}"] if not any(
          a.startswith("base_output_directory=") for a in args) else list(args)
      full.append("run_name=bad")
      code, err = run(full)
      lines = [line for line in err.splitlines() if line.startswith("maxtext-moe:")]
      ok = code == 2 and len(lines) == 1 and "Traceback" not in err and not (outputs / "bad").exists()
      total += 1
      clean += ok
      shown = " ".join(a.replace(str(REPO) + "/", "").replace(str(tmp) + "/", "") for a in args[1 if args[0] == TINY else 0:])
      print(f"{'PASS' if ok else 'FAIL'}  exit {code}  {shown:50s}  {lines[0][:150] if lines else err[-300:]!r}",
            flush=True)
  print(f"\n{clean} of {total} bad inputs: one clean line (exit 2, one 'maxtext-moe:' line, no traceback, "
        f"no run directory)")
  return 0 if clean == total else 1


if __name__ == "__main__":
  sys.exit(main())
