"""Tokenizer from GGUF metadata: round trips, special tokens, streaming, errors, llama.cpp parity.

The vocabulary is the synthetic one (`engine.synth.vocab`), written into a real GGUF file and
read back through `open_gguf(...).metadata`, the same path a downloaded model takes.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from engine.errors import TokenizerError
from engine.gguf.reader import open_gguf
from engine.gguf.tokenizer import Tokenizer, TokenType, bytes_to_unicode
from engine.synth.vocab import VocabSpec, build_vocab, write_vocab

N_VOCAB = 2048

TEXTS = [
    "Hello world",
    'The people of the city said: "don\'t go there!" (twice).',
    "naïve café, Ünïcödé — ‘quotes’ and “more” … ß",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "中文字符和日本語のテキスト、한국어",
    "line one\nline two\r\nline three\n\n\nend\n",
    "   leading, inner    runs,\t\ttabs and trailing   ",
    "def f(x):\n    return x ** 2  # comment\n",
    "numbers 12345 3.14159 -7 1e10",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "partial <|im_start and <|im_end|x|> pieces",
    "",
    " ",
    "\n",
]


def write_vocab_gguf(path: Path, spec: VocabSpec, extra: dict[str, Any] | None = None,
                     pre: str = "qwen2") -> Path:
    """A GGUF file holding `spec` (plus `extra` string keys, its pre-tokenizer `pre`) and one
    dummy F32 tensor."""
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    write_vocab(writer, spec, pre=pre)
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    writer.add_tensor("dummy", np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def with_user_tokens(spec: VocabSpec, texts: list[str]) -> VocabSpec:
    """`spec` with USER_DEFINED tokens appended, like Qwen3's `<think>` (special: false)."""
    return VocabSpec(
        tokens=spec.tokens + texts,
        token_types=spec.token_types + [int(TokenType.USER_DEFINED)] * len(texts),
        merges=spec.merges,
        bos_id=spec.bos_id,
        eos_id=spec.eos_id,
        pad_id=spec.pad_id,
        chat_template=spec.chat_template,
        words=spec.words,
    )


@pytest.fixture(scope="module")
def spec() -> VocabSpec:
    return with_user_tokens(build_vocab(N_VOCAB, seed=3), ["<think>", "</think>"])


@pytest.fixture(scope="module")
def gguf_path(spec: VocabSpec, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab_gguf(tmp_path_factory.mktemp("tok") / "vocab.gguf", spec)


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_metadata(open_gguf(gguf_path).metadata)


def ids_of(tok: Tokenizer, *texts: str) -> list[int]:
    return [tok.tokens.index(t) for t in texts]


def test_loads_from_gguf_metadata(tok: Tokenizer, spec: VocabSpec) -> None:
    assert tok.n_vocab == len(spec.tokens)
    assert tok.tokens == spec.tokens
    assert tok.pre == "qwen2"
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (spec.bos_id, spec.eos_id, spec.pad_id)
    assert tok.add_bos is False
    assert tok.chat_template == spec.chat_template


def test_from_gguf_matches_from_metadata(tok: Tokenizer, gguf_path: Path) -> None:
    other = Tokenizer.from_gguf(gguf_path)
    for text in TEXTS:
        assert other.encode(text) == tok.encode(text)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_round_trip(tok: Tokenizer, text: str, special: bool) -> None:
    assert tok.decode(tok.encode(text, special=special)) == text


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    im_start, im_end, eot = ids_of(tok, "<|im_start|>", "<|im_end|>", "<|endoftext|>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids[0] == im_start
    assert ids[-2:] == [im_end, eot]
    assert ids.count(im_start) == 1


def test_special_text_is_plain_when_special_false(tok: Tokenizer) -> None:
    specials = set(ids_of(tok, "<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text, special=False)
    assert not specials & set(ids)
    assert len(ids) > 6
    assert tok.decode(ids) == text
    # the library flag is toggled per call; the next special=True call must split again
    assert tok.encode(text)[0] in specials


def test_user_defined_tokens_match_even_when_special_false(tok: Tokenizer) -> None:
    think, end_think = ids_of(tok, "<think>", "</think>")
    for special in (True, False):
        ids = tok.encode("<think>\nplan\n</think>\n\nanswer", special=special)
        assert ids[0] == think and end_think in ids
    assert tok.decode([think], skip_special=True) == "<think>"  # not a control token


def test_decode_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nfine<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "assistant\nfine"


def test_words_are_single_tokens(tok: Tokenizer, spec: VocabSpec) -> None:
    assert len(spec.words) > 100
    for word in spec.words:
        assert len(tok.encode(word)) == 1, word
        (space_id,) = tok.encode(" " + word)
        assert tok.token_text(space_id) == "Ġ" + word


def test_byte_tokens_and_text(tok: Tokenizer) -> None:
    b2u = bytes_to_unicode()
    assert [tok.token_text(b) for b in range(256)] == [b2u[b] for b in range(256)]
    assert tok.encode("é") == [0xC3, 0xA9]  # synthetic vocab: byte token id = byte value
    assert tok.token_bytes(0xC3) == b"\xc3"


def test_eog_and_bos(tok: Tokenizer) -> None:
    assert tok.eog_ids == set(ids_of(tok, "<|im_end|>", "<|endoftext|>"))
    assert tok.encode("hi")[0] != tok.bos_id
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id
    assert tok.encode("hi", add_bos=True)[1:] == tok.encode("hi")


def test_render_chat_then_encode(tok: Tokenizer) -> None:
    prompt = tok.render_chat([{"role": "user", "content": "Hello there"}])
    assert prompt == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert ids[0] == ids_of(tok, "<|im_start|>")[0]
    assert tok.decode(ids) == prompt


def stream_all(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    stream = tok.stream(skip_special)
    return [stream.push(i) for i in ids] + [stream.flush()]


def test_stream_holds_partial_utf8(tok: Tokenizer) -> None:
    ids = tok.encode("a🎉b")  # 🎉 is four byte tokens in this vocab
    assert len(ids) == 6
    assert stream_all(tok, ids) == ["a", "", "", "", "🎉", "b", ""]
    assert stream_all(tok, [0xE4, 0xB8]) == ["", "", "\ufffd"]  # cut short: flushed as U+FFFD


def test_stream_equals_decode_on_random_ids(tok: Tokenizer) -> None:
    rng = random.Random(7)
    multibyte = [i for t in ("é中🎉👍🏽ß—한") for i in tok.encode(t)]
    for _ in range(300):
        n = rng.randint(0, 40)
        ids = [
            rng.choice(multibyte) if rng.random() < 0.5 else rng.randrange(tok.n_vocab)
            for _ in range(n)
        ]
        for skip in (False, True):
            assert "".join(stream_all(tok, ids, skip)) == tok.decode(ids, skip)


def test_stream_never_emits_partial_characters(tok: Tokenizer) -> None:
    text = "日本語 and 🇫🇷 flags, naïve 한국어 text" * 3
    pieces = stream_all(tok, tok.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_encode_speed_sanity() -> None:
    """A 72k-token paste with the full Qwen3-sized vocabulary (a loose guard, not a benchmark)."""
    spec = build_vocab(151_936)
    tok = Tokenizer(spec.tokens, spec.token_types, spec.merges, pre="qwen2")
    rng = random.Random(0)
    sentences = []
    for _ in range(20_000):
        words = [rng.choice(spec.words) for _ in range(rng.randint(4, 16))]
        sentences.append(" ".join(words).capitalize() + rng.choice([".", ",", "?", ".\n\n"]))
    ids = tok.encode(" ".join(sentences))
    assert len(ids) > 72_000
    text = tok.decode(ids[:72_000])
    start = time.perf_counter()
    n_tokens = len(tok.encode(text))
    elapsed_s = time.perf_counter() - start
    assert n_tokens >= 71_000
    assert elapsed_s < 3.0, f"{n_tokens} tokens took {elapsed_s:.2f} s"


def base_meta(spec: VocabSpec) -> dict[str, Any]:
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": list(spec.tokens),
        "tokenizer.ggml.token_type": list(spec.token_types),
        "tokenizer.ggml.merges": list(spec.merges),
        "tokenizer.ggml.eos_token_id": spec.eos_id,
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model = 'llama' is not supported"),
        ({"tokenizer.ggml.model": None}, "'tokenizer.ggml.model' is missing"),
        ({"tokenizer.ggml.tokens": None}, "'tokenizer.ggml.tokens' is missing"),
        ({"tokenizer.ggml.merges": None}, "'tokenizer.ggml.merges' is missing"),
        ({"tokenizer.ggml.pre": "deepseek-llm"}, "tokenizer.ggml.pre = 'deepseek-llm' is not supported"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, "eos_token_id = 1000000 is outside"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "token_type has 2 entries"),
        ({"tokenizer.ggml.merges": ["Ġ"]}, "merges[0] = 'Ġ' is not two tokens"),
        ({"tokenizer.ggml.merges": ["zz q"]}, "merges[0] = 'zz q' needs 'zz', which is not in"),
        ({"tokenizer.ggml.merges": ["Ġ q"]}, "merges[0] = 'Ġ q' needs 'Ġq', which is not in"),
    ],
)
def test_bad_metadata(spec: VocabSpec, change: dict[str, Any], message: str) -> None:
    meta = base_meta(spec)
    for key, value in change.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_metadata(meta)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_ids(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="token id 99999 is outside"):
        tok.decode([1, 99999])
    with pytest.raises(TokenizerError, match="token id -1 is outside"):
        tok.stream().push(-1)


def test_add_bos_without_bos_id(spec: VocabSpec) -> None:
    tok = Tokenizer.from_metadata(base_meta(spec))
    with pytest.raises(TokenizerError, match="no tokenizer.ggml.bos_token_id"):
        tok.encode("x", add_bos=True)


def test_duplicate_token_text_resolves_to_last_id() -> None:
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + ["ab", "ab"]
    tok = Tokenizer(tokens, [1] * len(tokens), ["a b"], pre="qwen2")
    assert tok.encode("ab") == [257]  # llama.cpp's token_to_id keeps the last
    assert tok.decode([256, 257]) == "abab"


def test_pre_tokenizer_choice(spec: VocabSpec) -> None:
    gpt2 = Tokenizer.from_metadata(base_meta(spec) | {"tokenizer.ggml.pre": "gpt2"})
    qwen2 = Tokenizer.from_metadata(base_meta(spec))
    text = "end.\n\nNext"
    # qwen2 keeps ".\n\n" as one piece (a token here); the GPT-2 regex splits it in three
    assert [qwen2.token_text(i) for i in qwen2.encode(text)] == ["end", ".ĊĊ", "Next"]
    assert [gpt2.token_text(i) for i in gpt2.encode(text)] == ["end", ".", "Ċ", "Ċ", "Next"]
    assert gpt2.decode(gpt2.encode(text)) == text


# --- llama.cpp parity: our synthetic GGUFs must tokenize the same there ------------------

PARITY_TEXTS = [
    *TEXTS,
    "<think>\nLet me think.\n</think>\n\nThe answer is 42.",
    "I'm sure they'll say we'd've DONE it, isn't it? 'S 'T",
    "Mixed\u00a0nbsp and zero\u200bwidth, ﬁ ligature, Ω, 𝔘𝔫𝔦",
]


def test_llama_cpp_tokenizes_the_same(tok: Tokenizer, gguf_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    rng = random.Random(5)
    spec_words = [t[1:] for t in tok.tokens if t.startswith("Ġ") and t[1:].isalpha()]
    texts = list(PARITY_TEXTS)
    for _ in range(100):
        parts = [
            rng.choice(["", " ", "\n"]) + rng.choice(spec_words)
            if rng.random() < 0.6
            else rng.choice(PARITY_TEXTS)[: rng.randint(0, 12)]
            for _ in range(rng.randint(1, 30))
        ]
        texts.append("".join(parts))
    for text in texts:
        for special in (True, False):
            ours = tok.encode(text, special=special)
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            assert ours == theirs, (text, special)
    ids = [i for i in range(tok.n_vocab) if i != tok.bos_id]
    rng.shuffle(ids)
    for special in (True, False):
        ours_bytes = b"".join(tok.token_bytes(i, skip_special=not special) for i in ids)
        assert llm.detokenize(ids, special=special) == ours_bytes


# llama.cpp's own tokenizer test strings (models/ggml-vocab-*.gguf.inp in its tree, the same for
# every vocabulary there), one string per `__ggml_vocab_test__` separator.
LLAMA_TEST_STRINGS = (Path(__file__).parent / "data" / "ggml-vocab-test.inp").read_text(
    encoding="utf-8").split("\n__ggml_vocab_test__\n")


def with_digit_and_unmerged_tokens(spec: VocabSpec) -> VocabSpec:
    """`spec` plus digit tokens "12", "123", "45", "456" with their merges (where a split into
    single digits and one into runs of three tokenize apart) and "qzq" with none (only a
    pre-tokenizer that skips the merges for whole-token pieces finds it)."""
    extra = ["12", "123", "45", "456", "qzq"]
    return VocabSpec(
        tokens=spec.tokens + extra, token_types=spec.token_types + [int(TokenType.NORMAL)] * 5,
        merges=spec.merges + ["1 2", "12 3", "4 5", "45 6"], bos_id=spec.bos_id,
        eos_id=spec.eos_id, pad_id=spec.pad_id, chat_template=spec.chat_template, words=spec.words,
    )


@pytest.mark.parametrize("pre", ["qwen2", "glm4", "llama-bpe"])
def test_each_pre_tokenizer_splits_as_llama_cpp(spec: VocabSpec, tmp_path: Path, pre: str) -> None:
    """qwen2 (Qwen3), glm4 (GLM-4.5: Llama 3's split, digits in threes) and llama-bpe (Llama 3:
    that split, and a piece that is a whole token skips the merges) on the same vocabulary:
    ours and llama.cpp's ids agree on llama.cpp's own test strings, digit runs and a token no
    merge makes."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write_vocab_gguf(tmp_path / f"{pre}.gguf", with_digit_and_unmerged_tokens(spec), pre=pre)
    tok = Tokenizer.from_metadata(open_gguf(path).metadata)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    texts = [*LLAMA_TEST_STRINGS, "1234567 89 0.12345", "x 3333333 y", "qzq qzq"]
    assert len(texts) > 40
    for text in texts:
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        assert tok.encode(text, special=False) == theirs, (pre, text)
    pieces = lambda text: [tok.token_text(i) for i in tok.encode(text)]
    assert pieces("1234567") == (list("1234567") if pre == "qwen2" else ["123", "456", "7"])
    assert pieces("qzq") == (["qzq"] if pre == "llama-bpe" else ["q", "z", "q"])
