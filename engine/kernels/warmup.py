"""What every CUDA engine loads whatever its model, loaded before the backend measures what
the process holds outside its budget (engine/memory/budget.py): the strided-batched cuBLAS
GEMM the MoE and the attention call, the kernel modules that take no model shape, and the
dequantize / fused GEMV kernels of the model's quant types (every batch size at once, so no
decode step stalls on a compile). Kernels of the model's other shapes (decode attention per KV
kind, FA2 per head size) load later, inside the budget's margin.

On a fresh machine each module is an NVRTC compile (a fraction of a second to a few seconds;
the demo model needs two dozen: each decoder's dequantize and GEMV instantiations are four
modules); CuPy keeps the binaries on disk, so later processes only load them. The modules
compile on a pool of threads (NVRTC runs outside the GIL), one per core up to MAX_WORKERS,
each thread on the caller's device, and `progress` hears each one finish."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from gguf import GGMLQuantizationType as Q

from engine.kernels import attention, decode, dequant, flash, fused, moe

Progress = Callable[[int, int], None]  # (modules loaded, modules in all)
MAX_WORKERS = 16  # compile threads at most (the H200 machine has 16 cores)
# fp16 weights (dense ones the backend decodes, a float draft head) run through the F16
# GEMV whatever types the file holds (engine/backend/cuda_ops.py)
ALWAYS_QTYPES = (Q.F16,)


def compile_jobs(qtypes: Sequence[Q] = ()) -> list[Callable[[], None]]:
    """The modules an engine of a model with these tensor types loads up front, one job each."""
    shape_free = [m.preload for m in (attention, decode, flash, fused, moe)]
    return [*shape_free, *dequant.preload_jobs([*qtypes, *ALWAYS_QTYPES])]


def warm_up(qtypes: Sequence[Q] = (), progress: Progress | None = None,
            workers: int | None = None) -> None:
    """Run one small fp16 GEMM through `moe.gemm_nt`, then compile and load the shape-free
    modules and the kernels of `qtypes` on `workers` threads (default: the cores, at most
    MAX_WORKERS).
    Needs a current device; the first failure is raised once every job has ended."""
    import cupy

    a = cupy.ones((1, 64, 64), dtype=cupy.float16)  # [G, m, K] = [G, N, K]
    moe.gemm_nt(a, a, cupy.empty((1, 64, 64), dtype=cupy.float16))  # out [G, m, N]
    jobs = compile_jobs(qtypes)
    device = cupy.cuda.Device().id

    def on_device(job: Callable[[], None]) -> None:
        with cupy.cuda.Device(device):  # a thread's current device is 0 until it sets one
            job()

    n_workers = max(1, min(workers or os.cpu_count() or 1, MAX_WORKERS, len(jobs)))
    if progress is not None:
        progress(0, len(jobs))
    with ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="strata-nvrtc") as pool:
        futures = [pool.submit(on_device, job) for job in jobs]
        for done, future in enumerate(as_completed(futures), 1):
            future.exception()  # wait; raised below, in submission order
            if progress is not None:
                progress(done, len(jobs))
    for future in futures:
        future.result()
