"""GPU telemetry through NVML (`pynvml`, from the nvidia-ml-py package): memory, PCIe, load.

`Telemetry.open(index)` returns None where NVML cannot be used (no package, no driver, no such
device), so callers on CPU-only machines need no special case. `Sampler` reads a GPU on its own
thread at a fixed rate (the app's GPU strip plots those readings; no UI thread waits on NVML). Memory comes from
`nvmlDeviceGetMemoryInfo_v2` where the driver has it (its `used` excludes memory the driver
reserves, which v2 reports apart), else from v1; `memory_api` says which. Fields a device or
driver does not report (power on some boards, per-process memory inside some containers) are
None rather than errors.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.memory.sizes import MiB


@dataclass(frozen=True)
class GpuSnapshot:
    """One reading of one GPU."""

    index: int
    name: str
    driver_version: str
    memory_api: str  # "v2" or "v1"
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int | None  # driver-reserved (v2 only)
    process_bytes: int | None  # this process's device memory, where NVML reports it
    pcie_gen: int | None
    pcie_width: int | None
    pcie_gen_max: int | None
    pcie_width_max: int | None
    gpu_util_pct: int | None
    mem_util_pct: int | None
    temperature_c: int | None
    power_w: float | None
    # defaults: a reading decoded from a server that predates these fields
    power_limit_w: float | None = None  # the enforced board power limit
    sm_clock_mhz: int | None = None  # current clocks
    mem_clock_mhz: int | None = None


def _nvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class Telemetry:
    """An open NVML handle on one GPU; `snapshot()` reads it (thread-safe)."""

    _lock = threading.Lock()  # nvmlInit/nvmlShutdown are reference-counted by NVML

    def __init__(self, nvml: Any, index: int):
        self._nvml = nvml
        self.index = index
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self._closed = False

    @classmethod
    def open(cls, index: int = 0) -> Telemetry | None:
        """NVML telemetry of GPU `index`, or None where NVML or the GPU is unavailable."""
        nvml = _nvml()
        if nvml is None:
            return None
        with cls._lock:
            try:
                nvml.nvmlInit()
            except nvml.NVMLError:
                return None
            try:
                telemetry = cls(nvml, index)
            except nvml.NVMLError:
                nvml.nvmlShutdown()
                return None
        return telemetry

    def close(self) -> None:
        """Release this handle's share of NVML."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._nvml.nvmlShutdown()

    def _maybe(self, fn: str, *args: Any) -> Any:
        """NVML call `fn(handle, *args)`, or None where this device or driver lacks it."""
        try:
            return getattr(self._nvml, fn)(self._handle, *args)
        except (self._nvml.NVMLError, AttributeError):
            return None

    def memory(self) -> tuple[str, int, int, int, int | None]:
        """(api, total, used, free, reserved) bytes."""
        nvml = self._nvml
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is not None:
            info = self._maybe("nvmlDeviceGetMemoryInfo", version)
            if info is not None:
                return "v2", info.total, info.used, info.free, info.reserved
        info = nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return "v1", info.total, info.used, info.free, None

    def process_used_bytes(self, pid: int | None = None) -> int | None:
        """Device memory NVML attributes to process `pid` (this one by default), or None."""
        pid = os.getpid() if pid is None else pid
        procs = self._maybe("nvmlDeviceGetComputeRunningProcesses") or []
        for p in procs:
            if p.pid == pid:
                used = p.usedGpuMemory
                return None if used is None else int(used)
        return None

    def snapshot(self) -> GpuSnapshot:
        """Read everything once."""
        api, total, used, free, reserved = self.memory()
        name = self._maybe("nvmlDeviceGetName")
        driver = _text(_call(self._nvml, "nvmlSystemGetDriverVersion"))
        util = self._maybe("nvmlDeviceGetUtilizationRates")
        power_mw = self._maybe("nvmlDeviceGetPowerUsage")
        limit_mw = self._maybe("nvmlDeviceGetEnforcedPowerLimit")
        return GpuSnapshot(
            index=self.index,
            name=_text(name),
            driver_version=driver,
            memory_api=api,
            total_bytes=int(total),
            used_bytes=int(used),
            free_bytes=int(free),
            reserved_bytes=None if reserved is None else int(reserved),
            process_bytes=self.process_used_bytes(),
            pcie_gen=self._maybe("nvmlDeviceGetCurrPcieLinkGeneration"),
            pcie_width=self._maybe("nvmlDeviceGetCurrPcieLinkWidth"),
            pcie_gen_max=self._maybe("nvmlDeviceGetMaxPcieLinkGeneration"),
            pcie_width_max=self._maybe("nvmlDeviceGetMaxPcieLinkWidth"),
            gpu_util_pct=None if util is None else int(util.gpu),
            mem_util_pct=None if util is None else int(util.memory),
            temperature_c=self._maybe("nvmlDeviceGetTemperature", self._nvml.NVML_TEMPERATURE_GPU),
            power_w=None if power_mw is None else power_mw / 1000.0,
            power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
            sm_clock_mhz=self._maybe("nvmlDeviceGetClockInfo", self._nvml.NVML_CLOCK_SM),
            mem_clock_mhz=self._maybe("nvmlDeviceGetClockInfo", self._nvml.NVML_CLOCK_MEM),
        )


class Sampler:
    """Reads `telemetry` every `period_s` on a daemon thread and hands each reading to
    `on_reading` (from that thread). `stop()` ends the thread before it returns, so the handle
    can be closed after it. A reading NVML refuses (the GPU lost) ends the sampling: the
    engine's own next device call says what happened."""

    def __init__(self, telemetry: Telemetry, period_s: float,
                 on_reading: Callable[[GpuSnapshot], None]) -> None:
        assert period_s > 0, period_s
        self._telemetry, self.period_s, self._on_reading = telemetry, period_s, on_reading
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        nvml_error = self._telemetry._nvml.NVMLError
        while not self._stop.wait(self.period_s):
            try:
                reading = self._telemetry.snapshot()
            except nvml_error:
                return
            self._on_reading(reading)


def _call(nvml: Any, fn: str) -> Any:
    try:
        return getattr(nvml, fn)()
    except (nvml.NVMLError, AttributeError):
        return None


def _text(value: Any) -> str:
    if value is None:
        return "?"
    return value.decode() if isinstance(value, bytes) else str(value)


def snapshot(index: int = 0) -> GpuSnapshot | None:
    """One reading of GPU `index`, or None without NVML."""
    telemetry = Telemetry.open(index)
    if telemetry is None:
        return None
    try:
        return telemetry.snapshot()
    finally:
        telemetry.close()


def format_snapshot(s: GpuSnapshot | None) -> str:
    """A few lines for people: memory, link and load."""
    if s is None:
        return "nvml: not available (no nvidia-ml-py package, driver or GPU)"

    def opt(v: Any, unit: str = "") -> str:
        return "n/a" if v is None else f"{v}{unit}"

    proc = "n/a" if s.process_bytes is None else f"{s.process_bytes / MiB:,.0f} MiB"
    reserved = "" if s.reserved_bytes is None else f", reserved {s.reserved_bytes / MiB:,.0f} MiB"
    power = "n/a" if s.power_w is None else f"{s.power_w:.0f} W"
    if s.power_limit_w is not None:
        power += f" of {s.power_limit_w:.0f} W"
    return "\n".join(
        [
            f"gpu {s.index}        {s.name} (driver {s.driver_version})",
            (
                f"memory ({s.memory_api})  total {s.total_bytes / MiB:,.0f} MiB, used "
                f"{s.used_bytes / MiB:,.0f} MiB, free {s.free_bytes / MiB:,.0f} MiB{reserved}"
            ),
            f"this process {proc}",
            (
                f"pcie         gen {opt(s.pcie_gen)} x{opt(s.pcie_width)} "
                f"(max gen {opt(s.pcie_gen_max)} x{opt(s.pcie_width_max)})"
            ),
            (
                f"load         gpu {opt(s.gpu_util_pct, '%')}, memory {opt(s.mem_util_pct, '%')}, "
                f"{opt(s.temperature_c, ' C')}, {power}"
            ),
            f"clocks       sm {opt(s.sm_clock_mhz, ' MHz')}, memory {opt(s.mem_clock_mhz, ' MHz')}",
        ]
    )
