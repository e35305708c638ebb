"""Devices: the `Backend` protocol and `make_backend(spec)` for `--device sim[:SIZE]|cuda[:N]`;
NVML readings (`telemetry`) and this process's device bytes (`process_memory`)."""

from __future__ import annotations

from collections.abc import Callable

from engine.backend.base import AddressSpace, Backend, CopyCounts, CopyStats, MemInfo
from engine.backend.sim import SimBackend
from engine.errors import DeviceError, FlagError
from engine.memory.sizes import GiB, parse_size

DEFAULT_SIM_BYTES = 8 * GiB

__all__ = [
    "DEFAULT_SIM_BYTES",
    "AddressSpace",
    "Backend",
    "CopyCounts",
    "CopyStats",
    "MemInfo",
    "SimBackend",
    "make_backend",
]


def make_backend(spec: str, limit_bytes: int | None = None, *, elastic: bool = True,
                 warm_up: Callable[[], None] | None = None) -> Backend:
    """The device named by `spec`: "sim" (8 GiB), "sim:512MiB", "cuda" or "cuda:N".

    `limit_bytes` (`--vram-limit`) bounds the whole CUDA process (context and kernels
    included): the backend measures what lies outside its budget after `warm_up` (what the
    engine loads whatever its model) and plans the rest; `elastic` (`--vram-elastic`) is
    recorded as a policy: CUDA maps ledger segments through VMM wherever the driver supports
    it (see docs/cuda.md).
    CuPy is imported only for a CUDA spec, so the CPU path never needs it.
    """
    kind, _, arg = spec.strip().partition(":")
    kind = kind.lower()
    if kind == "sim":
        if not arg:
            return SimBackend(DEFAULT_SIM_BYTES)
        try:
            return SimBackend(parse_size(arg, what="sim device size"))
        except FlagError as e:
            raise DeviceError(f"--device {spec}: {e}") from None
    if kind == "cuda":
        if arg and not arg.isdigit():
            raise DeviceError(f"--device {spec}: '{arg}' is not a GPU index; write cuda or cuda:0")
        try:
            from engine.backend.cuda import CudaBackend
        except ImportError as e:
            raise DeviceError(
                f"CUDA backend not available yet on this machine: --device {spec} needs CuPy "
                f"and cuda-bindings ({e.name} is missing; pip install 'strata-chat[cuda]')"
            ) from None
        return CudaBackend(int(arg or 0), limit_bytes, elastic=elastic, warm_up=warm_up)
    raise DeviceError(f"unknown device '{spec}'; use sim, sim:SIZE (e.g. sim:8GiB) or cuda[:N]")
