"""The draft head: output-head rows of a draft vocabulary, held as a releasable array.

The MTP block drafts through its own copy of head rows (region `mtp.draft_head`), so the
VRAM loan can release it before prefill and restore it, byte for byte, before the first token.

Draft vocabulary (`--draft-vocab N`, 0 = every row). With token frequencies (`counts`, for
instance from a profile of generated text), the N most frequent ids are kept. Without them we
keep the first ids of the regular vocabulary (normal, byte and user-defined tokens; control,
unknown and unused tokens are skipped): in a byte-level BPE vocabulary ids follow merge order,
so low ids are the short, frequent pieces. End-of-generation ids are always kept, so a draft
can propose the end of a turn; they count towards N. Draft rows map back to full-vocabulary
ids through `ids`; the verifier always scores the full vocabulary.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.backend.base import Backend
from engine.errors import FlagError
from engine.gguf import names
from engine.gguf.quant import QuantMatrix, dequantize_bytes, keeps_quantized
from engine.gguf.reader import TensorView
from engine.gguf.tokenizer import Tokenizer, TokenType
from engine.model.loader import Model

REGULAR_TYPES = (TokenType.NORMAL, TokenType.BYTE, TokenType.USER_DEFINED)


def select_draft_ids(tokenizer: Tokenizer, n: int, counts: np.ndarray | None = None) -> np.ndarray:
    """Sorted full-vocabulary ids [N] int64 of the draft vocabulary (N = n, or V when n is 0)."""
    v = tokenizer.n_vocab
    if n < 0:
        raise FlagError(f"--draft-vocab {n} must be >= 0 (0 keeps every row)")
    if n == 0 or n >= v:
        return np.arange(v, dtype=np.int64)
    eog = sorted(tokenizer.eog_ids)
    if n <= len(eog):
        raise FlagError(
            f"--draft-vocab {n} must be larger than the {len(eog)} end-of-generation tokens "
            "it always keeps"
        )
    if counts is not None:
        if counts.shape != (v,):
            raise FlagError(f"draft-vocab counts have shape {list(counts.shape)}, expected [{v}]")
        order = np.argsort(-counts, kind="stable")  # most frequent first, ties by lower id
    else:
        types = np.asarray(tokenizer.token_types)
        order = np.nonzero(np.isin(types, [int(t) for t in REGULAR_TYPES]))[0]
    rest = [int(i) for i in order if int(i) not in tokenizer.eog_ids][: n - len(eog)]
    return np.asarray(sorted(rest + eog), dtype=np.int64)


def shares_native_head(model: Model, draft_vocab: int) -> bool:
    """Whether the draft head would be every row of the native head's own tensor (no MTP head
    of its own, no draft vocabulary): then it is the native head itself (`NativeDraftHead`)."""
    hp = model.hp
    full = draft_vocab == 0 or draft_vocab >= hp.n_vocab
    return full and head_tensor(model) is model.mf.tensors[names.native_head(hp.has_output)]


def draft_head_of(model: Model, draft_vocab: int = 0,
                  to_device: Callable[[np.ndarray], Any] | None = None) -> NativeDraftHead | DraftHead:
    """The draft head of the built `model`: the native head itself where it shares its rows
    (`shares_native_head`), else a copy of the draft vocabulary's rows (`to_device`: where)."""
    if shares_native_head(model, draft_vocab):
        return NativeDraftHead(model.transformer)
    return DraftHead.from_model(model, draft_vocab, None, to_device)


def head_tensor(model: Model) -> TensorView:
    """The rows the MTP block predicts with: its own shared head, else the main output head
    (else the tied token embedding)."""
    own = names.nextn("shared_head_head", model.hp.n_layer)
    for name in (own, names.OUTPUT, names.TOKEN_EMBD):
        if name in model.mf.tensors:
            return model.mf.tensors[name]
    raise AssertionError("token_embd is always present")  # read_hparams checked it


class NativeDraftHead:
    """The draft head when it is the whole native output head (every row of the same tensor):
    the transformer's own head, read in place. No copy and no region of its own: the native
    head's loan releases and restores it, before any draft runs."""

    def __init__(self, transformer: Any):
        self.transformer = transformer
        self.n_vocab = self.n_rows = int(transformer.hp.n_vocab)
        self.ids = np.arange(self.n_rows, dtype=np.int64)
        self.full = True

    def logits(self, normed: Any) -> Any:
        """normed: [T, d] (after shared_head_norm) -> draft logits [T, V]."""
        head = self.transformer.head
        assert head is not None, "output head is released (on loan); restore it first"
        return self.transformer.backend.linear(normed, head)

    def full_logits(self, draft_logits: np.ndarray) -> np.ndarray:
        return draft_logits


class DraftHead:
    """Rows `ids` of an output head on the device, [N, d]: floats, or (`quantized`) the file's
    blocks as a `QuantMatrix`; releasable."""

    name = "mtp.draft_head"

    def __init__(
        self,
        source: TensorView,
        ids: np.ndarray,
        backend: Backend,
        to_device: Callable[[np.ndarray], Any] | None = None,
        decoded: np.ndarray | None = None,
        quantized: bool = False,
    ):
        """`to_device`: where the rows go (a ledger region's arena; by default a new device
        array). `decoded`: the whole `source` already decoded (float32 [V, d], the native
        head's host copy), so the rows are taken from it instead of decoding the file again.
        `quantized`: keep the rows in the file's blocks (`--dense quant`, a type the kernels
        decode)."""
        self.source, self.backend = source, backend
        self.quantized = quantized and keeps_quantized(source.qtype)
        self._to_device = to_device or backend.to_device
        self._decoded = decoded
        self.ids = np.asarray(ids, dtype=np.int64)  # [N] full-vocabulary id of each row
        self.n_vocab, self.n_embd = source.shape
        assert self.ids.ndim == 1 and 0 < self.ids.size <= self.n_vocab, self.ids.shape
        assert np.all(np.diff(self.ids) > 0) and 0 <= self.ids[0] and self.ids[-1] < self.n_vocab
        self.nbytes = int(self.ids.size * self.n_embd * 4)
        self._host_rows: np.ndarray | None = None
        host = self._host_rows = self._read()
        self._crc = zlib.crc32(np.ascontiguousarray(host))  # no copy of a contiguous array
        self.rows: Any = self._upload(host)  # [N, d]
        self.nbytes = int(self.rows.nbytes)  # the device bytes (fp16 on CUDA, or blocks)

    @classmethod
    def from_model(
        cls,
        model: Model,
        draft_vocab: int = 0,
        counts: np.ndarray | None = None,
        to_device: Callable[[np.ndarray], Any] | None = None,
    ) -> DraftHead:
        """The draft head of the built `model`, on its backend (a copy of rows; see
        `draft_head_of` for the head shared with the native one)."""
        ids = select_draft_ids(model.tokenizer, draft_vocab, counts)
        source = head_tensor(model)
        tr = model.transformer
        assert tr is not None, "build the model's weights first"
        quantized = tr.quantized and keeps_quantized(source.qtype)
        shared = source is model.mf.tensors.get(names.OUTPUT) and not quantized
        return cls(source, ids, tr.backend, to_device, tr.head_host() if shared else None,
                   quantized=quantized)

    @property
    def n_rows(self) -> int:
        return int(self.ids.size)

    @property
    def full(self) -> bool:
        """True when the draft vocabulary is the whole vocabulary."""
        return self.n_rows == self.n_vocab

    @property
    def resident(self) -> bool:
        return self.rows is not None

    def logits(self, normed: Any) -> Any:
        """normed: [T, d] (after shared_head_norm) -> draft logits [T, N]."""
        assert self.rows is not None, "draft head is released (on loan); restore it first"
        return self.backend.linear(normed, self.rows)

    def full_logits(self, draft_logits: np.ndarray) -> np.ndarray:
        """Host draft logits [N] -> [V] with -inf outside the draft vocabulary."""
        if self.full:
            return draft_logits
        out = np.full(self.n_vocab, -np.inf, dtype=draft_logits.dtype)
        out[self.ids] = draft_logits
        return out

    def release(self) -> int:
        """Drop the device rows; returns the bytes freed (0 if already released)."""
        if self.rows is None:
            return 0
        self.rows = None
        return self.nbytes

    def restore(self) -> int:
        """Re-read the rows from the GGUF file; returns the bytes now resident."""
        if self.rows is None:
            self.rows = self._upload(self._read())
        return self.nbytes

    def check_integrity(self, deep: bool = False) -> None:
        """Shape and size always; with `deep`, the rows' checksum against the file's."""
        if self.rows is None:
            return
        shape = tuple(self.rows.shape)
        if shape != (self.n_rows, self.n_embd) or int(self.rows.nbytes) != self.nbytes:
            raise AssertionError(
                f"draft head rows {shape} ({int(self.rows.nbytes)} bytes), expected "
                f"{(self.n_rows, self.n_embd)} ({self.nbytes} bytes)"
            )
        if deep:
            rows = self.rows.raw if isinstance(self.rows, QuantMatrix) else self.rows
            crc = zlib.crc32(np.ascontiguousarray(self.backend.download(rows)))
            if crc != self._crc:
                raise AssertionError(f"draft head checksum {crc:08x} != file rows {self._crc:08x}")

    def _upload(self, host: np.ndarray) -> Any:
        """Host rows (`_read`) -> the device rows [N, d]."""
        if self.quantized:
            return QuantMatrix(self._to_device(host.reshape(-1)), self.source.qtype,
                               (self.n_rows, self.n_embd))
        return self._to_device(host)

    def _read(self) -> np.ndarray:
        """The rows on the host: float32 [N, d], or uint8 [N, row_bytes] blocks when quantized
        (the file map itself for the whole vocabulary)."""
        if self._host_rows is not None:  # read once; a restore is one upload
            return self._host_rows
        if self.quantized:
            raw = self.source.raw.reshape(self.n_vocab, -1).view(np.uint8)  # [V, row_bytes]
            return raw if self.full else raw[self.ids]
        if self._decoded is not None:  # the native head's rows: the same bytes, decoded once
            rows = self._decoded[self.ids] if not self.full else self._decoded
            self._decoded = None  # the rows are kept from here on, not the whole head
            return rows
        t = self.source
        raw = t.raw.reshape(self.n_vocab, -1).view(np.uint8)  # [V, row_bytes]
        return dequantize_bytes(raw[self.ids], t.qtype, (self.n_rows, self.n_embd))

