"""What a prefill would do, asked of a runtime between requests (the forecast's input): the
geometry it would get, what its loan would release and restore, and the experts it would
stream. Questions only: nothing here changes the runtime."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.config import EngineOptions, LoanFlags
from engine.loan.forecast import Workload, workload
from engine.loan.geometry import REPEAT, growable_slots, loan_geometry
from engine.loan.transaction import loan_regions
from engine.memory.costs import Shapes
from engine.memory.plan_types import PromptGeometry
from engine.memory.sizes import ceil_div
from engine.runtime import flags as runtime_flags
from engine.runtime.parts import Runtime


def request_workload(rt: Runtime, kind: str | None, n_fresh: int, pos0: int, odds: np.ndarray,
                 flags: LoanFlags | None = None, options: EngineOptions | None = None,
                 geometry: PromptGeometry | None = None) -> Workload:
    """What a prefill of `n_fresh` tokens after `pos0` with loan `kind` (STARTUP, REPEAT
    or None) would do under `flags` and `options` (those in force by default): the
    geometry it would get (`geometry`: the one it got), what its loan releases and
    restores; `odds` are the routing odds in fill order (engine.loan.forecast.routing_odds).
    It reads the engine as it is between requests, so a question asked from another thread
    while a request runs sees neither that request's loan nor its lent slots. A question:
    nothing changes."""
    flags, options = flags or rt.flags, options or rt.options
    items = rt.resources.select(loan_regions(flags, options, rt.resources)
                                  if kind is not None else frozenset())
    resident = [r for r in items if _resident_at_rest(rt, r.region)]
    released = sum(r.n_bytes for r in resident) if kind == REPEAT else 0
    if geometry is None:
        geometry = rt.prompt.fit(
            _request_geometry(rt, kind, resident, flags, options), n_fresh)
    n_cache = rt.plan.n_cache_slots if rt.cache is not None else 0
    lendable = rt.plan_options.lendable_slots(n_cache, rt.costs)
    return workload(kind, n_fresh, pos0, geometry, Shapes.of(rt.model), n_cache,
                    lendable, odds, released, sum(r.n_bytes for r in items))

def _resident_at_rest(rt: Runtime, region: str) -> bool:
    """Between requests every decode-only region is resident but those the pending
    startup loan defers."""
    return rt.prefilled or region not in rt.plan_options.deferred

def _request_geometry(rt: Runtime, kind: str | None, resident: list, flags: LoanFlags,
                  options: EngineOptions) -> PromptGeometry:
    """The geometry `prefill` would start from: the decode-time plan without a loan, else
    the loan's (engine.loan.geometry, as the transaction asks it) with the memory free
    between requests plus what the loan releases of the `resident` regions it lends; the
    cache as planned (a request in flight may have grown it)."""
    plan, opts = rt.plan, rt.plan_options
    if options.prefill != rt.options.prefill:
        plan = replace(plan, prompt=runtime_flags.prompt_plan(rt, options.prefill))
        opts = replace(opts, prefill=options.prefill)
    if kind is None:
        return plan.prompt
    seg, costs = plan.segment_bytes, rt.costs
    restored = sum(r.n_segments for r in plan.deferred) * seg if rt.prefilled else 0
    freed = sum(ceil_div(r.n_bytes, seg) * seg for r in resident)
    free = plan.free_bytes - restored + freed
    n_lendable = n_growable = 0
    if rt.cache is not None:
        n = plan.n_cache_slots
        used = costs.cache_bytes(n)
        n_lendable = opts.lendable_slots(n, costs)
        n_growable = growable_slots(ceil_div(used, seg) * seg, used, free,
                                    costs.expert_blob_bytes)
    retained = rt.retained_geometry if flags.retain_startup_chunk else None
    return loan_geometry(plan, free, costs, opts, kind, retained, n_lendable, n_growable)[0]
