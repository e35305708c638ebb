"""Expert providers (`engine.backend.base.ExpertProvider`): where the backend's `moe` op gets a
layer's routed experts, as decoded float32 weights (the array ops) or as quantized device
bytes (the CUDA kernels).

`CachedExperts` is the provider over the expert cache, for the prompt path and for decode
steps: resident experts are read from their cache slot; misses are streamed through the prompt
path's staging ring, or (decode) read from host memory: decoded there for the array ops,
copied into a transient device buffer for the kernels. With an admission policy
(`--cache-policy adaptive`, engine/experts/policy.py) each decode step's routing
(`observe`) may promote missed experts into the cache. Counters report hits, experts streamed,
bytes streamed and experts promoted. `DirectExperts` reads every expert from host memory (no
cache, no ring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.backend.base import Backend, DeviceArray
from engine.config import CACHE_POLICIES
from engine.experts.cache import ExpertCache
from engine.experts.decoded import DecodedLRU
from engine.experts.host import FileExperts
from engine.experts.policy import Admission
from engine.memory.ring import StagingRing


@dataclass
class StreamCounters:
    """What one prefill (or the decode path since the last reset) read and streamed."""

    hits: int = 0
    streamed: int = 0
    bytes_streamed: int = 0
    host_reads: int = 0
    promoted: int = 0  # decode: missed experts the admission policy put into the cache

    def reset(self) -> None:
        self.hits = self.streamed = self.bytes_streamed = self.host_reads = self.promoted = 0


class CachedExperts:
    """`ExpertProvider` over the expert cache (see the module docstring).

    The array ops read resident experts decoded once and kept (the bytes of a resident
    (layer, expert) never change), ring-staged ones decoded per chunk, host misses decoded
    from host memory; the kernels read the quantized bytes themselves.
    """

    def __init__(self, cache: ExpertCache | None, host: FileExperts, decoded: DecodedLRU,
                 backend: Backend):
        self.cache, self.host, self.decoded, self.backend = cache, host, decoded, backend
        self.layout_of = host.layout_of
        self.ring: StagingRing | None = None
        self._ahead: list[list[int]] | None = None  # per layer: the experts the cache lacks
        self._seen: dict[int, set[int]] = {}  # per layer: what the last chunk routed to
        self.counters = StreamCounters()
        self._host_decoded = DecodedLRU(64 << 20)
        self.admission: Admission | None = None
        self.on_warning: Callable[[str], None] | None = None

    def set_policy(self, policy: str) -> None:
        """`adaptive`: decode steps' routing promotes missed experts (a fresh `Admission`,
        seeded with what is resident now); `static`: the cache keeps its fill."""
        assert policy in CACHE_POLICIES and policy != "auto", policy
        self.admission = None
        if policy == "adaptive" and self.cache is not None and self.cache.n_slots:
            table = self.cache.table
            self.admission = Admission(table.n_layer, table.n_expert, table.slot_of >= 0)

    @property
    def policy(self) -> str:
        """The cache policy decoding runs under: 'adaptive' while an admission policy runs."""
        return "adaptive" if self.admission is not None else "static"

    def ranking(self) -> list[tuple[int, int]]:
        """Every (layer, expert), the one a new slot should hold first: by the admission
        policy's scores where it runs (the cache's fill order breaks ties), else the fill
        order (empty without a cache)."""
        order = self.cache.order if self.cache is not None else []
        return self.admission.ranking(order) if self.admission is not None else list(order)

    def observe(self, routes: Any) -> None:
        """A decode step's routing (per layer ids [T, k] on the device, a list or one
        [L, T, k] array: the token graph's, read back in one copy): the admission policy
        counts it and its promotions are uploaded before the next step. Nothing while a slot
        is lent or refilling (the prompt path holds it). A failed promotion turns the policy
        off for the run, with a warning (the cache is left consistent: see `promote`)."""
        cache, admission = self.cache, self.admission
        if admission is None or cache is None or cache.n_lent or self.ring is not None:
            return
        xp = self.backend.xp
        if isinstance(routes, list):  # the eager forward's, a [T, k] array per layer
            routes = xp.stack([xp.asarray(r) for r in routes])
        ids = self.backend.download(routes)  # [L, T, k]
        table = cache.table
        moves = admission.step(ids, table.slot_of, table.owner_of, cache.replaceable())
        if not moves:
            return
        try:
            self.counters.promoted += cache.promote(moves)
        except Exception as e:  # noqa: BLE001  an upload failed: decode from the cache as it is
            self.admission = None
            if self.on_warning is not None:
                self.on_warning(f"strata: warning: promoting experts into the cache failed "
                                f"({e}); the cache keeps its experts for this run")

    @property
    def ring_slots(self) -> int | None:
        return self.ring.n_slots if self.ring is not None else None

    def prepare(self, layer: int, experts: list[int]) -> None:
        if self._ahead is not None:
            self._seen[layer] = set(experts)

    def _resident(self, layer: int, expert: int) -> Any:
        """The cache slot's device bytes of (layer, expert), counted as a hit; None on a miss."""
        slot = self.cache.lookup(layer, expert) if self.cache is not None else -1
        if slot < 0:
            return None
        self.counters.hits += 1
        return self.cache.slot_view(slot)  # type: ignore[union-attr]

    def attach_ring(self, ring: StagingRing | None) -> None:
        """The prompt path's staging ring (None after the prompt). Where copies run beside
        compute (`Backend.async_copies`: CUDA) and the ring holds two layers of the experts
        the cache lacks, `prefetch` stages a layer ahead; otherwise experts are staged as the
        MoE reaches them. (Correctness never depends on the size: an evicted prefetch is
        staged again; two layers is what keeps layer L+1's prefetch from evicting layer L's
        before L reads them.)"""
        self.ring, self._ahead, self._seen = ring, None, {}
        if ring is None or not self.backend.async_copies:
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
        before, before_bytes = self.ring.n_uploads, self.ring.bytes_uploaded
        out = staging()
        n = self.ring.n_uploads - before
        self.counters.streamed += n
        self.counters.bytes_streamed += self.ring.bytes_uploaded - before_bytes
        return out

    def blob(self, layer: int, expert: int) -> DeviceArray:
        """Device bytes of (layer, expert) outside the prompt path: its cache slot, or a
        transient buffer its pieces are copied into (the kernels' decode-miss policy: stream
        it over PCIe asynchronously; the kernels that read it wait for the copy, the host does
        not)."""
        view = self._resident(layer, expert)
        if view is not None:
            return view
        assert self.ring is None, "on the prompt path misses go through the ring (blobs)"
        self.counters.streamed += 1
        n = self.host.layer_blob_bytes[layer]
        self.counters.bytes_streamed += n
        xp = self.backend.xp
        buf = xp.empty(n, dtype=xp.uint8)
        self.backend.upload(self.host.pieces(layer, expert), buf)  # DMA from the pinned file
        return buf

    def blobs(self, layer: int, experts: list[int]) -> list[DeviceArray]:
        """`blob` of each expert, as one group: on the ring, no expert of the group evicts
        another (at most `ring.n_slots` experts)."""
        if self.ring is None:
            return [self.blob(layer, e) for e in experts]
        views: list[Any] = [self._resident(layer, e) for e in experts]
        missing = [e for e, v in zip(experts, views) if v is None]
        ring = self.ring
        staged = iter(self._counted(lambda: ring.stage_group(layer, missing, self.host.pieces)))
        return [v if v is not None else next(staged) for v in views]

    def needs_slot(self, layer: int, expert: int) -> bool:
        """Not resident: `blobs` stages it in a ring slot (an uncounted lookup)."""
        return self.cache is None or self.cache.table.lookup(layer, expert) < 0

    def reads_queued(self, layer: int, experts: list[int]) -> None:
        if self.ring is not None:
            self.ring.release(layer, experts)

    def source(self, layer: int) -> None:
        return None  # the host reads the routing: experts are handed over

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        be, layout = self.backend, self.host.layout_of(layer)
        view = self._resident(layer, expert)
        if view is not None:
            return self.decoded.get((layer, expert), lambda: be.decode_expert(view, layout))
        if self.ring is not None:
            view = self._stage(layer, expert)  # upload: counted H2D
            return be.decode_expert(view, layout)  # decoded per chunk: this is streaming
        self.counters.host_reads += 1
        return self._host_decoded.get((layer, expert), lambda: _upload_decoded(be, self.host, layer, expert))


class DirectExperts:
    """`ExpertProvider` that reads every expert from host memory (no cache, no ring): decoded
    there and uploaded for the array ops (kept, up to `max_bytes`), uploaded quantized for
    the kernels."""

    ring_slots = None

    def __init__(self, host: FileExperts, backend: Backend, max_bytes: int = 256 << 20):
        self.host, self.backend, self.layout_of = host, backend, host.layout_of
        self._decoded = DecodedLRU(max_bytes)

    def prepare(self, layer: int, experts: list[int]) -> None:
        pass

    def prefetch(self, layer: int) -> None:
        pass

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        return self._decoded.get(
            (layer, expert), lambda: _upload_decoded(self.backend, self.host, layer, expert)
        )

    def blobs(self, layer: int, experts: list[int]) -> list[DeviceArray]:
        return [self.backend.to_device(self.host.blob(layer, e)) for e in experts]

    def needs_slot(self, layer: int, expert: int) -> bool:
        return False

    def reads_queued(self, layer: int, experts: list[int]) -> None:
        pass

    def source(self, layer: int) -> None:
        return None


def _upload_decoded(be: Backend, host: FileExperts, layer: int, expert: int) -> tuple[Any, Any, Any]:
    """(gate, up, down) of (layer, expert) decoded from host memory, then uploaded."""
    gate, up, down = host.weights(layer, expert)  # [f, d], [f, d], [d, f]
    return be.to_device(gate), be.to_device(up), be.to_device(down)
