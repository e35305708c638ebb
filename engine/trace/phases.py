"""Where a prompt's time goes: device time per phase (attention, MoE) of the prompt path.

`PhaseClock(backend)` marks phase boundaries in stream order with the backend's `time_mark`:
on CUDA events recorded on the current stream (no host synchronisation, so the prefetch
overlap it measures is not disturbed), on the simulated device the wall clock. `lap(name)` closes the phase that began at the
previous mark; `totals()` waits for the last event once and returns seconds per phase.

Compared with the prefill's wall time this tells compute-bound (phases add up to the wall
time) from launch-bound (the device idles between them) without a profiler. The runtime
keeps one on every prompt (the loan forecast learns its rates from the totals) and prints
them after each prompt when STRATA_TRACE is set.

Code below the model marks sub-phases with `lap(name)` (a no-op unless a clock is `active`):
the CUDA MoE op hands it to the grouped MoE kernel, which splits its time into routing (with
its host reads), expert fetch + fp16 decode, and GEMMs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol


class Timer(Protocol):
    """What a clock needs of the backend: marks in stream order and the time between two."""

    def time_mark(self) -> Any: ...

    def seconds_between(self, start: Any, end: Any) -> float: ...


class PhaseClock:
    """Seconds per named phase, measured in stream order (see the module docstring)."""

    def __init__(self, timer: Timer):
        self._timer = timer
        self._last: Any = None
        self._laps: list[tuple[str, Any, Any]] = []
        self._totals: dict[str, float] = defaultdict(float)

    def start(self) -> None:
        """Mark the beginning of the first phase."""
        self._last = self._timer.time_mark()

    def lap(self, phase: str) -> None:
        """The time since the previous mark belongs to `phase`."""
        now = self._timer.time_mark()
        if self._last is not None:
            self._laps.append((phase, self._last, now))
        self._last = now

    def totals(self) -> dict[str, float]:
        """Seconds per phase so far (waits for the last mark on CUDA)."""
        for phase, a, b in self._laps:
            self._totals[phase] += self._timer.seconds_between(a, b)
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
