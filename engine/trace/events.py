"""Engine events: frozen dataclasses and a thread-safe bus — the only way out of the engine.

The UI subscribes and reads; it never calls into engine internals. The same facts are printed
as the text lines of DESIGN §8 by the CLI.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from engine.memory.ledger import LedgerSnapshot, RegionInfo
from engine.trace.timing import Timing

__all__ = ["RegionInfo"]


@dataclass(frozen=True)
class Event:
    t: float = field(default_factory=time.monotonic, kw_only=True)


@dataclass(frozen=True)
class Loading(Event):
    """Model build/load progress."""

    stage: str
    done: int
    total: int


@dataclass(frozen=True)
class Ready(Event):
    """The engine is loaded; `summary` describes model, device and plan; the rest are the
    model's facts, so a reader needs nothing else of the engine."""

    summary: str
    device: str
    model_name: str = ""  # general.name, else the file's name
    model_description: str = ""  # general.description: what to try first ("" when none)
    n_layer: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_vocab: int = 0


@dataclass(frozen=True)
class LedgerChanged(Event):
    """A snapshot of device memory by region, and the owner of every segment."""

    capacity_bytes: int
    segment_bytes: int
    regions: tuple[RegionInfo, ...]  # name, used_bytes, n_segments, mapped_bytes
    free_bytes: int
    segment_map: tuple[str, ...]
    unaccounted_bytes: int | None = None  # outside the ledger (on CUDA: NVML minus the regions)
    limit_bytes: int | None = None  # what the whole process may hold (None: the capacity)

    @classmethod
    def of(cls, s: LedgerSnapshot) -> LedgerChanged:
        return cls(s.capacity_bytes, s.segment_bytes, s.regions, s.free_bytes, s.segment_map,
                   s.unaccounted_bytes, s.limit_bytes)


@dataclass(frozen=True)
class CacheChanged(Event):
    """Expert-cache slot states (0 empty, 1 resident, 2 lent, 3 refilling) and the lent range;
    the slot size, each blob size with the layers that have it (several where a quant mix gives
    layers different types) and the slot bytes the resident experts leave unused."""

    states: bytes
    lent_range: tuple[int, int] | None
    n_lent: int
    slot_bytes: int = 0
    blob_sizes: tuple[tuple[int, str], ...] = ()  # (blob bytes, its layers as ranges)
    slack_bytes: int = 0


@dataclass(frozen=True)
class RequestStarted(Event):
    """A request was admitted: `prompt_tokens` in all, `fresh_tokens` to prefill."""

    request_id: int
    prompt_tokens: int
    fresh_tokens: int


@dataclass(frozen=True)
class PlanChosen(Event):
    """The prompt geometry for this request: `chunk tokens / ring slots`."""

    chunk_tokens: int
    ring_slots: int
    loan: bool
    n_chunks: int
    fresh_tokens: int
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrefillProgress(Event):
    chunk: int  # chunks done
    n_chunks: int
    tokens_done: int
    tokens_total: int
    chunk_ms: float


@dataclass(frozen=True)
class LoanStep(Event):
    """One step of a request's memory transaction: the loan's release, plan, restore, failed,
    cancelled, and the prompt path's lend and refill of cache-tail slots (with or without a
    loan; the slots' states are `CacheChanged` events)."""

    step: str
    detail: str
    n_bytes: int = 0
    ms: float = 0.0


@dataclass(frozen=True)
class Token(Event):
    """Generated text, already detokenized (complete UTF-8)."""

    text: str


@dataclass(frozen=True)
class RequestDone(Event):
    """A request finished, was cancelled, or failed (`error`: its one line): its timing
    record's figures, in seconds as `Timing` has them (`of` copies every field of the same
    name). A prefill that stopped says what it read (`read_tokens`, in `prefill_s`)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    fresh_tokens: int = 0
    prefill_s: float = 0.0
    generated: int = 0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    drafts_offered: int = 0
    drafts_accepted: int = 0
    bytes_streamed: int = 0
    cancelled: bool = False
    line: str = ""
    spec_steps: int = 0  # speculative decoding: verify steps, and how many of them drafted
    drafted_steps: int = 0
    decoded: bool = True  # a decode step ran (Timing.decoded); else there is no TG to show
    forecast_s: float = 0.0  # the prefill's forecast made before it ran (0: none)
    decode_hits: int = 0  # decode steps' routed experts found in the expert cache
    decode_misses: int = 0
    decode_promoted: int = 0  # missed experts the admission policy put into the cache
    read_tokens: int | None = None  # a stopped prefill's fresh tokens read; None: all
    error: str = ""  # a failed request: why (not a cancel: `cancelled` stays False)

    @property
    def n_read(self) -> int:
        """Fresh tokens the prefill read: all of them unless it was stopped."""
        return self.fresh_tokens if self.read_tokens is None else self.read_tokens

    @property
    def failed(self) -> bool:
        return bool(self.error)

    @classmethod
    def of(cls, timing: Timing, cancelled: bool = False, error: str = "") -> RequestDone:
        """The event of a request's timing record (and its timing line)."""
        assert not (cancelled and error), "a request is cancelled or failed, not both"
        own = ("cancelled", "line", "error")
        same = {f.name: getattr(timing, f.name) for f in fields(cls)
                if f.name not in own and hasattr(timing, f.name)}
        return cls(**same, cancelled=cancelled, line=timing.line(), error=error)


@dataclass(frozen=True)
class TraceLine(Event):
    """A text line as the CLI prints it (strata serve / trace / loan)."""

    text: str


@dataclass(frozen=True)
class FlagsChanged(Event):
    """Flags accepted; they apply from the next request. `warnings`: what the change says
    (a repeat threshold clamped to 256, one no message reaches: runtime_flags.warnings)."""

    flags: tuple[tuple[str, str], ...]
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class FlagsRefused(Event):
    violations: tuple[str, ...]


@dataclass(frozen=True)
class GpuStats(Event):
    """An NVML reading of the device (CUDA only), with the ledger's view beside it."""

    snapshot: Any  # engine.backend.telemetry.GpuSnapshot
    ledger_bytes: int  # bytes the ledger's regions hold
    limit_bytes: int | None = None  # the whole process's budget (--vram-limit)


class EventBus:
    """Fan-out of events to subscribers; publish is safe from any thread."""

    def __init__(self) -> None:
        self._subs: list[Callable[[Event], None]] = []
        self._lock = threading.Lock()

    def subscribe(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        with self._lock:
            self._subs.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subs:
                    self._subs.remove(fn)

        return unsubscribe

    def publish(self, event: Event) -> None:
        with self._lock:
            subs = list(self._subs)
        for fn in subs:
            fn(event)
