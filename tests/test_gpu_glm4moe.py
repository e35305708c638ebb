"""glm4moe on CUDA (gpu marker): the kernels' paths (sigmoid routing with a selection bias,
partial RoPE, a dense block and a shared expert through cuBLAS and the GEMV) against the
simulated device, the token graph against eager steps, and MTP drafts under a loan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import greedy_steps, host, prefill_request

from engine.config import EngineOptions, LoanFlags
from engine.gguf import names
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop
from engine.synth.model import PRESETS, write_model
from engine.tools.bench import LOAN_ON

pytestmark = pytest.mark.gpu
LOAN = LoanFlags.make(**{**LOAN_ON.as_kwargs(), "repeat_min_tokens": 256})


@pytest.fixture(scope="module")
def glm_path(tmp_path_factory: pytest.TempPathFactory, cp) -> Path:  # type: ignore[no-untyped-def]
    """GLM-4.5-Air's shapes, 3 blocks (the first dense) + the nextn block, 128-dim heads."""
    spec = replace(PRESETS["glm4.5-air"], n_layer=3, n_ctx=8192, n_vocab=8192)
    return write_model(tmp_path_factory.mktemp("gpu-glm") / "glm-mid.gguf", spec)


def test_cuda_matches_the_simulated_device_and_the_graph_its_eager_steps(glm_path: Path) -> None:
    sim = ServeLoop.create(EngineOptions(model=str(glm_path), device="sim", ctx=2048))
    assert sim.rt.model.hp.arch == names.ARCH_GLM4MOE
    base = EngineOptions(model=str(glm_path), device="cuda", ctx=2048, vram_limit="8GiB",
                         vram_segment_mib=64)
    gpu = ServeLoop.create(base)
    eager = ServeLoop.create(replace(base, no_token_graph=True))
    assert gpu.rt.session.graph is not None and eager.rt.session.graph is None
    ids = np.random.default_rng(3).integers(0, 8192, 300).tolist()
    a, _ = prefill_request(sim.rt, ids)
    b, _ = prefill_request(gpu.rt, ids)
    a, b = host(a)[-1], host(b)[-1]
    assert float(np.abs(a - b).max() / np.abs(a).max()) < 0.03  # fp16 weights, tensor cores
    gpu.rt.session.truncate(0)
    ta, la = greedy_steps(gpu, ids, 12)
    tb, lb = greedy_steps(eager, ids, 12)
    assert ta == tb and float(np.abs(la - lb).max() / np.abs(lb).max()) < 1e-3
    gpu.rt.check_integrity()


def test_mtp_drafts_and_a_loan_on_cuda(glm_path: Path) -> None:
    opts = EngineOptions(model=str(glm_path), device="cuda", ctx=4096, serve=True,
                         vram_elastic=True, mtp=True, spec=2, vram_limit="8GiB",
                         vram_segment_mib=64)
    on = ServeLoop.create(opts, LOAN)
    off = ServeLoop.create(replace(opts, mtp=False, spec=0), LoanFlags())
    tok = on.rt.model.tokenizer
    text = tok.decode(np.random.default_rng(5).integers(300, 8000, 900).tolist())
    a = on.chat(Conversation(), text, max_new=16).text
    b = off.chat(Conversation(), text, max_new=16).text
    assert a == b  # greedy: drafts and the loan change no token
    on.rt.check_integrity()
    assert on.rt.resources.all_resident()


def test_mtp_drafts_through_a_partial_expert_region_on_cuda(glm_path: Path) -> None:
    """The nextn block's 128 experts in 16 slots: drafts upload their misses into LRU slots
    (the kernels read the slots' bytes), under a loan, and change no greedy token."""
    opts = EngineOptions(model=str(glm_path), device="cuda", ctx=4096, serve=True,
                         vram_elastic=True, mtp=True, spec=2, vram_limit="8GiB",
                         vram_segment_mib=64, mtp_experts=16, spec_always=True)
    on = ServeLoop.create(opts, LOAN)
    off = ServeLoop.create(replace(opts, mtp=False, spec=0, mtp_experts="auto"), LoanFlags())
    tok = on.rt.model.tokenizer
    text = tok.decode(np.random.default_rng(6).integers(300, 8000, 900).tolist())
    assert on.chat(Conversation(), text, max_new=24).text == off.chat(Conversation(), text, max_new=24).text
    experts = on.rt.spec.draft.block.experts  # type: ignore[union-attr]
    assert experts.partial and experts.n_slots == 16
    assert experts.n_uploads > 16 and experts.n_hits > 0
    on.rt.check_integrity()
    experts.check_integrity(deep=True)
    assert on.rt.resources.all_resident()
