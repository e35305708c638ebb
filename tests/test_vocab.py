"""The synthetic word vocabulary: exact size, valid BPE merges, whole-word tokens, determinism."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.errors import ModelError
from engine.gguf.reader import open_gguf
from engine.gguf.tokenizer import Tokenizer, TokenType, bytes_to_unicode
from engine.synth.vocab import (
    MIN_N_VOCAB,
    SPECIAL_TOKENS,
    VocabSpec,
    build_vocab,
    word_list,
    write_vocab,
)

SIZES = [MIN_N_VOCAB, 300, 512, 768, 1024, 4096, 151_936]


@pytest.fixture(scope="module", params=SIZES)
def spec(request: pytest.FixtureRequest) -> VocabSpec:
    return build_vocab(request.param)


def tokenizer_of(spec: VocabSpec) -> Tokenizer:
    return Tokenizer(spec.tokens, spec.token_types, spec.merges, pre="qwen2", eos_id=spec.eos_id)


def test_word_list_file() -> None:
    words = word_list()
    assert len(words) >= 3000
    assert len(set(words)) == len(words)
    assert all(re.fullmatch(r"[a-z]+", w) for w in words)
    assert words[:3] == ("the", "of", "and")


def test_exact_size_unique_tokens_and_types(spec: VocabSpec) -> None:
    n = len(spec.tokens)
    assert n == spec.n_vocab == len(spec.token_types)
    assert n in SIZES
    assert len(set(spec.tokens)) == n
    assert spec.tokens[-3:] == list(SPECIAL_TOKENS)
    assert spec.token_types[-3:] == [TokenType.CONTROL] * 3
    assert set(spec.token_types[:-3]) == {TokenType.NORMAL}
    assert spec.bos_id == spec.eos_id == spec.pad_id == n - 3
    assert (spec.im_start_id, spec.im_end_id) == (n - 2, n - 1)
    b2u = bytes_to_unicode()
    assert spec.tokens[:256] == [b2u[b] for b in range(256)]


def test_merges_are_valid_bpe(spec: VocabSpec) -> None:
    index = {t: i for i, t in enumerate(spec.tokens)}
    produced = set()
    for merge in spec.merges:
        left, right = merge.split(" ")
        # both parts exist before the result: every token is reachable from bytes
        assert index[left] < index[left + right] and index[right] < index[left + right], merge
        produced.add(left + right)
    assert len(spec.merges) == len(set(spec.merges))
    merged_tokens = set(spec.tokens[256:-3])
    assert merged_tokens == produced


def test_words_encode_to_one_token(spec: VocabSpec) -> None:
    tok = tokenizer_of(spec)
    for word in spec.words:
        for text in (word, " " + word):
            ids = tok.encode(text)
            assert len(ids) == 1 and tok.decode(ids) == text, (text, ids)


def test_word_coverage_grows_with_size() -> None:
    counts = [len(build_vocab(n).words) for n in (512, 1024, 4096, 32_000)]
    assert counts == sorted(counts)
    assert counts[0] >= 30
    assert counts[-1] == len(word_list())


def test_full_vocabulary_has_every_spelling() -> None:
    tok = tokenizer_of(build_vocab(151_936))
    for word in word_list():
        cap = word.capitalize()
        for text in (word, " " + word, cap, " " + cap):
            assert len(tok.encode(text)) == 1, text
    for text in (".\n\n", "\n\n", " (", "'s", "...", " —"):
        assert len(tok.encode(text)) == 1, text


def test_padding_tokens_read_as_two_words() -> None:
    spec = build_vocab(40_000)
    tok = tokenizer_of(spec)
    words = set(word_list())
    for token_id in range(spec.n_vocab - 3 - 200, spec.n_vocab - 3):
        text = tok.decode([token_id])
        first, second = text[1:].split(" ")
        assert text[0] == " " and first in words and second in words, text


def test_deterministic_and_seeded() -> None:
    a, b = build_vocab(40_000, seed=0), build_vocab(40_000, seed=0)
    assert a == b
    c = build_vocab(40_000, seed=1)
    assert c.tokens != a.tokens
    n_same = next(i for i, (x, y) in enumerate(zip(a.tokens, c.tokens)) if x != y)
    assert n_same > 256 + 10_000  # trained tokens agree; only the padding pairs differ


def digest(spec: VocabSpec) -> str:
    h = hashlib.sha256()
    for part in (spec.tokens, spec.merges, [str(t) for t in spec.token_types]):
        h.update("\x00".join(part).encode())
    return h.hexdigest()


def test_same_vocabulary_in_a_fresh_process() -> None:
    """Training runs in Rust with per-process hash seeds; the result must not depend on them."""
    code = (
        "from engine.synth.vocab import build_vocab; import hashlib\n"
        "s = build_vocab(1024); h = hashlib.sha256()\n"
        "for part in (s.tokens, s.merges, [str(t) for t in s.token_types]):\n"
        "    h.update('\\x00'.join(part).encode())\n"
        "print(h.hexdigest())"
    )
    root = Path(__file__).resolve().parents[1]
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert runs == [digest(build_vocab(1024))] * 2


def test_build_time_for_qwen3_size() -> None:
    start = time.perf_counter()
    build_vocab(151_936, seed=5)
    assert time.perf_counter() - start < 10.0


@pytest.mark.parametrize("n_vocab", [0, MIN_N_VOCAB - 1, 1 << 21])
def test_size_out_of_range(n_vocab: int) -> None:
    with pytest.raises(ModelError, match=f"synthetic vocabulary size {n_vocab} is outside"):
        build_vocab(n_vocab)


def test_write_vocab_gguf_round_trip(tmp_path: Path) -> None:
    spec = build_vocab(1024, seed=2)
    path = tmp_path / "v.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    write_vocab(writer, spec)
    writer.add_tensor("dummy", np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = open_gguf(path).metadata
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "qwen2"
    assert meta["tokenizer.ggml.tokens"] == spec.tokens
    assert meta["tokenizer.ggml.token_type"] == spec.token_types
    assert meta["tokenizer.ggml.merges"] == spec.merges
    assert meta["tokenizer.ggml.bos_token_id"] == spec.bos_id
    assert meta["tokenizer.ggml.eos_token_id"] == spec.eos_id
    assert meta["tokenizer.ggml.padding_token_id"] == spec.pad_id
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.chat_template"] == spec.chat_template
    tok = Tokenizer.from_metadata(meta)
    text = "<|im_start|>user\nThe people said hello.<|im_end|>\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text)[0] == spec.im_start_id
