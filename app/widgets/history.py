"""SessionHistory: what the engine's events said over the session, kept for plotting.

Two bounded rings, fed only by events (no engine call, no clock read: the same events give the
same history, so the plots can be tested and snapshotted):

- samples in time: memory by region group and lent cache slots, one sample per `sample_s` of
  event time (`Event.t`). A sample is the state farthest from the one before it within its
  interval, so a loan shorter than an interval still shows. While a request runs, every
  interval gets a sample; an idle stretch longer than `max_idle` intervals is one gap (None),
  so the ring holds requests, not idle time. On CUDA the engine's telemetry thread publishes a
  GPU reading every 0.5 s, so there the clock ticks without requests too.
- one point per finished request: PP and TG tok/s, the decode steps' expert-cache hit rate,
  bytes streamed over the link, tokens read (a stopped prefill: what it read).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from engine.trace.events import (
    CacheChanged,
    Event,
    LedgerChanged,
    RequestDone,
    RequestStarted,
)

MAX_SAMPLES = 600  # 5 minutes of activity at 2 a second
MAX_REQUESTS = 200
SAMPLE_S = 0.5
MAX_IDLE = 4  # intervals of an idle stretch drawn as they are; a longer one is one gap

# region names -> the group plotted; decode-only: what a loan releases and restores
GROUPS = ("weights", "kv", "experts.cache", "decode-only", "prompt", "outside", "other")
DECODE_ONLY = ("head.native", "mtp.experts", "mtp.draft_head", "verifier")
LENT = "lent slots"
SERIES = (*GROUPS, LENT)


def region_group(name: str) -> str:
    """The plotted group of a ledger region (or of the ledger's 'unaccounted' part)."""
    if name.startswith("weights"):
        return "weights"
    if name in ("kv", "experts.cache"):
        return name
    if name in DECODE_ONLY:
        return "decode-only"
    if name.startswith("prompt."):
        return "prompt"
    if name == "unaccounted":
        return "outside"
    return "other"


def memory_by_group(ledger: LedgerChanged) -> dict[str, int]:
    """Mapped bytes of each group (what the VRAM bar draws), outside the ledger included."""
    out = dict.fromkeys(GROUPS, 0)
    for r in ledger.regions:
        out[region_group(r.name)] += r.mapped_bytes
    out["outside"] += ledger.unaccounted_bytes or 0
    return out


@dataclass(frozen=True)
class RequestPoint:
    """One finished request's figures (rates None where the phase did not run)."""

    request_id: int  # 0: began before the app connected
    prompt_tokens: int
    read_tokens: int  # fresh tokens the prefill read
    pp_tok_s: float | None
    tg_tok_s: float | None
    hit_pct: float | None  # decode steps' routed experts found in the cache
    bytes_streamed: int
    cancelled: bool
    failed: bool

    @classmethod
    def of(cls, request_id: int, done: RequestDone) -> RequestPoint:
        pp = done.n_read / done.prefill_s if done.prefill_s > 0 and done.n_read else None
        tg = done.generated / done.decode_s if done.decoded and done.decode_s > 0 else None
        n = done.decode_hits + done.decode_misses
        return cls(request_id, done.prompt_tokens, done.n_read, pp, tg,
                   100 * done.decode_hits / n if n else None, done.bytes_streamed,
                   done.cancelled, done.failed)


class SessionHistory:
    """The session's samples in time and its requests, both bounded rings."""

    def __init__(self, max_samples: int = MAX_SAMPLES, max_requests: int = MAX_REQUESTS,
                 sample_s: float = SAMPLE_S, max_idle: int = MAX_IDLE,
                 from_first_request: bool = False) -> None:
        """`from_first_request`: memory is sampled from the first request on (the engine's
        load is not activity, and a screen before any request draws the same every time)."""
        assert max_samples > 0 and max_requests > 0 and sample_s > 0 and max_idle >= 0
        self.sample_s, self.max_idle = sample_s, max_idle
        # a sample: {series: value}; None: an idle gap
        self.samples: deque[dict[str, float] | None] = deque(maxlen=max_samples)
        self.requests: deque[RequestPoint] = deque(maxlen=max_requests)
        self.n_requests = 0  # finished in the session (the ring keeps the last max_requests)
        self.state: dict[str, float] = {}  # the newest value of every series seen
        self._start: dict[str, float] = {}  # the state when the open interval began
        self._open: dict[str, float] = {}  # the open interval's sample so far
        self._interval: int | None = None  # index of the open interval (event time / sample_s)
        self._request_id = 0
        self.running = False
        self.sampling = not from_first_request

    # -- feeding -----------------------------------------------------------------------------
    def apply(self, event: Event) -> bool:
        """Take `event` in; True when it changed what the plots show."""
        self.sampling = self.sampling or isinstance(event, RequestStarted)
        ticked = self._tick(event.t) if self.sampling else False
        if isinstance(event, LedgerChanged):
            self._set(memory_by_group(event))
        elif isinstance(event, CacheChanged):
            self._set({LENT: event.n_lent})
        elif isinstance(event, RequestStarted):
            self._request_id, self.running = event.request_id, True
            return ticked
        elif isinstance(event, RequestDone):
            self.running = False
            self.requests.append(RequestPoint.of(self._request_id, event))
            self.n_requests += 1
            self._request_id = 0
        else:
            return ticked
        return True

    def _set(self, values: dict[str, float]) -> None:
        self.state.update(values)
        for name, v in values.items():
            ref = self._start.setdefault(name, v)  # first seen: the interval starts there
            if abs(v - ref) >= abs(self._open.get(name, ref) - ref):
                self._open[name] = v

    def _tick(self, t: float) -> bool:
        """Close the open interval when `t` lies past it and fill the intervals between;
        True when samples were added."""
        if not math.isfinite(t):
            return False
        i = math.floor(t / self.sample_s)
        if self._interval is None:
            self._interval = i
            return False
        if i <= self._interval:  # the same interval (or a clock that went back: a new server)
            return False
        n = len(self.samples)
        if self._open or self.state:
            self.samples.append({**self.state, **self._open})
        missed = i - self._interval - 1
        if missed > self.max_idle and not self.running:
            self.samples.append(None)
        else:
            self.samples.extend(dict(self.state) for _ in range(min(missed, self.samples.maxlen)))
        self._interval, self._open, self._start = i, {}, dict(self.state)
        return len(self.samples) != n or len(self.samples) == self.samples.maxlen

    # -- reading -----------------------------------------------------------------------------
    def series(self, *names: str) -> list[list[float | None]]:
        """The samples of each named series, the open interval last (None: a gap, or not
        seen yet)."""
        rows: list[dict[str, float] | None] = [*self.samples]
        if self.state:
            rows.append({**self.state, **self._open})
        return [[None if row is None else row.get(name) for row in rows] for name in names]

    def per_request(self, field: str) -> list[float | None]:
        """One value of `RequestPoint.field` per request in the ring, oldest first."""
        return [getattr(p, field) for p in self.requests]
