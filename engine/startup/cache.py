"""Startup pieces of a runtime on its device: the expert cache (filled in profile order, its
residency table staged, seed 003's fallback), the profile it is filled from, page-locking the
model file on CUDA. Each takes the parts it works on; warnings go to
`warn`, trace lines to `trace`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from engine.backend.base import Backend, GpuBackend
from engine.errors import DeviceError
from engine.experts.cache import ExpertCache
from engine.experts.decoded import DecodedLRU
from engine.experts.host import HostExperts
from engine.experts.profile import ExpertProfile
from engine.experts.provider import CachedExperts
from engine.experts.residency import residency_readers
from engine.faults import Faults
from engine.memory.ledger import Ledger
from engine.memory.plan_types import ModelCosts, PlanOptions, StartupPlan
from engine.memory.planner import plan_startup
from engine.memory.sizes import format_mib
from engine.model.loader import Model
from engine.startup.profile_record import default_profile

Sink = Callable[[str], None]


def make_cache(
    ledger: Ledger, host: HostExperts, plan: StartupPlan, costs: ModelCosts,
    plan_options: PlanOptions, *, profile: Callable[[], ExpertProfile], token_graph: bool,
    faults: Faults, trace: Sink, warn: Sink,
) -> tuple[ExpertCache | None, StartupPlan, PlanOptions]:
    """Fill the cache in profile order and stage the residency table for its readers; returns
    the cache with the plan and plan options it was made with.

    Seed 003: the table is staged whenever borrowing is possible, token graph or not. If
    staging fails and only borrowing needed it, warn, re-plan with owned prompt buffers
    and continue; if the token graph needs it, the error stands.
    """
    n = plan.n_cache_slots
    if n == 0:
        return None, plan, plan_options
    order = profile().order()
    cache = ExpertCache(ledger, host, n, on_trace=trace)
    cache.fill(order)
    readers = residency_readers(
        profile_present=True, borrow=plan.prompt.borrowed,
        chunk_tokens=plan.prompt.chunk_tokens, token_graph=token_graph,
    )
    if "stage" in faults.armed:  # test hook: a real device fault on the table upload
        faults.armed.discard("stage")
        ledger.backend.inject_fault("upload")
    warning = cache.stage_residency(readers)
    if warning is None:
        return cache, plan, plan_options
    trace(warning)
    warn(warning)
    cache.release()
    plan_options = replace(plan_options, borrow=False)
    plan = plan_startup(ledger.capacity_bytes, costs, plan_options)
    if plan.n_cache_slots == 0:
        return None, plan, plan_options
    cache = ExpertCache(ledger, host, plan.n_cache_slots, on_trace=trace)
    cache.fill(order)
    return cache, plan, plan_options


def pin_model_file(backend: GpuBackend, data: np.ndarray | None, trace: Sink, warn: Sink) -> None:
    """Page-lock the memory-mapped GGUF so expert uploads are one DMA each at full PCIe
    speed; where that fails (not enough lockable memory), uploads go through the
    backend's pinned staging buffer and a warning says so."""
    if data is None:
        return
    t0 = time.perf_counter()
    try:
        backend.pin(data)
    except DeviceError as e:
        warn(f"{e}; expert uploads go through a staging copy (slower)")
        return
    trace(f"pinned the model file: {format_mib(data.nbytes)} MiB in "
          f"{time.perf_counter() - t0:.1f} s")


def startup_profile(path: str | None, model: Model, backend: Backend,
                    warn: Sink | None = None) -> ExpertProfile:
    """The profile the cache is filled from: --expert-profile, else the calibration one
    (routed on `backend`; `warn`: a cached one that cannot be used, recorded again)."""
    if path:
        profile = ExpertProfile.load(path)
        profile.check_model(model.hp.n_moe_layer, model.hp.n_expert)
        return profile
    # the calibration pass streams every expert it routes to (the cache is not filled yet)
    stream = CachedExperts(None, model.experts, DecodedLRU(), backend)
    return default_profile(model, stream, warn)
