"""Mixture-of-experts FFN: softmax router, top-k renormalised, SwiGLU experts (the backend's `moe`).

Expert weights come from an `ExpertProvider` (engine/backend/base.py), so the same code runs
with experts read straight from the GGUF file, from expert-cache slots, or streamed through
the staging ring.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.backend.base import Backend, ExpertProvider
from engine.config import DECODE_ROWS
from engine.gguf.hparams import HParams


def moe_block(
    be: Backend, hp: HParams, norm: Any, router: Any, x: Any, layer: int, experts: ExpertProvider
) -> tuple[Any, Any, Any]:
    """x: [T, d] -> ([T, d] FFN output, ids [T, k] routing used, margin [T]).

    The host reads the routing once: a decode step's ids themselves (the decode kernels build
    their job tables from them), a prompt chunk's rows per expert; never where the provider
    names a `source` (a captured step: the kernels build their job rows on the device)."""
    h = be.rms_norm(x, norm, hp.rms_eps)  # [T, d]
    ids, w, margin = be.route(be.linear(h, router), hp.n_expert_used)  # [T, k], [T, k], [T]
    source = experts.source(layer)
    if source is not None:  # a captured step: the kernels read the routing on the device
        return be.moe_at(h, ids, w, source), ids, margin
    if len(ids) <= DECODE_ROWS:
        routed = be.download(ids)  # [T, k] on the host
        counts = np.bincount(routed.reshape(-1), minlength=hp.n_expert)  # [E]
    else:
        routed = ids
        counts = be.expert_counts(ids, hp.n_expert)  # [E]
    used = [int(e) for e in np.flatnonzero(counts)]
    experts.prepare(layer, used)
    return be.moe(h, routed, w, used, counts, experts, layer), ids, margin
