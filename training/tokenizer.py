"""A byte-level BPE vocabulary trained on the chat corpus with the `tokenizers` library.

The same pre-tokenizer the engine encodes with (qwen2's regex, then ByteLevel), so the merges
replay exactly in `engine.gguf.tokenizer` and in llama.cpp. Ids as the engine's synthetic
vocabularies lay them out: the 256 byte tokens (id = byte value), merged tokens in merge
order, then `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from engine.gguf.tokenizer import Tokenizer, bytes_to_unicode, make_pre_tokenizer
from engine.synth.vocab import PRE, SPECIAL_TOKENS, VocabSpec


def train_vocab(texts: Iterable[str], n_vocab: int) -> VocabSpec:
    """A `VocabSpec` of exactly `n_vocab` tokens whose merges are trained on `texts`."""
    n_merged = n_vocab - 256 - len(SPECIAL_TOKENS)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = make_pre_tokenizer(PRE)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + n_merged,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    hf.train_from_iterator(texts, trainer=trainer)
    raw = json.loads(hf.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in raw]
    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)]
    index = set(tokens)
    merge_lines = []
    for left, right in merges:
        merge_lines.append(f"{left} {right}")
        if left + right not in index:
            index.add(left + right)
            tokens.append(left + right)
    # the trainer may stop short (too few distinct pairs): pad with unreachable byte pairs
    n_regular = n_vocab - len(SPECIAL_TOKENS)
    filler = (a + b for a in byte_chars.values() for b in byte_chars.values())
    while len(tokens) < n_regular:
        t = next(filler)
        if t not in index:
            index.add(t)
            tokens.append(t)
    return VocabSpec.chatml(tokens[:n_regular], merge_lines[: n_regular - 256])


def tokenizer_of(vocab: VocabSpec) -> Tokenizer:
    """The engine's tokenizer over `vocab` (what encodes the training text)."""
    return Tokenizer(
        tokens=vocab.tokens, token_types=vocab.token_types, merges=vocab.merges, pre=PRE,
        bos_id=vocab.bos_id, eos_id=vocab.eos_id, pad_id=vocab.pad_id,
        chat_template=vocab.chat_template,
    )  # fmt: skip
