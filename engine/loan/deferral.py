"""What a loan defers: the decode-only regions the flags name (`deferred_regions`: what a
startup loan leaves free and every loan releases); while no request has run, the regions an
engine holds follow the flags (a runtime flag change before the first request), and the
startup plan names them and the larger startup geometry their bytes buy."""

from __future__ import annotations

from dataclasses import replace

from engine.config import EngineOptions, LoanFlags
from engine.faults import Faults
from engine.loan.resources import DecodeResource, ResourceSet
from engine.memory.ledger import REGION_NAMES
from engine.memory.plan_types import ModelCosts, PlanOptions, StartupPlan
from engine.memory.planner import plan_loan


def deferred_regions(flags: LoanFlags, options: EngineOptions) -> frozenset[str]:
    """Decode-only regions a loan releases: the master switch lends the verifier; the MTP
    loan adds the MTP experts and the draft head; the head loan adds the native head."""
    if not flags.elastic_loan:
        return frozenset()
    out = {"verifier"} if options.spec >= 2 else set()
    if flags.mtp_loan:
        out |= {"mtp.experts", "mtp.draft_head"}
    if flags.head_loan:
        out.add("head.native")
    return frozenset(out)


def follow_deferral(resources: ResourceSet, deferred: frozenset[str],
                    faults: Faults) -> tuple[list[DecodeResource], list[DecodeResource]]:
    """Hold the decode-only regions as an engine started with other flags would: restore
    (draft head -> MTP experts -> head -> verifier) what `deferred` no longer names, release
    what it adds. Returns (restored, released). A failed restore gives back what this call
    restored and raises; nothing has changed."""
    restore = [r for r in reversed(resources.items) if r.region not in deferred and not r.resident]
    release = [r for r in resources.items if r.region in deferred and r.resident]
    done: list[DecodeResource] = []
    try:
        for r in restore:
            faults.hit(f"flags:restore:{r.region}")
            r.restore()
            done.append(r)
    except BaseException:
        for r in done:
            r.release()
        raise
    for r in release:
        r.release()
    return restore, release


def deferral_line(restored: list[DecodeResource], released: list[DecodeResource]) -> str | None:
    """The loan line saying what a flag change before the first request moved, if anything."""
    parts = [f"restored {', '.join(r.label for r in restored)}"] if restored else []
    parts += [f"deferred {', '.join(r.label for r in released)}"] if released else []
    if not parts:
        return None
    return f"strata loan: flags changed before the first request: {'; '.join(parts)}"


def plan_deferred(plan: StartupPlan, costs: ModelCosts, options: PlanOptions) -> StartupPlan:
    """The startup plan with `options.deferred` as its deferred regions and the startup
    geometry their bytes buy (what `plan_startup` would give with these flags; the cache does
    not move)."""
    deferred = options.deferred
    every = sorted((*plan.regions, *plan.deferred), key=lambda r: REGION_NAMES.index(r.name))
    plan = replace(plan, regions=tuple(r for r in every if r.name not in deferred),
                   deferred=tuple(r for r in every if r.name in deferred))
    freed = sum(r.n_segments for r in plan.deferred) * plan.segment_bytes
    startup = plan_loan(plan, freed, costs, options) if freed else plan.prompt
    return replace(plan, startup_prompt=startup)
