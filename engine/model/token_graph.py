"""The token graph: a decode step (a few token rows through every block and the output head)
captured once as a CUDA graph and replayed every step; `--no-token-graph` turns it off.

Why. A decode step is ~15 launches per layer; from Python each costs 10-20 us of host time, and
the eager path brings the routed expert ids to the host once per layer (a wait for the GPU).
Replaying a graph queues the whole step in one call and the host never waits inside it.

What makes the step capturable (engine/kernels/decode.py):
- every position-dependent kernel (RoPE, the KV write, attention) reads the step's position
  from device memory (`pos`), and attention reads the KV cells in place over the whole context
  (tiles past the position return at once), so the same launches serve every step;
- the MoE builds its GEMV job rows on the device from the routed ids and the staged residency
  table: a hit reads the cache slot, a miss reads the expert in place from the page-locked GGUF
  over PCIe (the decode-miss policy under the graph: nothing is copied, nothing waits);
- every linear is the fp16 GEMV kernel (cuBLAS calls cannot be captured).

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

from engine.backend.base import Backend
from engine.config import DECODE_ROWS
from engine.errors import TokenGraphError
from engine.experts.cache import ExpertCache
from engine.experts.provider import CachedExperts
from engine.gguf.quant import QuantMatrix, QuantStack
from engine.kernels.decode import (
    GRAPH_KV_KINDS,
    ExpertSource,
    KVCells,
    attention_at,
    attention_workspace,
    kv_write_at,
    moe_at,
)
from engine.kernels.dequant import GEMV_MAX_ROWS, decoder_align
from engine.kernels.fused import rope_neox_, route_topk
from engine.kv import KVCache
from engine.model.attention import project_qkv
from engine.model.transformer import ForwardResult, Transformer


@dataclass
class _Graph:
    """One captured step and the device buffers its addresses point at."""

    graph: Any
    x_in: Any  # [T, d] float32 token embeddings, written before each replay
    logits: Any  # [T or 1, V] float32
    hidden: Any  # [T, d] residual stream before the final norm
    routes: Any  # [L, T, k] int64
    margins: Any  # [T] float32


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
        self._pool = cupy.cuda.MemoryPool(allocator=cupy.get_default_memory_pool().malloc)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._fingerprint: tuple[int, ...] | None = None
        self.n_captures = 0
        self.n_replays = 0
        self._events = (cupy.cuda.Event(), cupy.cuda.Event())  # around each replay
        self._gpu_ms: dict[int, list[float]] = {}  # rows -> [replays, GPU ms] since `stats_line`
        with cupy.cuda.using_allocator(self._pool.malloc):
            self.pos = cupy.zeros(1, dtype=cupy.int32)  # position of row 0 of the step
            # per layer: expert hits, misses (cumulative); a miss streams that layer's blob size
            self.counts = cupy.zeros((transformer.hp.n_layer, 2), dtype=cupy.uint64)
            self._sources = self._expert_sources()
        self._counted = np.zeros((transformer.hp.n_layer, 2), dtype=np.uint64)

    @property
    def nbytes(self) -> int:
        """Device bytes the graphs' buffers and temporaries hold (from the workspace pool)."""
        return int(self._pool.total_bytes())

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
        self._graphs.clear()
        self._fingerprint = None
        self._pool.free_all_blocks()  # unused blocks only: pos, counts and the tables stay

    # -- the step --------------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, pos0: int, logits: str) -> ForwardResult:
        """`Transformer.forward` for a decode step: rows `tokens` [T] at positions pos0.."""
        cp, be, t = self._cp, self.backend, len(tokens)
        fingerprint = self._addresses()
        if fingerprint != self._fingerprint:  # an address a graph baked in has moved
            self.release()
            with cp.cuda.using_allocator(self._pool.malloc):
                self._sources = self._expert_sources()
            self._fingerprint = fingerprint
        rows = np.ascontiguousarray(self.tr.embd.rows(np.asarray(tokens, dtype=np.int64)), np.float32)
        be.upload_inline(np.array([pos0], dtype=np.int32), self.pos)
        key = (t, logits == "all")
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(rows, key[1])
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
        if logits == "none":
            out = cp.zeros((0, self.tr.hp.n_vocab), dtype=cp.float32)
        else:
            out = g.logits.copy()
        return ForwardResult(logits=out, hidden=g.hidden.copy(), routes=g.routes,
                             margins=g.margins.copy())

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

    def _capture(self, rows: np.ndarray, all_logits: bool) -> _Graph:
        """Run the step once (compiles kernels, sizes the pool; its KV writes are the ones the
        replay repeats) and capture it on a side stream."""
        cp, hp = self._cp, self.tr.hp
        t = rows.shape[0]
        cur = cp.cuda.get_current_stream()
        with cp.cuda.using_allocator(self._pool.malloc):
            g = _Graph(
                graph=None, x_in=self.backend.to_device(rows),
                logits=cp.empty((t if all_logits else 1, hp.n_vocab), dtype=cp.float32),
                hidden=cp.empty((t, hp.n_embd), dtype=cp.float32),
                routes=cp.empty((hp.n_layer, t, hp.n_expert_used), dtype=cp.int64),
                margins=cp.empty(t, dtype=cp.float32),
            )
            s = self._stream
            s.wait_event(cur.record())
            with s:
                self._step(g, all_logits)
                self._counted = self.backend.download(self.counts)  # not the step's experts
                # relaxed: the pool may still cudaMalloc a block while capturing
                s.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    self._step(g, all_logits)
                except Exception as e:
                    _end_quietly(s)
                    raise TokenGraphError(f"token graph: the decode step cannot be captured ({e})") from e
                g.graph = s.end_capture()
            cur.wait_event(s.record())
        self.n_captures += 1
        return g

    def _step(self, g: _Graph, all_logits: bool) -> None:
        """The decode step on the graph's buffers (what is captured)."""
        cp, be, tr, hp = self._cp, self.backend, self.tr, self.tr.hp
        x = g.x_in.copy()  # [T, d] residual stream
        g.margins.fill(np.inf)
        for i, blk in enumerate(tr.blocks):
            x += self._attention(blk.attn, x, i)
            h = be.rms_norm(x, blk.ffn_norm, hp.rms_eps)  # [T, d]
            ids, w, margin = route_topk(_gemv(be, h, blk.router), hp.n_expert_used)
            g.routes[i] = ids
            x += moe_at(h, ids, w, self._sources[i], self.counts[i])
            cp.minimum(g.margins, margin, out=g.margins)
        g.hidden[...] = x
        tail = x if all_logits else x[-1:]
        g.logits[...] = _gemv(be, be.rms_norm(tail, tr.output_norm, hp.rms_eps), tr.head)

    def _attention(self, w: Any, x: Any, layer: int) -> Any:
        """`attention_block` with the position on the device: x [T, d] -> [T, d]."""
        q = self._qkv(w, x, layer)
        return _gemv(self.backend, self._attend(q, layer).reshape(x.shape[0], self.tr.hp.q_dim), w.wo)

    def _qkv(self, w: Any, x: Any, layer: int) -> Any:
        """Norm, q/k/v projections, RoPE and the KV write of rows x [T, d] -> q [T, H, D]."""
        cp, be, hp = self._cp, self.backend, self.tr.hp
        h = be.rms_norm(x, w.norm, hp.rms_eps)
        _check_gemv(h, w.wqkv)
        q, k, v = project_qkv(be, hp, w.wqkv, h)  # one GEMV launch for the three
        q = be.rms_norm(q, w.q_norm, hp.rms_eps)
        k = be.rms_norm(k, w.k_norm, hp.rms_eps)
        rope_neox_(q, 0, hp.rope_base, pos=self.pos)
        rope_neox_(k, 0, hp.rope_base, pos=self.pos)
        kv_write_at(layer_cells(self.kv, layer), k, cp.ascontiguousarray(v), self.pos)
        return q

    def _attend(self, q: Any, layer: int) -> Any:
        """q [T, H, D] over the layer's KV cells 0..pos+t -> [T, H, D]."""
        cp, hp, t = self._cp, self.tr.hp, q.shape[0]
        ml_shape, acc_shape = attention_workspace(t, hp.n_head, hp.head_dim, self.kv.n_ctx)
        ml, acc = cp.empty(ml_shape, dtype=cp.float32), cp.empty(acc_shape, dtype=cp.float32)
        return attention_at(q, layer_cells(self.kv, layer), self.pos, ml, acc)  # [T, H, D]

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
            ))
        return out

    def _addresses(self) -> tuple[int, ...]:
        """The addresses a captured graph baked in besides its own buffers."""
        head = self.tr.head
        cache = (self.cache.table_view().data.ptr, self.cache.slots_address) if self.cache else ()
        head_ptr = 0 if head is None else (head.raw if isinstance(head, QuantMatrix) else head).data.ptr
        return (head_ptr, self.kv.data.data.ptr, *cache)


def layer_cells(kv: KVCache, layer: int) -> KVCells:
    """Every cell of `layer` of `kv` as the decode kernels take them (views, no copy)."""
    scale = kv.scale
    return KVCells(kv.kind, kv.data[layer, 0], None if scale is None else scale[layer, 0],
                   kv.data[layer, 1], None if scale is None else scale[layer, 1])


def _check_gemv(x: Any, w: Any) -> None:
    """Raise where `linear(x, w)` would not take the GEMV kernel (a cuBLAS call would end the
    capture): the weight must be quantized blocks or contiguous fp16, x a few rows."""
    if isinstance(w, QuantStack):
        for part in w.parts:
            _check_gemv(x, part)
        return
    quant = isinstance(w, QuantMatrix)
    if not ((quant or (w.dtype == np.float16 and w.flags.c_contiguous))
            and x.ndim == 2 and x.shape[0] <= GEMV_MAX_ROWS):
        kind = w.qtype.name if quant else w.dtype
        raise TokenGraphError(f"token graph: a {kind} [{w.shape}] weight would need cuBLAS")


def _gemv(be: Backend, x: Any, w: Any) -> Any:
    """The backend's `linear` where it must take the GEMV kernel (`_check_gemv`)."""
    _check_gemv(x, w)
    return be.linear(x, w)


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
