"""The MTP block's decode-only regions lent to the expert cache while decoding plain.

With `--mtp --spec`, the MTP experts (and the draft head's rows, where they are a region of
their own) serve only drafted steps. When the drafting policy settles on plain steps for a
long span (drafts are not paying), `lend` releases those regions, grows the expert cache into
their segments and fills the new slots with the experts it misses that rank first (`ranking`:
the admission policy's scores under `--cache-policy adaptive`, else the cache's fill order), so
the plain steps hit the cache more often; `repay` empties those slots, shrinks the cache back
and restores the regions (from their page-locked host copies) before the draft model runs
again, and at the end of every request: between requests every decode-only region is
resident, as the prefill loan's invariant says.

An option of its own (`--cache-lend`, `EngineOptions.cache_lend`), off by default: it is no part
of the seed's prefill loan, whose default path is unchanged when no STRATA_PREFILL_* flag is set.
Trace lines (STRATA_TRACE=1) begin `strata lend:`, apart from the prefill loan's `strata loan:`;
the ledger's and the cache's change events draw what moved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from engine.errors import StrataError
from engine.experts.cache import ExpertCache
from engine.faults import Faults
from engine.loan.resources import LABELS, DecodeResource, ResourceSet
from engine.memory.ledger import Ledger
from engine.memory.sizes import format_mib
from engine.trace.report import Reporter

REGIONS = frozenset({"mtp.experts", "mtp.draft_head"})
PREFIX = "strata lend: "  # its trace lines, named apart from the prefill loan's


class CacheLend:
    """Lends the MTP regions of `resources` to `cache` (see the module docstring)."""

    def __init__(self, resources: ResourceSet, cache: ExpertCache, ledger: Ledger,
                 faults: Faults, report: Reporter,
                 ranking: Callable[[], Sequence[tuple[int, int]]] | None = None):
        self.resources, self.cache, self.ledger, self.faults = resources, cache, ledger, faults
        self.report = report
        self.ranking = ranking  # the experts a new slot should hold first (None: fill order)
        self.lent: list[DecodeResource] = []
        self.grown = 0  # slots the cache holds on loan
        self.n_lends = 0  # lends made (traces and tests)
        self.off = False  # a lend failed: the regions stay resident from then on

    def lend(self) -> None:
        """Release the resident MTP regions and grow the cache by their bytes (no more: free
        memory the plan left is not the lend's); nothing when the cache misses no expert."""
        if self.lent or self.off:
            return
        items = [r for r in self.resources.select(REGIONS) if r.resident]
        host = self.cache.host
        if not items or self.cache.n_slots >= host.n_layer * host.n_expert:
            return
        try:
            self._lend(items)
        except StrataError as e:  # an optimisation failed: undo it, decode on without it
            self.off = True
            self.report.warn(f"strata: warning: lending the MTP regions to the expert cache "
                             f"failed ({e}); they stay resident")
            self.repay()

    def _lend(self, items: list[DecodeResource]) -> None:
        t0 = time.perf_counter()
        for r in items:
            self.faults.hit(f"cache-lend:{r.region}")
            self.lent.append(r)
            r.release()
        region = self.cache.region
        slack = region.mapped_bytes - region.used_bytes  # the cache's last segment's tail
        freed = sum(r.n_bytes for r in items)
        n = min(slack + freed, slack + self.ledger.free_bytes) // self.cache.blob_bytes
        filled = 0
        if n:
            self.cache.grow(n)
            self.grown = n
            filled = self.cache.fill_tail(n, self.ranking() if self.ranking else None)
        self.n_lends += 1
        parts = ", ".join(f"{LABELS[r.region]} {format_mib(r.n_bytes)} MiB" for r in items)
        self._say(f"{PREFIX}decoding plain: lent {parts} to the expert cache: {n} more "
                  f"slots, {filled} filled in {(time.perf_counter() - t0) * 1e3:.1f} ms")

    def repay(self) -> None:
        """Empty and drop the grown slots, then restore the regions (a one-shot fault gets one
        retry, as the prefill loan's restore)."""
        if not self.lent:
            return
        t0 = time.perf_counter()
        if self.grown:
            self.cache.evict_tail(self.grown)
            self.cache.shrink(self.grown)
            self.grown = 0
        for r in reversed(self.lent):
            for attempt in (1, 2):
                try:
                    self.faults.hit(f"cache-repay:{r.region}")
                    r.restore()
                    break
                except StrataError:
                    if attempt == 2:
                        raise
        parts = ", ".join(LABELS[r.region] for r in self.lent)
        self.lent = []
        self._say(f"{PREFIX}drafting again: {parts} restored from the expert cache in "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms")

    def _say(self, line: str) -> None:
        self.report.cache(self.cache)
        self.report.trace(line)
