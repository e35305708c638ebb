"""Mixture-of-experts FFN: softmax router, top-k renormalised, SwiGLU experts grouped by expert.

Expert weights come from an `ExpertProvider`, so the same code runs with experts read straight
from the GGUF file, from expert-cache slots, or streamed through the staging ring.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.gguf.hparams import HParams
from engine.model.ops import linear, rms_norm, silu, softmax


class ExpertProvider(Protocol):
    """Supplies dequantized expert weights for one layer at a time.

    A provider may also define `ffn(layer, h, ids, w, used, counts) -> [T, d]` to compute the
    whole routed FFN itself (the CUDA provider runs grouped kernels there; `counts` is the host
    array [E] of rows per expert when `moe_block` read it, else None); otherwise `moe_block`
    loops over the used experts with `weights`.
    """

    def prepare(self, layer: int, experts: list[int]) -> None:
        """Called once per (chunk, layer) with the sorted experts the chunk routes to."""

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        """(gate [f, d], up [f, d], down [d, f]) float32 arrays on the backend."""


def route(xp: Any, hp: HParams, router: Any, h: Any) -> tuple[Any, Any, Any]:
    """h: [T, d] -> (ids [T, k] int, weights [T, k] renormalised to sum 1, margin [T]).

    `margin` is the probability gap between the k-th and (k+1)-th expert: how far the
    routing decision is from a tie (a perturbation larger than it can change the top-k).
    """
    k = hp.n_expert_used
    if xp.__name__ == "cupy":  # softmax, top-k, renormalisation and margin in one launch
        from engine.kernels.fused import route_topk

        return route_topk(linear(xp, h, router), k)
    probs = softmax(xp, linear(xp, h, router))  # [T, E]
    order = xp.argsort(-probs, axis=-1, kind="stable")  # [T, E]; ties: lower index first
    ids = order[:, :k]  # [T, k]
    w = xp.take_along_axis(probs, ids, axis=-1)  # [T, k]
    if k < hp.n_expert:
        margin = w[:, -1] - xp.take_along_axis(probs, order[:, k : k + 1], axis=-1)[:, 0]
    else:
        margin = xp.ones(h.shape[0], dtype=probs.dtype)
    return ids, w / xp.sum(w, axis=-1, keepdims=True), margin


def moe_block(
    xp: Any, hp: HParams, norm: Any, router: Any, x: Any, layer: int, experts: ExpertProvider
) -> tuple[Any, Any, Any]:
    """x: [T, d] -> ([T, d] FFN output, ids [T, k] routing used, margin [T])."""
    h = rms_norm(xp, x, norm, hp.rms_eps)  # [T, d]
    ids, w, margin = route(xp, hp, router, h)
    counts = None
    if xp.__name__ == "cupy" and len(ids) <= 8:  # decode: the ids come to the host once
        ids = ids.get()
        used = sorted(set(ids.reshape(-1).tolist()))
    elif xp.__name__ == "cupy":  # prompt: rows per expert, the one host read of the routing
        counts = xp.bincount(ids.reshape(-1), minlength=hp.n_expert).get()  # [E]
        used = [int(e) for e in counts.nonzero()[0]]
    else:
        used = sorted(int(e) for e in xp.unique(ids).tolist())
    experts.prepare(layer, used)
    ffn = getattr(experts, "ffn", None)
    if ffn is not None:
        return ffn(layer, h, ids, w, used, counts), ids, margin
    return expert_loop(xp, experts, layer, h, ids, w, used), ids, margin


def expert_loop(
    xp: Any, experts: ExpertProvider, layer: int, h: Any, ids: Any, w: Any, used: list[int]
) -> Any:
    """The routed FFN one expert at a time: h [T, d], ids/w [T, k] -> [T, d]."""
    out = xp.zeros_like(h)
    for e in used:
        tok, slot = xp.nonzero(ids == e)  # each token routes to an expert at most once
        gate, up, down = experts.weights(layer, e)
        he = h[tok]  # [n_e, d]
        act = silu(xp, linear(xp, he, gate)) * linear(xp, he, up)  # [n_e, f]
        out[tok] += linear(xp, act, down) * w[tok, slot][:, None]  # [n_e, d]
    return out
