"""Triton kernels over GGUF-quantized weights: load-time repacking, in-register decoding, fused MoE, matmul."""
