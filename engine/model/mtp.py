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
from typing import Any, Protocol

import numpy as np

from engine.backend.base import Backend, ExpertProvider
from engine.errors import ModelError
from engine.experts.decoded import DecodedLRU
from engine.experts.host import FileExperts
from engine.gguf import names
from engine.gguf.quant import ExpertLayout
from engine.kv import KVCache
from engine.model.attention import attention_block
from engine.model.loader import Model
from engine.model.moe import moe_block
from engine.model.weights import BlockWeights, TokenEmbedding, WeightLoader, load_block

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
    """The MTP block's routed experts in the releasable region `mtp.experts`; an
    `ExpertProvider` for local layer 0 (no ring).

    Every expert resident (`n_slots` None or >= E): one quantized array `data` [E, blob_bytes]
    uploaded once. Fewer slots (a device too small for all of them, `strata plan` says so):
    `data` [n_slots, blob_bytes] holds the experts drafts routed to most lately (LRU); a miss
    is uploaded from the page-locked host copy into the least recently used slot the call
    does not read. A call that reads more experts than there are slots gets the rest as
    transient device copies (outside the ledger, freed after the call)."""

    name = "mtp.experts"
    ring_slots = None

    def __init__(self, host: FileExperts, backend: Backend,
                 to_device: Callable[[np.ndarray], Any] | None = None,
                 n_slots: int | None = None,
                 alloc: Callable[[tuple[int, ...], Any], Any] | None = None):
        """`to_device` / `alloc`: where the blobs go (a ledger region's arena; by default new
        device arrays); `n_slots`: how many experts the region holds (None: all)."""
        assert host.n_layer == 1, f"one MTP block supported, got {host.n_layer}"
        self.host, self.backend, self.layout = host, backend, host.layout_of(0)
        self._to_device = to_device or backend.to_device
        self._alloc = alloc or (lambda shape, dtype: backend.xp.zeros(shape, dtype=dtype))
        n_expert = host.n_expert
        self.n_slots = n_expert if n_slots is None else min(n_slots, n_expert)
        assert self.n_slots >= 1, "an MTP expert region holds at least one expert"
        self.partial = self.n_slots < n_expert
        self.nbytes = self.n_slots * host.blob_bytes
        # uint8 [E, blob_bytes] gathered from the file once: a loan's restore (and a partial
        # region's miss) is one upload from it (page-locked on CUDA), not a gather and a staged
        # copy (344 ms for 324 MiB)
        self._host_data = self._read()
        backend.keep_for_upload(self._host_data)
        self._crc = zlib.crc32(self._host_data)
        # a partial region's bookkeeping: the expert in each slot (-1 empty), its last use
        self._owner = np.full(self.n_slots, -1, dtype=np.int64)  # [n_slots]
        self._slot_of = np.full(n_expert, -1, dtype=np.int64)  # [E]
        self._used_at = np.zeros(self.n_slots, dtype=np.int64)  # [n_slots] LRU clock
        self._clock = 0
        self.n_hits = self.n_uploads = 0  # partial region: reads served / uploads on a miss
        self.data: Any = None  # uint8 [n_slots, blob_bytes]
        self.restore()
        # decoded float32 copies: what the array ops keep in place of a GPU's dequantizing GEMV
        self._decoded = DecodedLRU()

    @property
    def resident(self) -> bool:
        return self.data is not None

    def layout_of(self, layer: int) -> ExpertLayout:
        return self.layout

    def prepare(self, layer: int, experts: list[int]) -> None:
        assert layer == 0, f"MTP experts have one local layer, got {layer}"

    def prefetch(self, layer: int) -> None:
        pass  # misses are uploaded where they are read

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        assert self.data is not None, "MTP experts are released (on loan); restore them first"
        return self._decoded.get(
            expert, lambda: self.backend.decode_expert(self._view(expert, {expert}), self.layout)
        )

    def blobs(self, layer: int, experts: list[int]) -> list[Any]:
        assert self.data is not None, "MTP experts are released (on loan); restore them first"
        reading = set(experts)
        return [self._view(e, reading) for e in experts]

    def needs_slot(self, layer: int, expert: int) -> bool:
        return False

    def reads_queued(self, layer: int, experts: list[int]) -> None:
        pass  # no ring: a slot's next upload waits for the compute queued before it

    def source(self, layer: int) -> None:
        return None

    def release(self) -> int:
        """Drop the device blobs; returns the bytes freed (0 if already released). The
        decoded float copies stay: they stand in for a GPU's dequantizing reads (host memory,
        outside the device's ledger), and `restore` brings back the same bytes, so a draft
        after a loan or a cache lend does not decode every expert again."""
        if self.data is None:
            return 0
        self.data = None
        return self.nbytes

    def restore(self) -> int:
        """Upload the blobs again from the host copy (a partial region: the experts its slots
        held); returns the bytes resident."""
        if self.data is not None:
            return self.nbytes
        if not self.partial:
            self.data = self._to_device(self._host_data)
            return self.nbytes
        self.data = self._alloc((self.n_slots, self.host.blob_bytes), np.uint8)
        for slot in np.flatnonzero(self._owner >= 0):
            self.backend.upload(self._host_data[self._owner[slot]], self.data[slot])
        return self.nbytes

    def check_integrity(self, deep: bool = False) -> None:
        """Shape and size always; with `deep`, the resident blobs' checksum against the file's."""
        if self.data is None:
            return
        want = (self.n_slots, self.host.blob_bytes)
        if tuple(self.data.shape) != want or int(self.data.nbytes) != self.nbytes:
            raise AssertionError(
                f"MTP experts {tuple(self.data.shape)} ({int(self.data.nbytes)} bytes), "
                f"expected {want} ({self.nbytes} bytes)"
            )
        if not deep:
            return
        held = np.flatnonzero(self._owner >= 0) if self.partial else np.arange(self.n_slots)
        experts = self._owner[held] if self.partial else held
        if not len(held):
            return
        got = np.ascontiguousarray(self.backend.download(self.data)[held])  # [n, blob_bytes]
        crc = zlib.crc32(got)
        file_crc = (zlib.crc32(np.stack([self.host.blob(0, int(e)) for e in experts]))
                    if self.partial else self._crc)  # the file's bytes, not the host copy's
        if crc != file_crc:
            raise AssertionError(f"MTP experts checksum {crc:08x} != file {file_crc:08x}")

    def _view(self, expert: int, reading: set[int]) -> Any:
        """The device bytes of `expert`: its slot, after an upload on a miss into the least
        recently used slot holding none of `reading`, or (every slot read by this call) a
        transient copy."""
        if not self.partial:
            return self.data[expert]
        self._clock += 1
        slot = int(self._slot_of[expert])
        if slot >= 0:
            self.n_hits += 1
            self._used_at[slot] = self._clock
            return self.data[slot]
        self.n_uploads += 1
        free = np.flatnonzero(~np.isin(self._owner, list(reading)))  # slots this call does not read
        if not free.size:
            return self.backend.to_device(self._host_data[expert])
        slot = int(free[np.argmin(self._used_at[free])])
        if self._owner[slot] >= 0:
            self._slot_of[self._owner[slot]] = -1
        self.backend.upload(self._host_data[expert], self.data[slot])
        self._owner[slot], self._slot_of[expert], self._used_at[slot] = expert, slot, self._clock
        return self.data[slot]

    def _read(self) -> np.ndarray:
        return np.stack([self.host.blob(0, e) for e in range(self.host.n_expert)])


class DraftRows(Protocol):
    """The head the block's logits come from: `n_rows` vocabulary rows (all of them, or the
    draft vocabulary's subset)."""

    @property
    def n_rows(self) -> int: ...

    def logits(self, normed: Any) -> Any:
        """normed [T, d] -> logits [T, n_rows]."""
        ...


class MTPBlock:
    """Weights of the nextn block and its forward pass. Run-state (its KV) lives outside."""

    def __init__(
        self,
        model: Model,
        head: DraftRows,
        experts: ExpertProvider | None = None,
        to_device: Callable[[np.ndarray], Any] | None = None,
    ):
        """On the backend of the built `model`; `to_device`: where the dense weights go (a
        ledger region's arena; by default new device arrays)."""
        require_mtp(model)
        assert model.mtp_experts is not None and model.transformer is not None
        mf, hp = model.mf, model.hp
        be = self.backend = model.transformer.backend
        to_device = to_device or be.to_device
        self.model, self.hp, self.xp = model, hp, be.xp
        i = hp.n_layer  # the nextn block follows the main blocks
        load = WeightLoader(to_device, model.transformer.quantized)
        get = lambda kind: load.vector(mf.tensor(names.nextn(kind, i)))
        self.eh_proj = load.matrix(mf.tensor(names.nextn("eh_proj", i)))  # [d, 2d]
        self.enorm = get("enorm")  # [d]
        self.hnorm = get("hnorm")  # [d]
        self.shared_head_norm = get("shared_head_norm")  # [d]
        self.block: BlockWeights = load_block(mf, hp, i, load)
        own_embd = mf.tensors.get(names.nextn("embed_tokens", i))
        self.embd = TokenEmbedding(
            own_embd if own_embd is not None else mf.tensor(names.TOKEN_EMBD)
        )  # host rows
        self.head = head  # the draft head (`engine.speculative.draft_head.DraftHead`)
        # default: a resident, releasable copy of the quantized experts (not the host map)
        self.experts: ExpertProvider = experts or MTPExperts(model.mtp_experts, be, to_device)

    def new_kv(self, n_ctx: int, kind: str = "f16", alloc: Callable | None = None) -> KVCache:
        """An empty KV cache for the block (one layer, `n_ctx` cells)."""
        hp = self.hp
        return KVCache(self.backend, 1, n_ctx, hp.n_head_kv, hp.head_dim, kind, alloc)

    def forward(
        self, h_prev: Any, tokens: np.ndarray, pos0: int, kv: KVCache, logits: str = "last"
    ) -> MTPOutput:
        """Cells pos0..pos0+T-1 from h_prev [T, d] and the tokens after them [T]; writes K/V."""
        be, xp, hp = self.backend, self.xp, self.hp
        ids = np.asarray(tokens, dtype=np.int64)
        assert h_prev.shape == (len(ids), hp.n_embd), (h_prev.shape, len(ids))
        e = be.embed(self.embd.raw_rows(ids), self.embd.t.qtype, hp.n_embd)  # [T, d] (a long
        # catch-up decodes its rows on the device, as the main model's prompt chunks do)
        u = xp.concatenate(
            [be.rms_norm(e, self.enorm, hp.rms_eps), be.rms_norm(h_prev, self.hnorm, hp.rms_eps)],
            axis=-1,
        )  # [T, 2d]: embedding first, then hidden
        x = be.linear(u, self.eh_proj)  # [T, d]
        x = x + attention_block(be, hp, self.block.attn, x, pos0, kv, 0)
        ffn, _, _ = moe_block(be, hp, self.block, x, 0, self.experts)
        x = x + ffn  # [T, d]
        kv.n_tokens = pos0 + len(ids)
        if logits == "none":
            out = xp.zeros((0, self.head.n_rows), dtype=xp.float32)
        else:
            sel = x if logits == "all" else x[-1:]
            out = self.head.logits(be.rms_norm(sel, self.shared_head_norm, hp.rms_eps))
        return MTPOutput(logits=out, hidden=x)

