"""Reporter: where an engine's progress goes — events on its bus and the text lines the CLI
prints. Startup, the loan transaction, the prompt path and the runtime all report through one
`Reporter`, so what a user sees (the app's panels, `strata run`'s lines) has one source.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.backend.base import Backend, as_gpu
from engine.backend.telemetry import Sampler, Telemetry
from engine.experts.cache import LENT, ExpertCache
from engine.gguf.type_mix import layer_ranges, layers_by_value
from engine.memory.ledger import Ledger
from engine.trace.events import CacheChanged, EventBus, GpuStats, TraceLine

Sink = Callable[[str], None]
GPU_SAMPLE_S = 0.5  # on CUDA a GpuStats reading at least this often, requests or not


class Reporter:
    """Events and text lines of one engine.

    `trace` lines are events always and printed with STRATA_TRACE=1; `say` lines (the serve
    lines) are printed always; `warn` lines are kept in `warnings` and printed always.
    """

    def __init__(self, bus: EventBus | None = None, on_line: Sink | None = None,
                 trace_on: bool | None = None):
        self.bus = bus or EventBus()
        self.on_line = on_line
        self.trace_on = (os.environ.get("STRATA_TRACE", "") not in ("", "0")
                         if trace_on is None else trace_on)
        self.warnings: list[str] = []
        self._telemetry: Any = None  # engine.backend.telemetry.Telemetry; False without NVML
        self._sampler: Sampler | None = None
        self._gpu_t = 0.0
        self._ledger_bytes, self._limit_bytes = 0, None  # the last engine-thread reading's

    def publish(self, event: Any) -> None:
        self.bus.publish(event)

    def trace(self, line: str) -> None:
        """A trace or loan line: a TraceLine event, printed with STRATA_TRACE=1."""
        self.bus.publish(TraceLine(line))
        self._print(line, self.trace_on)

    def say(self, line: str) -> None:
        """A serve line: a TraceLine event, always printed."""
        self.bus.publish(TraceLine(line))
        self._print(line, True)

    def warn(self, line: str) -> None:
        """A warning: kept in `warnings` and always printed."""
        self.warnings.append(line)
        self._print(line, True)

    def _print(self, line: str, show: bool) -> None:
        if self.on_line is not None and show:
            self.on_line(line)

    def cache(self, cache: ExpertCache | None) -> None:
        """A CacheChanged event: every slot's state, the lent range, the blob sizes."""
        if cache is None:
            return
        states = cache.states()
        lent = np.nonzero(states == LENT)[0]
        rng = (int(lent[0]), int(lent[-1])) if len(lent) else None
        sizes = tuple((n, layer_ranges(ls))
                      for n, ls in layers_by_value(cache.host.layer_blob_bytes).items())
        self.bus.publish(CacheChanged(states.astype(np.uint8).tobytes(), rng, len(lent),
                                      cache.blob_bytes, sizes, cache.slack_bytes()))

    def gpu(self, backend: Backend, ledger: Ledger, force: bool = False) -> None:
        """On CUDA, at most twice a second unless `force`: measure again what the process
        holds outside the ledger (`CudaBackend.refresh_outside`: growth comes off the pool's
        limit; with STRATA_TRACE=1 and `force` its memory line), then an NVML reading as a
        GpuStats event with the whole-process limit. The first call also starts the sampler
        thread: between these calls (decoding, idle) it publishes a reading every
        `GPU_SAMPLE_S` with the ledger bytes and limit measured here last."""
        gpu = as_gpu(backend)
        if gpu is None:
            return
        now = time.monotonic()
        if not force and now - self._gpu_t < 0.5:
            return
        self._gpu_t = now
        gpu.refresh_outside()
        if force and self.trace_on:
            self.trace(gpu.memory_line())
        if self._telemetry is None:
            self._telemetry = Telemetry.open(gpu.device_index) or False
            if self._telemetry:
                self._sampler = Sampler(self._telemetry, GPU_SAMPLE_S, self._sampled).start()
        if self._telemetry:
            self._ledger_bytes = sum(r.used_bytes for r in ledger.snapshot().regions)
            self._limit_bytes = backend.mem_info().total_bytes
            self.bus.publish(GpuStats(self._telemetry.snapshot(), self._ledger_bytes,
                                      self._limit_bytes))

    def _sampled(self, reading: Any) -> None:
        # the sampler's thread: the ledger is the engine thread's, so its last figures are used
        if time.monotonic() - self._gpu_t >= GPU_SAMPLE_S / 2:  # no reading just published
            self.bus.publish(GpuStats(reading, self._ledger_bytes, self._limit_bytes))

    def close(self) -> None:
        """Stop the sampler and release the NVML handle (a closed engine publishes no more
        readings)."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self._telemetry:
            self._telemetry.close()
        self._telemetry = False
