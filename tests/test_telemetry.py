"""NVML telemetry: the no-NVML path everywhere, a real reading where a GPU is present."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from engine.backend.telemetry import GpuSnapshot, Sampler, Telemetry, format_snapshot, snapshot


def test_without_nvml_everything_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    assert Telemetry.open(0) is None
    assert snapshot(0) is None
    assert "not available" in format_snapshot(None)


def test_format_snapshot_names_every_reading() -> None:
    s = GpuSnapshot(
        index=0, name="NVIDIA H200", driver_version="580.1", memory_api="v2",
        total_bytes=143_771 << 20, used_bytes=1_024 << 20, free_bytes=142_747 << 20,
        reserved_bytes=512 << 20, process_bytes=600 << 20, pcie_gen=5, pcie_width=16,
        pcie_gen_max=5, pcie_width_max=16, gpu_util_pct=37, mem_util_pct=12,
        temperature_c=41, power_w=None, sm_clock_mhz=1980,
    )  # fmt: skip
    text = format_snapshot(s)
    for words in ("NVIDIA H200", "memory (v2)", "143,771 MiB", "reserved 512 MiB",
                  "this process 600 MiB", "gen 5 x16", "gpu 37%", "41 C", "n/a",
                  "sm 1980 MHz", "memory n/a"):  # fmt: skip
        assert words in text, (words, text)
    assert len(text.splitlines()) == 6
    powered = format_snapshot(GpuSnapshot(**{**s.__dict__, "power_w": 310.4,
                                             "power_limit_w": 700.0}))
    assert "310 W of 700 W" in powered


@pytest.mark.gpu
def test_snapshot_on_a_gpu() -> None:
    pytest.importorskip("pynvml")
    t = Telemetry.open(0)
    if t is None:
        pytest.skip("NVML finds no GPU")
    try:
        s = t.snapshot()
    finally:
        t.close()
    assert s.memory_api in ("v1", "v2")
    assert s.total_bytes > 0 and 0 <= s.used_bytes <= s.total_bytes
    assert s.free_bytes <= s.total_bytes
    assert s.name != "?"
    assert s.pcie_gen is None or s.pcie_gen >= 1
    assert s.sm_clock_mhz is None or s.sm_clock_mhz > 0
    assert s.power_limit_w is None or s.power_limit_w > 0


@pytest.mark.gpu
def test_sampler_reads_at_its_rate_on_its_own_thread_and_stops() -> None:
    pytest.importorskip("pynvml")
    t = Telemetry.open(0)
    if t is None:
        pytest.skip("NVML finds no GPU")
    readings: list[tuple[str, GpuSnapshot]] = []
    sampler = Sampler(t, 0.1, lambda s: readings.append((threading.current_thread().name, s)))
    try:
        sampler.start()
        time.sleep(0.75)
        sampler.stop()
        n = len(readings)
        time.sleep(0.3)
        assert len(readings) == n, "a reading after stop()"
    finally:
        sampler.stop()
        t.close()
    assert 4 <= n <= 8, n  # 0.1 s apart over 0.75 s
    assert {name for name, _ in readings} == {"gpu-telemetry"}
    assert all(s.total_bytes > 0 for _, s in readings)


@pytest.mark.gpu
def test_an_idle_cuda_engine_publishes_readings_from_its_telemetry_thread() -> None:
    """Between requests (nothing calls the reporter) the sampler keeps the GPU strip live;
    a closed engine publishes no more."""
    pytest.importorskip("pynvml")
    from engine.devices import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA device")
    from engine.config import EngineOptions, LoanFlags
    from engine.runtime.serve import ServeLoop
    from engine.trace.events import EventBus, GpuStats
    from engine.trace.report import GPU_SAMPLE_S

    bus = EventBus()
    got: list[tuple[str, GpuStats]] = []
    bus.subscribe(lambda e: got.append((threading.current_thread().name, e))
                  if isinstance(e, GpuStats) else None)
    loop = ServeLoop.create(EngineOptions(model="tiny", device="cuda"), LoanFlags(), bus)
    try:
        n = len(got)
        time.sleep(6 * GPU_SAMPLE_S + 0.2)
        idle = got[n:]
        assert 5 <= len(idle) <= 7, len(idle)
        assert {name for name, _ in idle} == {"gpu-telemetry"}
        assert all(e.ledger_bytes > 0 and e.limit_bytes for _, e in idle)
    finally:
        loop.close()
    n = len(got)
    time.sleep(2 * GPU_SAMPLE_S)
    assert len(got) == n, "a reading after close"
    assert "gpu-telemetry" not in {t.name for t in threading.enumerate()}
