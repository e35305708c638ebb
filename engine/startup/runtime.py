"""Startup (DESIGN §4): open the model (no weights decoded yet), plan memory (pure, the same
code `strata plan` runs), create the ledger, reserve regions while decoding weights straight
into them, fill the expert cache in profile order, stage the residency table (seed 003), build
speculative decoding, then release whatever a startup loan defers. The result is a `Runtime`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np

from engine.backend.base import as_gpu
from engine.config import EngineOptions, LoanFlags
from engine.devices import cache_policy
from engine.experts.decoded import DecodedLRU
from engine.experts.provider import CachedExperts
from engine.faults import Faults
from engine.loan.cache_lend import CacheLend
from engine.loan.resources import DecodeResource, NativeHead, ResourceSet
from engine.memory.arena import Arena
from engine.memory.costs import Shapes
from engine.memory.ledger import Ledger
from engine.model.loader import load_model
from engine.model.token_graph import make_token_graph, token_graph_wanted
from engine.prompt.path import PromptPath
from engine.request.session import Session
from engine.runtime.parts import Runtime
from engine.startup.cache import make_cache, pin_model_file, startup_profile
from engine.startup.device import plan_device
from engine.startup.speculation import build_spec
from engine.synth.demo import resolve_model
from engine.trace.events import EventBus, LedgerChanged, Loading
from engine.trace.report import Reporter

SLOW_KERNELS_S = 2.0  # a warm-up longer than this says so: a first run compiles (NVRTC)


def kernel_progress(report: Reporter) -> Callable[[int, int], None]:
    """The CUDA warm-up's progress (engine/kernels/warmup.py) as `Loading` events, and once
    it took longer than SLOW_KERNELS_S (a first run on this machine compiles every module) a
    line saying how long, so neither the app nor the CLI sits through it silently."""
    t0 = 0.0  # set by the warm-up's first call, (0, total)

    def progress(done: int, total: int) -> None:
        nonlocal t0
        if done == 0:
            t0 = time.perf_counter()
        report.publish(Loading("loading CUDA kernels", done, total))
        seconds = time.perf_counter() - t0
        if done == total and seconds > SLOW_KERNELS_S:
            report.say(f"strata serve: {total} CUDA kernel modules compiled in {seconds:.1f} s "
                       "(NVRTC, once per machine: CuPy's disk cache keeps them)")

    return progress


def build_runtime(options: EngineOptions, flags: LoanFlags, bus: EventBus | None = None,
                  on_line: Callable[[str], None] | None = None,
                  faults: Faults | None = None) -> Runtime:
    """Load, plan and allocate; publishes Loading, LedgerChanged and Ready events.

    `on_line` receives the text lines the CLI prints (serve lines and warnings always, trace
    and loan lines with STRATA_TRACE=1); `faults` arms named failure points (tests).
    """
    # An engine let go of is held by reference cycles (its parts keep its bound methods)
    # until a full collection: run one now, so its memory (device buffers on CUDA, the
    # decoded experts) is back before this engine plans from what is free.
    gc.collect()
    faults = faults or Faults()
    report = Reporter(bus, on_line)
    publish = report.publish
    path = resolve_model(options.model,
                         progress=lambda d, t: publish(Loading("building model", d, t)))
    publish(Loading("opening model", 0, 1))
    model = load_model(path, build=False)
    planned = plan_device(options, flags, Shapes.of(model), compiling=kernel_progress(report))
    backend, costs = planned.backend, planned.costs
    ledger = Ledger(backend, backend.capacity_bytes,
                    segment_bytes=planned.plan_options.segment_bytes,
                    on_change=lambda s: publish(LedgerChanged.of(s)))

    publish(Loading("decoding weights", 0, 3))
    wdt = np.float16 if backend.traits.weight_bytes == 2 else np.float32
    dense = Arena(ledger, "weights.dense", costs.dense_bytes, float_dtype=wdt)
    head = Arena(ledger, "head.native", costs.head_bytes, float_dtype=wdt)
    model.build(backend, dense.to_device, head.to_device, quantized=planned.quantized)
    publish(Loading("decoding weights", 1, 3))
    kv = Arena(ledger, "kv", costs.kv_bytes)
    if planned.plan_options.reserve_bytes:
        Arena(ledger, "reserve", planned.plan_options.reserve_bytes)
    gpu = as_gpu(backend)
    if gpu is not None:
        report.say(f"strata serve: {gpu.budget.line()}")
        pin_model_file(gpu, model.mf.data, report.trace, report.warn)
    token_graph = token_graph_wanted(backend, options.no_token_graph)
    cache, plan, plan_options = make_cache(
        ledger, model.experts, planned.plan, costs, planned.plan_options,
        profile=lambda: startup_profile(options.expert_profile, model, backend, report.warn),
        token_graph=token_graph, faults=faults, trace=report.trace, warn=report.warn,
    )
    experts = CachedExperts(cache, model.experts, DecodedLRU(), backend)
    experts.on_warning = report.warn
    experts.set_policy(cache_policy(backend.traits, options))
    session = Session(model, n_ctx=options.ctx, kv_kind=options.kv, experts=experts,
                      kv_alloc=kv.alloc)
    session.on_step = experts.observe
    if token_graph:
        session.graph = make_token_graph(model.transformer, session.kv, experts, cache, backend,
                                         report.warn)
    prompt = PromptPath(ledger, plan.prompt, costs, cache, experts, backend, faults, report)

    items = [DecodeResource("head.native", head, NativeHead(model.transformer, head))]
    spec = None
    if options.mtp:
        spec, mtp_items = build_spec(options, model, ledger, costs, weight_dtype=wdt,
                                     dense=dense, kv=kv)
        items += mtp_items
        if spec is not None:
            session.on_hidden = spec.collect
    resources = ResourceSet(items)
    if spec is not None and cache is not None and options.cache_lend:
        spec.lender = CacheLend(resources, cache, ledger, faults, report, experts.ranking)
    rt = Runtime(options=options, flags=flags, model=model, backend=backend, ledger=ledger,
                 plan=plan, costs=costs, plan_options=plan_options, cache=cache,
                 experts=experts, session=session, prompt=prompt, resources=resources,
                 spec=spec, faults=faults, report=report)
    publish(Loading("decoding weights", 3, 3))
    for r in resources.select(plan_options.deferred):
        r.release()
    rt.startup_loan_pending = bool(flags.elastic_loan)
    report.cache(cache)
    publish(rt.ready())
    rt.publish_gpu(force=True)
    return rt

