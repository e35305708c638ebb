"""A block's FFN: the mixture of experts (router, top-k, SwiGLU experts through the backend's
`moe`, and a shared expert beside them where the model has one), or a dense SwiGLU FFN (the
dense leading blocks of glm4moe).

Expert weights come from an `ExpertProvider` (engine/backend/base.py), so the same code runs
with experts read straight from the GGUF file, from expert-cache slots, or streamed through
the staging ring. A shared expert and a dense FFN are resident weights, like attention's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backend.base import Backend, ExpertProvider, Routing
from engine.config import DECODE_ROWS
from engine.gguf.hparams import HParams


@dataclass
class DenseFFN:
    """A SwiGLU FFN on resident weights: a dense leading block's, or the shared expert."""

    gate_up: Any  # [2F, d]: the gate's rows, then the up projection's (one launch)
    down: Any  # [d, F]
    n_ff: int  # F


def dense_ffn(be: Backend, w: DenseFFN, h: Any) -> Any:
    """h [T, d] (normed) -> [T, d]: down(silu(gate h) * up h)."""
    xp = be.xp
    gu = be.linear(h, w.gate_up)  # [T, 2F]
    g, u = gu[:, : w.n_ff], gu[:, w.n_ff :]  # [T, F] each
    return be.linear(g * u / (1.0 + xp.exp(-g)), w.down)  # [T, d]


@functools.cache
def routing(hp: HParams) -> Routing:
    """The model's top-k rule (see `Routing`), made once per model (every MoE layer of every
    step asks)."""
    return Routing(hp.n_expert_used, sigmoid=hp.gating == "sigmoid", norm=hp.weights_norm,
                   scale=hp.weights_scale)


def moe_block(
    be: Backend, hp: HParams, blk: Any, x: Any, layer: int, experts: ExpertProvider
) -> tuple[Any, Any, Any]:
    """x: [T, d] -> ([T, d] FFN output, ids [T, k] routing used, margin [T]); `blk` a
    `BlockWeights` with a router, `layer` the provider's (MoE) layer.

    The host reads the routing once: a decode step's ids themselves (the decode kernels build
    their job tables from them), a prompt chunk's rows per expert; never where the provider
    names a `source` (a captured step: the kernels build their job rows on the device)."""
    h = be.rms_norm(x, blk.ffn_norm, hp.rms_eps)  # [T, d]
    ids, w, margin = be.route(be.linear(h, blk.router), routing(hp), blk.selection_bias)  # [T, k] x2, [T]
    source = experts.source(layer)
    if source is not None:  # a captured step: the kernels read the routing on the device
        out = be.moe_at(h, ids, w, source)
    else:
        if len(ids) <= DECODE_ROWS:
            routed = be.download(ids)  # [T, k] on the host
            counts = np.bincount(routed.reshape(-1), minlength=hp.n_expert)  # [E]
        else:
            routed = ids
            counts = be.expert_counts(ids, hp.n_expert)  # [E]
        used = [int(e) for e in np.flatnonzero(counts)]
        experts.prepare(layer, used)
        out = be.moe(h, routed, w, used, counts, experts, layer)
    if blk.shared is not None:
        out += dense_ffn(be, blk.shared, h)
    return out, ids, margin


def dense_block(be: Backend, hp: HParams, blk: Any, x: Any) -> Any:
    """x: [T, d] -> [T, d], a dense block's FFN (`blk.dense`)."""
    return dense_ffn(be, blk.dense, be.rms_norm(x, blk.ffn_norm, hp.rms_eps))
