"""`Runtime.close`: every byte an engine holds on its device goes back, for every configuration
`strata bench` runs (the simulated device here; tests/test_gpu_vram_limit.py checks NVML on
CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineOptions
from engine.runtime.serve import ServeLoop
from engine.tools.bench import LOAN_ON, SCENARIOS, SIMULATED, run_once, scenario
from engine.trace.events import EventBus, LedgerChanged


def test_close_empties_the_ledger_and_the_device_and_is_idempotent(tiny_path: Path) -> None:
    opts = EngineOptions(model=str(tiny_path), ctx=1024, serve=True, vram_elastic=True,
                         mtp=True, spec=2, prefill=128)
    loop = ServeLoop.create(opts, LOAN_ON)
    with loop.rt as rt:  # the runtime is a context manager whose exit closes it
        loop.complete(rt.model.tokenizer.encode("the river runs " * 30), max_new=4)
        assert rt.ledger.snapshot().regions and rt.backend.mem_info().process_bytes
    assert rt.closed and rt.ledger.snapshot().regions == ()
    assert rt.ledger.free_bytes == rt.ledger.capacity_bytes
    info = rt.backend.mem_info()
    assert info.process_bytes == 0 and info.free_bytes == info.total_bytes  # the device is empty
    loop.close()  # again: nothing to do
    assert not hasattr(rt, "session") and not hasattr(rt, "model")  # its parts are gone


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_bench_configuration_closes_its_engine(tiny_path: Path, name: str) -> None:
    """Each run of `strata bench` ends with its engine closed: the ledger's last snapshot has
    no region, nothing outside it, and the simulated device is free; the peak is the device's
    own high-water mark."""
    # the CLI's base; a device that holds the chunk sweep's 2,048-token chunk
    base = EngineOptions(model=str(tiny_path), ctx=1024, device="sim:64MiB")
    _, configs = scenario(name, base, 300)
    for cfg in configs:
        bus = EventBus()
        ledgers: list[LedgerChanged] = []
        bus.subscribe(lambda e, seen=ledgers: seen.append(e) if isinstance(e, LedgerChanged) else None)
        s = run_once(cfg, 300, 2, bus=bus)
        first, last = ledgers[0], ledgers[-1]
        assert last.regions == () and last.free_bytes == last.capacity_bytes, cfg.label
        assert last.unaccounted_bytes == 0, cfg.label  # nothing held outside the ledger either
        assert s.peak_source == SIMULATED and s.limit_mib == 0 and not s.over_limit
        mapped_mib = max(sum(r.mapped_bytes for r in e.regions) for e in ledgers) / (1 << 20)
        assert s.peak_mib == pytest.approx(mapped_mib), cfg.label  # the ledger is all it held
        assert s.peak_mib <= first.limit_bytes / (1 << 20)
