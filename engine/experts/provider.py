"""The expert provider over the expert cache, for the prompt path and for decode steps.

Resident experts are read from their cache slot; misses are streamed through the prompt
path's staging ring, or (decode) decoded from host memory on the CPU and copied into a
transient device buffer on CUDA. Counters report hits, experts streamed and bytes streamed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import phases
from engine.backend.base import Backend
from engine.experts.cache import ExpertCache
from engine.experts.decoded import DecodedLRU
from engine.experts.host import FileExperts
from engine.memory.ring import StagingRing


@dataclass
class StreamCounters:
    """What one prefill (or the decode path since the last reset) read and streamed."""

    hits: int = 0
    streamed: int = 0
    bytes_streamed: int = 0
    host_reads: int = 0

    def reset(self) -> None:
        self.hits = self.streamed = self.bytes_streamed = self.host_reads = 0


class CachedExperts:
    """ExpertProvider over the expert cache.

    Resident experts are read from their slot (on the CPU decoded once and kept: the bytes
    of a resident (layer, expert) never change). Misses go to the staging ring when one is
    attached (the prompt path); otherwise (decode) the CPU decodes them from host memory and
    CUDA copies them into a transient device buffer.
    """

    def __init__(self, cache: ExpertCache | None, host: FileExperts, decoded: DecodedLRU,
                 to_host: Callable[[Any], Any], backend: Backend | None = None):
        """`backend`: given on CUDA, where experts are computed from their quantized bytes by
        the MoE kernels and a decode miss is streamed into a transient device buffer."""
        self.cache, self.host, self.decoded = cache, host, decoded
        self.ring: StagingRing | None = None
        self._ahead: list[list[int]] | None = None  # per layer: the experts the cache lacks
        self._seen: dict[int, set[int]] = {}  # per layer: what the last chunk routed to
        self.counters = StreamCounters()
        self._to_host = to_host
        self._host_decoded = DecodedLRU(64 << 20)
        self._backend = backend
        if backend is not None:
            self.ffn = self.kernel_ffn

    def prepare(self, layer: int, experts: list[int]) -> None:
        pass

    def _resident(self, layer: int, expert: int) -> Any:
        """The cache slot's device bytes of (layer, expert), counted as a hit; None on a miss."""
        slot = self.cache.lookup(layer, expert) if self.cache is not None else -1
        if slot < 0:
            return None
        self.counters.hits += 1
        return self.cache.slot_view(slot)  # type: ignore[union-attr]

    def attach_ring(self, ring: StagingRing | None) -> None:
        """The prompt path's staging ring (None after the prompt). On CUDA, when the ring
        holds two layers of the experts the cache lacks, `prefetch` stages a layer ahead;
        otherwise experts are staged as the MoE kernels reach them. (Correctness never
        depends on the size: an evicted prefetch is staged again; two layers is what keeps
        layer L+1's prefetch from evicting layer L's before L reads them.)"""
        self.ring, self._ahead, self._seen = ring, None, {}
        if ring is None or self._backend is None:
            return
        n_layer, n_expert = self.host.n_layer, self.host.n_expert
        lookup = self.cache.lookup if self.cache is not None else (lambda layer, e: -1)
        missing = [[e for e in range(n_expert) if lookup(layer, e) < 0] for layer in range(n_layer)]
        if 2 * max(len(m) for m in missing) <= ring.n_slots:
            self._ahead = missing

    def prefetch(self, layer: int) -> None:
        """Queue the uploads of the experts of `layer` the cache lacks (when `attach_ring`
        enabled it): on the first chunk all of them, later only those the previous chunk
        routed to at this layer (routing is similar chunk to chunk; an expert not
        prefetched is staged when the MoE reaches it). The compute waits for each copy only
        where it reads it."""
        if self._ahead is None or layer >= len(self._ahead):
            return
        seen = self._seen.get(layer)
        experts = [e for e in self._ahead[layer] if seen is None or e in seen]
        ring, pieces = self.ring, self.host.pieces
        assert ring is not None
        if experts:  # one batch of copies behind one wait, one event
            self._counted(lambda: ring.stage_group(layer, experts, pieces, wait=False))

    def _stage(self, layer: int, expert: int) -> Any:
        """The ring slot holding (layer, expert), counted as streamed when uploaded."""
        assert self.ring is not None
        return self._counted(lambda: self.ring.stage(layer, expert, self.host.pieces))

    def _counted(self, staging: Callable[[], Any]) -> Any:
        """Run a ring staging call; what it uploaded counts as streamed."""
        assert self.ring is not None
        before = self.ring.n_uploads
        out = staging()
        n = self.ring.n_uploads - before
        self.counters.streamed += n
        self.counters.bytes_streamed += n * self.host.blob_bytes
        return out

    def blob(self, layer: int, expert: int) -> Any:
        """Device bytes of (layer, expert) on CUDA outside the prompt path: its cache slot, or
        a transient buffer its pieces are copied into (the decode-miss policy: stream it
        over PCIe asynchronously; the kernels that read it wait for the copy, the host does
        not)."""
        view = self._resident(layer, expert)
        if view is not None:
            return view
        assert self._backend is not None and self.ring is None, "blob() is CUDA's decode path"
        self.counters.streamed += 1
        self.counters.bytes_streamed += self.host.blob_bytes
        buf = self._backend.xp.empty(self.host.blob_bytes, dtype=self._backend.xp.uint8)
        self._backend.upload(self.host.pieces(layer, expert), buf)  # DMA from the pinned file
        return buf

    def blobs(self, layer: int, experts: list[int]) -> list[Any]:
        """`blob` of each expert, as one group: on the ring, no expert of the group evicts
        another (at most `ring.n_slots` experts)."""
        if self.ring is None:
            return [self.blob(layer, e) for e in experts]
        views: list[Any] = [self._resident(layer, e) for e in experts]
        missing = [e for e, v in zip(experts, views) if v is None]
        ring = self.ring
        staged = iter(self._counted(lambda: ring.stage_group(layer, missing, self.host.pieces)))
        return [v if v is not None else next(staged) for v in views]

    def kernel_ffn(self, layer: int, h: Any, ids: Any, w: Any, used: list[int],
                   counts: Any = None) -> Any:
        """The routed FFN on CUDA, h [T, d], ids/w [T, k] -> [T, d]: fused GEMVs for a few
        decode tokens, else grouped fp16 GEMMs with experts fetched one group at a time (a
        group never needs more ring slots than the ring has); `counts`: host rows per
        expert, when the caller read them."""
        from engine.kernels.moe import moe_decode, moe_prefill

        layout = self.host.layout
        if self._ahead is not None:
            self._seen[layer] = set(used)
        if h.shape[0] <= 8 and self.ring is None:
            return moe_decode(h, ids, w, {e: self.blob(layer, e) for e in used}, layout)
        ring = self.ring
        if ring is None:
            return moe_prefill(h, ids, w, lambda es: self.blobs(layer, es), layout, counts=counts,
                               lap=phases.lap)
        table = self.cache.table if self.cache is not None else None  # (uncounted lookups)
        return moe_prefill(h, ids, w, lambda es: self.blobs(layer, es), layout, counts=counts,
                           max_group=ring.n_slots, release=lambda es: ring.release(layer, es),
                           staged=lambda e: table is None or table.lookup(layer, e) < 0,
                           lap=phases.lap)  # fmt: skip

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        layout = self.host.layout
        view = self._resident(layer, expert)
        if view is not None:
            return self.decoded.get((layer, expert), lambda: layout.decode(self._to_host(view)))
        if self.ring is not None:
            view = self._stage(layer, expert)  # upload: counted H2D
            return layout.decode(self._to_host(view))  # decoded per chunk: this is streaming
        self.counters.host_reads += 1
        return self._host_decoded.get(
            (layer, expert), lambda: layout.decode(self.host.blob(layer, expert))
        )


def kernel_ffn(layout: Any, blobs: dict[int, Any], h: Any, ids: Any, w: Any,
               counts: Any = None) -> Any:
    """h [T, d], ids/w [T, k] -> [T, d] with the CUDA MoE kernels over resident blobs
    (`counts`: host rows per expert, when the caller read them)."""
    from engine.kernels.moe import moe_decode, moe_prefill

    if h.shape[0] <= 8:
        return moe_decode(h, ids, w, blobs, layout)
    return moe_prefill(h, ids, w, blobs, layout, counts=counts, lap=phases.lap)


class DirectExperts:
    """ExpertProvider that decodes experts straight from host memory (no cache, no ring)."""

    def __init__(self, host: FileExperts, to_device: Any = np.asarray, max_bytes: int = 256 << 20):
        self.host = host
        self._to_device = to_device
        self._decoded = DecodedLRU(max_bytes)

    def prepare(self, layer: int, experts: list[int]) -> None:
        pass

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        return self._decoded.get(
            (layer, expert),
            lambda: tuple(self._to_device(w) for w in self.host.weights(layer, expert)),  # type: ignore[return-value]
        )
