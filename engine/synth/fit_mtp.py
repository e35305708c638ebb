"""Make a synthetic model's MTP block predictive: fit `eh_proj` to the main model by least squares.

A random nextn block drafts at chance. What a draft must match is the main model's own greedy
choice, and that choice is a function of the main model's next hidden state h[p+1]. So we
collect the main model's greedy continuations of random prompts, teacher-force them once to get
h[p] at every position, and fit the block to map (t[p+1], h[p]) to h[p+1]:

1. `shared_head_norm` := `output_norm`, so a block output proportional to h[p+1] gives the
   main head's logits (RMSNorm ignores the scale).
2. `eh_proj` := ridge least squares from u = [enorm(embed(t[p+1])), hnorm(h[p])] to the
   target x* = h[p+1] - f(x), where f is what the block's (unchanged, random) attention and
   experts add on top of x; f depends on x, so we alternate: fit, run the block, refit.

Everything else in the file is copied unchanged; the two tensors are re-quantized to their own
types and written in place, so the file layout is identical. It is honest as a draft model: it
only ever sees the main model's outputs, and every draft is still checked by the verifier.
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

from engine.gguf import names
from engine.model.loader import Model, load_model
from engine.model.mtp import MTPBlock, require_mtp
from engine.model.ops import rms_norm
from engine.quant import dequantize
from engine.sampler import SamplingParams
from engine.session import Session


@dataclass
class Trace:
    """One teacher-forced sequence: prompt + greedy continuation, with the main hidden."""

    tokens: list[int]
    hidden: np.ndarray  # [n, d] pre-norm hidden of every position
    n_prompt: int


@dataclass(frozen=True)
class FitReport:
    path: Path
    n_samples: int
    accuracy_before: float  # held-out top-1 agreement of the first draft with the greedy token
    accuracy_after: float


def collect(model: Model, n_seq: int, n_prompt: int, n_gen: int, seed: int) -> list[Trace]:
    """Greedy continuations of random regular-token prompts, teacher-forced for the hidden."""
    rng = np.random.default_rng(seed)
    types = np.asarray(model.tokenizer.token_types)
    regular = np.nonzero(types == 1)[0]  # TokenType.NORMAL
    traces = []
    for _ in range(n_seq):
        prompt = [int(t) for t in rng.choice(regular, n_prompt)]
        s = Session(model, n_ctx=n_prompt + n_gen + 1)
        out = list(s.generate(prompt, n_gen, SamplingParams()))
        tokens = prompt + out
        s.reset()
        hidden = np.asarray(s.forward(tokens, logits="none").hidden)  # [n, d]
        traces.append(Trace(tokens, hidden, n_prompt))
    return traces


def _inputs(block: MTPBlock, tr: Trace) -> np.ndarray:
    """u [n-1, 2d] for cells p = 0..n-2: [enorm(embed(t[p+1])), hnorm(h[p])]."""
    hp, xp = block.hp, block.xp
    e = block.embd.rows(np.asarray(tr.tokens[1:], dtype=np.int64))  # [n-1, d]
    return np.concatenate(
        [rms_norm(xp, e, block.enorm, hp.rms_eps), rms_norm(xp, tr.hidden[:-1], block.hnorm, hp.rms_eps)],
        axis=-1,
    )


def _run_block(block: MTPBlock, tr: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(x after eh_proj [n-1, d], block output [n-1, d]) over every cell of the trace."""
    kv = block.new_kv(len(tr.tokens))
    out = block.forward(tr.hidden[:-1], np.asarray(tr.tokens[1:]), 0, kv, logits="none")
    return _inputs(block, tr) @ block.eh_proj.T, np.asarray(out.hidden)


def draft_accuracy(block: MTPBlock, traces: list[Trace]) -> float:
    """Share of generated positions where the block's top-1 draft is the main greedy token."""
    hits = total = 0
    for tr in traces:
        kv = block.new_kv(len(tr.tokens))
        out = block.forward(tr.hidden[:-1], np.asarray(tr.tokens[1:]), 0, kv, logits="all")
        pred = block.head.ids[np.argmax(np.asarray(out.logits), axis=-1)]  # cell p predicts t[p+2]
        cells = range(tr.n_prompt - 1, len(tr.tokens) - 2)  # t[p+2] is a generated token
        hits += sum(int(pred[p] == tr.tokens[p + 2]) for p in cells)
        total += len(cells)
    return hits / max(total, 1)


def fit_eh_proj(block: MTPBlock, traces: list[Trace], n_iter: int = 3, ridge: float = 1e-2) -> int:
    """Fit `block.eh_proj` in place; returns the number of samples used."""
    n_cells = [len(tr.tokens) - 1 for tr in traces]
    u = np.concatenate([_inputs(block, tr) for tr in traces]).astype(np.float64)  # [S, 2d]
    target = np.concatenate([tr.hidden[1:] for tr in traces]).astype(np.float64)  # [S, d]
    gram = u.T @ u + ridge * len(u) * np.eye(u.shape[1], dtype=np.float64)  # [2d, 2d]
    residual = np.zeros_like(target)  # f(x): what attention + experts add to x
    for _ in range(n_iter):
        w = np.linalg.solve(gram, u.T @ (target - residual))  # [2d, d]
        block.eh_proj = block._to_device(np.ascontiguousarray(w.T, dtype=np.float32))
        runs = [_run_block(block, tr) for tr in traces]
        residual = np.concatenate([out - x for x, out in runs])
    assert sum(n_cells) == len(u)
    return len(u)


def fit_mtp(
    src: str | Path,
    dst: str | Path | None = None,
    n_seq: int = 48,
    n_prompt: int = 16,
    n_gen: int = 96,
    n_iter: int = 3,
    seed: int = 1234,
) -> FitReport:
    """Copy `src` to `dst` (default `<stem>-mtpfit.gguf`) with a fitted nextn block."""
    src = Path(src)
    dst = Path(dst) if dst is not None else src.with_name(f"{src.stem}-mtpfit.gguf")
    model = load_model(src)
    require_mtp(model)
    block = MTPBlock(model)
    train = collect(model, n_seq, n_prompt, n_gen, seed)
    held_out = collect(model, max(4, n_seq // 6), n_prompt, n_gen, seed + 1)
    before = draft_accuracy(block, held_out)
    block.shared_head_norm = block._to_device(model.transformer.output_norm.copy())
    n_samples = fit_eh_proj(block, train, n_iter)
    tmp = dst.with_suffix(dst.suffix + ".part")
    shutil.copyfile(src, tmp)
    i = model.hp.n_layer
    _write(tmp, {
        names.nextn("eh_proj", i): np.asarray(block.eh_proj),
        names.nextn("shared_head_norm", i): dequantize(model.mf.tensor(names.OUTPUT_NORM)),
    })
    tmp.replace(dst)
    after = draft_accuracy(MTPBlock(load_model(dst)), held_out)  # as quantized in the file
    return FitReport(dst, n_samples, before, after)


def _write(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Overwrite tensors of a GGUF file in place, re-encoded to each tensor's own type."""
    reader = GGUFReader(path, "r+")
    by_name = {t.name: t for t in reader.tensors}
    for name, value in tensors.items():
        t = by_name[name]
        qtype = Q(int(t.tensor_type))
        data: Any = t.data
        if qtype == Q.F32:
            data[...] = value.astype(np.float32).reshape(data.shape)
        elif qtype == Q.F16:
            data[...] = value.astype(np.float16).reshape(data.shape)
        else:
            data[...] = gq.quantize(value.astype(np.float32), qtype).reshape(data.shape)
    reader.data.flush()
