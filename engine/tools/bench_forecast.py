"""`strata bench --forecast`: the loan forecast against measured prefills (engine.loan.forecast).

After one short warm-up request in an engine of its own (what a process does once: CUDA
kernels compile), each prompt size gets one engine: its first request takes the startup loan;
then a calibration pair (loan off, then a repeat loan) and `runs` measured pairs, every
request a new prompt of the same size with all its tokens fresh. Each forecast is made just
before its request from the rates measured by every earlier request (the engine's own
`verdict`), and every request is then kept for the next forecasts, as in normal use (but
the first prefill of each engine, engine.runtime.serve). Sizes run in the order given; the rates
carry over from one size's engine to the next (and start from the model's stored rates, or
from the defaults with `fresh_rates`).

The table shows, per size and configuration, the forecast and the measured prefill (median and
range of the measured runs) and the median absolute error; the calibration pair and the startup
request are shown apart ("first of its geometry"): their forecasts had no earlier request of
the same plan. A second table splits the last measured runs by part (forecast / measured).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.config import EngineOptions, LoanFlags
from engine.devices import cuda_index, hardware_name
from engine.loan.forecast import PARTS, Rates
from engine.runtime.serve import ServeLoop
from engine.tools.bench import LOAN_ON, WARMUP_NEW, prompt_tokens
from engine.trace.events import EventBus

LOAN_FLAGS = LOAN_ON.with_changes(repeat_min_tokens=256)  # every measured size takes the loan
CONFIGS = ("startup loan", "loan off", "repeat loan")


@dataclass
class Shot:
    """One request: its forecast and what it measured."""

    n_tokens: int
    config: str
    plan: str
    forecast_s: float
    measured_s: float
    first: bool  # the first request of its geometry (startup, or the calibration pair)
    forecast_mib: float
    measured_mib: float
    forecast_parts: dict[str, float] = field(default_factory=dict)
    measured_parts: dict[str, float] = field(default_factory=dict)

    @property
    def error(self) -> float:
        """Signed relative error of the forecast."""
        return self.forecast_s / self.measured_s - 1 if self.measured_s > 0 else 0.0


def _parts_measured(seconds: dict[str, float]) -> dict[str, float]:
    return {p: seconds.get(p, 0.0) for p in PARTS}


def _parts_forecast(seconds: dict[str, float]) -> dict[str, float]:
    out = {p: seconds.get(p, 0.0) for p in PARTS}
    out["moe"] += seconds.get("stream", 0.0)  # measured together
    return out


def run_size(base: EngineOptions, n_tokens: int, runs: int, max_new: int, rates: Rates | None,
             rates_file: Path | None = None,
             progress: Callable[[str], None] | None = None) -> tuple[list[Shot], Rates]:
    """One engine at `n_tokens`: the startup loan, the calibration pair, `runs` pairs.
    `rates`: the rates to start from (None: the model's stored ones), saved to `rates_file`
    (None: the model's). Returns the shots and the rates after them."""
    options = size_options(base, n_tokens, max_new)
    loop = ServeLoop.create(options, LOAN_FLAGS, EventBus())
    try:
        return _run_shots(loop, options, n_tokens, runs, max_new, rates, rates_file, progress)
    finally:
        loop.close()  # every device byte back before the next size's engine plans


def _run_shots(loop: ServeLoop, options: EngineOptions, n_tokens: int, runs: int, max_new: int,
               rates: Rates | None, rates_file: Path | None,
               progress: Callable[[str], None] | None) -> tuple[list[Shot], Rates]:
    if rates is not None:
        loop.rates = rates
    if rates_file is not None:
        loop.learner.rates_file = rates_file
    shots: list[Shot] = []
    schedule = [("startup loan", LOAN_FLAGS, True)]
    schedule += [(c, f, i == 0) for i in range(runs + 1)
                 for c, f in (("loan off", LoanFlags()), ("repeat loan", LOAN_FLAGS))]
    for i, (config, flags, first) in enumerate(schedule):
        if loop.set_flags(flags, options):
            raise AssertionError(f"the bench's own flags were refused: {flags}")
        t0 = time.perf_counter()
        reply = loop.complete(prompt_tokens(loop, n_tokens, salt=1000 * n_tokens + i),
                              max_new=max_new)
        loop.rt.check_integrity()
        assert reply.verdict is not None
        forecast, t = reply.verdict.chosen, reply.timing
        w = forecast.workload
        obs = loop.learner.last_observation  # None where it was not kept (an engine's first prefill)
        shots.append(Shot(
            n_tokens, config, f"{w.chunk_tokens:,} / {w.ring_slots}", forecast.total_s,
            t.prefill_s, first, w.streamed_bytes / (1 << 20), t.bytes_streamed / (1 << 20),
            _parts_forecast(dict(forecast.seconds)),
            _parts_measured(dict(obs.seconds)) if obs is not None else {},
        ))  # fmt: skip
        if progress:
            progress(f"{n_tokens:,} {config}: forecast {forecast.total_s:.2f} s, measured "
                     f"{t.prefill_s:.2f} s ({100 * shots[-1].error:+.0f}%), "
                     f"{time.perf_counter() - t0:.1f} s")
    return shots, loop.rates


def size_options(base: EngineOptions, n_tokens: int, max_new: int) -> EngineOptions:
    """The engine of one size: loan-ready, the automatic planner, a context that fits."""
    return replace(base, serve=True, vram_elastic=True, mtp=True, spec=base.spec or 4,
                   prefill="auto", ctx=max(base.ctx, n_tokens + max_new + 128))


def run_forecast_bench(base: EngineOptions, sizes: Sequence[int], runs: int, max_new: int,
                       fresh_rates: bool = False, warmup: bool = True,
                       progress: Callable[[str], None] | None = None) -> list[Shot]:
    """Every size in order (see the module docstring); returns every request's shot.
    `fresh_rates`: start from the device's defaults (and keep the model's stored rates out of
    it: the bench's are saved to a temporary file). `warmup`: first one short request in an
    engine of its own, so no measured request pays what a process does once (CUDA kernels
    compile, the model file comes into the page cache)."""
    shots: list[Shot] = []
    rates = Rates.fresh(_device_name(base.device)) if fresh_rates else None
    with tempfile.TemporaryDirectory(prefix="strata-rates-") as tmp:
        rates_file = Path(tmp) / "bench.rates.json" if fresh_rates else None
        if warmup:
            t0 = time.perf_counter()
            loop = ServeLoop.create(size_options(base, sizes[0], WARMUP_NEW), LoanFlags(),
                                    EventBus())
            try:
                loop.learner.rates_file = rates_file or loop.learner.rates_file
                loop.complete(prompt_tokens(loop, min(sizes[0], 256), salt=7),
                              max_new=WARMUP_NEW)
            finally:
                loop.close()
            if progress:
                progress(f"warm-up: {time.perf_counter() - t0:.1f} s")
        for n in sizes:
            size_shots, rates = run_size(base, n, runs, max_new, rates, rates_file, progress)
            shots += size_shots
    return shots


def _device_name(device: str) -> str:
    """The name the rates of `device` ('auto', 'sim...', 'cuda[:N]') are kept under."""
    return hardware_name(cuda_index(device))


def _median_range(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def markdown(shots: list[Shot], title: str) -> str:
    """The forecast table, the median errors, and the parts of the last measured runs."""
    lines = [
        f"### {title}", "",
        ("| Prompt | Configuration | Prompt plan | Forecast (s) | Measured (s) | Median abs. error "
        "| First of its geometry: error | Streamed MiB (forecast / measured) |"),
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    keys = list(dict.fromkeys((s.n_tokens, s.config) for s in shots))
    for n, config in keys:
        mine = [s for s in shots if (s.n_tokens, s.config) == (n, config)]
        measured = [s for s in mine if not s.first] or mine
        first = [s for s in mine if s.first]
        plans = " / ".join(sorted({s.plan for s in mine}))
        err = statistics.median(abs(s.error) for s in measured)
        first_err = f"{100 * first[0].error:+.0f}%" if first else "-"
        lines.append(
            f"| {n:,} | {config} | {plans} | "
            f"{_median_range([s.forecast_s for s in measured], '{:.2f}')} | "
            f"{_median_range([s.measured_s for s in measured], '{:.2f}')} | {100 * err:.1f}% | "
            f"{first_err} | {statistics.median(s.forecast_mib for s in measured):,.0f} / "
            f"{statistics.median(s.measured_mib for s in measured):,.0f} |"
        )
    measured = [s for s in shots if not s.first]
    first = [s for s in shots if s.first]
    summary = []
    if measured:
        summary.append(f"Median absolute error of the measured runs: "
                       f"{100 * statistics.median(abs(s.error) for s in measured):.1f}% "
                       f"({len(measured)} requests)")
    if first:
        summary.append(f"of the first request of each geometry: "
                       f"{100 * statistics.median(abs(s.error) for s in first):.1f}% "
                       f"({len(first)} requests)")
    lines += ["", "; ".join(summary) + "."]
    lines += ["", ("Parts of the last run of each row, forecast / measured (s; MoE includes its "
              "expert streaming):"), "",
              "| Prompt | Configuration | " + " | ".join(PARTS) + " |",
              "|---:|---|" + "---:|" * len(PARTS)]
    for n, config in keys:
        mine = [s for s in shots if (s.n_tokens, s.config) == (n, config) and s.measured_parts]
        if not mine:  # an engine's first prefill: not kept
            continue
        s = mine[-1]
        cells = " | ".join(f"{s.forecast_parts[p]:.3f} / {s.measured_parts[p]:.3f}" for p in PARTS)
        lines.append(f"| {n:,} | {config} | {cells} |")
    return "\n".join(lines)


def as_json(shots: list[Shot]) -> str:
    return json.dumps([asdict(s) for s in shots], indent=1)
