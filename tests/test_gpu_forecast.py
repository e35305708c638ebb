"""The loan forecast on CUDA (gpu marker): the rates are the GPU's own, the phase clock's CUDA
events measure every part, the verdict plans what the request runs, and the forecast learns
(the second request of a geometry is forecast closer than the defaults did)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_gpu_engine import LOAN, mid_path  # noqa: F401 - the fixture, and skips without a GPU

from engine.config import EngineOptions, LoanFlags
from engine.runtime.serve import ServeLoop
from engine.tools.bench import prompt_tokens
from engine.trace.events import EventBus, PlanChosen

pytestmark = pytest.mark.gpu


def test_the_forecast_measures_and_learns_on_cuda(mid_path: Path, tmp_path: Path,  # noqa: F811
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))  # rates of this test's own
    bus = EventBus()
    plans: list[PlanChosen] = []
    bus.subscribe(lambda e: plans.append(e) if isinstance(e, PlanChosen) else None)
    opts = EngineOptions(model=str(mid_path), device="cuda", ctx=8192, vram_limit="4GiB",
                         vram_segment_mib=64, vram_elastic=True, serve=True, mtp=True, spec=2,
                         kv="q4_0")
    loop = ServeLoop.create(opts, LOAN, bus)
    assert loop.rates.device.startswith("cuda ") and loop.rates.observations == ()
    loop.complete(prompt_tokens(loop, 256, salt=99), max_new=2)  # startup loan; kernels compile
    errors = []
    for i, flags in enumerate((LoanFlags(), LOAN, LoanFlags(), LOAN)):
        assert not loop.set_flags(flags)
        reply = loop.complete(prompt_tokens(loop, 4096, salt=i), max_new=2)
        v, p, o = reply.verdict, plans[-1], loop.learner.last_observation
        assert v is not None and o is not None
        w = v.chosen.workload
        assert (w.kind is not None, w.chunk_tokens, w.ring_slots) == (p.loan, p.chunk_tokens,
                                                                      p.ring_slots)
        assert o.seconds["attention"] > 0 and o.seconds["moe"] > 0  # CUDA events, every part
        assert sum(o.seconds.values()) == pytest.approx(o.prefill_s)
        errors.append(abs(v.chosen.total_s / reply.timing.prefill_s - 1))
        loop.rt.check_integrity()
    # the last two repeat the geometries of the two before them: their rates were learned
    assert max(errors[2:]) < 0.3, errors
