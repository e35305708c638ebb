"""Where a decode step's GPU time goes: each part of the token graph's step captured alone.

A CUDA graph cannot be timed node by node without a profiler, and running the step eagerly
measures Python's launch rate instead of the kernels. So each part of layer 0's step (q/k/v,
attention over the KV cells, the output projection, the router, the routed experts) and the
output head is captured as its own small graph and replayed `repeat` times between two CUDA
events; per-layer parts are then multiplied by the layer count. The sum beside the whole
step's replay shows what the node-to-node gaps cost.

The parts run at a position `pos` past the session's tokens (the KV writes land in free cells,
which later steps overwrite), on the embeddings of real tokens, so layer 0 routes as in use;
the expert hit/miss counters are put back afterwards. It calls the model's own step pieces
(`qkv_rows`, `KVCache.attend`, the backend's `route` and `moe_at`, `Transformer.logits`) at
the graph's device position with its sourced experts, on its stream and memory pool, so what
it times is what the graph replays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine.model.attention import qkv_rows
from engine.model.moe import routing
from engine.model.token_graph import TokenGraph


def _time_graph(cp: Any, stream: Any, pool: Any, fn: Callable[[], Any], repeat: int) -> float:
    """Mean GPU ms of `fn` captured once as a graph and replayed `repeat` times."""
    with cp.cuda.using_allocator(pool.malloc), stream:
        fn()  # compile, size the pool
        stream.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
        fn()
        graph = stream.end_capture()
        graph.launch(stream=stream)  # one untimed replay
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(repeat):
            graph.launch(stream=stream)
        end.record(stream)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / repeat


def profile_step(tg: TokenGraph, tokens: list[int], pos: int, repeat: int = 20) -> list[tuple[str, float]]:
    """[(part, GPU ms per step)] for a step of rows `tokens` at position `pos` (>= the KV's
    tokens): per-layer parts x n_layer, the head, their sum and the whole step's replay."""
    import cupy as cp

    be, tr, hp, kv, pos_at = tg.backend, tg.tr, tg.tr.hp, tg.kv, tg.position
    t = len(tokens)
    assert kv.n_tokens <= pos and pos + t <= kv.n_ctx, (kv.n_tokens, pos, t)
    blk, layer = tr.blocks[hp.n_dense_lead], 0  # the first block with experts
    saved = tg.counts.copy()
    be.upload_inline(np.array([pos], dtype=np.int32), pos_at.array)
    x = be.to_device(np.ascontiguousarray(tr.embd.rows(np.asarray(tokens, dtype=np.int64)), np.float32))
    q, k, v = qkv_rows(be, hp, blk.attn, x, pos_at)
    o = kv.attend(layer, pos_at, q, k, v)
    h = be.rms_norm(x, blk.ffn_norm, hp.rms_eps)
    ids, w, _ = be.route(be.linear(h, blk.router), routing(hp), blk.selection_bias)
    source = tg.on_device.source(layer)
    parts: list[tuple[str, Callable[[], Any], int]] = [
        ("norm, q/k/v, rope", lambda: qkv_rows(be, hp, blk.attn, x, pos_at), hp.n_layer),
        (f"KV write, attention over {pos + t} cells", lambda: kv.attend(layer, pos_at, q, k, v),
         hp.n_layer),
        ("output projection", lambda: be.linear(o.reshape(t, hp.q_dim), blk.attn.wo), hp.n_layer),
        ("norm, router, top-k", lambda: be.route(be.linear(be.rms_norm(x, blk.ffn_norm, hp.rms_eps),
                                                         blk.router), routing(hp), blk.selection_bias),
         hp.n_moe_layer),
        ("routed experts (layer 0's routing)", lambda: be.moe_at(h, ids, w, source), hp.n_moe_layer),
        ("output head", lambda: tr.logits(x[-1:]), 1),
    ]
    rows = [(name, n * _time_graph(cp, tg.stream, tg.pool, fn, repeat)) for name, fn, n in parts]
    rows.append(("sum of the parts", sum(ms for _, ms in rows)))
    graph = tg.graphs.get((t, False))
    if graph is not None:  # the captured step itself, replayed back to back
        graph.x_in[...] = x
        s = tg.stream
        start, end = cp.cuda.Event(), cp.cuda.Event()
        with s:
            graph.graph.launch(stream=s)
            start.record(s)
            for _ in range(repeat):
                graph.graph.launch(stream=s)
            end.record(s)
        end.synchronize()
        rows.append(("whole step (replay)", cp.cuda.get_elapsed_time(start, end) / repeat))
    tg.counts[...] = saved
    return rows


def format_profile(rows: list[tuple[str, float]], rows_per_step: int) -> str:
    """A markdown table of `profile_step`'s result."""
    lines = [f"| Decode step part ({rows_per_step} row{'s' if rows_per_step > 1 else ''}) | GPU ms |",
             "|---|---:|"]
    lines += [f"| {name} | {ms:.3f} |" for name, ms in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.tools.graph_profile --model F [--pos 2048,31000]`: one short greedy request
    (plain decoding, so the 1-row graph exists), then the step's parts at each position."""
    import argparse

    from engine.config import EngineOptions
    from engine.runtime.serve import ServeLoop

    p = argparse.ArgumentParser(prog="python -m engine.tools.graph_profile", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--vram-limit", default="8GiB")
    p.add_argument("--kv", default="q4_0")
    p.add_argument("--pos", default="2048,31000", help="step positions, comma-separated")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    positions = [int(v) for v in args.pos.split(",")]
    opts = EngineOptions(model=args.model, device="cuda", ctx=max(positions) + 64,
                         vram_limit=args.vram_limit, kv=args.kv)
    loop = ServeLoop.create(opts)
    ids = loop.rt.model.tokenizer.encode("The river runs through the old city. " * 8)
    loop.complete(list(ids), max_new=4)
    tg = loop.rt.session.graph
    if tg is None:
        print("no token graph on this engine (see the startup warnings)")
        return 1
    for pos in positions:
        print(format_profile(profile_step(tg, list(ids[-1:]), pos, args.repeat), 1)
              .replace("| GPU ms |", f"| GPU ms at position {pos} |"), end="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
