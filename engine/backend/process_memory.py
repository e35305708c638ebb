"""This process's device memory as NVML sees it, and the highest of it over a run.

`ProcessMemory.read()` is NVML's count for this process (`nvmlDeviceGetComputeRunningProcesses`,
the CUDA context, cuBLAS, kernel modules and every allocation included) where the driver
reports it; inside containers that hide process ids it falls back to the device's used bytes
minus those used when this process first looked (`baseline`, taken before its CUDA context
when the CUDA backend opens it first: it is then this process's bytes plus whatever others
allocated since). Each reading says which it is.

`PeakSampler` polls a reader on a daemon thread and keeps the highest reading: what `strata
bench`'s "GPU peak" column and `strata run`'s peak line print, and what a `--vram-limit` is
checked against. NVML calls release the GIL; a 10 ms poll costs the engine well under 1%.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from engine.backend.telemetry import Telemetry

PROCESS = "NVML, this process"
DEVICE = "NVML, device used minus the baseline"

_baselines: dict[int, int] = {}  # device index -> NVML used bytes when this process first looked
_lock = threading.Lock()


@dataclass(frozen=True)
class MemoryReading:
    """Device bytes and where they were read (`PROCESS` or `DEVICE`)."""

    n_bytes: int
    source: str


class ProcessMemory:
    """This process's bytes on one GPU (see the module docstring). Built by `open`; the two
    readers are arguments so the fallback is testable without a GPU."""

    def __init__(self, read_process: Callable[[], int | None],
                 read_device_used: Callable[[], int], baseline_bytes: int,
                 close: Callable[[], None] = lambda: None):
        self._read_process, self._read_device_used = read_process, read_device_used
        self.baseline_bytes = baseline_bytes
        self._close = close

    @classmethod
    def open(cls, index: int = 0) -> ProcessMemory | None:
        """The reader of GPU `index`, or None without NVML. The process's first `open` of a
        device takes the baseline (the CUDA backend opens it before making its context)."""
        telemetry = Telemetry.open(index)
        if telemetry is None:
            return None

        def device_used() -> int:
            return int(telemetry.memory()[2])

        with _lock:
            baseline = _baselines.setdefault(index, device_used())
        pid = os.getpid()
        return cls(lambda: telemetry.process_used_bytes(pid), device_used, baseline,
                   telemetry.close)

    def read(self) -> MemoryReading:
        """This process's bytes now: NVML's own count, else device used minus the baseline."""
        n = self._read_process()
        if n is not None:
            return MemoryReading(n, PROCESS)
        return MemoryReading(max(0, self._read_device_used() - self.baseline_bytes), DEVICE)

    def close(self) -> None:
        """Release the NVML handle."""
        self._close()


class PeakSampler:
    """The highest `read()` of a reader between `start` and `stop`, polled every `interval_s`
    on a daemon thread; a context manager. 50 ms: a reading holds the GIL for ~0.4 ms, and at
    10 ms the poller took 4% of a host-bound decode's time (cProfile on the H200); device
    memory grows at allocations that stay for a chunk or longer, which 50 ms still sees."""

    def __init__(self, read: Callable[[], MemoryReading], interval_s: float = 0.05,
                 close: Callable[[], None] = lambda: None):
        self._read, self.interval_s, self._close = read, interval_s, close
        self._peak: MemoryReading | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, index: int, interval_s: float = 0.05) -> PeakSampler | None:
        """A sampler of this process's bytes on GPU `index` (not started), or None without
        NVML."""
        memory = ProcessMemory.open(index)
        if memory is None:
            return None
        return cls(memory.read, interval_s, memory.close)

    @property
    def peak(self) -> MemoryReading | None:
        """The highest reading so far (None before the first)."""
        return self._peak

    def sample(self) -> None:
        """Take one reading now (the thread calls this; so can the owner at a moment it
        knows is high)."""
        r = self._read()
        peak = self._peak
        if peak is None or r.n_bytes > peak.n_bytes:
            self._peak = r

    def start(self) -> Self:
        assert self._thread is None, "a PeakSampler starts once"
        self.sample()
        self._thread = threading.Thread(target=self._run, name="strata-vram-peak", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> MemoryReading | None:
        """Stop polling (after a last reading); the peak."""
        if self._thread is not None and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.sample()
            self._close()
        return self._peak

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
