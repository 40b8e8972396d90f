"""maxtext-moe: dropless Mixture-of-Experts pretraining on NVIDIA GPUs, built on
upstream MaxText (maxtext==0.2.5) from outside, through patches/."""

__version__ = "0.1.0"
