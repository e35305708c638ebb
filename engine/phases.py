"""Where a prompt's time goes: device time per phase (attention, MoE) of the prompt path.

`PhaseClock(xp)` marks phase boundaries in stream order: on CUDA with events recorded on the
current stream (no host synchronisation, so the prefetch overlap it measures is not
disturbed), on the CPU with the wall clock. `lap(name)` closes the phase that began at the
previous mark; `totals()` waits for the last event once and returns seconds per phase.

Compared with the prefill's wall time this tells compute-bound (phases add up to the wall
time) from launch-bound (the device idles between them) without a profiler. The runtime
keeps one on every prompt (the loan forecast learns its rates from the totals) and prints
them after each prompt when STRATA_TRACE is set.

Kernels mark sub-phases with `lap(name)` (a no-op unless a clock is `active`): the grouped
MoE splits its time into routing (with its host reads), expert fetch + fp16 decode, and GEMMs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any


class PhaseClock:
    """Seconds per named phase, measured in stream order (see the module docstring)."""

    def __init__(self, xp: Any):
        self._cuda = xp.__name__ == "cupy"
        self._xp = xp
        self._last: Any = None
        self._laps: list[tuple[str, Any, Any]] = []
        self._totals: dict[str, float] = defaultdict(float)

    def _now(self) -> Any:
        if self._cuda:
            ev = self._xp.cuda.Event()
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        """Mark the beginning of the first phase."""
        self._last = self._now()

    def lap(self, phase: str) -> None:
        """The time since the previous mark belongs to `phase`."""
        now = self._now()
        if self._last is not None:
            self._laps.append((phase, self._last, now))
        self._last = now

    def totals(self) -> dict[str, float]:
        """Seconds per phase so far (waits for the last recorded event on CUDA)."""
        if self._laps and self._cuda:
            self._laps[-1][2].synchronize()
        for phase, a, b in self._laps:
            seconds = self._xp.cuda.get_elapsed_time(a, b) / 1e3 if self._cuda else b - a
            self._totals[phase] += seconds
        self._laps.clear()
        return dict(self._totals)

    def line(self, wall_s: float) -> str:
        """'prefill phases: attention 1.20 s, moe 2.31 s = 3.51 s of 4.02 s wall'."""
        totals = self.totals()
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in totals.items())
        return f"prefill phases: {parts} = {sum(totals.values()):.2f} s of {wall_s:.2f} s wall"


_ACTIVE: ContextVar[PhaseClock | None] = ContextVar("strata_phase_clock", default=None)


@contextmanager
def active(clock: PhaseClock | None) -> Iterator[None]:
    """Make `clock` the one `lap` marks while the block runs (None: laps are no-ops)."""
    token = _ACTIVE.set(clock)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def lap(phase: str) -> None:
    """The time since the active clock's previous mark belongs to `phase` (no clock: nothing)."""
    clock = _ACTIVE.get()
    if clock is not None:
        clock.lap(phase)
