"""The whole engine on CUDA (gpu marker): parity with the simulated device, and a loan that
really frees and restores device memory (NVML)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_helpers import host, prefill_request

from engine.config import EngineOptions, LoanFlags
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop
from engine.synth.model import PRESETS, write_model
from engine.trace.events import EventBus, LoanStep

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
try:
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no driver
    HAVE_GPU = False
if not HAVE_GPU:
    pytest.skip("no CUDA device", allow_module_level=True)

LOAN = LoanFlags.make(elastic_loan=True, mtp_loan=True, head_loan=True,
                      retain_startup_chunk=True, repeat_loan=True, repeat_min_tokens=256)


@pytest.fixture(scope="module")
def mid_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-30B-A3B shapes, 2 blocks + MTP: big enough for 64 MiB segments to matter."""
    from dataclasses import replace

    spec = replace(PRESETS["qwen3-30b-a3b"], n_layer=2, n_ctx=8192)
    return write_model(tmp_path_factory.mktemp("gpu") / "mid.gguf", spec)


def first_logits(loop: ServeLoop, ids: list[int]) -> np.ndarray:
    logits, _ = prefill_request(loop.rt, ids)
    return host(logits)[-1]


def test_cuda_matches_the_simulated_device(demo_path: Path) -> None:
    sim = ServeLoop.create(EngineOptions(model=str(demo_path), device="sim", ctx=2048))
    gpu = ServeLoop.create(EngineOptions(model=str(demo_path), device="cuda", ctx=2048,
                                         vram_limit="2GiB", vram_segment_mib=2))
    ids = sim.rt.model.tokenizer.encode("the river runs through the old city " * 40)
    a, b = first_logits(sim, ids), first_logits(gpu, ids)
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    assert rel < 0.03, rel  # fp16 weights and tensor-core GEMMs against float32 numpy
    sim.rt.session.truncate(0)
    gpu.rt.session.truncate(0)
    ta = sim.complete(list(ids), max_new=16).text
    tb = gpu.complete(list(ids), max_new=16).text
    assert ta.split()[:4] == tb.split()[:4]
    gpu.rt.check_integrity()


def test_loan_frees_and_restores_device_memory(mid_path: Path) -> None:
    from engine.backend.telemetry import Telemetry

    tele = Telemetry.open(0)
    if tele is None:
        pytest.skip("NVML not available")
    bus = EventBus()
    used: dict[str, int] = {}

    def on_step(e: object) -> None:
        if isinstance(e, LoanStep) and e.step in ("release", "restore"):
            used[e.step] = tele.snapshot().used_bytes

    bus.subscribe(on_step)
    opts = EngineOptions(model=str(mid_path), device="cuda", ctx=4096, serve=True,
                         vram_elastic=True, mtp=True, spec=2, vram_limit="4GiB",
                         vram_segment_mib=64)
    loop = ServeLoop.create(opts, LOAN, bus)
    conv = Conversation()
    loop.chat(conv, "hello", max_new=2)  # the startup loan
    baseline = tele.snapshot().used_bytes
    freed = sum(r.n_bytes for r in loop.rt.resources.items)
    loop.chat(conv, "the river runs through the old city " * 120, max_new=2)  # a repeat loan
    assert baseline - used["release"] >= 0.8 * freed, (baseline, used, freed)
    assert abs(used["restore"] - baseline) <= 0.2 * freed
    loop.rt.check_integrity()
    assert loop.rt.cache.n_lent == 0 and loop.rt.resources.all_resident()


def test_prompt_temporaries_live_in_the_chunk_buffer(mid_path: Path) -> None:
    """With the loan, a long prompt's temporaries come from the lent chunk buffer (nothing
    spills to the workspace), the model file is pinned, and the answer matches a run whose
    chunk is the same size but whose temporaries may spill (a tiny chunk buffer)."""
    opts = EngineOptions(model=str(mid_path), device="cuda", ctx=4096, serve=True,
                         vram_elastic=True, mtp=True, spec=2, vram_limit="4GiB",
                         vram_segment_mib=64)
    loop = ServeLoop.create(opts, LOAN)
    data = loop.rt.model.mf.data
    assert loop.rt.backend._is_pinned(data.ctypes.data, data.nbytes)
    ids = loop.rt.model.tokenizer.encode("the river runs through the old city " * 300)[:3000]
    logits, _ = prefill_request(loop.rt, ids)
    stats = loop.rt.prompt.arena_stats
    assert stats is not None and stats.spilled_bytes == 0, stats
    assert 0 < stats.peak_bytes <= stats.n_bytes
    loop.rt.check_integrity()
    assert loop.rt.cache.n_lent == 0
    ref = ServeLoop.create(EngineOptions(model=str(mid_path), device="cuda", ctx=4096,
                                         vram_limit="4GiB", vram_segment_mib=64, prefill=256))
    b, _ = prefill_request(ref.rt, ids)
    a, b = host(logits)[-1], host(b)[-1]
    assert float(np.abs(a - b).max() / np.abs(b).max()) < 0.03
