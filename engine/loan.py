"""The VRAM loan (seed 000, DESIGN §5): a request-scoped transaction around prompt prefill.

    admit -> release verifier, head, MTP experts, draft head (as the flags say)
          -> re-plan a larger prompt geometry (or reuse the retained startup one)
          -> grow the expert cache into the freed segments -> lend the tail -> prefill
          -> refill the same slots -> shrink the cache back
          -> restore draft head, MTP experts, head, verifier -> first token's logits

`LoanTransaction` is a context manager whose exit is the one undo path for success, failure
and cancel alike: refill anything still lent, shrink, restore what this transaction released,
so the engine is exactly as before the request (a startup loan's deferred resources stay
deferred until a request completes). Strata exits the process on a lend or refill failure;
we roll back instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Self

from engine.devices import deferred_regions
from engine.errors import StrataError
from engine.events import LoanStep, TraceLine
from engine.memory.plan_types import PromptGeometry
from engine.memory.planner import plan_loan
from engine.memory.sizes import MiB
from engine.resources import LABELS, DecodeResource

if TYPE_CHECKING:
    from engine.runtime import Runtime

STARTUP, REPEAT = "startup", "repeat"


class InjectedFault(StrataError):
    """A failure injected by a test at a named step of the transaction."""


class Faults:
    """Named one-shot fault points: `arm('release:verifier')`, `hit(step)` raises once."""

    def __init__(self) -> None:
        self.armed: set[str] = set()
        self.seen: list[str] = []

    def arm(self, step: str) -> None:
        self.armed.add(step)

    def hit(self, step: str) -> None:
        self.seen.append(step)
        if step in self.armed:
            self.armed.discard(step)
            raise InjectedFault(f"fault injected at {step}")


def admit(rt: Runtime, n_fresh: int) -> str | None:
    """Which loan this request gets: the startup loan, a repeat loan, or none."""
    flags = rt.flags
    if not flags.elastic_loan:
        return None
    if rt.startup_loan_pending:
        return STARTUP
    if flags.repeat_loan and n_fresh >= flags.repeat_min_tokens:
        return REPEAT
    return None


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


class LoanTransaction:
    """One loan; `geometry` is valid inside the `with` block (see the module docstring)."""

    def __init__(self, rt: Runtime, kind: str, regions: frozenset[str]):
        self.rt, self.kind, self.regions = rt, kind, regions
        self.released: list[DecodeResource] = []  # by this transaction, in release order
        self.grown = 0
        self.geometry: PromptGeometry | None = None

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
        rt, t0 = self.rt, time.perf_counter()
        parts = []
        for r in rt.resources.select(self.regions):
            rt.faults.hit(f"release:{r.region}")
            if r.resident:
                n = r.release()
                self.released.append(r)
            else:  # deferred at startup: already free
                n = r.n_bytes
            parts.append(f"{LABELS[r.region]} {_mib(n)}")
        ms = (time.perf_counter() - t0) * 1e3
        freed = sum(r.n_bytes for r in rt.resources.select(self.regions))
        line = f"strata loan: released {', '.join(parts) or 'nothing'} in {ms:.1f} ms"
        self._step("release", line, freed, ms)

    def _plan(self) -> PromptGeometry:
        rt, t0 = self.rt, time.perf_counter()
        rt.faults.hit("plan")
        retained = rt.retained_geometry if rt.flags.retain_startup_chunk else None
        if self.kind == REPEAT and retained is not None and self._fits(retained):
            g, how = retained, "retained startup geometry"
        else:
            g, how = plan_loan(rt.plan, rt.ledger.free_bytes, rt.costs, rt.plan_options), "re-planned"
        ms = (time.perf_counter() - t0) * 1e3
        self._step("plan", f"strata loan: prompt plan {g.label} ({how}, {self.kind} loan)", 0, ms)
        return g

    def _fits(self, g: PromptGeometry) -> bool:
        rt = self.rt
        if not g.borrowed or rt.cache is None:
            return True
        extra = self._growable()
        return g.n_lent_slots <= rt.plan_options.lendable_slots(rt.cache.n_slots, rt.costs) + extra

    def _growable(self) -> int:
        rt = self.rt
        assert rt.cache is not None
        region = rt.cache.region
        spare = region.mapped_bytes - region.used_bytes + rt.ledger.free_bytes
        return spare // rt.cache.blob_bytes

    def _grow(self) -> None:
        rt = self.rt
        rt.faults.hit("grow")
        g = self.geometry
        assert g is not None
        if not g.borrowed or rt.cache is None:
            rt.grow_owned_prompt(g)
            return
        lendable = rt.plan_options.lendable_slots(rt.cache.n_slots, rt.costs)
        need = max(0, g.n_lent_slots - lendable)
        n = min(self._growable(), max(need, 0))
        if n:
            rt.cache.grow(n)
            self.grown = n
        rt.publish_cache()

    # -- exit: refill, shrink, restore --------------------------------------------------------
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._undo(failed=True, cancelled=getattr(exc_type, "is_cancel", False))
            return
        try:
            self._finish()
        except BaseException:
            self._undo(failed=True)
            raise

    def _finish(self) -> None:
        rt = self.rt
        rt.faults.hit("shrink")
        self._shrink()
        self._restore(self.rt.resources.select(self.regions))
        if self.kind == STARTUP:
            rt.startup_loan_pending = False
            if rt.flags.retain_startup_chunk:
                rt.retained_geometry = self.geometry

    def _undo(self, failed: bool, cancelled: bool = False) -> None:
        """Refill what is still lent, shrink, restore what this transaction released."""
        rt = self.rt
        rt.refill_pending()
        self._shrink()
        self._restore(self.released)
        rt.owned_prompt_back()
        step = "cancelled" if cancelled else "failed"
        self._step(step, f"strata loan: {step}; rolled back to the state before the request")

    def _shrink(self) -> None:
        rt = self.rt
        if self.grown and rt.cache is not None:
            rt.cache.shrink(self.grown)
            self.grown = 0
            rt.publish_cache()
        rt.owned_prompt_back()

    def _restore(self, items: list[DecodeResource]) -> None:
        rt, t0 = self.rt, time.perf_counter()
        parts = []
        for r in reversed(items):
            if r.resident:
                continue
            for attempt in (1, 2):  # a one-shot device fault gets one retry
                try:
                    rt.faults.hit(f"restore:{r.region}")
                    parts.append(f"{LABELS[r.region]} {_mib(r.restore())}")
                    break
                except StrataError:
                    if attempt == 2:
                        raise
        ms = (time.perf_counter() - t0) * 1e3
        if parts:
            line = f"strata loan: restored {', '.join(parts)} in {ms:.1f} ms"
            self._step("restore", line, sum(r.n_bytes for r in items), ms)

    def _step(self, step: str, line: str, n_bytes: int = 0, ms: float = 0.0) -> None:
        self.rt.bus.publish(LoanStep(step, line.removeprefix("strata loan: "), n_bytes, ms))
        self.rt.bus.publish(TraceLine(line))
        self.rt.emit_trace(line)


def loan_regions(rt: Runtime) -> frozenset[str]:
    present = {r.region for r in rt.resources.items}
    return frozenset(deferred_regions(rt.flags, rt.options) & present)


def on_chunk_guard(rt: Runtime, on_chunk: Callable | None) -> Callable:
    """Wrap the serve loop's chunk callback with the per-chunk fault point."""

    def wrapped(c: int, n: int, seconds: float) -> None:
        rt.faults.hit(f"chunk:{c}")
        if on_chunk:
            on_chunk(c, n, seconds)

    return wrapped
