"""CUDA kernels (CuPy + NVRTC): GGUF dequantization, fused dequantize-GEMV, grouped MoE prefill,
causal prompt attention.

Importing this package needs no GPU and no CuPy; CuPy is imported on the first kernel call.
"""

from engine.kernels.attention import causal_attention
from engine.kernels.dequant import (
    SUPPORTED,
    check_layouts,
    dequantize,
    dequantize_many,
    gemv,
    gemv_many,
)
from engine.kernels.moe import (
    expert_fp16_bytes,
    gemm_nt,
    moe_decode,
    moe_prefill,
)

__all__ = [
    "SUPPORTED",
    "causal_attention",
    "check_layouts",
    "dequantize",
    "dequantize_many",
    "expert_fp16_bytes",
    "gemm_nt",
    "gemv",
    "gemv_many",
    "moe_decode",
    "moe_prefill",
]
