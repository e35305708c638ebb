"""The VRAM loan (seed 000, DESIGN §5): a request-scoped transaction around prompt prefill.

    admit -> release verifier, head, MTP experts, draft head (as the flags say)
          -> re-plan a larger prompt geometry (or reuse the retained startup one)
          -> grow the expert cache into the freed segments -> lend the tail -> prefill
          -> refill the same slots -> shrink the cache back
          -> restore draft head, MTP experts, head, verifier -> first token's logits

`LoanTransaction` is a context manager whose exit is the one undo path, for a failure and a
cancel anywhere inside its `with` block (the first token's logits included, computed there
after `restore`): refill anything still lent, shrink, restore what this transaction released
and defer again what a startup loan restored, so the engine is exactly as before the request
(a startup loan's deferred resources stay deferred until a request completes). Strata exits
the process on a lend or refill failure; we roll back instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from engine.config import REPEAT_MIN_FLOOR, EngineOptions, LoanFlags
from engine.errors import StrataError
from engine.experts.cache import ExpertCache
from engine.faults import Faults
from engine.loan.deferral import deferred_regions
from engine.loan.geometry import REPEAT, STARTUP, growable_slots, loan_geometry
from engine.loan.resources import LABELS, DecodeResource, ResourceSet
from engine.memory.ledger import Ledger
from engine.memory.plan_types import ModelCosts, PlanOptions, PromptGeometry, StartupPlan
from engine.memory.sizes import MiB
from engine.prompt.path import PromptPath
from engine.trace.events import LoanStep
from engine.trace.report import Reporter


def admit(flags: LoanFlags, startup_loan_pending: bool, n_fresh: int,
          pays: bool | None = None) -> str | None:
    """Which loan this request gets: the startup loan, a repeat loan, or none."""
    return admission(flags, startup_loan_pending, n_fresh, pays)[0]


def admission(flags: LoanFlags, startup_loan_pending: bool, n_fresh: int,
              pays: bool | None = None) -> tuple[str | None, str]:
    """The loan a request of `n_fresh` fresh tokens gets (STARTUP, REPEAT or None) and why.

    With STRATA_PREFILL_REPEAT_MIN_TOKENS=auto the repeat loan is taken when `pays` (the
    forecast's verdict, engine.loan.forecast.pays) for a message of at least the 256-token floor;
    with no forecast the threshold decides."""
    if not flags.elastic_loan:
        return None, "loan flags off"
    if startup_loan_pending:
        return STARTUP, "the first request takes the startup loan"
    if not flags.repeat_loan:
        return None, "repeat loan off"
    if flags.repeat_auto and pays is not None:
        if n_fresh < REPEAT_MIN_FLOOR:
            return None, f"auto: {n_fresh:,} fresh < {REPEAT_MIN_FLOOR} (the floor)"
        if pays:
            return REPEAT, "auto: the forecast says the loan pays"
        return None, "auto: the forecast says the loan does not pay"
    if n_fresh >= flags.repeat_min_tokens:
        return REPEAT, f"{n_fresh:,} fresh >= {flags.repeat_min_tokens:,}"
    return None, f"{n_fresh:,} fresh < {flags.repeat_min_tokens:,}"


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


@dataclass(eq=False)
class LoanTransaction:
    """One loan; `geometry` is valid inside the `with` block (see the module docstring).

    Inside the block: prefill with `geometry`, then `restore` (the decode-only resources back),
    then the first token's logits; the exit restores what the block did not. It acts on the
    parts it is given and sets no field of the runtime: after a successful startup loan the
    runtime ends the startup deferral and keeps the geometry."""

    kind: str  # STARTUP or REPEAT
    regions: frozenset[str]  # the decode-only regions this loan releases
    resources: ResourceSet
    ledger: Ledger
    cache: ExpertCache | None
    prompt: PromptPath  # its owned regions grow; its lent range is refilled by the undo path
    plan: StartupPlan
    plan_options: PlanOptions
    costs: ModelCosts
    retained: PromptGeometry | None  # the retained startup geometry a repeat loan may reuse
    faults: Faults
    report: Reporter  # loan steps as events, loan lines, the cache after it grows or shrinks
    released: list[DecodeResource] = field(default_factory=list, init=False)  # in release order
    # free before it (deferred at startup), in release order: a startup loan restores them
    deferred: list[DecodeResource] = field(default_factory=list, init=False)
    restored: bool = field(default=False, init=False)  # `restore` ran: the resources are back
    grown: int = field(default=0, init=False)
    geometry: PromptGeometry | None = field(default=None, init=False)
    seconds: dict[str, float] = field(default_factory=dict, init=False)  # step -> its time

    # -- enter: release, plan, grow ------------------------------------------------------------
    def __enter__(self) -> Self:
        try:
            self._release()
            self.geometry = self._plan()
            self._grow()
        except BaseException:
            self._undo(failed=True)
            raise
        return self

    def _release(self) -> None:
        t0 = time.perf_counter()
        parts = []
        for r in self.resources.select(self.regions):
            self.faults.hit(f"release:{r.region}")
            if r.resident:
                n = r.release()
                self.released.append(r)
            else:  # deferred at startup: already free
                self.deferred.append(r)
                n = r.n_bytes
            parts.append(f"{LABELS[r.region]} {_mib(n)}")
        ms = (time.perf_counter() - t0) * 1e3
        freed = sum(r.n_bytes for r in self.resources.select(self.regions))
        line = f"strata loan: released {', '.join(parts) or 'nothing'} in {ms:.1f} ms"
        self._step("release", line, freed, ms)

    def _plan(self) -> PromptGeometry:
        t0 = time.perf_counter()
        self.faults.hit("plan")
        n_lendable = n_growable = 0
        if self.cache is not None:
            n_lendable = self.plan_options.lendable_slots(self.cache.n_slots, self.costs)
            n_growable = self._growable()
        g, how = loan_geometry(self.plan, self.ledger.free_bytes, self.costs, self.plan_options,
                               self.kind, self.retained, n_lendable, n_growable)
        ms = (time.perf_counter() - t0) * 1e3
        self._step("plan", f"strata loan: prompt plan {g.label} ({how}, {self.kind} loan)", 0, ms)
        return g

    def _growable(self) -> int:
        assert self.cache is not None
        region = self.cache.region
        return growable_slots(region.mapped_bytes, region.used_bytes, self.ledger.free_bytes,
                              self.cache.blob_bytes)

    def _grow(self) -> None:
        self.faults.hit("grow")
        g = self.geometry
        assert g is not None
        if not g.borrowed or self.cache is None:
            self._grow_owned(g)
            return
        lendable = self.plan_options.lendable_slots(self.cache.n_slots, self.costs)
        need = max(0, g.n_lent_slots - lendable)
        n = min(self._growable(), max(need, 0))
        if n:
            self.cache.grow(n)
            self.grown = n
        self.report.cache(self.cache)

    def _grow_owned(self, g: PromptGeometry) -> None:
        """An owned prompt path: grow prompt.chunk / prompt.ring to fit `g`."""
        for arena, need in zip(self.prompt.owned, (g.chunk_bytes, g.ring_bytes)):
            if arena is not None and arena.region is not None and need > arena.region.used_bytes:
                self.ledger.grow(arena.name, need - arena.region.used_bytes)

    # -- restore (inside the block), exit: the undo path -------------------------------------
    def restore(self) -> None:
        """After the prefill: shrink the cache back, restore draft head -> MTP experts -> head
        -> verifier (the first token's logits need the head). A failure from here to the end
        of the block still rolls the loan back."""
        if self.restored:
            return
        self.faults.hit("shrink")
        self._shrink()
        self._restore(self.resources.select(self.regions))
        self.restored = True

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._undo(failed=True, cancelled=getattr(exc_type, "is_cancel", False))
            return
        try:
            self.restore()
        except BaseException:
            self._undo(failed=True)
            raise

    def _undo(self, failed: bool, cancelled: bool = False) -> None:
        """Back to the state before the request: refill what is still lent, shrink, defer
        again what a startup loan found deferred (restored if it got that far), restore what
        this transaction released."""
        self.prompt.refill_pending()
        self._shrink()
        if self.kind == STARTUP:
            for r in self.deferred:
                r.release()
        self._restore(self.released)
        self._owned_back()
        step = "cancelled" if cancelled else "failed"
        self._step(step, f"strata loan: {step}; rolled back to the state before the request")

    def _shrink(self) -> None:
        if self.grown and self.cache is not None:
            self.cache.shrink(self.grown)
            self.grown = 0
            self.report.cache(self.cache)
        self._owned_back()

    def _owned_back(self) -> None:
        """Shrink the owned prompt regions back to their startup size."""
        for arena in self.prompt.owned:
            if arena is not None and arena.region is not None:
                extra = arena.region.used_bytes - arena.n_bytes
                if extra > 0:
                    self.ledger.shrink(arena.name, extra)

    def _restore(self, items: list[DecodeResource]) -> None:
        t0 = time.perf_counter()
        parts = []
        for r in reversed(items):
            if r.resident:
                continue
            for attempt in (1, 2):  # a one-shot device fault gets one retry
                try:
                    self.faults.hit(f"restore:{r.region}")
                    n = r.restore()
                    mapped, filled = (1e3 * x for x in r.last_restore_s)
                    parts.append(f"{LABELS[r.region]} {_mib(n)} (map {mapped:.0f} + fill "
                                 f"{filled:.0f} ms)")
                    break
                except StrataError:
                    if attempt == 2:
                        raise
        ms = (time.perf_counter() - t0) * 1e3
        if parts:
            line = f"strata loan: restored {', '.join(parts)} in {ms:.1f} ms"
            self._step("restore", line, sum(r.n_bytes for r in items), ms)

    def _step(self, step: str, line: str, n_bytes: int = 0, ms: float = 0.0) -> None:
        self.seconds[step] = ms / 1e3
        self.report.publish(LoanStep(step, line.removeprefix("strata loan: "), n_bytes, ms))
        self.report.trace(line)


def loan_regions(flags: LoanFlags, options: EngineOptions,
                 resources: ResourceSet) -> frozenset[str]:
    """The decode-only regions a loan releases: what the flags defer, of what was built."""
    present = {r.region for r in resources.items}
    return frozenset(deferred_regions(flags, options) & present)

