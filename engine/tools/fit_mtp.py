"""Make a synthetic model's MTP block predictive: fit it to the main model by least squares.

A random nextn block drafts at chance. What a draft must match is the main model's own greedy
choice, and that choice is a function of the main model's next hidden state h[p+1]. So we
collect the main model's greedy continuations of random prompts (with h[p] at every position)
and fit the block to map (t[p+1], h[p]) to h[p+1]:

1. `shared_head_norm` := `output_norm`, so a block output proportional to h[p+1] gives the
   main head's logits (RMSNorm ignores the scale).
2. `eh_proj` := ridge least squares from u = [enorm(embed(t[p+1])), hnorm(h[p])] to
   x* = h[p+1] - f(x), where f is what the block's attention and experts add to x. f depends
   on x, so we alternate: fit, run the block, refit.
3. `ffn_down_exps` := ridge least squares of the routed experts' output onto what is still
   missing (h[p+1] - x - attention). With gate, up and the router fixed, the MoE output is
   linear in the down projections: the experts act as random features. Solved expert by expert
   (block Gauss-Seidel sweeps, which converge to the joint solution).

Everything else in the file is copied unchanged; the fitted tensors are re-encoded to their
own quant types and written in place, so the layout is identical. It is honest as a draft
model: it only ever sees the main model's outputs, and every draft is still verified.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf import quants as gq

from engine.backend.array_ops import rms_norm, route_topk, silu
from engine.backend.base import Backend, DeviceArray
from engine.gguf import names
from engine.gguf.quant import ExpertLayout, dequantize
from engine.gguf.tokenizer import TokenType
from engine.model.attention import attention_block
from engine.model.loader import Model, load_model
from engine.model.moe import routing
from engine.model.mtp import MTPBlock, require_mtp
from engine.request.session import Session
from engine.speculative.draft_head import DraftHead


@dataclass
class Trace:
    """One greedy sequence (prompt + continuation) with the main hidden of every position."""

    tokens: list[int]
    hidden: np.ndarray  # [n, d] pre-norm
    n_prompt: int


@dataclass(frozen=True)
class FitReport:
    path: Path
    n_samples: int
    accuracy_before: float  # held-out share of first drafts equal to the greedy token
    accuracy_linear: float  # after fitting eh_proj only (float32, before writing)
    accuracy_after: float  # the written file, as quantized


class ArrayExperts:
    """ExpertProvider over float32 (gate [f, d], up [f, d], down [d, f]) arrays of one layer,
    held in host memory (as blobs: the three F32 matrices back to back)."""

    ring_slots = None

    def __init__(self, weights: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]],
                 backend: Backend):
        self.w, self.backend = weights, backend
        gate, up, down = next(iter(weights.values()))
        self.layout = ExpertLayout((Q.F32, Q.F32, Q.F32), (gate.shape, up.shape, down.shape))

    def layout_of(self, layer: int) -> ExpertLayout:
        return self.layout

    def prepare(self, layer: int, experts: list[int]) -> None:
        pass

    def prefetch(self, layer: int) -> None:
        pass

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        return self.w[expert]

    def blobs(self, layer: int, experts: list[int]) -> list[DeviceArray]:
        parts = lambda e: [np.ascontiguousarray(a, np.float32).reshape(-1).view(np.uint8)
                           for a in self.w[e]]
        return [self.backend.to_device(np.concatenate(parts(e))) for e in experts]

    def needs_slot(self, layer: int, expert: int) -> bool:
        return False

    def reads_queued(self, layer: int, experts: list[int]) -> None:
        pass

    def source(self, layer: int) -> None:
        return None


def collect(model: Model, n_seq: int, n_prompt: int, n_gen: int, seed: int) -> list[Trace]:
    """Greedy continuations of random regular-token prompts, keeping every position's hidden."""
    rng = np.random.default_rng(seed)
    regular = np.nonzero(np.asarray(model.tokenizer.token_types) == TokenType.NORMAL)[0]
    traces = []
    for _ in range(n_seq):
        tokens = [int(t) for t in rng.choice(regular, n_prompt)]
        s = Session(model, n_ctx=n_prompt + n_gen)
        res = s.forward(tokens)
        hidden = [np.asarray(res.hidden)]
        for _ in range(n_gen - 1):
            tokens.append(int(np.argmax(np.asarray(res.logits[-1]))))
            res = s.forward(tokens[-1:])
            hidden.append(np.asarray(res.hidden))
        tokens.append(int(np.argmax(np.asarray(res.logits[-1]))))
        traces.append(Trace(tokens[:-1], np.concatenate(hidden), n_prompt))
    return traces


def _inputs(block: MTPBlock, tr: Trace) -> np.ndarray:
    """u [n-1, 2d] for cells p = 0..n-2: [enorm(embed(t[p+1])), hnorm(h[p])]."""
    hp = block.hp
    e = block.embd.rows(np.asarray(tr.tokens[1:], dtype=np.int64))  # [n-1, d]
    return np.concatenate(
        [
            rms_norm(np, e, block.enorm, hp.rms_eps),
            rms_norm(np, tr.hidden[:-1], block.hnorm, hp.rms_eps),
        ],
        axis=-1,
    )


def draft_accuracy(block: MTPBlock, traces: list[Trace]) -> float:
    """Share of generated positions where the block's top-1 draft is the main greedy token."""
    hits = total = 0
    for tr in traces:
        kv = block.new_kv(len(tr.tokens))
        out = block.forward(tr.hidden[:-1], np.asarray(tr.tokens[1:]), 0, kv, logits="all")
        pred = block.head.ids[np.argmax(np.asarray(out.logits), axis=-1)]  # cell p -> t[p+2]
        cells = range(tr.n_prompt - 1, len(tr.tokens) - 2)  # t[p+2] is a generated token
        hits += sum(int(pred[p] == tr.tokens[p + 2]) for p in cells)
        total += len(cells)
    return hits / max(total, 1)


def fit_eh_proj(block: MTPBlock, traces: list[Trace], n_iter: int = 3, ridge: float = 1e-2) -> int:
    """Fit `block.eh_proj` in place; returns the number of samples (cells) used."""
    u = np.concatenate([_inputs(block, tr) for tr in traces]).astype(np.float64)  # [S, 2d]
    target = np.concatenate([tr.hidden[1:] for tr in traces]).astype(np.float64)  # [S, d]
    gram = u.T @ u + ridge * len(u) * np.eye(u.shape[1])  # [2d, 2d]
    residual = np.zeros_like(target)  # f(x): what attention + experts add to x
    for _ in range(n_iter):
        w = np.linalg.solve(gram, u.T @ (target - residual))  # [2d, d]
        block.eh_proj = np.ascontiguousarray(w.T, dtype=np.float32)  # [d, 2d]
        outs = []
        for tr in traces:
            kv = block.new_kv(len(tr.tokens))
            out = block.forward(tr.hidden[:-1], np.asarray(tr.tokens[1:]), 0, kv, logits="none")
            outs.append(np.asarray(out.hidden) - _inputs(block, tr) @ block.eh_proj.T)
        residual = np.concatenate(outs)
    return len(u)


def fit_expert_down(
    block: MTPBlock, traces: list[Trace], ridge: float = 1e-2, n_sweep: int = 3
) -> dict[int, np.ndarray]:
    """Fit every expert's down projection [d, f]; installs them in `block.experts`."""
    hp = block.hp
    n_exp = hp.n_expert
    block.experts.prepare(0, list(range(n_exp)))
    w0 = {e: tuple(np.asarray(a) for a in block.experts.weights(0, e)) for e in range(n_exp)}
    acts: dict[int, list[np.ndarray]] = {e: [] for e in range(n_exp)}  # weighted [n_e, f]
    rows: dict[int, list[np.ndarray]] = {e: [] for e in range(n_exp)}  # sample index [n_e]
    targets, base = [], 0
    for tr in traces:
        kv = block.new_kv(len(tr.tokens))
        x = _inputs(block, tr) @ block.eh_proj.T  # [n-1, d]
        a = x + attention_block(block.backend, hp, block.block.attn, x, 0, kv, 0)
        h = rms_norm(np, a, block.block.ffn_norm, hp.rms_eps)
        ids, w, _ = route_topk(np, h @ block.block.router.T, routing(hp), block.block.selection_bias)  # [n-1, k]
        for e in np.unique(ids).tolist():
            tok, slot = np.nonzero(ids == e)
            gate, up, _ = w0[e]
            act = silu(np, h[tok] @ gate.T) * (h[tok] @ up.T)  # [n_e, f]
            acts[e].append(act * w[tok, slot][:, None])
            rows[e].append(tok + base)
        targets.append(tr.hidden[1:] - a)  # what the MoE should add
        base += len(x)
    target = np.concatenate(targets).astype(np.float64)  # [S, d]
    phi = {e: np.concatenate(acts[e]).astype(np.float64) for e in acts if acts[e]}
    idx = {e: np.concatenate(rows[e]) for e in phi}
    down = {e: np.zeros((hp.n_embd, hp.n_ff_exp)) for e in range(n_exp)}  # unrouted: zero
    pred = np.zeros_like(target)  # current MoE output per sample
    for _ in range(n_sweep):
        for e, f in phi.items():
            pred[idx[e]] -= f @ down[e].T  # leave expert e out
            gram = f.T @ f + ridge * np.trace(f.T @ f) / f.shape[1] * np.eye(f.shape[1])
            down[e] = np.linalg.solve(gram, f.T @ (target[idx[e]] - pred[idx[e]])).T
            pred[idx[e]] += f @ down[e].T
    fitted = {e: np.ascontiguousarray(down[e], dtype=np.float32) for e in range(n_exp)}
    block.experts = ArrayExperts({e: (w0[e][0], w0[e][1], fitted[e]) for e in range(n_exp)},
                                 block.backend)
    return fitted


def fit_mtp(
    src: str | Path,
    dst: str | Path | None = None,
    n_seq: int = 160,
    n_prompt: int = 16,
    n_gen: int = 112,
    seed: int = 1234,
) -> FitReport:
    """Copy `src` to `dst` (default `<stem>-mtpfit.gguf`) with a fitted nextn block."""
    src = Path(src)
    dst = Path(dst) if dst is not None else src.with_name(f"{src.stem}-mtpfit.gguf")
    model = load_model(src)
    require_mtp(model)
    block = MTPBlock(model, DraftHead.from_model(model))
    train = collect(model, n_seq, n_prompt, n_gen, seed)
    held_out = collect(model, max(4, n_seq // 8), n_prompt, n_gen, seed + 1)
    before = draft_accuracy(block, held_out)
    block.shared_head_norm = np.array(model.transformer.output_norm)
    n_samples = fit_eh_proj(block, train)
    linear = draft_accuracy(block, held_out)
    down = fit_expert_down(block, train)
    i = model.hp.n_layer
    tmp = dst.with_suffix(dst.suffix + ".part")
    shutil.copyfile(src, tmp)
    _write(
        tmp,
        {
            names.nextn("eh_proj", i): np.asarray(block.eh_proj),
            names.nextn("shared_head_norm", i): dequantize(model.mf.tensor(names.OUTPUT_NORM)),
            names.block("ffn_down_exps", i): np.stack([down[e] for e in sorted(down)]),
        },
    )
    tmp.replace(dst)
    quantized = load_model(dst)  # as quantized in the file
    after = draft_accuracy(MTPBlock(quantized, DraftHead.from_model(quantized)), held_out)
    return FitReport(dst, n_samples, before, linear, after)


def _write(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Overwrite tensors of a GGUF file in place, re-encoded to each tensor's own type."""
    reader = GGUFReader(path, "r+")
    by_name = {t.name: t for t in reader.tensors}
    for name, value in tensors.items():
        t = by_name[name]
        qtype = Q(int(t.tensor_type))
        data: Any = t.data
        if qtype in (Q.F32, Q.F16):
            data[...] = value.astype(data.dtype).reshape(data.shape)
        else:
            flat = value.reshape(-1, value.shape[-1]).astype(np.float32)
            data[...] = gq.quantize(flat, qtype).reshape(data.shape)
    reader.data.flush()
