"""`strata gpu-probe`: one screen on whether this machine's GPU can run the engine.

Prints the device, NVML memory and link, VMM support and granularity, pinned host-to-device
bandwidth, and a kernel check (compile, run, compare with `gguf.quants` on random blocks).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.cli.options import integer
from engine.kernels import dequantize, gemv
from engine.kernels.warmup import warm_up
from engine.memory.sizes import MiB
from engine.tools.kernel_bench import random_quant_bytes


def _line(name: str, value: str) -> str:
    return f"{name:<14}{value}"


def _h2d_gbs(backend: object, n_bytes: int, *, pinned: bool) -> float:
    import cupy as cp

    dev = cp.empty(n_bytes, dtype=cp.uint8)
    host = backend.host_buffer(n_bytes) if pinned else np.empty(n_bytes, dtype=np.uint8)  # type: ignore[attr-defined]
    host[:] = 7
    best = float("inf")
    for _ in range(4):
        t0 = time.perf_counter()
        backend.upload(host, dev)  # type: ignore[attr-defined]
        backend.synchronize()  # type: ignore[attr-defined]
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best / 1e9


def _kernel_check() -> str:
    import cupy as cp
    from gguf import GGMLQuantizationType as Q

    from engine.gguf.quant import dequantize_bytes

    rng = np.random.default_rng(0)
    shape = (256, 2048)
    worst = 0.0
    t0 = time.perf_counter()
    for qtype in (Q.Q4_K, Q.Q6_K, Q.IQ4_XS):
        raw = random_quant_bytes(rng, qtype, shape)
        ref = dequantize_bytes(raw, qtype, shape)
        dev = cp.asarray(raw)
        got = dequantize(dev, qtype, shape, cp.float32).get()
        worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
        x = rng.standard_normal(shape[1]).astype(np.float32)
        y = gemv(dev, qtype, shape, cp.asarray(x)).get()
        worst = max(worst, float(np.linalg.norm(y - ref @ x) / np.linalg.norm(ref @ x)))
    ok = "ok" if worst < 1e-4 else "MISMATCH"
    return f"{ok}: Q4_K, Q6_K, IQ4_XS dequant+gemv, worst rel err {worst:.1e}, {time.perf_counter() - t0:.1f} s incl. NVRTC"


def probe(device: int = 0) -> str:
    """The probe's text."""
    from engine.backend.telemetry import format_snapshot, snapshot

    try:
        import cupy as cp
    except ImportError:
        return "cupy: not installed (pip install 'strata-chat[cuda]')\n" + format_snapshot(
            snapshot(device)
        )
    from engine.backend.cuda import CudaBackend
    from engine.backend.vmm import vmm_granularity, vmm_supported

    backend = CudaBackend(device, warm_up=warm_up)  # measured as an engine's start measures it
    props = cp.cuda.runtime.getDeviceProperties(device)
    free, total = backend.device_mem_info()
    lines = [
        _line(
            "device",
            f"cuda:{device} {props['name'].decode()}, sm_{props['major']}{props['minor']}, "
            f"{props['multiProcessorCount']} SMs, L2 {props['l2CacheSize'] >> 20} MiB",
        ),
        _line(
            "cuda",
            f"runtime {cp.cuda.runtime.runtimeGetVersion()}, driver "
            f"{cp.cuda.runtime.driverGetVersion()}, cupy {cp.__version__}",
        ),
        _line("cudaMemGetInfo", f"free {free / MiB:,.0f} MiB of {total / MiB:,.0f} MiB"),
        _line("plan budget", backend.budget.line()),
        format_snapshot(snapshot(device)),
    ]
    vmm = vmm_supported(device)
    gran = f"granularity {vmm_granularity(device) / MiB:g} MiB (minimum {vmm_granularity(device, recommended=False) / MiB:g} MiB)"
    lines.append(
        _line("vmm", f"{'supported' if vmm else 'NOT supported (plain allocations)'}, {gran}")
    )
    n = 256 * MiB
    lines.append(
        _line(
            "h2d",
            f"pinned {_h2d_gbs(backend, n, pinned=True):.1f} GB/s, pageable via staging "
            f"{_h2d_gbs(backend, n, pinned=False):.1f} GB/s ({n // MiB} MiB)",
        )
    )
    lines.append(_line("kernels", _kernel_check()))
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu-probe", help="check the CUDA device: memory, VMM, PCIe, kernels")
    p.add_argument("--device", type=integer, default=0, help="GPU index (default 0)")
    p.set_defaults(func=lambda a: print(probe(a.device)))
