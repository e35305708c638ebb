"""What every CUDA engine loads whatever its model, loaded before the backend measures what
the process holds outside its budget (engine/memory/budget.py): the strided-batched cuBLAS
GEMM the MoE and the attention call, the kernel modules that take no model shape, and the
dequantize / fused GEMV kernels of the model's quant types (every batch size at once, so no
decode step stalls on a compile). Kernels of the model's other shapes (decode attention per KV
kind, FA2 per head size) load later, inside the budget's margin."""

from __future__ import annotations

from collections.abc import Sequence

from gguf import GGMLQuantizationType as Q

from engine.kernels import attention, decode, dequant, flash, fused, moe


def warm_up(qtypes: Sequence[Q] = ()) -> None:
    """Run one small fp16 GEMM through `moe.gemm_nt`, load the shape-free modules and the
    kernels of `qtypes` (compiled by NVRTC on a fresh machine, from CuPy's disk cache
    afterwards). Needs a current device."""
    import cupy

    a = cupy.ones((1, 64, 64), dtype=cupy.float16)  # [G, m, K] = [G, N, K]
    moe.gemm_nt(a, a, cupy.empty((1, 64, 64), dtype=cupy.float16))  # out [G, m, N]
    for module in (attention, decode, flash, fused, moe):
        module.preload()
    dequant.preload(qtypes)
