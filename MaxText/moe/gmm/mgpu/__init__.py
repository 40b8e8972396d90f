"""Our Hopper grouped-GEMM kernels in JAX Pallas Mosaic GPU. Two backends of MaxText.moe.gmm live here:
"mgpu" (bf16.py: the forward/dlhs kernels in kernels.py and pingpong.py, dW in tgmm.py) and "mgpu_fp8" (fp8.py:
DeepSeek-V3's blockwise FP8, dW in fp8_tgmm.py, the one-pass quantizations in fp8_quant_kernels.py). tiling.py holds
the per-shape tile table (pure Python), schedule.py the warp-specialized pipeline's pieces."""
