"""Attention kernels upstream MaxText lacks on GPU: GPT-OSS's attention with sinks in a fused kernel
(sinks.py; its kernels: flash_cudnn.py, flash_xla.py, sinks_te.py)."""
