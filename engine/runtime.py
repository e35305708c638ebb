"""Runtime: one loaded model on one device, with its memory, KV and decode resources.

The serve loop drives it; it owns no conversation logic.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.config import EngineOptions, LoanFlags
from engine.events import EventBus, Loading, Ready
from engine.model.loader import Model, load_model
from engine.sampler import Sampler
from engine.session import Session, Timing
from engine.synth.demo import resolve_model


@dataclass(frozen=True)
class Geometry:
    """The prompt plan of one request."""

    chunk_tokens: int
    ring_slots: int
    loan: bool

    def line(self) -> str:
        return (
            f"strata serve: prompt plan {self.chunk_tokens:,} / {self.ring_slots} "
            f"(chunk tokens / ring slots), loan {'on' if self.loan else 'off'}"
        )


@dataclass(frozen=True)
class Checkpoint:
    n_tokens: int


class Runtime:
    """Model + session + the options and flags in force."""

    def __init__(self, options: EngineOptions, flags: LoanFlags, bus: EventBus, model: Model):
        self.options, self.flags, self.bus, self.model = options, flags, bus, model
        self.session = Session(model, n_ctx=options.ctx, kv_kind=options.kv)

    @classmethod
    def create(cls, options: EngineOptions, flags: LoanFlags, bus: EventBus) -> Runtime:
        model_path = resolve_model(
            options.model, progress=lambda d, t: bus.publish(Loading("building model", d, t))
        )
        bus.publish(Loading("loading model", 0, 1))
        model = load_model(model_path)
        bus.publish(Loading("loading model", 1, 1))
        rt = cls(options, flags, bus, model)
        bus.publish(Ready(summary=f"{model_path.name}", device="cpu"))
        return rt

    def validate(self, options: EngineOptions, flags: LoanFlags) -> list[str]:
        from engine.guards import validate

        return validate(options, flags, device="sim", has_mtp=self.model.has_mtp,
                        has_native_head=self.model.hp.has_output)

    def apply(self, options: EngineOptions, flags: LoanFlags) -> None:
        self.options, self.flags = options, flags

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(len(self.session.tokens))

    def rollback(self, cp: Checkpoint) -> None:
        self.session.truncate(min(cp.n_tokens, len(self.session.tokens)))

    def prompt_geometry(self, n_fresh: int) -> Geometry:
        chunk = self.options.prefill if isinstance(self.options.prefill, int) else 512
        return Geometry(chunk, 0, False)

    def prefill(self, fresh: list[int], g: Geometry, on_chunk: Any) -> np.ndarray:
        return self.session.prefill(fresh, g.chunk_tokens, on_chunk)

    def decode(
        self,
        logits: Any,
        sampler: Sampler,
        max_new: int,
        stop_ids: frozenset[int],
        timing: Timing,
        cancel: threading.Event,
    ) -> Iterator[int]:
        for i in range(max_new):
            tok = sampler.sample(np.asarray(logits[-1]))
            timing.generated += 1
            yield tok
            if tok in stop_ids or cancel.is_set() or len(self.session.tokens) >= self.session.n_ctx:
                return
            logits = self.session.forward([tok]).logits
