"""Startup pieces of a runtime on its device: the expert cache (filled in profile order, its
residency table staged, seed 003's fallback), the profile it is filled from, and page-locking
the model file on CUDA."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.errors import DeviceError, TokenGraphError
from engine.experts.cache import ExpertCache
from engine.experts.profile import ExpertProfile
from engine.experts.provider import CachedExperts
from engine.experts.residency import residency_readers
from engine.memory.planner import plan_startup
from engine.memory.sizes import format_mib
from engine.model.weights import DecodedLRU
from engine.profile_record import default_profile

if TYPE_CHECKING:
    from engine.runtime import Runtime


def make_cache(rt: Runtime) -> ExpertCache | None:
    """Fill the cache in profile order and stage the residency table for its readers.

    Seed 003: the table is staged whenever borrowing is possible, token graph or not. If
    staging fails and only borrowing needed it, warn, re-plan with owned prompt buffers
    and continue; if the token graph needs it, the error stands.
    """
    n = rt.plan.n_cache_slots
    if n == 0:
        return None
    order = startup_profile(rt).order()
    cache = ExpertCache(rt.ledger, rt.model.experts, n, on_trace=rt._trace)
    cache.fill(order)
    readers = residency_readers(
        profile_present=True, borrow=rt.plan.prompt.borrowed,
        chunk_tokens=rt.plan.prompt.chunk_tokens,
        token_graph=token_graph(rt),
    )
    if "stage" in rt.faults.armed:  # test hook: a real device fault on the table upload
        rt.faults.armed.discard("stage")
        rt.backend.inject_fault("upload")
    warning = cache.stage_residency(readers)
    if warning is None:
        return cache
    rt.warnings.append(warning)
    rt._trace(warning)
    rt.emit_trace(warning, always=True)
    cache.release()
    rt.plan_options = replace(rt.plan_options, borrow=False)
    rt.plan = plan_startup(rt.ledger.capacity_bytes, rt.costs, rt.plan_options)
    if rt.plan.n_cache_slots == 0:
        return None
    cache = ExpertCache(rt.ledger, rt.model.experts, rt.plan.n_cache_slots, on_trace=rt._trace)
    cache.fill(order)
    return cache


def pin_model_file(rt: Runtime) -> None:
    """Page-lock the memory-mapped GGUF so expert uploads are one DMA each at full PCIe
    speed; where that fails (not enough lockable memory), uploads go through the
    backend's pinned staging buffer and a warning says so."""
    data = rt.model.mf.data
    if data is None:
        return
    t0 = time.perf_counter()
    try:
        rt.backend.pin(data)
    except DeviceError as e:
        rt.warnings.append(f"{e}; expert uploads go through a staging copy (slower)")
        rt.emit_trace(rt.warnings[-1], always=True)
        return
    rt._trace(f"pinned the model file: {format_mib(data.nbytes)} MiB in "
              f"{time.perf_counter() - t0:.1f} s")


def attach_token_graph(rt: Runtime) -> None:
    """On CUDA (unless --no-token-graph) decode steps replay captured CUDA graphs
    (engine/token_graph.py); where that cannot work here, a warning says why and steps run
    eagerly."""
    if not token_graph(rt):
        return
    from engine.token_graph import TokenGraph

    tr = rt.model.transformer
    tr.on_warning = lambda line: _warn(rt, line)
    try:
        tr.token_graph = TokenGraph(tr, rt.session.kv, rt.experts, rt.cache, rt.backend)
    except TokenGraphError as e:
        _warn(rt, f"strata: warning: {e}; decode steps run eagerly")


def detach_token_graph(rt: Runtime) -> None:
    """Drop the captured decode steps; steps run eagerly until `attach_token_graph`."""
    tr = rt.model.transformer
    if tr.token_graph is not None:
        tr.token_graph.release()
        tr.token_graph = None


def _warn(rt: Runtime, line: str) -> None:
    rt.warnings.append(line)
    rt.emit_trace(line, always=True)


def token_graph(rt: Runtime) -> bool:
    """Decode steps are captured as a CUDA graph unless --no-token-graph (CUDA only)."""
    return rt.backend.name.startswith("cuda") and not rt.options.no_token_graph


def startup_profile(rt: Runtime) -> ExpertProfile:
    """The profile the cache is filled from: --expert-profile, else the calibration one."""
    if rt.options.expert_profile:
        profile = ExpertProfile.load(rt.options.expert_profile)
        profile.check_model(rt.model.hp.n_layer, rt.model.hp.n_expert)
        return profile
    # the calibration pass streams every expert it routes to (the cache is not filled yet)
    stream = CachedExperts(None, rt.model.experts, DecodedLRU(), rt.to_host,
                           rt.backend if rt.on_cuda else None)
    return default_profile(rt.model, stream)
