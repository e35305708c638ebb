"""The forward-pass oracle: logits from llama.cpp (through llama-cpp-python) and ours on the
same file, and a token sequence steered away from routing ties (test_llama_oracle.py says why).
Importing this module skips the importing test module where llama-cpp-python is absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.model.loader import load_model
from engine.request.session import Session

llama_cpp = pytest.importorskip("llama_cpp")

MIN_MARGIN = 3e-3
SEED_TOKENS = [5, 17, 300, 42, 9, 700, 123, 64, 1, 250, 511, 33, 96, 480, 77, 2, 610, 8, 150, 99]


def llama_logits(path: Path, tokens: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True,
        n_gpu_layers=0, n_threads=2, flash_attn=False, verbose=False,
    )
    llm.reset()
    llm.eval(tokens)
    out = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    llm.close()
    return out


def ours(path: Path, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logits [T, V], smallest routing margin per position [T]) in one teacher-forced pass."""
    res = Session(load_model(path), n_ctx=len(tokens)).forward(tokens, logits="all")
    return np.asarray(res.logits), np.asarray(res.margins)


def away_from_ties(path: Path, n_vocab: int) -> list[int]:
    """SEED_TOKENS with tokens replaced until no position routes within MIN_MARGIN of a tie."""
    tokens = list(SEED_TOKENS)
    for i in range(len(tokens)):
        for _ in range(64):
            _, margins = ours(path, tokens[: i + 1])
            if margins[i] >= MIN_MARGIN:
                break
            tokens[i] = (tokens[i] + 37) % n_vocab
    return tokens


