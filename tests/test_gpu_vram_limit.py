"""`--vram-limit` bounds the whole process on CUDA (gpu marker): NVML's bytes for this process
stay under the limit from the engine's start through a prefill with the loan and decoding; the
budget leaves room for what lies outside the ledger; `Runtime.close` gives the memory back, so
`strata bench`'s runs do not pile up; `strata run` prints the peak."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import pytest
from test_gpu_engine import LOAN, cupy, mid_path  # noqa: F401 - the fixture, and skips without a GPU

from engine.backend.process_memory import PROCESS, PeakSampler, ProcessMemory
from engine.config import EngineOptions
from engine.memory.budget import GROWTH_MARGIN_BYTES
from engine.memory.sizes import GiB, MiB
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop
from engine.trace.events import EventBus, LedgerChanged, LoanStep

pytestmark = pytest.mark.gpu

LIMIT = 4 * GiB


def options(path: Path, **kw: object) -> EngineOptions:
    base = EngineOptions(model=str(path), device="cuda", ctx=8192, serve=True,
                         vram_elastic=True, mtp=True, spec=2, vram_limit="4GiB",
                         vram_segment_mib=64, kv="q4_0")
    return replace(base, **kw)  # type: ignore[arg-type]


def settle() -> ProcessMemory:
    """Engines earlier tests let go of are collected (their segments unmapped) and cached
    pool blocks freed; the reader of this process's bytes (skip without NVML)."""
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    memory = ProcessMemory.open(0)
    if memory is None:
        pytest.skip("NVML not available")
    return memory


def test_the_budget_leaves_room_for_what_lies_outside_the_ledger() -> None:
    from engine.backend.cuda import CudaBackend
    from engine.kernels.warmup import warm_up

    memory = settle()
    b = CudaBackend(0, limit_bytes=3 * GiB, warm_up=warm_up)
    try:
        assert b.outside_source == PROCESS, "NVML does not report this process's bytes here"
        assert b.limit_bytes == 3 * GiB and b.outside_bytes >= 100 * MiB  # a context, at least
        parts = b.outside_bytes + b.margin_bytes + b.workspace_bytes + b.capacity_bytes
        assert b.limit_bytes - 2 * MiB < parts <= b.limit_bytes, b.budget.line()
        info = b.mem_info()
        assert info.total_bytes == 3 * GiB and info.process_bytes is not None
        assert info.process_bytes <= b.outside_bytes + 64 * MiB  # the ledger holds nothing yet
        assert memory.read().n_bytes <= b.limit_bytes
    finally:
        b.close()
        memory.close()


def test_the_process_stays_under_the_limit_through_a_loan_and_decoding(mid_path: Path) -> None:  # noqa: F811
    """A startup loan on a 3,000-token prompt, a repeat loan on another, 64 tokens decoded
    after each (token graph, MTP drafts): NVML's peak for this process, polled every 2 ms from
    before the engine starts to its close, stays under --vram-limit 4GiB."""
    settle().close()
    bus = EventBus()
    steps: list[str] = []
    mapped: list[int] = []
    bus.subscribe(lambda e: steps.append(e.step) if isinstance(e, LoanStep) else None)
    bus.subscribe(lambda e: mapped.append(sum(r.mapped_bytes for r in e.regions))
                  if isinstance(e, LedgerChanged) else None)
    sampler = PeakSampler.open(0, interval_s=0.002)
    assert sampler is not None
    with sampler:
        loop = ServeLoop.create(options(mid_path), LOAN, bus)
        try:
            words = "the river runs through the old city and the hills beyond it "
            conv = Conversation()
            first = loop.chat(conv, words * 250, max_new=64)
            second = loop.chat(conv, "and then " + words * 250, max_new=64)
            loop.rt.check_integrity()
            line = loop.rt.backend.budget.line()  # type: ignore[attr-defined]
        finally:
            loop.close()
    peak = sampler.peak
    assert peak is not None and peak.source == PROCESS
    assert first.timing.fresh_tokens >= 2500 and second.timing.fresh_tokens >= 2500
    assert first.timing.generated > 1 and second.timing.generated > 1  # both decoded
    assert steps.count("release") >= 2 and steps.count("restore") >= 2, steps  # two loans
    assert peak.n_bytes >= max(mapped), "the sampler did not see the engine's memory"
    assert peak.n_bytes <= LIMIT, (
        f"peak {peak.n_bytes / MiB:,.0f} MiB passes --vram-limit 4,096 MiB by "
        f"{(peak.n_bytes - LIMIT) / MiB:,.0f} MiB; {line}")


def test_close_gives_the_memory_back_and_bench_runs_do_not_pile_up(mid_path: Path) -> None:  # noqa: F811
    """Each bench run closes its engine: NVML's bytes after a run are back where they were
    before it (what stays is what a process loads once: kernels of the model's shapes, within
    the margin the budget keeps for them), however many runs."""
    from engine.backend.cuda import CudaBackend
    from engine.kernels.warmup import warm_up
    from engine.tools.bench import Config, run_once

    memory = settle()
    CudaBackend(0, warm_up=warm_up).close()  # the context, cuBLAS, the shape-free kernels
    before = memory.read().n_bytes
    cfg = Config("loan on", options(mid_path, ctx=4096), LOAN)
    after = []
    for _ in range(3):
        s = run_once(cfg, 1500, 16)
        assert s.peak_source == PROCESS and s.limit_mib == 4096 and not s.over_limit, s
        after.append(memory.read().n_bytes)
    memory.close()
    assert after[0] - before <= GROWTH_MARGIN_BYTES, (before, after)
    assert max(after) - min(after) <= 32 * MiB, after  # nothing piles up run after run


def test_strata_run_prints_the_peak(mid_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    from tests.test_cli import run

    settle().close()
    code, _, err = run(capsys, "run", "--model", str(mid_path), "--device", "cuda",
                       "--vram-limit", "4GiB", "--vram-segment-mib", "64", "--kv", "q4_0",
                       "--prompt", "Tell me about rivers.", "--max-new", "16")
    assert code == 0, err
    line = next(ln for ln in err.splitlines() if ln.startswith("strata run: GPU peak "))
    assert line.endswith("(NVML, this process) of --vram-limit 4,096 MiB"), line
    assert "strata serve: vram limit 4,096.0 MiB = ledger" in err
