"""Recording expert profiles from the routing of real prompts (`strata profile`, and the
default profile a model gets when `--expert-profile` is not given).

The default profile routes a calibration text (the embedded English word list, shuffled into
sentences) through the model once and is cached beside the model file, or in the cache
directory when that is not writable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from engine.backend.base import ExpertProvider
from engine.experts.profile import ExpertProfile, ProfileError, ProfileRecorder
from engine.experts.provider import DirectExperts
from engine.kv import KVCache
from engine.model.loader import Model
from engine.synth.demo import cache_dir
from engine.synth.vocab import word_list

CALIBRATION_TOKENS = 512
CHUNK_TOKENS = 256


def calibration_text(n_words: int = 600, seed: int = 0) -> str:
    words = list(word_list())
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(words), size=n_words)
    sentences, line = [], []
    for i, w in enumerate(picks):
        line.append(words[w])
        if len(line) >= 8 + i % 7:
            sentences.append(" ".join(line).capitalize() + ".")
            line = []
    return " ".join(sentences)


def record_profile(model: Model, texts: Iterable[str], max_tokens: int = 1 << 20,
                   experts: ExpertProvider | None = None) -> ExpertProfile:
    """Route `texts` through the main blocks; counts every (MoE layer, expert) pick. `experts`
    computes the routed FFN (default: decoded from host memory)."""
    assert model.transformer is not None, "build the model weights first"
    hp = model.hp
    be = model.transformer.backend
    rec = ProfileRecorder(hp.n_moe_layer, hp.n_expert)
    experts = experts or DirectExperts(model.experts, be)
    for text in texts:
        ids = model.tokenizer.encode(text)[:max_tokens]
        if not ids:
            continue
        kv = KVCache(be, hp.n_layer, len(ids), hp.n_head_kv, hp.head_dim)
        for start in range(0, len(ids), CHUNK_TOKENS):
            part = np.asarray(ids[start : start + CHUNK_TOKENS], dtype=np.int64)
            res = model.transformer.forward(part, start, kv, experts, logits="none")
            for layer, routed in enumerate(res.routes):
                rec.add(layer, be.download(routed))
    if rec.n_tokens == 0:
        raise ProfileError("no tokens to profile: the prompt set is empty")
    return rec.profile()


def _cached_path(model: Model) -> list[Path]:
    key = hashlib.sha1(f"{model.path.resolve()}:{model.mf.n_file_bytes}".encode()).hexdigest()[:12]
    return [
        model.path.with_suffix(".profile.json"),
        cache_dir() / "profiles" / f"{model.path.stem}-{key}.profile.json",
    ]


def cached_profile(model: Model, warn: Callable[[str], None] | None = None
                   ) -> ExpertProfile | None:
    """The model's calibration profile where an earlier run cached it, else None. A cached
    file that cannot be used (stale, foreign, damaged or hostile: it is read with bounds) is
    passed over with a one-line `warn`, so the caller records it again."""
    hp = model.hp
    for path in _cached_path(model):
        if path.exists():
            try:
                return ExpertProfile.load(path, n_layer=hp.n_moe_layer, n_expert=hp.n_expert)
            except ProfileError as e:
                if warn is not None:
                    warn(f"strata: warning: {e} (ignored: the calibration profile is "
                         "recorded again)")
    return None


def default_profile(model: Model, experts: ExpertProvider | None = None,
                    warn: Callable[[str], None] | None = None) -> ExpertProfile:
    """The model's calibration profile: loaded when cached, else recorded and cached (`warn`:
    a cached one passed over)."""
    cached = cached_profile(model, warn)
    if cached is not None:
        return cached
    profile = record_profile(model, [calibration_text()], CALIBRATION_TOKENS, experts)
    for path in _cached_path(model):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            profile.save(path)
            break
        except OSError:
            continue
    return profile
