"""The whole-process device budget (engine/memory/budget.py) and the NVML peak sampler
(engine/backend/process_memory.py) without a GPU: the arithmetic, and the sampler's thread over a
reader the test drives."""

from __future__ import annotations

import threading

import pytest

from engine.backend.process_memory import DEVICE, PROCESS, MemoryReading, PeakSampler, ProcessMemory
from engine.errors import DeviceError
from engine.memory.budget import ProcessBudget, plan_budget
from engine.memory.sizes import GiB, MiB

G = 2 * MiB  # the H200's mapping granularity


def test_the_limit_is_outside_plus_margin_plus_workspace_plus_ledger() -> None:
    """8 GiB asked, 600 MiB measured outside (context, cuBLAS, kernels), 256 MiB margin."""
    b = plan_budget(8 * GiB, free_bytes=130 * GiB, outside_bytes=600 * MiB, granularity_bytes=G,
                    margin_bytes=256 * MiB)
    assert b.limit_bytes == 8 * GiB and b.outside_bytes == 600 * MiB
    assert b.inside_bytes == 8 * GiB - 600 * MiB - 256 * MiB
    assert b.workspace_bytes == b.inside_bytes // 8  # an eighth: 917 MiB > the 768 MiB floor
    assert b.capacity_bytes % G == 0
    parts = b.outside_bytes + b.margin_bytes + b.workspace_bytes + b.capacity_bytes
    assert 0 <= b.limit_bytes - parts < G  # only the rounding to whole granules is left over
    assert "vram limit 8,192.0 MiB = ledger" in b.line() and "outside the ledger 600.0" in b.line()


def test_a_small_limit_keeps_the_workspace_floor_at_half() -> None:
    b = plan_budget(2 * GiB, free_bytes=100 * GiB, outside_bytes=700 * MiB, granularity_bytes=G,
                    margin_bytes=256 * MiB)
    assert b.inside_bytes == 2048 * MiB - 956 * MiB
    assert b.workspace_bytes == b.inside_bytes // 2  # the 768 MiB floor would take it all
    assert b.capacity_bytes == (b.inside_bytes - b.workspace_bytes) // G * G


def test_without_a_limit_the_process_gets_what_is_free_less_the_device_margin() -> None:
    b = plan_budget(None, free_bytes=20 * GiB, outside_bytes=600 * MiB, granularity_bytes=G,
                    margin_bytes=256 * MiB, device_margin_bytes=512 * MiB)
    assert b.limit_bytes == 600 * MiB + 20 * GiB - 512 * MiB
    assert b.inside_bytes == 20 * GiB - 512 * MiB - 256 * MiB


def test_a_limit_above_what_is_free_plans_only_what_can_be_had() -> None:
    b = plan_budget(64 * GiB, free_bytes=10 * GiB, outside_bytes=600 * MiB, granularity_bytes=G,
                    margin_bytes=256 * MiB, device_margin_bytes=512 * MiB)
    assert b.limit_bytes == 64 * GiB  # the bar's total stays what was asked
    assert b.inside_bytes == 10 * GiB - 512 * MiB - 256 * MiB


def test_a_limit_the_outside_fills_is_one_line_naming_what_holds_it() -> None:
    with pytest.raises(DeviceError) as e:
        plan_budget(768 * MiB, free_bytes=100 * GiB, outside_bytes=600 * MiB,
                    granularity_bytes=G, margin_bytes=256 * MiB)
    msg = str(e.value)
    assert "--vram-limit 768.0 MiB leaves nothing to plan" in msg and "600.0 MiB outside" in msg
    assert "raise --vram-limit" in msg and "\n" not in msg
    with pytest.raises(DeviceError, match="MiB free on the device"):
        plan_budget(None, free_bytes=600 * MiB, outside_bytes=600 * MiB, granularity_bytes=G,
                    margin_bytes=256 * MiB, device_margin_bytes=512 * MiB)
    with pytest.raises(DeviceError, match="no 2.0 MiB granule is left for the ledger"):
        plan_budget(1000 * MiB, free_bytes=100 * GiB, outside_bytes=600 * MiB,
                    granularity_bytes=G, margin_bytes=398 * MiB)


def test_the_pool_takes_what_the_ledger_leaves_and_gives_up_outside_growth() -> None:
    b = ProcessBudget(limit_bytes=8 * GiB, outside_bytes=600 * MiB, margin_bytes=256 * MiB,
                      inside_bytes=8 * GiB - 856 * MiB, workspace_bytes=900 * MiB,
                      capacity_bytes=6000 * MiB)
    assert b.pool_limit_bytes(0, 600 * MiB) == b.inside_bytes
    assert b.pool_limit_bytes(6000 * MiB, 600 * MiB) == b.inside_bytes - 6000 * MiB
    # 200 MiB more outside (kernels, graphs): the pool's limit is 200 MiB lower, so the
    # process still ends at the limit less the margin
    pool = b.pool_limit_bytes(6000 * MiB, 800 * MiB)
    assert pool == b.inside_bytes - 6000 * MiB - 200 * MiB
    assert 6000 * MiB + pool + 800 * MiB + b.margin_bytes == b.limit_bytes
    assert b.pool_limit_bytes(6000 * MiB, 500 * MiB) == b.inside_bytes - 6000 * MiB  # never more
    assert b.pool_limit_bytes(8 * GiB, 600 * MiB) == 1  # nothing left: 1 byte, never 0 (no limit)


def test_process_memory_falls_back_to_the_device_less_its_baseline() -> None:
    device_used = [5 * GiB]
    per_process: list[int | None] = [None]
    m = ProcessMemory(lambda: per_process[0], lambda: device_used[0], baseline_bytes=4 * GiB)
    assert m.read() == MemoryReading(1 * GiB, DEVICE)  # the container hides pids
    per_process[0] = 700 * MiB
    assert m.read() == MemoryReading(700 * MiB, PROCESS)  # NVML's own count when it has one
    per_process[0], device_used[0] = None, 3 * GiB
    assert m.read().n_bytes == 0  # others freed memory: never negative


def test_the_peak_sampler_keeps_the_highest_reading_of_its_thread() -> None:
    """A reader that climbs to 900 MiB and back while the sampler polls: the peak is 900."""
    values = iter([100, 300, 900, 400, 200] + [150] * 10_000)
    read_twice = threading.Event()
    calls = [0]

    def read() -> MemoryReading:
        calls[0] += 1
        if calls[0] >= 6:
            read_twice.set()
        return MemoryReading(next(values) * MiB, PROCESS)

    with PeakSampler(read, interval_s=0.001) as sampler:
        assert read_twice.wait(5), "the sampler's thread never polled"
    assert sampler.peak == MemoryReading(900 * MiB, PROCESS)
    n = calls[0]
    assert sampler.stop() == sampler.peak and calls[0] == n  # stopping twice reads nothing more


def test_without_nvml_there_is_no_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from engine.devices import peak_sampler

    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert ProcessMemory.open(0) is None and PeakSampler.open(0) is None
    assert peak_sampler("sim") is None and peak_sampler("cuda:0") is None
