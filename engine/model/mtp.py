"""The MTP (nextn) block: one extra transformer block that drafts the token after next.

GLM-4.5 / DeepSeek-V3 convention, as llama.cpp and vLLM compute it (embedding first, then
hidden: `cat([inputs_embeds, previous_hidden_states])`):

    u = concat(enorm(embed(t[p+1])), hnorm(h[p]))        # [T, 2d]
    x = u @ eh_proj.T                                    # [T, d]
    x = x + attention(x);  x = x + moe(x)                # the block's own attention and experts
    draft logits = head(shared_head_norm(x))             # draft-vocabulary rows

`h[p]` is the main model's pre-norm hidden at position p. Cell p of the block's own KV cache
(n_layer = 1) holds (h[p], t[p+1]) at RoPE position p, so its output there predicts t[p+2].
The output `x` is the `h_prev` of the next chained draft step (recursive MTP). Position 0 is
not masked (vLLM zeroes its embedding; llama.cpp does not).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.draft_head import DraftHead
from engine.errors import ModelError
from engine.gguf import names
from engine.kv import KVCache
from engine.model.attention import attention_block
from engine.model.loader import Model
from engine.model.moe import ExpertProvider, moe_block
from engine.model.ops import linear, rms_norm
from engine.model.weights import (
    BlockWeights,
    DecodedLRU,
    HostExperts,
    TokenEmbedding,
    load_block,
)
from engine.quant import dequantize
from engine.sampler import Sampler, distribution

if TYPE_CHECKING:
    from engine.session import Session

MTP_CHUNK = 512  # cells per MTP pass when catching up over a prompt

NO_MTP = "model has no MTP (nextn) layer; drop --mtp"


def require_mtp(model: Model) -> None:
    """Raise the one-line `ModelError` for a model without a nextn block."""
    if not model.has_mtp or model.mtp_experts is None:
        raise ModelError(f"{model.path.name}: {NO_MTP}")


@dataclass
class MTPOutput:
    logits: Any  # [T_out, N] draft-vocabulary logits (T_out = 1 'last', T 'all', 0 'none')
    hidden: Any  # [T, d] block output before shared_head_norm: h_prev of the next chained step


class MTPExperts:
    """The MTP block's routed experts as one resident quantized array [E, blob_bytes]
    (region `mtp.experts`); an `ExpertProvider` for local layer 0, releasable."""

    name = "mtp.experts"

    def __init__(
        self,
        host: HostExperts,
        xp: Any = np,
        to_device: Callable[[np.ndarray], Any] = np.ascontiguousarray,
    ):
        assert host.n_layer == 1, f"one MTP block supported, got {host.n_layer}"
        self.host, self.xp, self._to_device = host, xp, to_device
        self.nbytes = host.n_expert * host.blob_bytes
        blobs = self._read()
        self._crc = zlib.crc32(np.ascontiguousarray(blobs))
        self.blobs: Any = to_device(blobs)  # uint8 [E, blob_bytes]
        # decoded float32 copies: what the CPU keeps in place of a GPU's dequantizing GEMV
        self._decoded = DecodedLRU()

    @property
    def resident(self) -> bool:
        return self.blobs is not None

    def prepare(self, layer: int, experts: list[int]) -> None:
        assert layer == 0, f"MTP experts have one local layer, got {layer}"

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        assert self.blobs is not None, "MTP experts are released (on loan); restore them first"
        return self._decoded.get(expert, lambda: self._decode(expert))

    def _decode(self, expert: int) -> tuple[Any, Any, Any]:
        blob = _host(self.xp)(self.blobs[expert])  # [blob_bytes]
        gate, up, down = self.host.layout.decode(blob)  # [f, d], [f, d], [d, f]
        return self.xp.asarray(gate), self.xp.asarray(up), self.xp.asarray(down)

    def release(self) -> int:
        """Drop the resident blobs; returns the bytes freed (0 if already released)."""
        if self.blobs is None:
            return 0
        self.blobs = None
        self._decoded.clear()
        return self.nbytes

    def restore(self) -> int:
        """Re-read every blob from the host copy (the GGUF map); returns the bytes resident."""
        if self.blobs is None:
            self.blobs = self._to_device(self._read())
        return self.nbytes

    def check_integrity(self, deep: bool = False) -> None:
        """Shape and size always; with `deep`, the blobs' checksum against the file's."""
        if self.blobs is None:
            return
        want = (self.host.n_expert, self.host.blob_bytes)
        if tuple(self.blobs.shape) != want or int(self.blobs.nbytes) != self.nbytes:
            raise AssertionError(
                f"MTP experts {tuple(self.blobs.shape)} ({int(self.blobs.nbytes)} bytes), "
                f"expected {want} ({self.nbytes} bytes)"
            )
        if deep:
            crc = zlib.crc32(np.ascontiguousarray(_host(self.xp)(self.blobs)))
            if crc != self._crc:
                raise AssertionError(f"MTP experts checksum {crc:08x} != file {self._crc:08x}")

    def _read(self) -> np.ndarray:
        return np.stack([self.host.blob(0, e) for e in range(self.host.n_expert)])


class MTPBlock:
    """Weights of the nextn block and its forward pass. Run-state (its KV) lives outside."""

    def __init__(
        self,
        model: Model,
        head: DraftHead | None = None,
        experts: ExpertProvider | None = None,
        xp: Any = np,
        to_device: Callable[[np.ndarray], Any] = np.ascontiguousarray,
    ):
        require_mtp(model)
        assert model.mtp_experts is not None
        mf, hp = model.mf, model.hp
        self.model, self.hp, self.xp, self._to_device = model, hp, xp, to_device
        i = hp.n_layer  # the nextn block follows the main blocks
        get = lambda kind: to_device(dequantize(mf.tensor(names.nextn(kind, i))))
        self.eh_proj = get("eh_proj")  # [d, 2d]
        self.enorm = get("enorm")  # [d]
        self.hnorm = get("hnorm")  # [d]
        self.shared_head_norm = get("shared_head_norm")  # [d]
        self.block: BlockWeights = load_block(mf, i, to_device)
        own_embd = mf.tensors.get(names.nextn("embed_tokens", i))
        self.embd = TokenEmbedding(
            own_embd if own_embd is not None else mf.tensor(names.TOKEN_EMBD)
        )  # host rows
        self.head = (
            head if head is not None else DraftHead.from_model(model, 0, None, xp, to_device)
        )
        # default: a resident, releasable copy of the quantized experts (not the host map)
        self.experts: ExpertProvider = experts or MTPExperts(model.mtp_experts, xp, to_device)

    def new_kv(self, n_ctx: int, kind: str = "f16", alloc: Callable | None = None) -> KVCache:
        """An empty KV cache for the block (one layer, `n_ctx` cells)."""
        hp = self.hp
        return KVCache(self.xp, 1, n_ctx, hp.n_head_kv, hp.head_dim, kind, alloc)

    def forward(
        self, h_prev: Any, tokens: np.ndarray, pos0: int, kv: KVCache, logits: str = "last"
    ) -> MTPOutput:
        """Cells pos0..pos0+T-1 from h_prev [T, d] and the tokens after them [T]; writes K/V."""
        xp, hp = self.xp, self.hp
        ids = np.asarray(tokens, dtype=np.int64)
        assert h_prev.shape == (len(ids), hp.n_embd), (h_prev.shape, len(ids))
        e = xp.asarray(self.embd.rows(ids))  # [T, d] activations, not a weight upload
        u = xp.concatenate(
            [rms_norm(xp, e, self.enorm, hp.rms_eps), rms_norm(xp, h_prev, self.hnorm, hp.rms_eps)],
            axis=-1,
        )  # [T, 2d]: embedding first, then hidden
        x = linear(xp, u, self.eh_proj)  # [T, d]
        x = x + attention_block(xp, hp, self.block.attn, x, pos0, kv, 0)
        ffn, _, _ = moe_block(xp, hp, self.block.ffn_norm, self.block.router, x, 0, self.experts)
        x = x + ffn  # [T, d]
        kv.n_tokens = pos0 + len(ids)
        if logits == "none":
            out = xp.zeros((0, self.head.n_rows), dtype=xp.float32)
        else:
            sel = x if logits == "all" else x[-1:]
            out = self.head.logits(rms_norm(xp, sel, self.shared_head_norm, hp.rms_eps))
        return MTPOutput(logits=out, hidden=x)


@dataclass
class Draft:
    """Proposed tokens and, in sampled mode, the [V] distribution q each was drawn from."""

    tokens: list[int]
    q: list[np.ndarray] | None


def draft_token(logits: np.ndarray, sampler: Sampler) -> tuple[int, np.ndarray | None]:
    """logits [V] -> greedy argmax, or a draw from the sampling distribution q (returned)."""
    if sampler.params.greedy:
        return int(np.argmax(logits)), None
    q = distribution(logits, sampler.params)
    return sampler.draw(q), q


class MTPDraft:
    """Drafts with the MTP block; its KV cache (run-state) follows the main session.

    Cell p needs the main hidden h[p]: `observe` builds cells from the prompt's hidden after
    prefill and from the verifier's hidden of each accepted window. Chained drafts write cells
    past the committed ones, fed the block's own output; the next `observe` overwrites them.
    Implements `engine.spec.DraftSource`.
    """

    def __init__(self, block: MTPBlock, kv_alloc: Callable | None = None):
        self.block, self._kv_alloc = block, kv_alloc
        self.kv: KVCache | None = None
        self.n_cells = 0  # committed cells 0..n_cells-1
        self.seq: list[int] = []  # t[0..n_cells]: main tokens and the pending one
        self._logits: np.ndarray | None = None  # [N] draft logits of the last committed cell
        self._hidden: Any = None  # [1, d] block output there: h_prev of the first chained step

    def resources(self) -> list[Any]:
        """The releasable objects: MTP experts, then the draft head (loan release order)."""
        return [r for r in (self.block.experts, self.block.head) if hasattr(r, "release")]

    def reusable(self, session: Session, prompt_ids: list[int], reuse: int) -> int:
        kv = session.kv
        if self.kv is None or (self.kv.n_ctx, self.kv.kind) != (kv.n_ctx, kv.kind):
            self.kv = self.block.new_kv(kv.n_ctx, kv.kind, self._kv_alloc)
            self.n_cells, self.seq, self._logits, self._hidden = 0, [], None, None
        n_match = 0  # cell p stays valid while t[0..p+1] match
        for a, b in zip(self.seq, prompt_ids):
            if a != b:
                break
            n_match += 1
        return max(0, min(reuse, self.n_cells, n_match - 1))

    def truncate(self, n: int) -> None:
        if n < self.n_cells:
            self.n_cells = n
            del self.seq[n + 1 :]
            self._logits = self._hidden = None
        if self.kv is not None:
            self.kv.truncate(min(self.kv.n_tokens, self.n_cells))

    def observe(self, session: Session, pos0: int, hidden: Any, next_ids: list[int]) -> None:
        assert self.kv is not None, "reusable() binds the MTP KV to the session first"
        n = len(next_ids)
        assert 0 < n == hidden.shape[0], (n, hidden.shape)
        assert pos0 <= self.n_cells, (
            f"MTP has cells 0..{self.n_cells - 1}, asked to go on at {pos0}"
        )
        assert session.tokens[pos0 + 1 : pos0 + n] == list(next_ids[:-1])
        self.kv.truncate(pos0)
        for a in range(0, n, MTP_CHUNK):
            b = min(n, a + MTP_CHUNK)
            want = "last" if b == n else "none"
            out = self.block.forward(  # prompt rows come from host memory, a slice at a time
                self.block.xp.asarray(hidden[a:b]), np.asarray(next_ids[a:b]), pos0 + a, self.kv, want
            )
        self.n_cells = pos0 + n
        self.seq = [*session.tokens[: pos0 + 1], *next_ids]
        self._logits = _host(self.block.xp)(out.logits[-1])
        self._hidden = out.hidden[-1:]

    def propose(self, session: Session, pending: int, n_draft: int, sampler: Sampler) -> Draft:
        assert self.kv is not None and self._logits is not None, "observe() comes first"
        assert self.n_cells == len(session.tokens) and self.seq[-1] == pending
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        logits, h = self._logits, self._hidden
        for j in range(n_draft):
            if j:  # chained step: the block's own output stands in for the main hidden
                out = self.block.forward(h, np.asarray(tokens[-1:]), self.n_cells + j - 1, self.kv)
                logits, h = _host(self.block.xp)(out.logits[-1]), out.hidden
            tok, q = draft_token(self.block.head.full_logits(logits), sampler)
            tokens.append(tok)
            if q is not None:
                qs.append(q)
        return Draft(tokens, None if sampler.params.greedy else qs)

    def check_integrity(self) -> None:
        if self.kv is None:
            return
        self.kv.check_integrity()
        if self.n_cells > self.kv.n_tokens or (self.n_cells and len(self.seq) != self.n_cells + 1):
            raise AssertionError(
                f"MTP state: {self.n_cells} cells, KV {self.kv.n_tokens}, {len(self.seq)} tokens"
            )


def _host(xp: Any) -> Callable[[Any], np.ndarray]:
    return getattr(xp, "asnumpy", np.asarray)
