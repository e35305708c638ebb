"""The backend as the dispatch point, on the simulated device: every host<->device copy of a
decode step goes through it and is counted (the bytes it reports are the bytes the step moves,
worked out from the model's shapes), and the model holds no device-specific code."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.backend import SimBackend
from engine.backend.array_ops import kv_decode, kv_encode
from engine.backend.base import Backend, CopyCounts, ExpertProvider
from engine.config import EngineOptions
from engine.kv import KVCache
from engine.memory.sizes import MiB
from engine.model.loader import Model, load_model
from engine.request.sampler import Sampler, SamplingParams
from engine.request.session import Session
from engine.runtime.serve import ServeLoop

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Model:
    return load_model(tiny_path)


def step_copies(model: Model, n_steps: int, n_samples: int) -> CopyCounts:
    """What `n_samples` sampled tokens and `n_steps` decode steps of one row copy, from the
    shapes: each sample reads a logits row [V] float32; each step reads every layer's routed
    ids [1, k] int64 and uploads one embedding row [1, d] float32."""
    hp = model.hp
    ids_bytes = hp.n_expert_used * np.dtype(np.int64).itemsize
    return CopyCounts(
        h2d_bytes=n_steps * hp.n_embd * 4, h2d_copies=n_steps,
        d2h_bytes=n_samples * hp.n_vocab * 4 + n_steps * hp.n_layer * ids_bytes,
        d2h_copies=n_samples + n_steps * hp.n_layer,
    )  # fmt: skip


def test_a_decode_step_copies_what_the_backend_counts(model: Model) -> None:
    session = Session(model, n_ctx=512)
    backend = session.backend
    ids = [int(t) for t in np.random.default_rng(1).integers(5, 900, 300)]
    logits = session.prefill(ids, 128)  # routes to every expert: all decoded from here on
    before = backend.stats.snapshot()
    out = list(session.decode(logits, Sampler(GREEDY), max_new=4))
    assert len(out) == 4  # four samples, three decode steps (the last token needs none)
    assert backend.stats.snapshot() - before == step_copies(model, n_steps=3, n_samples=4)


def test_the_runtime_decode_path_counts_its_copies_too(tiny_path: Path) -> None:
    """The engine's own path: the expert cache's provider, ledger-backed KV and head; the
    adaptive cache policy reads each step's routing back once more, as one [L, 1, k] array
    (its promotions, if any, are uploads: none here, every expert is resident)."""
    loop = ServeLoop.create(EngineOptions(model=str(tiny_path), ctx=1024, prefill=128,
                                          cache_policy="adaptive"))
    rt = loop.rt
    loop.complete(list(range(5, 400)), max_new=2)  # every expert resident or decoded once
    before = rt.backend.stats.snapshot()
    logits = rt.session.forward([17]).logits
    list(rt.session.decode(logits, Sampler(GREEDY), max_new=3))
    want = step_copies(rt.model, n_steps=3, n_samples=3)
    hp = rt.model.hp
    want = replace(want, d2h_bytes=want.d2h_bytes + 3 * hp.n_layer * hp.n_expert_used * 8,
                   d2h_copies=want.d2h_copies + 3)  # the routes, once a step
    assert rt.cache.n_slots == hp.n_layer * hp.n_expert and rt.experts.policy == "adaptive"
    assert rt.backend.stats.snapshot() - before == want


def test_a_prompt_chunk_reads_one_count_per_layer(model: Model) -> None:
    """A prompt chunk reads the routing back once per layer, as rows per expert [E]."""
    session = Session(model, n_ctx=512)
    before = session.backend.stats.snapshot()
    session.forward(list(range(10, 60)), logits="none")
    got = session.backend.stats.snapshot() - before
    hp = model.hp
    assert got.d2h_copies == hp.n_layer
    assert got.d2h_bytes == hp.n_layer * hp.n_expert * np.dtype(np.int64).itemsize


@pytest.mark.parametrize("kind", ["f16", "int8", "q4_0"])
def test_the_kv_codec_is_the_backends(kind: str) -> None:
    be = SimBackend(1 * MiB)
    kv = KVCache(be, 2, 16, 2, 64, kind)
    x = np.random.default_rng(2).standard_normal((5, 2, 64)).astype(np.float32)
    kv.write(1, 3, x, -x)
    k, v = kv.read(1, 8)
    q, s = kv_encode(np, kind, x)
    np.testing.assert_array_equal(k[3:8], kv_decode(np, kind, q, s))
    assert not k[:3].any()  # cells nobody wrote read back as zeros
    tol = {"f16": 1e-3, "int8": 2e-2, "q4_0": 0.2}[kind]
    assert np.abs(k[3:8] - x).max() <= tol * np.abs(x).max()
    np.testing.assert_array_equal(v[3:8], kv_decode(np, kind, *kv_encode(np, kind, -x)))


def test_every_expert_provider_implements_the_whole_protocol(model: Model) -> None:
    from engine.experts.decoded import DecodedLRU
    from engine.experts.provider import CachedExperts, DirectExperts
    from engine.model.mtp import MTPExperts
    from engine.tools.fit_mtp import ArrayExperts

    be = model.transformer.backend
    assert model.mtp_experts is not None
    w = (np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32), np.zeros((8, 4), np.float32))
    providers = [CachedExperts(None, model.experts, DecodedLRU(), be),
                 DirectExperts(model.experts, be), MTPExperts(model.mtp_experts, be),
                 ArrayExperts({0: w}, be)]
    for p in providers:
        assert isinstance(p, ExpertProvider), type(p).__name__
        assert p.ring_slots is None and p.layout_of(0).blob_bytes > 0


@pytest.mark.parametrize("kind", ["f16", "int8", "q4_0"])
def test_a_step_at_a_device_position_is_the_same_pass(random_demo_path: Path, kind: str) -> None:
    """The token graph's pass (`forward_embedded` at a `DevicePosition`: the position read
    where the step runs, K/V written into the cells in place) gives what the host position
    gives, through any backend's ops: here the array code's."""
    from engine.backend.base import DevicePosition
    from engine.experts.provider import DirectExperts

    model = load_model(random_demo_path)
    tr, be = model.transformer, model.transformer.backend
    experts = DirectExperts(model.experts, be)
    ids = np.random.default_rng(3).integers(5, 900, 40)
    caches = [KVCache(be, model.hp.n_layer, 64, model.hp.n_head_kv, model.hp.head_dim, kind)
              for _ in range(2)]
    for kv in caches:
        tr.forward(ids[:37], 0, kv, experts, logits="none")
    want = tr.forward(ids[37:], 37, caches[0], experts, logits="all")
    at = DevicePosition(be.to_device(np.array([37], dtype=np.int32)))
    got = tr.forward_embedded(tr.embed(ids[37:]), at, caches[1], experts, logits="all")
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(caches[1].data, caches[0].data)  # the same cells written
    for a, b in zip(got.routes, want.routes):
        np.testing.assert_array_equal(a, b)


def test_the_sim_backend_implements_the_whole_protocol() -> None:
    be = SimBackend(1 * MiB)
    assert isinstance(be, Backend)
    declared = {n for n in vars(Backend) if not n.startswith("_")} - {"name", "xp",
                                                                        "capacity_bytes", "stats"}
    missing = sorted(n for n in declared if not hasattr(be, n))
    assert not missing, missing


DEVICE_CODE = ("engine/model", "engine/kv.py", "engine/experts", "engine/memory",
               "engine/trace/phases.py", "engine/request/session.py", "engine/prompt")
# in those folders, held to other rules: the token graph is CUDA's capture of Transformer.forward
# (streams, memory pools, the expert sources its kernels read); costs reads the kernels' sizes
NOT_DEVICE_CODE = ("engine/model/token_graph.py", "engine/memory/costs.py")


def test_model_code_never_asks_which_device_it_runs_on() -> None:
    """No module-name tests, no probing for optional methods, no `asnumpy`/`.get()` reads
    that bypass the backend's counted download, no kernel import outside the backend."""
    found = []
    for top in DEVICE_CODE:
        path = ROOT / top
        for f in sorted(path.rglob("*.py") if path.is_dir() else [path]):
            if str(f.relative_to(ROOT)) in NOT_DEVICE_CODE:
                continue
            tree = ast.parse(f.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                where = f"{f.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Attribute) and node.attr in ("__name__", "asnumpy"):
                    found.append(f"{where} .{node.attr}")
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr == "get" and not node.args and not node.keywords
                      and not _is_context_var(node.func.value)):
                    found.append(f"{where} .get()")
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                      and node.func.id in ("getattr", "hasattr")
                      and any(isinstance(a, ast.Constant) for a in node.args[1:2])):
                    found.append(f"{where} {node.func.id}() of a named attribute")
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        ("engine.kernels", "cupy")):
                    found.append(f"{where} imports {node.module}")
                elif isinstance(node, ast.Import) and any(
                        a.name.startswith(("engine.kernels", "cupy")) for a in node.names):
                    found.append(f"{where} imports {[a.name for a in node.names]}")
    assert not found, "\n".join(found)


def _is_context_var(node: ast.expr) -> bool:
    """`_ACTIVE.get()`: engine.trace.phases reads its ContextVar, not a device array."""
    return isinstance(node, ast.Name) and node.id == "_ACTIVE"
