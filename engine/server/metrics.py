"""Metrics: the engine's events counted for `GET /metrics` (Prometheus text, through
`prometheus_client` on a registry of this server's own).

Tokens (prompt, reused, prefilled, generated), prefill and decode seconds with the last
request's PP and TG, loans taken and rolled back, cache slots lent (now and in all), bytes per
ledger region, drafts offered and accepted; the queue is read when scraped.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.server.codec import SLOT_STATES
from engine.trace.events import (
    CacheChanged,
    Event,
    EventBus,
    LedgerChanged,
    LoanStep,
    PlanChosen,
    RequestDone,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Counters and gauges fed by the bus (thread-safe: prometheus_client locks them)."""

    def __init__(self, bus: EventBus):
        disable_created_metrics()  # no `*_created` series beside every counter
        r = self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        self.requests = counter("strata_requests",
                                "Requests the engine ran: completed, cancelled (rolled back: "
                                "the client left, or the server stopped) or failed (rolled back)",
                                ("outcome",))
        self.refused = counter("strata_requests_refused",
                               "Requests refused before the engine: queue full (429) or bad (4xx)",
                               ("reason",))
        self.prompt_tokens = counter("strata_prompt_tokens", "Prompt tokens of requests")
        self.reused_tokens = counter("strata_prompt_tokens_reused",
                                     "Prompt tokens found in the KV cache (not prefilled)")
        self.prefilled_tokens = counter("strata_prompt_tokens_prefilled", "Prompt tokens read")
        self.generated_tokens = counter("strata_tokens_generated", "Tokens generated")
        self.prefill_seconds = counter("strata_prefill_seconds", "Time spent reading prompts")
        self.decode_seconds = counter("strata_decode_seconds", "Time spent generating")
        self.pp = gauge("strata_prompt_tokens_per_second", "PP of the last request")
        self.tg = gauge("strata_generation_tokens_per_second",
                        "TG of the last request that ran a decode step")
        self.loans = counter("strata_loans", "Loans taken (decode-only VRAM lent to a prefill)")
        self.rollbacks = counter("strata_loans_rolled_back", "Loans undone, by why",
                                 ("step",))
        self.lent_now = gauge("strata_cache_slots_lent", "Expert-cache slots lent now")
        self.lent = counter("strata_cache_slot_loans",
                            "Expert-cache slots lent to prompt paths, in all")
        self.slots = gauge("strata_cache_slots", "Expert-cache slots by state", ("state",))
        self.region_bytes = gauge("strata_ledger_region_bytes", "Device bytes per ledger region",
                                  ("region",))
        self.free_bytes = gauge("strata_ledger_free_bytes", "Device bytes no region holds")
        self.capacity_bytes = gauge("strata_ledger_capacity_bytes", "The device budget")
        self.drafts_offered = counter("strata_drafts_offered", "MTP draft tokens offered")
        self.drafts_accepted = counter("strata_drafts_accepted", "MTP draft tokens accepted")
        self.waiting = gauge("strata_queue_waiting", "Requests waiting for the engine")
        self.running = gauge("strata_requests_running", "Requests the engine is running (0 or 1)")
        self._n_lent = 0
        self._regions_seen: set[str] = set()
        bus.subscribe(self.on_event)

    def watch_queue(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        """Read the queue when scraped."""
        self.waiting.set_function(waiting)
        self.running.set_function(running)

    def on_event(self, e: Event) -> None:
        if isinstance(e, RequestDone):
            self._done(e)
        elif isinstance(e, PlanChosen) and e.loan:
            self.loans.inc()
        elif isinstance(e, LoanStep) and e.step in ("failed", "cancelled"):
            self.rollbacks.labels(e.step).inc()
        elif isinstance(e, CacheChanged):
            if e.n_lent > self._n_lent:
                self.lent.inc(e.n_lent - self._n_lent)
            self._n_lent = e.n_lent
            self.lent_now.set(e.n_lent)
            for state, code in SLOT_STATES.items():
                self.slots.labels(state).set(e.states.count(code))
        elif isinstance(e, LedgerChanged):
            for region in e.regions:
                self.region_bytes.labels(region.name).set(region.used_bytes)
            held = {r.name for r in e.regions}
            for name in self._regions_seen - held:  # released: 0, not its last size
                self.region_bytes.labels(name).set(0)
            self._regions_seen |= held
            self.free_bytes.set(e.free_bytes)
            self.capacity_bytes.set(e.capacity_bytes)

    def _done(self, e: RequestDone) -> None:
        self.prompt_tokens.inc(e.prompt_tokens)
        self.reused_tokens.inc(e.reused_tokens)
        self.prefilled_tokens.inc(e.n_read)
        self.generated_tokens.inc(e.generated)
        self.prefill_seconds.inc(e.prefill_s)
        self.decode_seconds.inc(e.decode_s)
        self.drafts_offered.inc(e.drafts_offered)
        self.drafts_accepted.inc(e.drafts_accepted)
        if e.cancelled or e.failed:
            return
        if e.prefill_s > 0:
            self.pp.set(e.n_read / e.prefill_s)
        if e.decoded and e.decode_s > 0:
            self.tg.set(e.generated / e.decode_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
