"""Runtime: one model on one device — memory plan, ledger regions, expert cache, KV, session,
decode-only resources. The serve loop drives it; it owns no conversation logic.

Startup order (DESIGN §4): open the model (no weights decoded yet), plan memory (pure), create
the ledger, reserve regions while decoding weights straight into them, fill the expert cache
in profile order, stage the residency table (seed 003), then release whatever a startup loan
defers.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from engine.backend import make_backend
from engine.backend.base import Backend
from engine.build.cache import (
    attach_token_graph,
    detach_token_graph,
    make_cache,
    pin_model_file,
    startup_profile,
)
from engine.build.spec import build_spec
from engine.config import EngineOptions, LoanFlags
from engine.costs import Shapes, model_costs
from engine.devices import (
    deferred_regions,
    resolve_device,
    segment_bytes,
    sim_device,
    vram_limit_bytes,
    weight_bytes,
)
from engine.errors import FlagError, StrataError
from engine.events import (
    CacheChanged,
    EventBus,
    GpuStats,
    LedgerChanged,
    Loading,
    Ready,
    TraceLine,
)
from engine.experts.cache import LENT, ExpertCache
from engine.experts.decoded import DecodedLRU
from engine.experts.provider import CachedExperts
from engine.loan.faults import Faults
from engine.loan.guards import validate
from engine.loan.resources import DecodeResource, NativeHead, ResourceSet
from engine.loan.transaction import STARTUP, LoanTransaction, admit, loan_regions, on_chunk_guard
from engine.memory.arena import Arena
from engine.memory.ledger import REGION_NAMES, Ledger
from engine.memory.plan_types import ModelCosts, PlanOptions, PromptGeometry, StartupPlan
from engine.memory.planner import plan_loan, plan_prompt, plan_startup
from engine.memory.sizes import MiB, format_mib
from engine.model.loader import Model, load_model
from engine.phases import PhaseClock
from engine.prompt.path import PrefillResult, run_prompt, shrink_geometry
from engine.sampler import Sampler
from engine.session import Session, Timing
from engine.synth.demo import resolve_model


@dataclass(frozen=True)
class Checkpoint:
    n_tokens: int


@dataclass(frozen=True)
class DevicePlan:
    """What startup decides before it allocates: the device, what each item costs, and the
    memory plan. `Runtime.create` allocates it; `strata plan` prints it."""

    backend: Backend
    costs: ModelCosts
    plan_options: PlanOptions
    plan: StartupPlan


def plan_device(options: EngineOptions, flags: LoanFlags, shapes: Shapes) -> DevicePlan:
    """Open the device, run the guards on the options, the flags and the device's facts
    (capacity, segment), then plan memory. Every refusal is one FlagError listing them all,
    raised before anything is allocated or deferred."""
    device = resolve_device(options.device)
    costs = model_costs(shapes, options, weight_bytes(device), gpu=device.startswith("cuda"))
    reserve = options.vram_reserve_mib * MiB
    limit = vram_limit_bytes(options)
    backend = make_backend(sim_device(device, costs, reserve, limit), limit,
                           elastic=options.vram_elastic)
    capacity = backend.capacity_bytes
    seg = segment_bytes(options, capacity)
    violations = validate(options, flags, device, shapes.has_mtp, shapes.hp.has_output,
                          segment_bytes=seg, capacity_bytes=capacity)
    if violations:
        raise FlagError(violations)
    plan_options = Runtime.plan_options_for(options, flags, reserve, seg, device)
    return DevicePlan(backend, costs, plan_options, plan_startup(capacity, costs, plan_options))


class Runtime:
    """Everything one loaded engine holds. Built by `Runtime.create`."""

    def __init__(self) -> None:
        self.options: EngineOptions
        self.flags: LoanFlags
        self.bus: EventBus
        self.model: Model
        self.backend: Backend
        self.ledger: Ledger
        self.plan: StartupPlan
        self.costs: ModelCosts
        self.plan_options: PlanOptions
        self.cache: ExpertCache | None
        self.experts: CachedExperts
        self.session: Session
        self.resources: ResourceSet
        self.spec: Any = None  # SpecDecoder when --mtp --spec T
        self.startup_loan_pending = False
        self.prefilled = False  # a request's prefill has completed (the startup loan is over)
        self.retained_geometry: PromptGeometry | None = None
        self.active_lent: Any = None  # LentRange while the prompt path holds cache slots
        self.faults = Faults()
        self.warnings: list[str] = []
        self._telemetry: Any = None  # engine.telemetry.Telemetry, False without NVML
        self._gpu_t = 0.0
        self.trace = os.environ.get("STRATA_TRACE", "") not in ("", "0")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, options: EngineOptions, flags: LoanFlags, bus: EventBus | None = None,
               on_trace: Callable[[str], None] | None = None,
               faults: Faults | None = None) -> Runtime:
        """Load, plan and allocate. `faults` arms named failure points (tests)."""
        # An engine let go of is held by reference cycles (its parts keep its bound methods)
        # until a full collection: run one now, so its memory (device buffers on CUDA, the
        # decoded experts) is back before this engine plans from what is free.
        gc.collect()
        rt = cls()
        rt.faults = faults or Faults()
        rt.options, rt.flags, rt.bus = options, flags, bus or EventBus()
        publish = rt.bus.publish
        path = resolve_model(options.model, progress=lambda d, t: publish(Loading("building model", d, t)))
        publish(Loading("opening model", 0, 1))
        rt.model = load_model(path, build=False)
        planned = plan_device(options, flags, Shapes.of(rt.model))
        rt.backend, rt.costs = planned.backend, planned.costs
        rt.plan_options, rt.plan = planned.plan_options, planned.plan
        rt.ledger = Ledger(rt.backend, rt.backend.capacity_bytes,
                           segment_bytes=rt.plan_options.segment_bytes,
                           on_change=lambda s: publish(LedgerChanged.of(s)))
        rt._build(on_trace)
        publish(rt.ready())
        rt.publish_gpu(force=True)
        return rt

    @staticmethod
    def plan_options_for(options: EngineOptions, flags: LoanFlags, reserve_bytes: int,
                         segment_bytes: int, device: str = "sim") -> PlanOptions:
        """The planner's options; on CUDA the ring wants two layers of experts (the prompt
        path uploads the next layer's experts while this one computes)."""
        return PlanOptions(
            ring_layers=2 if device.startswith("cuda") else 1,
            expert_cache=options.expert_cache, prefill=options.prefill,
            deferred=deferred_regions(flags, options), borrow=not options.no_borrow,
            reserve_bytes=reserve_bytes, segment_bytes=segment_bytes,
        )

    def _build(self, on_trace: Callable[[str], None] | None) -> None:
        o, m, publish = self.options, self.model, self.bus.publish
        publish(Loading("decoding weights", 0, 3))
        wdt = self.weight_dtype
        dense = Arena(self.ledger, "weights.dense", self.costs.dense_bytes, float_dtype=wdt)
        head = Arena(self.ledger, "head.native", self.costs.head_bytes, float_dtype=wdt)
        m.build(self.backend, dense.to_device, head.to_device)
        publish(Loading("decoding weights", 1, 3))
        kv = Arena(self.ledger, "kv", self.costs.kv_bytes)
        if self.plan_options.reserve_bytes:
            Arena(self.ledger, "reserve", self.plan_options.reserve_bytes)
        self._trace_fn = on_trace
        cuda = self.backend if self.on_cuda else None
        if cuda is not None:
            pin_model_file(cuda, m.mf.data, self._trace, self._warn)
        self.cache, self.plan, self.plan_options = make_cache(
            self.ledger, m.experts, self.plan, self.costs, self.plan_options,
            profile=lambda: startup_profile(o.expert_profile, m, self.backend),
            token_graph=self.token_graph_wanted, faults=self.faults, trace=self._trace,
            warn=self._warn,
        )
        self.experts = CachedExperts(self.cache, m.experts, DecodedLRU(), self.backend)
        self.session = Session(m, n_ctx=o.ctx, kv_kind=o.kv, experts=self.experts,
                               kv_alloc=kv.alloc)
        self._attach_token_graph()
        self._owned_prompt()
        items = [DecodeResource("head.native", head, NativeHead(m.transformer, head))]
        if o.mtp:
            items += self._make_spec(dense, kv)
        self.resources = ResourceSet(items)
        publish(Loading("decoding weights", 3, 3))
        for r in self.resources.select(self.plan_options.deferred):
            r.release()
        self.startup_loan_pending = bool(self.flags.elastic_loan)
        self.publish_cache()

    def _owned_prompt(self) -> None:
        g = self.plan.prompt
        self.owned_chunk = self.owned_ring = None
        if g.chunk_tokens and not g.borrowed:
            self.owned_chunk = Arena(self.ledger, "prompt.chunk", g.chunk_bytes)
            self.owned_ring = Arena(self.ledger, "prompt.ring", g.ring_bytes)

    def _make_spec(self, dense: Arena, kv: Arena) -> list[DecodeResource]:
        self.spec, items = build_spec(self.options, self.model, self.ledger, self.costs,
                                      weight_dtype=self.weight_dtype, dense=dense, kv=kv)
        if self.spec is not None:
            self.session.on_hidden = self.spec.collect
        return items

    def _attach_token_graph(self) -> None:
        if self.token_graph_wanted:
            attach_token_graph(self.model.transformer, self.session.kv, self.experts, self.cache,
                               self.backend, self._warn)

    @property
    def xp(self) -> Any:
        return self.backend.xp

    @property
    def on_cuda(self) -> bool:
        return self.backend.name.startswith("cuda")

    @property
    def token_graph_wanted(self) -> bool:
        """Decode steps are captured as a CUDA graph unless --no-token-graph (CUDA only)."""
        return self.on_cuda and not self.options.no_token_graph

    @property
    def weight_dtype(self) -> Any:
        return np.float16 if weight_bytes(self.backend.name) == 2 else np.float32

    def to_host(self, a: Any) -> np.ndarray:
        return self.backend.download(a)

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
            f"{self.model.path.name}: {hp.n_layer} layers x {hp.n_expert} experts (top-{hp.n_expert_used}), "
            f"{self.backend.name} {format_mib(self.ledger.capacity_bytes)} MiB, "
            f"cache {n_slots}/{hp.n_layer * hp.n_expert} experts, prompt plan {self.plan.prompt.label}"
            + (", token graph" if self.model.transformer.token_graph is not None else "")
        )

    RESTART_FIELDS = ("model", "device", "ctx", "kv", "expert_cache", "expert_profile",
                      "vram_segment_mib", "vram_reserve_mib", "vram_limit", "mtp", "draft_vocab",
                      "no_borrow", "batch_slots", "prefill_head_alias", "vram_elastic", "serve")

    def validate(self, options: EngineOptions, flags: LoanFlags) -> list[str]:
        """The guards, plus what cannot change without a restart (a runtime change)."""
        v = validate(options, flags, self.backend.name, self.model.has_mtp,
                     self.model.hp.has_output, segment_bytes=self.ledger.segment_bytes,
                     capacity_bytes=self.backend.capacity_bytes)
        for name in self.RESTART_FIELDS:
            if getattr(options, name) != getattr(self.options, name) and not v:
                v.append(f"--{name.replace('_', '-')} cannot change while running; restart strata")
        built = self.spec.verifier.n_window if self.spec is not None else 0
        if options.spec > built:
            v.append(f"--spec {options.spec} needs a verifier for {options.spec} tokens, this "
                     f"engine built {built or 'none'}; restart with --spec {options.spec}")
        if options.prefill != self.options.prefill:
            try:
                self._prompt_plan(options.prefill)
            except StrataError as e:
                v.append(f"--prefill {options.prefill}: {e}")
        return v

    def _prompt_plan(self, prefill: int | str) -> PromptGeometry:
        """The decode-time geometry for another `--prefill`, on the memory this engine has."""
        opts = replace(self.plan_options, prefill=prefill)
        if self.plan.prompt.borrowed and self.cache is not None:
            lendable = self.cache.n_slots * self.cache.blob_bytes
            return plan_prompt(lendable, self.costs, opts, self.cache.n_slots)
        owned = sum(a.n_bytes for a in (self.owned_chunk, self.owned_ring) if a is not None)
        return plan_prompt(owned, self.costs, opts, self.cache.n_slots if self.cache else 0)

    def check_integrity(self) -> None:
        """Ledger, cache, KV and resources agree; 0 slots lent between requests."""
        self.ledger.check_integrity()
        if self.cache is not None:
            self.cache.check_integrity()
            assert self.cache.n_lent == 0, f"{self.cache.n_lent} slots still lent"
        self.session.kv.check_integrity()
        self.resources.check_integrity()

    # -- actions -----------------------------------------------------------------------------
    def apply(self, options: EngineOptions, flags: LoanFlags) -> None:
        """Flags/options accepted by `validate` take effect from the next request.

        Until a request has been prefilled, what the startup loan defers follows the new flags
        (`follow_deferral`); afterwards every decode-only region is resident between requests
        and a loan releases only what the flags of its own request say. If a region cannot be
        restored, this raises with the engine and its flags as they were.
        """
        if not self.prefilled:
            self.follow_deferral(deferred_regions(flags, options), armed=flags.elastic_loan)
        if options.prefill != self.options.prefill:
            self.plan_options = replace(self.plan_options, prefill=options.prefill)
            self.plan = replace(self.plan, prompt=self._prompt_plan(options.prefill))
            self.retained_geometry = None
        if not self.prefilled:
            self._plan_deferred()
        if self.spec is not None:
            self.spec.n_window = max(options.spec, 1)
            self.spec.always = options.spec_always
        graph_changed = options.no_token_graph != self.options.no_token_graph
        self.options, self.flags = options, flags
        if graph_changed:  # --no-token-graph toggled: decode steps eager / captured from now on
            detach_token_graph(self.model.transformer)
            self._attach_token_graph()

    def follow_deferral(self, deferred: frozenset[str], armed: bool) -> None:
        """Before the first request: hold the decode-only regions as an engine started with
        other flags would. Restore (draft head -> MTP experts -> head -> verifier) what
        `deferred` no longer names, release what it adds, and arm the startup loan or not. A
        failed restore gives back what this call restored and raises; nothing has changed."""
        assert not self.prefilled, "after the first request every region stays resident"
        restore = [r for r in reversed(self.resources.items)
                   if r.region not in deferred and not r.resident]
        release = [r for r in self.resources.items if r.region in deferred and r.resident]
        done: list[DecodeResource] = []
        try:
            for r in restore:
                self.faults.hit(f"flags:restore:{r.region}")
                r.restore()
                done.append(r)
        except BaseException:
            for r in done:
                r.release()
            raise
        for r in release:
            r.release()
        self.plan_options = replace(self.plan_options, deferred=deferred)
        self.startup_loan_pending = armed
        parts = [f"restored {', '.join(r.label for r in restore)}"] if restore else []
        parts += [f"deferred {', '.join(r.label for r in release)}"] if release else []
        if parts:
            self._trace(f"strata loan: flags changed before the first request: {'; '.join(parts)}")

    def _plan_deferred(self) -> None:
        """The startup plan's deferred regions and startup geometry for `plan_options.deferred`
        (what `plan_startup` would give with these flags: the cache does not move)."""
        p, deferred = self.plan, self.plan_options.deferred
        every = sorted((*p.regions, *p.deferred), key=lambda r: REGION_NAMES.index(r.name))
        plan = replace(p, regions=tuple(r for r in every if r.name not in deferred),
                       deferred=tuple(r for r in every if r.name in deferred))
        freed = sum(r.n_segments for r in plan.deferred) * plan.segment_bytes
        startup = plan_loan(plan, freed, self.costs, self.plan_options) if freed else plan.prompt
        self.plan = replace(plan, startup_prompt=startup)

    def rollback(self, cp: Checkpoint) -> None:
        self.session.truncate(min(cp.n_tokens, len(self.session.tokens)))
        if self.spec is not None:
            self.spec.draft.truncate(min(cp.n_tokens, len(self.session.tokens)))

    def publish_gpu(self, force: bool = False) -> None:
        """On CUDA, an NVML reading as a GpuStats event (at most twice a second)."""
        if not self.on_cuda:
            return
        now = time.monotonic()
        if not force and now - self._gpu_t < 0.5:
            return
        self._gpu_t = now
        if self._telemetry is None:
            from engine.telemetry import Telemetry

            self._telemetry = Telemetry.open(int(self.backend.name.partition(":")[2] or 0)) or False
        if self._telemetry:
            used = sum(r.used_bytes for r in self.ledger.snapshot().regions)
            self.bus.publish(GpuStats(self._telemetry.snapshot(), used))

    def publish_cache(self) -> None:
        if self.cache is None:
            return
        states = self.cache.states()
        lent = np.nonzero(states == LENT)[0]
        rng = (int(lent[0]), int(lent[-1])) if len(lent) else None
        self.bus.publish(CacheChanged(states.astype(np.uint8).tobytes(), rng, len(lent)))

    def _trace(self, line: str) -> None:
        self.bus.publish(TraceLine(line))
        self.emit_trace(line)

    def _warn(self, line: str) -> None:
        """A warning: kept in `warnings` and always printed."""
        self.warnings.append(line)
        self.emit_trace(line, always=True)

    def emit_trace(self, line: str, always: bool = False) -> None:
        """Print a line through the CLI's writer: serve lines always, trace and loan lines
        when STRATA_TRACE=1."""
        if self._trace_fn is not None and (always or self.trace):
            self._trace_fn(line)

    # -- the prompt path ---------------------------------------------------------------------
    def decode_geometry(self, n_fresh: int) -> PromptGeometry:
        """The decode-time prompt plan, cut down to a prompt shorter than one chunk."""
        return self._fit_to(self.plan.prompt, n_fresh)

    def _fit_to(self, g: PromptGeometry, n_fresh: int) -> PromptGeometry:
        c = self.costs
        return shrink_geometry(g, n_fresh, c.act_bytes_per_token, c.act_bytes_fixed,
                               c.expert_blob_bytes)

    def prefill(
        self,
        fresh: list[int],
        on_chunk: Callable[[int, int, float], None] | None = None,
        on_plan: Callable[[PromptGeometry, bool], None] | None = None,
    ) -> tuple[Any, PrefillResult]:
        """Prefill `fresh` (loan or not, as `admit` decides); returns the first token's logits.

        Any failure or cancel leaves ledger, cache and resources as before the call; the
        caller truncates the session back to its checkpoint.
        """
        kind = admit(self.flags, self.startup_loan_pending, len(fresh))
        cb = on_chunk_guard(self.faults, on_chunk)
        on_plan = on_plan or (lambda g, loan: None)
        try:
            if kind is None:
                g = self.decode_geometry(len(fresh))
                on_plan(g, False)
                res = self._run(fresh, g, cb)
            else:
                with self._loan(kind) as tx:
                    assert tx.geometry is not None
                    g = self._fit_to(tx.geometry, len(fresh))
                    on_plan(g, True)
                    res = self._run(fresh, g, cb)
                if kind == STARTUP:  # everything restored: the startup loan is over
                    self.startup_loan_pending = False
                    if self.flags.retain_startup_chunk:
                        self.retained_geometry = tx.geometry
            self.faults.hit("logits")
            logits = self.model.transformer.logits(self.session.last_hidden)  # restored head
        except BaseException:
            self.refill_pending()
            if kind == STARTUP and not self.startup_loan_pending:  # failed after restoring
                for r in self.resources.select(self.plan_options.deferred):
                    r.release()
                self.startup_loan_pending = True
            self.publish_cache()
            raise
        self.prefilled = True
        self.publish_cache()
        self.publish_gpu(force=True)
        return logits, res

    def _loan(self, kind: str) -> LoanTransaction:
        """The loan transaction of one request, on this runtime's parts."""
        return LoanTransaction(
            kind, loan_regions(self.flags, self.options, self.resources),
            resources=self.resources, ledger=self.ledger, cache=self.cache,
            owned=(self.owned_chunk, self.owned_ring), plan=self.plan,
            plan_options=self.plan_options, costs=self.costs,
            retained=self.retained_geometry if self.flags.retain_startup_chunk else None,
            faults=self.faults, refill_pending=self.refill_pending,
            publish_cache=self.publish_cache, bus=self.bus, trace=self._trace,
        )

    def _run(self, fresh: list[int], g: PromptGeometry, on_chunk: Callable) -> PrefillResult:
        def chunk_done(c: int, n: int, seconds: float) -> None:
            self.publish_gpu()
            on_chunk(c, n, seconds)

        def hook(event: str, lent: Any) -> None:
            self.active_lent = lent
            self.publish_cache()
            self.faults.hit(event)

        owned = None
        if not g.borrowed and self.owned_chunk is not None:
            assert self.owned_chunk.region is not None and self.owned_ring.region is not None
            owned = (self.owned_chunk.region.view(0, g.chunk_bytes),
                     self.owned_ring.region.view(0, g.ring_bytes))
        tr = self.model.transformer
        tr.phase_clock = PhaseClock(self.backend) if self.trace else None
        if tr.phase_clock is not None:
            tr.phase_clock.start()
        t0 = time.perf_counter()
        try:
            res = run_prompt(self.session, fresh, g, self.cache, self.experts, self.backend,
                             owned, chunk_done, hook)
            if tr.phase_clock is not None:
                self._trace(tr.phase_clock.line(time.perf_counter() - t0))
        finally:
            tr.phase_clock = None
        self.active_lent = None
        if tr.arena_stats is not None:
            self._trace(tr.arena_stats.line())
        return res

    def refill_pending(self) -> None:
        """The undo path's refill: give back every slot the prompt path still holds."""
        if self.cache is not None and self.active_lent is not None and self.cache.n_lent:
            for attempt in (1, 2):  # a one-shot device fault gets one retry
                try:
                    self.cache.refill(self.active_lent)
                    break
                except Exception:
                    if attempt == 2:
                        raise
        self.active_lent = None

    def decode(self, logits: Any, sampler: Sampler, max_new: int, stop_ids: frozenset[int],
               timing: Timing, cancel: threading.Event) -> Iterator[int]:
        """Tokens after the prompt: plain, or speculative when --spec T is on."""
        if self.spec is not None and self.options.spec >= 2:
            yield from self.spec.decode(self.session, logits, sampler, max_new, stop_ids,
                                        timing, cancel)
            return
        yield from self.session.decode(logits, sampler, max_new, stop_ids, timing, cancel)

    def trace_decode(self, timing: Timing) -> None:
        """With STRATA_TRACE=1, after a request: what the drafting policy did (speculative
        decoding), and the token graph's GPU time per step with the decode steps'
        expert-cache hits."""
        graph = self.model.transformer.token_graph
        line = graph.stats_line() if graph is not None else None
        if self.trace and self.spec is not None and self.options.spec >= 2:
            self._trace(f"speculation: drafted {timing.drafted_steps} of {timing.spec_steps} "
                        f"steps{self.spec.policy.rates()}")
        if not self.trace or line is None:
            return
        n = timing.decode_hits + timing.decode_misses
        hits = f", expert cache hits {100 * timing.decode_hits / n:.0f}%" if n else ""
        self._trace(f"{line}; decode {timing.decode_s:.2f} s wall{hits}")
