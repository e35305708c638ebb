"""Flag and option changes between requests, on a running engine's parts: what it can take
(`validate`: the guards, plus what needs a restart) and taking it (`apply`), from the next
request on; `PendingFlags`: a change accepted while a request runs, kept for the next one
(the app's flag panel, `ServeLoop.set_flags`)."""

from __future__ import annotations

import threading
from dataclasses import replace

from engine.config import EngineOptions, LoanFlags
from engine.devices import cache_policy
from engine.errors import StrataError
from engine.loan.deferral import deferral_line, deferred_regions, follow_deferral, plan_deferred
from engine.loan.guards import validate as guards
from engine.memory.plan_types import PromptGeometry
from engine.memory.planner import plan_prompt
from engine.runtime.parts import Runtime
from engine.trace.events import EventBus, FlagsChanged, FlagsRefused

RESTART_FIELDS = ("model", "device", "ctx", "kv", "expert_cache", "expert_profile",
                  "vram_segment_mib", "vram_reserve_mib", "vram_limit", "mtp", "draft_vocab", "mtp_experts",
                  "no_borrow", "batch_slots", "prefill_head_alias", "vram_elastic", "serve",
                  "dense", "cache_lend")


def validate(rt: Runtime, options: EngineOptions, flags: LoanFlags) -> list[str]:
    """The guards, plus what cannot change without a restart (a runtime change). A `--prefill`
    change is planned here once and kept on the runtime for `apply`."""
    v = guards(options, flags, rt.backend.traits, rt.model.has_mtp, rt.model.hp.has_output,
               segment_bytes=rt.ledger.segment_bytes, capacity_bytes=rt.backend.capacity_bytes)
    for name in RESTART_FIELDS:
        if getattr(options, name) != getattr(rt.options, name) and not v:
            v.append(f"--{name.replace('_', '-')} cannot change while running; restart strata")
    built = rt.spec.verifier.n_window if rt.spec is not None else 0
    if options.spec > built:
        v.append(f"--spec {options.spec} needs a verifier for {options.spec} tokens, this "
                 f"engine built {built or 'none'}; restart with --spec {options.spec}")
    if options.prefill != rt.options.prefill:
        try:
            rt.replanned = options.prefill, prompt_plan(rt, options.prefill)
        except StrataError as e:
            v.append(f"--prefill {options.prefill}: {e}")
    return v


def warnings(options: EngineOptions, flags: LoanFlags) -> list[str]:
    """What an accepted change says besides taking effect: a repeat threshold clamped to 256
    (a negative one too), or one above the context that no message reaches. The serve loop
    prints them and puts them on its FlagsChanged event; `POST /v1/flags` returns them."""
    return list(flags.warnings_for(options))


def prompt_plan(rt: Runtime, prefill: int | str) -> PromptGeometry:
    """The decode-time geometry for another `--prefill`, on the memory this engine has
    (planned once: `validate` keeps it for `apply`)."""
    if rt.replanned is not None and rt.replanned[0] == prefill:
        return rt.replanned[1]
    opts = replace(rt.plan_options, prefill=prefill)
    cache = rt.cache
    n_slots = cache.n_slots if cache else 0
    if rt.plan.prompt.borrowed and cache is not None:
        return plan_prompt(n_slots * cache.blob_bytes, rt.costs, opts, n_slots)
    return plan_prompt(rt.prompt.owned_bytes, rt.costs, opts, n_slots)


def apply(rt: Runtime, options: EngineOptions, flags: LoanFlags) -> None:
    """Flags/options accepted by `validate` take effect from the next request.

    Until a request has been prefilled, what the startup loan defers follows the new flags;
    afterwards every decode-only region is resident between requests and a loan releases
    only what the flags of its own request say. If a region cannot be restored, this raises
    with the engine and its flags as they were.
    """
    if not rt.prefilled:
        follow(rt, deferred_regions(flags, options), armed=flags.elastic_loan)
    if options.prefill != rt.options.prefill:
        rt.plan_options = replace(rt.plan_options, prefill=options.prefill)
        rt.plan = replace(rt.plan, prompt=prompt_plan(rt, options.prefill))
        rt.retained_geometry = rt.replanned = None
    if not rt.prefilled:
        rt.plan = plan_deferred(rt.plan, rt.costs, rt.plan_options)
    if rt.spec is not None:
        rt.spec.n_window = max(options.spec, 1)
        rt.spec.always = options.spec_always
    if options.cache_policy != rt.options.cache_policy:
        rt.experts.set_policy(cache_policy(rt.backend.traits, options))
    graph_changed = options.no_token_graph != rt.options.no_token_graph
    rt.options, rt.flags = options, flags
    if graph_changed:  # --no-token-graph toggled: decode steps eager / captured from now on
        rt.detach_token_graph()
        rt.attach_token_graph()


def follow(rt: Runtime, deferred: frozenset[str], armed: bool) -> None:
    """Before the first request: hold the decode-only regions as an engine started with other
    flags would (engine.loan.deferral), and arm the startup loan or not."""
    assert not rt.prefilled, "after the first request every region stays resident"
    restored, released = follow_deferral(rt.resources, deferred, rt.faults)
    rt.plan_options = replace(rt.plan_options, deferred=deferred)
    rt.startup_loan_pending = armed
    line = deferral_line(restored, released)
    if line:
        rt.report.trace(line)


class PendingFlags:
    """Flags and options accepted while the engine runs, waiting for the next request: set from
    any thread (`offer`: validated by the guards, said as FlagsChanged or FlagsRefused), taken
    at a request's start (`take`: applied on the runtime). Until taken, `flags` and `options`
    answer with them, so a question about the next request sees what it will run with."""

    def __init__(self, rt: Runtime, bus: EventBus):
        self.rt, self.bus = rt, bus
        self._lock = threading.Lock()
        self._flags: LoanFlags | None = None
        self._options: EngineOptions | None = None

    @property
    def flags(self) -> LoanFlags:
        return self._flags or self.rt.flags

    @property
    def options(self) -> EngineOptions:
        return self._options or self.rt.options

    def offer(self, flags: LoanFlags, options: EngineOptions | None = None) -> list[str]:
        """Validate new flags (and options) with the guards; keep them for the next request.
        Returns the violations (empty when accepted). An accepted change's warnings
        (`warnings`: a clamped threshold) are printed as warning lines and carried on its
        FlagsChanged event."""
        with self._lock:
            options = options or self.options
            violations = validate(self.rt, options, flags)
            if violations:
                self.bus.publish(FlagsRefused(tuple(violations)))
                return violations
            self._flags, self._options = flags, options
            said = warnings(options, flags)
            for w in said:
                self.rt.report.warn(f"strata: warning: {w}")
            self.bus.publish(FlagsChanged(tuple(sorted(flags.as_env().items())) + (
                ("spec", str(options.spec)), ("prefill", str(options.prefill))), tuple(said)))
        return []

    def take(self) -> None:
        """At a request's start: what was accepted since the last one takes effect."""
        with self._lock:
            if self._flags or self._options:
                apply(self.rt, self.options, self.flags)
                self._flags = self._options = None
