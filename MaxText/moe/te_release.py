"""The Transformer Engine releases our TE adapters are written to.

gmm/te.py (grouped_gemm with GroupedNoScaleTensor operands) and dispatch/te_ncclep.py (ep.py's
EpLayerConfig API) were both checked against the released 2.20.2 source and run on it on an H200;
MaxText/attention/sinks_te.py (fused attention's learnable softmax) is written to the same release, never run;
TE's JAX API changes between minor releases, so anything else is refused by name, not guessed at.
docker/manifest.yaml and pyproject.toml's [te] extra name the same series (tests/test_te_release.py).
"""

from __future__ import annotations

SUPPORTED_TE = ("2.20",)


def installed_version() -> str:
  """transformer_engine.__version__, or 'unknown' (raises ImportError when TE does not import)."""
  import transformer_engine  # pylint: disable=import-outside-toplevel

  return str(getattr(transformer_engine, "__version__", "unknown"))


def unsupported(version: str) -> str | None:
  """Why `version` is not a release the adapters support, or None."""
  if version.startswith(tuple(f"{series}." for series in SUPPORTED_TE)):
    return None
  return (f"supports Transformer Engine {', '.join(f'{s}.x' for s in SUPPORTED_TE)}; {version} is installed")
