"""What an engine keeps from its requests for the next ones (and the next engine on this model
and machine), as subscribers of a request's end (`ServeLoop.on_done`): the loan forecast's
rates (`ForecastLearner`) and the drafting policy (`PolicyKeeper`), each loaded at start and
saved beside the expert profile; a file that cannot be written is said once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from engine.loan.forecast import (
    Observation,
    Rates,
    RatesError,
    load_rates,
    measured_parts,
    rates_path,
    save_rates,
)
from engine.runtime.parts import Runtime
from engine.runtime.stages import FAILED, Finished
from engine.runtime.workload import request_workload
from engine.speculative import policy as draft_policy
from engine.synth.demo import cache_dir


class ForecastLearner:
    """The forecast's rates on this device: from the rates file (the defaults where there is
    none or it is damaged), then learned from each prefill that ran to its end."""

    def __init__(self, rt: Runtime, odds: np.ndarray, device: str):
        self.rt, self.odds, self.device = rt, odds, device  # odds: routing odds, fill order
        self.rates_file = rates_path(rt.model.path, rt.options.expert_profile, cache_dir())
        try:
            self.rates = load_rates(self.rates_file, device)
        except RatesError as e:
            rt.report.warn(f"strata: warning: {e}; the forecast starts from its defaults")
            self.rates = Rates.fresh(device)
        self.last_observation: Observation | None = None  # what the last prefill measured
        self.prefills = 0  # whole prefills seen
        self._saved = True  # False once a save failed (said once)

    def on_done(self, finished: Finished) -> None:
        """After a request whose prefill ran to its end: compare the prefill with its forecast
        (a trace line, `timing.forecast_s`) and keep what it measured for the next forecasts;
        but not the engine's first prefill, which pays what an engine does once (CUDA compiles
        its kernels, the CPU decodes its resident experts)."""
        req, verdict = finished.request, finished.verdict
        if not req.prefilled:
            return
        rt, timing = self.rt, req.timing
        forecast = verdict.with_loan if req.loan is not None else verdict.without_loan
        if forecast is not None and forecast.workload.kind == req.loan:
            timing.forecast_s = forecast.total_s
            error = 100 * (forecast.total_s / timing.prefill_s - 1) if timing.prefill_s else 0.0
            rt.report.trace(f"strata forecast: prefill {forecast.total_s:.2f} s forecast "
                            f"({verdict.line()}), {timing.prefill_s:.2f} s measured "
                            f"({error:+.0f}%)")
        self.prefills += 1
        self.last_observation = None
        if self.prefills == 1:  # it pays what an engine does once: not a rate
            return
        w = request_workload(rt, req.loan, len(req.fresh), req.reused, self.odds,
                             geometry=req.geometry)
        expected = w.streamed_bytes
        w = replace(w, streamed_bytes=float(timing.bytes_streamed))
        s = req.seconds
        self.last_observation = obs = measured_parts(
            w, timing.prefill_s, s, s.get("release", 0.0), s.get("restore", 0.0), expected)
        self.rates = self.rates.observe(obs)
        try:
            save_rates(self.rates_file, self.rates)
        except OSError as e:
            if self._saved:  # once: the forecast still learns in this process
                rt.report.warn(f"strata: warning: cannot save the prefill rates to "
                               f"{self.rates_file} ({e.strerror}); they last this run only")
            self._saved = False


class PolicyKeeper:
    """The drafting policy across engines: the last engine's on this model and machine at
    start (beside the rates file), saved after each request that decoded and measured it."""

    def __init__(self, rt: Runtime, rates_file: Path, device: str):
        self.rt, self.device = rt, device
        self.policy_file = draft_policy.policy_path(rates_file)
        self._saved = True  # False once a save failed (said once)
        if rt.spec is not None:
            prior = draft_policy.load(self.policy_file, device)
            if prior is not None:
                rt.spec.policy = prior

    def on_done(self, finished: Finished) -> None:
        """Save the policy after a request that was not a failure, where it measures (not
        `--spec-always`)."""
        spec = self.rt.spec
        if spec is None or spec.policy.always or finished.outcome == FAILED:
            return
        try:
            draft_policy.save(self.policy_file, self.device, spec.policy)
        except OSError as e:
            if self._saved:
                self.rt.report.warn(f"strata: warning: cannot save the drafting policy to "
                                    f"{self.policy_file} ({e.strerror})")
            self._saved = False
