"""Test helpers that drive the runtime below the serve loop: one prefill as a request."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.request.record import Request
from engine.runtime.parts import Runtime


class QuietProgress:
    """A request's progress going nowhere (a test that prefills without a serve loop)."""

    def planned(self, request: Request) -> None:
        pass

    def chunk(self, request: Request, index: int, seconds: float) -> None:
        pass


def prefill_request(rt: Runtime, ids: list[int]) -> tuple[Any, Request]:
    """Prefill `ids` as a request (the reuse rule applied); returns the first token's logits
    [1, V] and the request record (its loan, geometry and chunk count)."""
    req = Request.start(0, list(ids), rt.session, rt.spec)
    return rt.prefill(req, QuietProgress()), req


def greedy_steps(loop: Any, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy steps after prefilling `ids` on a serve loop's runtime: the tokens and every
    step's logits [n, V]."""
    rt = loop.rt
    logits, _ = prefill_request(rt, ids)
    rows, toks = [], []
    row = host(logits)[-1]
    for _ in range(n):
        tok = int(np.argmax(row))
        toks.append(tok)
        row = host(rt.session.forward([tok]).logits)[-1]
        rows.append(row)
    return toks, np.stack(rows)


def host(a: Any) -> np.ndarray:
    """A device array's host copy."""
    return a.get() if hasattr(a, "get") else np.asarray(a)
