"""Byte-level BPE tokenizer built from GGUF `tokenizer.ggml.*` metadata.

Encoding runs in the HuggingFace `tokenizers` library (pre-tokenizer regex split, ByteLevel,
BPE with the file's merge ranks); decoding maps each id to its bytes the way llama.cpp's
`token_to_piece` does, so a streamed reply and a whole decode agree byte for byte.
"""

from __future__ import annotations

import codecs
import os
import re
import threading
from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import TokenizerError
from engine.gguf.container import show_value

KEY_MODEL = "tokenizer.ggml.model"
KEY_PRE = "tokenizer.ggml.pre"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_TYPES = "tokenizer.ggml.token_type"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_BOS = "tokenizer.ggml.bos_token_id"
KEY_EOS = "tokenizer.ggml.eos_token_id"
KEY_PAD = "tokenizer.ggml.padding_token_id"
KEY_EOT = "tokenizer.ggml.eot_token_id"
KEY_EOM = "tokenizer.ggml.eom_token_id"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"

GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Llama 3's, which GLM-4 (glm4moe) shares: qwen2's with digits in runs of up to three.
LLAMA3_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# `tokenizer.ggml.pre` -> split regex, as llama.cpp's llama-vocab.cpp maps the names. llama.cpp's
# own "default" adds digit-grouping passes; we read it as plain GPT-2, which is what the
# converter means when it writes "default".
PRE_REGEX = {
    "qwen2": QWEN2_REGEX, "gpt2": GPT2_REGEX, "default": GPT2_REGEX,
    "glm4": LLAMA3_REGEX, "chatglm-bpe": LLAMA3_REGEX,
    "llama3": LLAMA3_REGEX, "llama-v3": LLAMA3_REGEX, "llama-bpe": LLAMA3_REGEX,
}
# Pre-tokenizers whose pieces that are whole tokens skip the merges (llama.cpp's
# `ignore_merges`, the `tokenizers` BPE's option of the same name).
IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe"})

# Text of end-of-generation tokens recognised by name, as llama.cpp does.
EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    n_extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n_extra)
            n_extra += 1
    return table


_UNICODE_TO_BYTE = {ch: b for b, ch in bytes_to_unicode().items()}
_TO_LATIN1 = str.maketrans({ch: chr(b) for ch, b in _UNICODE_TO_BYTE.items()})
# Characters that are not byte-level symbols; a token holding one takes the slow path.
_NON_BYTE_CHAR = re.compile("[^" + "".join(re.escape(ch) for ch in _UNICODE_TO_BYTE) + "]")


def byte_level_decode(text: str) -> bytes:
    """Bytes of a byte-level token; characters outside the byte map pass through as UTF-8."""
    if _NON_BYTE_CHAR.search(text) is None:
        return text.translate(_TO_LATIN1).encode("latin-1")
    out = bytearray()
    for ch in text:
        b = _UNICODE_TO_BYTE.get(ch)
        out += bytes([b]) if b is not None else ch.encode("utf-8")
    return bytes(out)


def make_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer for a `tokenizer.ggml.pre` name: regex split, ByteLevel."""
    if pre not in PRE_REGEX:
        raise TokenizerError(
            f"{KEY_PRE} = {pre!r} is not supported; supported: {', '.join(sorted(PRE_REGEX))}"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_REGEX[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


class StreamDecoder:
    """Incremental detokenizer: `push` returns only complete UTF-8 text.

    Bytes of a character split across byte tokens are held until the character is whole;
    invalid bytes become U+FFFD exactly as a one-shot `decode` would, so the concatenation of
    every `push` and the final `flush` equals `Tokenizer.decode` of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one id; return the text it completes ("" while a character is partial)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, self._skip_special))

    def flush(self) -> str:
        """End of stream: return held bytes (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """A GGUF `gpt2` (byte-level BPE) vocabulary: encode, decode, stream, chat template."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        pre: str = "default",
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_eog_ids: Iterable[int] = (),
    ) -> None:
        self.tokens = list(tokens)
        self.token_types = [int(t) for t in token_types]
        self.pre = pre
        self.add_bos = add_bos
        self.chat_template = chat_template or None
        n = len(self.tokens)
        if len(self.token_types) != n:
            raise TokenizerError(
                f"{KEY_TYPES} has {len(self.token_types)} entries but {KEY_TOKENS} has {n}; "
                "the file is inconsistent, re-export the model"
            )
        for key, value in ((KEY_BOS, bos_id), (KEY_EOS, eos_id), (KEY_PAD, pad_id)):
            if value is not None and not 0 <= value < n:
                raise TokenizerError(f"{key} = {value} is outside 0..{n - 1}; re-export the model")
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self._special_ids = frozenset(
            i for i, t in enumerate(self.token_types) if t in (TokenType.CONTROL, TokenType.UNKNOWN)
        )
        self._pieces: list[bytes | None] = [None] * n
        self._hf = self._build_hf(merges)
        # `encode_special_tokens` is per-tokenizer state, toggled per call under this lock
        self._hf_lock = threading.Lock()
        named = [self._hf.token_to_id(t) for t in EOG_TEXTS]
        eog = [i for i in (eos_id, *extra_eog_ids, *named) if i is not None and 0 <= i < n]
        self.eog_ids: frozenset[int] = frozenset(eog)

    def _build_hf(self, merges: Sequence[str]) -> HFTokenizer:
        # llama.cpp resolves duplicate token text to the last id; shadowed ids keep their slot
        # under a name byte-level text can never produce (byte 0 is 'Ā' there, never '\0').
        vocab: dict[str, int] = {}
        for i, text in enumerate(self.tokens):
            if text in vocab:
                prev = vocab[text]
                vocab[f"\0shadowed{prev}"] = prev
            vocab[text] = i
        pairs: list[tuple[str, str]] = []
        for k, merge in enumerate(merges):
            left, sep, right = merge.partition(" ")
            if not sep or not left or not right:
                raise TokenizerError(
                    f"{KEY_MERGES}[{k}] = {merge!r} is not two tokens separated by one space; "
                    "re-export the model"
                )
            missing = [t for t in (left, right, left + right) if t not in vocab]
            if missing:
                raise TokenizerError(
                    f"{KEY_MERGES}[{k}] = {merge!r} needs {missing[0]!r}, which is not in "
                    f"{KEY_TOKENS}; re-export the model"
                )
            pairs.append((left, right))
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                         ignore_merges=self.pre in IGNORE_MERGES)
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = make_pre_tokenizer(self.pre)
        hf.decoder = decoders.ByteLevel()
        control, user = [], []
        for i, kind in enumerate(self.token_types):
            if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
                control.append(AddedToken(self.tokens[i], special=True, normalized=False))
            elif kind == TokenType.USER_DEFINED:
                user.append(AddedToken(self.tokens[i], special=False, normalized=False))
        hf.add_special_tokens(control)
        hf.add_tokens(user)
        return hf

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from decoded GGUF metadata (`ModelFile.metadata`), or raise `TokenizerError`."""
        model = meta.get(KEY_MODEL)
        if model is None:
            raise TokenizerError(
                f"metadata key '{KEY_MODEL}' is missing; the file has no vocabulary"
            )
        if model != "gpt2":
            raise TokenizerError(
                f"{KEY_MODEL} = {model!r} is not supported; only 'gpt2' (byte-level BPE) is"
            )
        for key in (KEY_TOKENS, KEY_MERGES):
            if key not in meta:
                raise TokenizerError(f"metadata key '{key}' is missing; re-export the model")
        tokens = _array(meta, KEY_TOKENS, str)
        types = _array(meta, KEY_TYPES, int) if KEY_TYPES in meta else None
        template = meta.get(KEY_CHAT_TEMPLATE)
        return cls(
            tokens=tokens,
            token_types=[TokenType.NORMAL] * len(tokens) if types is None else types,
            merges=_array(meta, KEY_MERGES, str),
            pre=str(meta.get(KEY_PRE, "default")),
            bos_id=_opt_id(meta, KEY_BOS),
            eos_id=_opt_id(meta, KEY_EOS),
            pad_id=_opt_id(meta, KEY_PAD),
            add_bos=bool(meta.get(KEY_ADD_BOS, False)),
            chat_template=str(template) if template else None,
            extra_eog_ids=[i for k in (KEY_EOT, KEY_EOM) if (i := _opt_id(meta, k)) is not None],
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Open a GGUF file and build its tokenizer."""
        from engine.gguf.reader import open_gguf

        return cls.from_metadata(open_gguf(path).metadata)

    @property
    def n_vocab(self) -> int:
        """Number of tokens, the row count of `token_embd`."""
        return len(self.tokens)

    def encode(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. `special`: control-token text (`<|im_start|>`) becomes one id;
        otherwise it is tokenized as plain text. `add_bos=None` follows the file's flag."""
        with self._hf_lock:
            # True: control-token text is not split out, it goes through BPE as plain text
            self._hf.encode_special_tokens = not special
            # encode_batch lets go of the GIL while it works (encode holds it: a long prompt
            # would stall every other thread, the server's event loop among them)
            ids = self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError(f"add_bos was requested but the file has no {KEY_BOS}")
            ids.insert(0, self.bos_id)
        return ids

    def encode_many(self, texts: Sequence[str], special: bool = True) -> list[list[int]]:
        """`encode` of each text (no BOS), in one batch on the library's threads."""
        with self._hf_lock:
            self._hf.encode_special_tokens = not special
            return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the file (byte-level symbols, e.g. 'Ġthe')."""
        self._check_id(token_id)
        return self.tokens[token_id]

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes a token stands for: control text verbatim, unused tokens as nothing."""
        self._check_id(token_id)
        if skip_special and token_id in self._special_ids:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._piece(token_id)
            self._pieces[token_id] = piece
        return piece

    def _piece(self, token_id: int) -> bytes:
        kind = self.token_types[token_id]
        text = self.tokens[token_id]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8")
        if kind == TokenType.UNUSED:
            return b""
        return byte_level_decode(text)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        raw = b"".join(self.token_bytes(int(i), skip_special) for i in ids)
        return raw.decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer for one reply."""
        return StreamDecoder(self, skip_special)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **context: Any
    ) -> str:
        """Render `messages` with the file's chat template (ChatML when it has none), in the
        bounded renderer process (engine.gguf.template_renderer)."""
        from engine.gguf.template_renderer import render_chat

        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_id),
            eos_token=self._token_text(self.eos_id),
            **context,
        )

    def check_chat_template(self, source: str = "") -> None:
        """Refuse, in one line (after `source`, the file's name), a chat template that cannot
        render a probe conversation, or renders nothing, within the template limits: the
        engine's load, `strata info` and `strata plan` run it."""
        from engine.gguf.template_renderer import check_chat_template

        try:
            check_chat_template(self.chat_template, self._token_text(self.bos_id),
                                self._token_text(self.eos_id))
        except TokenizerError as exc:
            if not source:
                raise
            raise TokenizerError(f"{source}: {exc}") from None

    def _token_text(self, token_id: int | None) -> str:
        return self.tokens[token_id] if token_id is not None else ""

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self.tokens):
            raise TokenizerError(f"token id {token_id} is outside 0..{len(self.tokens) - 1}")


def _array(meta: dict[str, Any], key: str, kind: type) -> list[Any]:
    """A metadata array of `kind` items. The container decodes an array's items to one Python
    type, so the first item stands for all (no pass over a 152k vocabulary)."""
    value = meta[key]
    if not isinstance(value, list) or (value and not isinstance(value[0], kind)):
        raise TokenizerError(
            f"metadata key '{key}' = {show_value(value)} is not an array of {kind.__name__} "
            "values; the file is corrupt, re-export the model"
        )
    return value


def _opt_id(meta: dict[str, Any], key: str) -> int | None:
    """An optional token id: an integer (the range is checked against the vocabulary later)."""
    value = meta.get(key)
    if value is None or type(value) is int:
        return value
    raise TokenizerError(
        f"metadata key '{key}' = {show_value(value)} is not a token id (an integer); "
        "the file is corrupt, re-export the model"
    )
