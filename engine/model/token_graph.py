"""The token graph: a decode step (a few token rows through every block and the output head)
captured once as a CUDA graph and replayed every step; `--no-token-graph` turns it off.

Why. A decode step is ~15 launches per layer; from Python each costs 10-20 us of host time, and
the eager path brings the routed expert ids to the host once per layer (a wait for the GPU).
Replaying a graph queues the whole step in one call and the host never waits inside it.

What is captured is the model's own pass, `Transformer.forward_embedded`, through the backend:
its rows' position is a `DevicePosition` and its expert provider a `SourcedExperts`, and the
backend's ops take the kernels below for both (`rope`, `attention_at`, `moe_at`).

What makes the step capturable (engine/kernels/decode.py):
- every position-dependent kernel (RoPE, the KV write, attention) reads the step's position
  from device memory (`pos`), and attention reads the KV cells in place over the whole context
  (tiles past the position return at once), so the same launches serve every step;
- the MoE builds its GEMV job rows on the device from the routed ids and the staged residency
  table: a hit reads the cache slot, a miss reads the expert in place from the page-locked GGUF
  over PCIe (the decode-miss policy under the graph: nothing is copied, nothing waits);
- every linear is the fp16 GEMV kernel (cuBLAS calls cannot be captured): checked on the
  weights before a capture.

Graphs are keyed by (rows, logits wanted): plain decoding replays the 1-row graph, speculative
decoding also the n_window + 1 row one. Their temporaries come from a private memory pool fed
by the backend's workspace pool; after capture the pool hands those blocks to nobody else (a
graph's addresses are baked in), and graphs share them since they never run at once. A graph
is captured again when an address it baked in changes (the output head after a loan's restore,
the KV cache or the expert-cache region).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backend.base import Backend, DeviceArray, DevicePosition
from engine.config import DECODE_ROWS
from engine.errors import TokenGraphError
from engine.experts.cache import ExpertCache
from engine.experts.host import FileExperts
from engine.experts.provider import CachedExperts
from engine.gguf.quant import QuantMatrix, QuantStack
from engine.kernels.decode import GRAPH_KV_KINDS, ExpertSource
from engine.kernels.dequant import GEMV_MAX_ROWS, decoder_align
from engine.kv import KVCache
from engine.model.transformer import ForwardResult, Transformer


class SourcedExperts:
    """`ExpertProvider` of a captured decode step (the token graph): the MoE kernels find each
    expert themselves from `source(layer)` (the staged residency row: a hit reads its cache
    slot, a miss the page-locked file over PCIe), so the routed ids never leave the device.
    Nothing is staged, decoded or handed over here."""

    ring_slots = None

    def __init__(self, host: FileExperts, sources: list[ExpertSource]):
        self.layout_of = host.layout_of
        self.sources = sources  # per layer

    def source(self, layer: int) -> ExpertSource:
        return self.sources[layer]

    def prepare(self, layer: int, experts: list[int]) -> None:
        pass

    def prefetch(self, layer: int) -> None:
        pass

    def weights(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        raise AssertionError("a captured step's kernels read experts from `source`")

    def blobs(self, layer: int, experts: list[int]) -> list[DeviceArray]:
        raise AssertionError("a captured step's kernels read experts from `source`")

    def needs_slot(self, layer: int, expert: int) -> bool:
        return False

    def reads_queued(self, layer: int, experts: list[int]) -> None:
        pass


@dataclass
class Graph:
    """One captured step: the rows it reads and the outputs of the captured pass (their
    device buffers are the ones every replay writes)."""

    graph: Any
    x_in: Any  # [T, d] float32 token embeddings, written before each replay
    out: ForwardResult  # logits [T or 1, V], hidden [T, d], routes [L, T, k], margins [T]


class TokenGraph:
    """Captured decode steps of one transformer over one KV cache and expert cache.

    Construction raises `TokenGraphError` (one line) where the step cannot be captured here:
    a KV kind without a device-position kernel, a model file that is not page-locked, expert
    bytes the GEMV decoders cannot address."""

    def __init__(self, transformer: Transformer, kv: KVCache, experts: CachedExperts,
                 cache: ExpertCache | None, backend: Any, warn: Callable[[str], None]):
        """`backend`: the `CudaBackend` (its ops, counted copies and `mapped_address`);
        `warn`: where a step that cannot be replayed says why (decode steps then run eagerly)."""
        import cupy

        if kv.kind not in GRAPH_KV_KINDS:
            raise TokenGraphError(f"token graph: --kv {kv.kind} is not one of its KV kinds "
                                  f"{GRAPH_KV_KINDS}")
        self.tr, self.kv, self.experts, self.cache, self.backend = transformer, kv, experts, cache, backend
        self._warn = warn
        self._cp = cupy
        # the graphs' buffers and temporaries, and the side stream they are captured on
        self.pool = cupy.cuda.MemoryPool(allocator=cupy.get_default_memory_pool().malloc)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.graphs: dict[tuple[int, bool], Graph] = {}  # (rows, every row's logits) -> graph
        self._fingerprint: tuple[int, ...] | None = None
        self.n_captures = 0
        self.n_replays = 0
        self._events = (cupy.cuda.Event(), cupy.cuda.Event())  # around each replay
        self._gpu_ms: dict[int, list[float]] = {}  # rows -> [replays, GPU ms] since `stats_line`
        with cupy.cuda.using_allocator(self.pool.malloc):
            # row 0's position, written before each replay
            self.position = DevicePosition(cupy.zeros(1, dtype=cupy.int32))
            # per layer: expert hits, misses (cumulative); a miss streams that layer's blob size
            self.counts = cupy.zeros((transformer.hp.n_moe_layer, 2), dtype=cupy.uint64)
            self.on_device = SourcedExperts(experts.host, self._expert_sources())
        self._counted = np.zeros((transformer.hp.n_moe_layer, 2), dtype=np.uint64)

    @property
    def nbytes(self) -> int:
        """Device bytes the graphs' buffers and temporaries hold (from the workspace pool)."""
        return int(self.pool.total_bytes())

    def handles(self, n_rows: int, experts: Any, chunk: Any) -> bool:
        """Whether the session's forward of `n_rows` rows (not a prompt chunk's) is a step
        this graph replays."""
        staged = self.cache is None or self.cache.staged
        return chunk is None and experts is self.experts and 1 <= n_rows <= DECODE_ROWS and staged

    def step(self, tokens: np.ndarray, pos0: int, logits: str) -> ForwardResult | None:
        """`forward`, or None where the step cannot be captured (e.g. a weight that needs
        cuBLAS): then the graphs are released and a warning says why."""
        try:
            return self.forward(tokens, pos0, logits)
        except TokenGraphError as e:
            self.release()
            self._warn(f"strata: warning: {e}; decode steps run eagerly")
            return None

    def release(self) -> None:
        """Drop every graph and give their memory back to the workspace pool."""
        self.graphs.clear()
        self._fingerprint = None
        self.pool.free_all_blocks()  # unused blocks only: pos, counts and the tables stay

    # -- the step --------------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, pos0: int, logits: str) -> ForwardResult:
        """`Transformer.forward` for a decode step: rows `tokens` [T] at positions pos0.."""
        cp, be, t = self._cp, self.backend, len(tokens)
        fingerprint = self._addresses()
        if fingerprint != self._fingerprint:  # an address a graph baked in has moved
            self.release()
            with cp.cuda.using_allocator(self.pool.malloc):
                self.on_device = SourcedExperts(self.experts.host, self._expert_sources())
            self._fingerprint = fingerprint
        rows = np.ascontiguousarray(self.tr.embd.rows(np.asarray(tokens, dtype=np.int64)), np.float32)
        be.upload_inline(np.array([pos0], dtype=np.int32), self.position.array)
        key = (t, logits == "all")
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(rows, key[1])
        else:
            be.upload_inline(rows, g.x_in)
        stream = cp.cuda.get_current_stream()
        self._events[0].record(stream)
        g.graph.launch(stream=stream)
        self._events[1].record(stream)
        self.n_replays += 1
        self._count()  # waits for the step
        acc = self._gpu_ms.setdefault(t, [0, 0.0])
        acc[0] += 1
        acc[1] += cp.cuda.get_elapsed_time(*self._events)
        self.kv.n_tokens = pos0 + t
        out = g.out
        if logits == "none":
            step_logits = cp.zeros((0, self.tr.hp.n_vocab), dtype=cp.float32)
        else:
            step_logits = out.logits.copy()
        return ForwardResult(logits=step_logits, hidden=out.hidden.copy(), routes=out.routes,
                             margins=out.margins.copy())

    def run(self, x_in: Any, all_logits: bool) -> ForwardResult:
        """The step as it is captured: the transformer's own pass over a copy of the rows
        x_in [T, d], at the device position, with the sourced experts; routes stacked into
        one [L, T, k] array (read back in one copy), a layer at a time: `cupy.stack` of many
        arrays uploads a table of their addresses, and a capture refuses host-to-device copies
        (48 layers did; 2 did not)."""
        res = self.tr.forward_embedded(x_in.copy(), self.position, self.kv, self.on_device,
                                       "all" if all_logits else "last")
        routes = self._cp.empty((len(res.routes), *res.routes[0].shape), dtype=res.routes[0].dtype)
        for layer, ids in enumerate(res.routes):  # [T, k] each
            routes[layer] = ids
        return ForwardResult(logits=res.logits, hidden=res.hidden, routes=routes,
                             margins=res.margins)

    def stats_line(self) -> str | None:
        """'token graph: 1 row 511 x 21.3 ms GPU, ...' since the last call (None if no replay):
        the GPU time of the replayed steps, by rows; with the decode wall time it says how
        much of a token is the graph and how much the host (sampling, MTP drafts)."""
        if not self._gpu_ms:
            return None
        parts = ", ".join(f"{t} row{'s' if t > 1 else ''} {n} x {ms / n:.2f} ms GPU"
                          for t, (n, ms) in sorted(self._gpu_ms.items()))
        self._gpu_ms = {}
        return f"token graph: {parts}"

    def _count(self) -> None:
        """Expert hits and misses of the step, into the provider's and the cache's counters."""
        now = self.backend.download(self.counts)  # waits for the step (the sampler would next)
        step = (now - self._counted).astype(np.int64)  # [L, (hits, misses)]
        self._counted = now
        hits, misses = (int(v) for v in step.sum(axis=0))
        c = self.experts.counters
        c.hits += hits
        c.streamed += misses
        c.bytes_streamed += int(step[:, 1] @ np.asarray(self.experts.host.layer_blob_bytes))
        if self.cache is not None:
            self.cache.n_hits += hits
            self.cache.n_misses += misses

    def _capture(self, rows: np.ndarray, all_logits: bool) -> Graph:
        """Run the step once (compiles kernels, sizes the pool; its KV writes are the ones the
        replay repeats) and capture it on a side stream."""
        cp = self._cp
        check_gemv_weights(self.tr, rows.shape[0])
        cur = cp.cuda.get_current_stream()
        with cp.cuda.using_allocator(self.pool.malloc):
            x_in = self.backend.to_device(rows)
            s = self.stream
            s.wait_event(cur.record())
            with s:
                self.run(x_in, all_logits)
                self._counted = self.backend.download(self.counts)  # not the step's experts
                # relaxed: the pool may still cudaMalloc a block while capturing
                s.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    out = self.run(x_in, all_logits)
                except Exception as e:
                    _end_quietly(s)
                    raise TokenGraphError(f"token graph: the decode step cannot be captured ({e})") from e
                graph = s.end_capture()
            cur.wait_event(s.record())
        self.n_captures += 1
        return Graph(graph=graph, x_in=x_in, out=out)

    # -- addresses -------------------------------------------------------------------------------
    def _expert_sources(self) -> list[ExpertSource]:
        """Per layer: the residency row, slot addresses and the mapped file's expert tensors."""
        cp, be, host = self._cp, self.backend, self.experts.host
        if self.cache is not None:
            table, slot_base = self.cache.table_view(), self.cache.slots_address
        else:  # no cache: every expert is a miss
            table = cp.full((host.n_layer, host.n_expert), -1, dtype=cp.int32)
            slot_base = 0
        out = []
        for layer in range(host.n_layer):
            layout = host.layout_of(layer)
            n_gate, n_up, _ = layout.part_bytes
            parts = host.parts(layer)
            addrs = [self.backend.mapped_address(p) for p in parts]
            if any(a is None for a in addrs):
                raise TokenGraphError("token graph: the model file is not page-locked (missed "
                                      "experts are read from it)")
            strides = [p.strides[0] for p in parts]
            offsets = (0, n_gate, n_gate + n_up)
            for q, addr, stride, off in zip(layout.qtypes, addrs, strides, offsets):
                align = decoder_align(q)
                if any(v % align for v in (addr, stride, slot_base, host.blob_bytes, off)):
                    raise TokenGraphError(f"token graph: {q.name} expert bytes are not "
                                          f"{align}-byte aligned")
            out.append(ExpertSource(
                table=table[layer], slot_base=slot_base, slot_bytes=host.blob_bytes,
                offsets=(n_gate, n_gate + n_up), host=be.to_device(np.array(addrs, np.uint64)),
                part_bytes=be.to_device(np.array(strides, np.int64)), layout=layout,
                counts=self.counts[layer],
            ))
        return out

    def _addresses(self) -> tuple[int, ...]:
        """The addresses a captured graph baked in besides its own buffers."""
        head = self.tr.head
        cache = (self.cache.table_view().data.ptr, self.cache.slots_address) if self.cache else ()
        head_ptr = 0 if head is None else (head.raw if isinstance(head, QuantMatrix) else head).data.ptr
        return (head_ptr, self.kv.data.data.ptr, *cache)


def check_gemv_weights(tr: Transformer, n_rows: int) -> None:
    """Raise where a step of `n_rows` rows would not take the GEMV kernel for every linear
    (a cuBLAS call would end the capture): each weight quantized blocks or contiguous fp16."""
    assert n_rows <= GEMV_MAX_ROWS, n_rows
    weights = [w for blk in tr.blocks for w in (blk.attn.wqkv, blk.attn.wo, blk.router)
               if w is not None]
    weights += [w for blk in tr.blocks for ffn in (blk.shared, blk.dense) if ffn is not None
                for w in (ffn.gate_up, ffn.down)]
    for w in [*weights, tr.head]:
        for part in (w.parts if isinstance(w, QuantStack) else (w,)):
            if not (isinstance(part, QuantMatrix)
                    or (part.dtype == np.float16 and part.flags.c_contiguous)):
                raise TokenGraphError(f"token graph: a {part.dtype} [{part.shape}] weight would "
                                      "need cuBLAS")


def _end_quietly(stream: Any) -> None:
    """End a failed capture; the capture error already says what went wrong."""
    try:
        stream.end_capture()
    except Exception:  # noqa: BLE001, S110 - invalidated capture
        pass


def token_graph_wanted(backend: Backend, no_token_graph: bool) -> bool:
    """Decode steps are captured as a graph where the device can (CUDA) unless --no-token-graph."""
    return backend.traits.graphs and not no_token_graph


def make_token_graph(tr: Transformer, kv: KVCache, experts: CachedExperts,
                     cache: ExpertCache | None, backend: Backend,
                     warn: Callable[[str], None]) -> TokenGraph | None:
    """The token graph of a session's decode steps (CUDA, unless --no-token-graph); where it
    cannot work here, None, and a warning says why (steps run eagerly)."""
    try:
        return TokenGraph(tr, kv, experts, cache, backend, warn)
    except TokenGraphError as e:
        warn(f"strata: warning: {e}; decode steps run eagerly")
        return None
