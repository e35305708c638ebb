"""Runtime: one loaded engine running requests — prefill (with the loan when it is admitted)
and decode. `engine.startup.runtime` makes it; the serve loop drives it; flag changes between
requests are `engine.runtime.flags`; it holds no conversation logic.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Self

from engine.backend.base import Backend
from engine.config import EngineOptions, LoanFlags
from engine.experts.cache import ExpertCache
from engine.experts.provider import CachedExperts
from engine.faults import Faults
from engine.loan.geometry import STARTUP
from engine.loan.resources import ResourceSet
from engine.loan.transaction import LoanTransaction, admit, loan_regions
from engine.memory.ledger import Ledger
from engine.memory.plan_types import (
    ModelCosts,
    PlanOptions,
    PromptGeometry,
    StartupPlan,
    chunk_count,
)
from engine.memory.sizes import format_mib
from engine.model.loader import Model
from engine.model.token_graph import make_token_graph, token_graph_wanted
from engine.prompt.path import PromptPath
from engine.request.record import Progress, Request, decode_tokens
from engine.request.sampler import Sampler
from engine.request.session import Session
from engine.speculative.decoder import SpecDecoder
from engine.trace.events import Ready
from engine.trace.phases import PhaseClock
from engine.trace.report import Reporter
from engine.trace.timing import Timing


@dataclass(eq=False)
class Runtime:
    """Everything one loaded engine holds, and its two operations: `prefill` and `decode`."""

    options: EngineOptions
    flags: LoanFlags
    model: Model
    backend: Backend
    ledger: Ledger
    plan: StartupPlan
    costs: ModelCosts
    plan_options: PlanOptions
    cache: ExpertCache | None
    experts: CachedExperts
    session: Session
    prompt: PromptPath
    resources: ResourceSet
    spec: SpecDecoder | None  # when --mtp --spec T >= 2 at startup
    faults: Faults
    report: Reporter
    startup_loan_pending: bool = False
    prefilled: bool = False  # a request's prefill has completed (the startup loan is over)
    retained_geometry: PromptGeometry | None = None
    closed: bool = False  # `close` gave every device byte back; nothing runs any more
    # a --prefill change planned by `runtime_flags.validate`, kept for its `apply`
    replanned: tuple[int | str, PromptGeometry] | None = field(default=None, repr=False)

    @property
    def xp(self) -> Any:
        return self.backend.xp

    @property
    def token_graph_wanted(self) -> bool:
        """Decode steps are captured as a CUDA graph unless --no-token-graph (CUDA only)."""
        return token_graph_wanted(self.backend, self.options.no_token_graph)

    # -- questions ---------------------------------------------------------------------------
    def ready(self) -> Ready:
        """The Ready event: the summary line and the model's facts."""
        hp, meta = self.model.hp, self.model.mf.metadata
        return Ready(
            summary=self.summary(), device=self.backend.name,
            model_name=str(meta.get("general.name") or self.model.path.name),
            model_description=str(meta.get("general.description") or ""),
            n_layer=hp.n_layer, n_expert=hp.n_expert, n_expert_used=hp.n_expert_used,
            n_vocab=hp.n_vocab,
        )  # fmt: skip

    def summary(self) -> str:
        hp = self.model.hp
        n_slots = self.cache.n_slots if self.cache else 0
        return (
            f"{self.model.path.name}: {hp.n_moe_layer} layers x {hp.n_expert} experts (top-{hp.n_expert_used})"
            f"{hp.resident_ffn()}, "
            f"{self.backend.name} {format_mib(self.ledger.capacity_bytes)} MiB, "
            f"cache {n_slots}/{hp.n_moe_layer * hp.n_expert} experts, prompt plan {self.plan.prompt.label}"
            + (", token graph" if self.session.graph is not None else "")
        )

    def check_integrity(self) -> None:
        """Ledger, cache, KV and resources agree; 0 slots lent between requests."""
        self.ledger.check_integrity()
        if self.cache is not None:
            self.cache.check_integrity()
            assert self.cache.n_lent == 0, f"{self.cache.n_lent} slots still lent"
        self.session.kv.check_integrity()
        self.resources.check_integrity()

    def attach_token_graph(self) -> None:
        """Decode steps replay captured CUDA graphs from now on (unless --no-token-graph)."""
        if self.token_graph_wanted:
            self.session.graph = make_token_graph(self.model.transformer, self.session.kv,
                                                  self.experts, self.cache, self.backend,
                                                  self.report.warn)

    def detach_token_graph(self) -> None:
        """Drop the captured decode steps; steps run eagerly until `attach_token_graph`."""
        if self.session.graph is not None:
            self.session.graph.release()
            self.session.graph = None

    def rollback(self, n_tokens: int) -> None:
        """Drop the KV (and the draft's) after the first `n_tokens`."""
        n = min(n_tokens, len(self.session.tokens))
        self.session.truncate(n)
        if self.spec is not None:
            self.spec.draft.truncate(n)

    def publish_gpu(self, force: bool = False) -> None:
        """On CUDA, at most twice a second unless `force`: the outside of the ledger measured
        again (growth comes off the pool's limit) and an NVML reading as a GpuStats event."""
        if not self.closed:
            self.report.gpu(self.backend, self.ledger, force)

    # -- prefill and decode ------------------------------------------------------------------
    def prefill(self, req: Request, progress: Progress) -> Any:
        """Prefill `req.fresh` (with the loan `admit` grants, or none); returns the first
        token's logits [1, V], computed with the restored head.

        Any failure or cancel leaves ledger, cache and resources as before the call: the
        loan's exit is its undo path, the prompt path refills what it lent; the caller rolls
        the session back to `req.reused`.
        """
        assert not self.closed, "prefill on a closed engine"
        req.loan = kind = admit(self.flags, self.startup_loan_pending, len(req.fresh),
                                req.loan_pays)
        if kind is None:
            self._prefill(req, self.plan.prompt, progress)
            logits = self._first_logits()
        else:
            with self._loan(kind) as tx:
                assert tx.geometry is not None
                self._prefill(req, tx.geometry, progress)
                tx.restore()
                logits = self._first_logits()  # [1, V] with the restored head
            req.seconds.update((k, tx.seconds.get(k, 0.0)) for k in ("release", "restore"))
            if kind == STARTUP:  # everything restored: the startup loan is over
                self.startup_loan_pending = False
                if self.flags.retain_startup_chunk:
                    self.retained_geometry = tx.geometry
        self.prefilled = True
        self.publish_gpu(force=True)
        return logits

    def _first_logits(self) -> Any:
        """The first generated token's logits [1, V], from the last prompt token's hidden."""
        self.faults.hit("logits")
        return self.model.transformer.logits(self.session.last_hidden)

    def _loan(self, kind: str) -> LoanTransaction:
        """The loan transaction of one request, on this runtime's parts."""
        return LoanTransaction(
            kind, loan_regions(self.flags, self.options, self.resources),
            resources=self.resources, ledger=self.ledger, cache=self.cache, prompt=self.prompt,
            plan=self.plan, plan_options=self.plan_options, costs=self.costs,
            retained=self.retained_geometry if self.flags.retain_startup_chunk else None,
            faults=self.faults, report=self.report,
        )

    def _prefill(self, req: Request, geometry: PromptGeometry, progress: Progress) -> None:
        """The prompt path with `geometry` cut to this prompt; progress per chunk."""
        req.geometry = g = self.prompt.fit(geometry, len(req.fresh))
        req.n_chunks = chunk_count(len(req.fresh), g.chunk_tokens)
        progress.planned(req)

        def on_chunk(index: int, n: int, seconds: float) -> None:
            req.n_chunks_read = index + 1
            self.faults.hit(f"chunk:{index}")
            self.publish_gpu()
            progress.chunk(req, index, seconds)

        clock = PhaseClock(self.backend)  # always: the forecast learns from its totals
        clock.start()
        t0 = time.perf_counter()
        res = self.prompt.run(self.session, req.fresh, g, on_chunk, clock)
        req.seconds.update(clock.totals())
        if self.report.trace_on:
            self.report.trace(clock.line(time.perf_counter() - t0))
        req.timing.bytes_streamed = res.counters.bytes_streamed
        if self.prompt.arena_stats is not None:
            self.report.trace(self.prompt.arena_stats.line())

    def decode(self, logits: Any, sampler: Sampler, max_new: int, stop_ids: frozenset[int],
               timing: Timing, cancel: threading.Event) -> Iterator[int]:
        """Tokens after the prompt: plain, or speculative when --spec T is on."""
        spec = self.spec if self.options.spec >= 2 else None
        return decode_tokens(self.session, spec, logits, sampler, max_new, stop_ids, timing,
                             cancel)

    def settle(self, quiet: bool = False) -> None:
        """After a reply's timing is taken: the speculative decoder's deferred work (the memory
        it lent to the expert cache back, the draft model over the rows it has not seen);
        `quiet` after a failed request. Every decode-only region is resident afterwards."""
        if self.spec is not None:
            self.spec.settle(quiet)

    def trace_decode(self, timing: Timing) -> None:
        """After a request: on CUDA the device memory measured again (`publish_gpu`: decode's
        kernels and captured graphs lie outside the ledger); with STRATA_TRACE=1 what the
        drafting policy did (speculative decoding), the decode steps' expert-cache hits and
        promotions, and the token graph's GPU time per step."""
        self.publish_gpu(force=True)
        if not self.report.trace_on:
            return
        if self.spec is not None and self.options.spec >= 2:
            self.report.trace(f"speculation: drafted {timing.drafted_steps} of "
                              f"{timing.spec_steps} steps{self.spec.policy.rates()}")
        if timing.decode_hits + timing.decode_misses:
            self.report.trace(f"expert cache: {timing.decode_hit_pct:.0f}% hits while decoding, "
                              f"{timing.decode_promoted} promoted ({self.experts.policy})")
        graph = self.session.graph
        if graph is not None:
            self.report.trace(f"{graph.stats_line()}; decode {timing.decode_s:.2f} s wall")

    # -- the end -----------------------------------------------------------------------------
    # The parts whose arrays live on the device outside the ledger (CuPy's pool on CUDA).
    _PARTS = ("spec", "resources", "prompt", "session", "experts", "cache",
              "retained_geometry", "model")

    def close(self) -> None:
        """Give back every byte this engine holds on its device: the captured decode steps,
        the parts whose arrays live in CuPy's pool (dropped), every ledger region (VMM
        segments unmapped, address ranges freed; a last LedgerChanged shows none), then the
        backend's own buffers, cached pool blocks and page-locked host memory. Idempotent; a
        closed engine keeps its options, plan, ledger and backend (both empty) and runs
        nothing more. `strata bench` closes each run's engine before the next."""
        if self.closed:
            return
        self.closed = True
        self.backend.synchronize()
        self.detach_token_graph()
        for name in self._PARTS:
            if name in self.__dict__:
                delattr(self, name)
        gc.collect()  # the parts hold each other and this engine's bound methods in cycles
        self.ledger.close()
        self.backend.close()
        self.report.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
