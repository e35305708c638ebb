"""glm4moe (GLM-4.5 / 4.5-Air / 4.6 / 4.7) on the CPU: the file's hyper-parameters, the forward
pass against a float64 reference written from the GLM-4.5 graph (not from engine/model), MTP
drafts exact under greedy decoding, and the VRAM loan with every sub-option on a glm4moe file.
llama.cpp's logits on glm4moe files are in test_llama_oracle.py.

What glm4moe adds to qwen3moe's block: q/k/v biases, no q/k norm in GLM-4.5-Air, partial RoPE
(`rope.dimension_count` of a head's dims), a dense leading block, sigmoid routing whose top-k is
chosen on the probabilities plus `exp_probs_b` while the weights are the probabilities
themselves (normalised, then scaled), and a shared expert beside the routed ones.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineOptions, LoanFlags
from engine.gguf import names
from engine.gguf.quant import dequantize
from engine.loan.resources import LABELS
from engine.model.loader import Model, load_model
from engine.model.mtp import MTPExperts
from engine.request.conversation import Conversation
from engine.request.record import generate
from engine.request.sampler import SamplingParams
from engine.request.session import Session
from engine.runtime.serve import ServeLoop
from engine.speculative.decoder import SpecDecoder
from engine.synth.model import PRESETS, write_model
from engine.tools.bench import LOAN_ON, prompt_tokens
from engine.trace.events import EventBus, LoanStep

GLM = PRESETS["tiny-glm"]
# the shipped demo's shape as glm4moe: more experts than the default simulated device's cache
# holds, so prompts stream experts and borrow cache slots
GLM_DEMO = replace(PRESETS["random-demo"], arch=names.ARCH_GLM4MOE, n_layer=6, n_dense_lead=1, n_ff=256,
                   n_expert_shared=1, n_rot=16, qk_norm=False, weights_scale=2.5, seed=21)


@pytest.fixture(scope="module")
def glm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("glm") / "tiny-glm.gguf", GLM)


@pytest.fixture(scope="module")
def model(glm_path: Path) -> Model:
    return load_model(glm_path)


def test_hyper_parameters_are_glm4moes(model: Model) -> None:
    hp = model.hp
    assert (hp.arch, hp.n_layer, hp.n_nextn, hp.n_dense_lead, hp.n_moe_layer) == ("glm4moe", 3, 1, 1, 2)
    assert (hp.gating, hp.weights_norm, hp.weights_scale) == ("sigmoid", True, 1.5)
    assert (hp.n_rot, hp.rot_dims, hp.qk_norm, hp.qkv_bias, hp.selection_bias) == (8, 8, False, True, True)
    assert (hp.n_ff, hp.n_expert_shared, hp.n_ff_shexp) == (128, 1, 64)
    # the dense block has no routed experts: the expert cache's layers are the MoE blocks
    assert model.experts.n_layer == 2 and model.experts.blocks == range(1, 3)
    assert model.transformer is not None
    blocks = model.transformer.blocks
    assert blocks[0].router is None and blocks[0].dense is not None
    assert all(b.router is not None and b.shared is not None for b in blocks[1:])
    assert hp.resident_ffn() == " + 1 dense layer, 1 shared expert (resident)"


# --- a float64 reference from the file's tensors ---------------------------------------------


def _t(m: Model, name: str) -> np.ndarray:
    return dequantize(m.mf.tensor(name)).astype(np.float64)


def _norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    """x [T, H, D]: NEOX pairs (i, i + n_rot/2) of the first n_rot dims at positions 0..T-1."""
    half = n_rot // 2
    freq = base ** (-np.arange(half) * 2.0 / n_rot)  # [n_rot/2]
    ang = np.arange(x.shape[0])[:, None, None] * freq  # [T, 1, n_rot/2]
    a, b = x[..., :half], x[..., half:n_rot]
    rot = np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)
    return np.concatenate([rot, x[..., n_rot:]], -1)


def _swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g = h @ gate.T
    return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T


def reference_logits(m: Model, tokens: list[int]) -> np.ndarray:
    """[T, V] logits of the main blocks, float64, as llama.cpp's llm_build_glm4_moe computes."""
    hp, eps = m.hp, m.hp.rms_eps
    blk = lambda kind, i: _t(m, names.block(kind, i))
    x = dequantize(m.mf.tensor(names.TOKEN_EMBD))[tokens].astype(np.float64)  # [T, d]
    t, group = len(tokens), hp.n_head // hp.n_head_kv
    causal = np.tril(np.ones((t, t), dtype=bool))
    for i in range(hp.n_layer):
        h = _norm(x, blk("attn_norm", i), eps)
        q = (h @ blk("attn_q", i).T + blk("attn_q_bias", i)).reshape(t, hp.n_head, hp.head_dim)
        k = (h @ blk("attn_k", i).T + blk("attn_k_bias", i)).reshape(t, hp.n_head_kv, hp.head_dim)
        v = (h @ blk("attn_v", i).T + blk("attn_v_bias", i)).reshape(t, hp.n_head_kv, hp.head_dim)
        q, k = _rope(q, hp.rot_dims, hp.rope_base), _rope(k, hp.rot_dims, hp.rope_base)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [T, H, D]
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hp.head_dim)
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", p, v).reshape(t, -1) @ blk("attn_output", i).T
        h = _norm(x, blk("post_attention_norm", i), eps)
        if i < hp.n_dense_lead:
            x = x + _swiglu(h, blk("ffn_gate", i), blk("ffn_up", i), blk("ffn_down", i))
            continue
        probs = 1 / (1 + np.exp(-(h @ blk("ffn_gate_inp", i).T)))  # [T, E]
        chosen = np.argsort(-(probs + blk("exp_probs_b", i)), axis=-1, kind="stable")[:, : hp.n_expert_used]
        w = np.take_along_axis(probs, chosen, -1)
        w = w / w.sum(-1, keepdims=True) * hp.weights_scale  # [T, k]
        gates, ups, downs = (blk(k_, i) for k_ in names.EXPERT_TENSORS)
        ffn = _swiglu(h, blk("ffn_gate_shexp", i), blk("ffn_up_shexp", i), blk("ffn_down_shexp", i))
        for r in range(t):
            for e, we in zip(chosen[r], w[r]):
                ffn[r] += we * _swiglu(h[r : r + 1], gates[e], ups[e], downs[e])[0]
        x = x + ffn
    return _norm(x, _t(m, names.OUTPUT_NORM), eps) @ _t(m, names.OUTPUT).T


def test_forward_matches_a_float64_reference(tmp_path: Path) -> None:
    m = load_model(write_model(tmp_path / "glm-f32.gguf", GLM.with_qtype("all", "F32")))
    tokens = [5, 17, 300, 42, 9, 700, 123, 64, 1, 250, 511, 33]
    res = Session(m, n_ctx=64).forward(tokens, logits="all")
    ref = reference_logits(m, tokens)
    # the KV cache keeps f16 (as llama.cpp's): about 1e-3 of logits of magnitude ~4
    assert np.abs(np.asarray(res.logits) - ref).max() <= 1e-2 * np.abs(ref).max()
    assert (np.asarray(res.logits).argmax(-1) == ref.argmax(-1)).all()
    # partial RoPE matters at this tolerance: rotating every dim moves the reference well past it
    hp = m.hp
    assert np.abs(ref - reference_logits(
        replace(m, hp=replace(hp, n_rot=0)), tokens)).max() > 5e-2 * np.abs(ref).max()


# --- speculative decoding with the nextn block --------------------------------------------------


@pytest.mark.parametrize("n_window", [2, 4])
def test_greedy_mtp_drafts_equal_plain_decoding(model: Model, n_window: int) -> None:
    dec = SpecDecoder.with_mtp(model, n_window)
    dec.always = True  # every step drafts
    for n, chunk in ((5, 512), (40, 7)):
        ids = np.random.default_rng(n).integers(0, GLM.n_vocab, n).tolist()
        want = list(generate(Session(model, n_ctx=256), ids, 30, SamplingParams(), chunk))
        got = list(generate(Session(model, n_ctx=256), ids, 30, SamplingParams(), chunk, spec=dec))
        assert got == want, (n_window, n)
        dec.check_integrity()


def test_greedy_mtp_drafts_with_few_expert_slots_equal_plain_decoding(model: Model) -> None:
    """The nextn block's experts in 4 slots (a device too small for all of them): drafts
    upload their misses and reach the same tokens."""
    dec = SpecDecoder.with_mtp(model, 3, mtp_expert_slots=4)
    dec.always = True
    experts = dec.draft.block.experts
    assert isinstance(experts, MTPExperts) and experts.partial
    ids = np.random.default_rng(3).integers(0, GLM.n_vocab, 40).tolist()
    want = list(generate(Session(model, n_ctx=256), ids, 30, SamplingParams(), 16))
    got = list(generate(Session(model, n_ctx=256), ids, 30, SamplingParams(), 16, spec=dec))
    assert got == want
    assert experts.n_uploads > 4  # more experts than slots were read: slots were reused
    experts.check_integrity(deep=True)


# --- the loan ----------------------------------------------------------------------------------

OPTS = {"serve": True, "vram_elastic": True, "mtp": True, "spec": 4, "prefill": "auto", "ctx": 4096}
FLAGS = LoanFlags.make(**{**LOAN_ON.as_kwargs(), "repeat_min_tokens": 256})


def test_loan_startup_and_repeat_give_the_same_tokens(tmp_path: Path) -> None:
    """Every loan sub-option on a glm4moe file: a startup loan, a short message, a repeat loan,
    the same replies as with the loan off, and the ledger whole after each request; the plan
    names the dense layer and the shared expert as resident weights."""
    path = write_model(tmp_path / "glm-demo.gguf", GLM_DEMO)

    def converse(flags: LoanFlags, bus: EventBus | None = None, **more: object) -> list[str]:
        options = EngineOptions(model=str(path), **{**OPTS, **more})  # type: ignore[arg-type]
        loop = ServeLoop.create(options, flags, bus)
        assert "1 dense layer, 1 shared expert (resident)" in loop.rt.summary()
        tok = loop.rt.model.tokenizer
        conv, out = Conversation(), []
        for n, salt in ((1200, 1), (40, 2), (700, 3)):
            out.append(loop.chat(conv, tok.decode(prompt_tokens(loop, n, salt=salt)), max_new=10).text)
            loop.rt.check_integrity()
            assert loop.rt.cache is not None and loop.rt.cache.n_lent == 0
            assert loop.rt.resources.all_resident()
        loop.close()
        return out

    bus = EventBus()
    steps: list[LoanStep] = []
    bus.subscribe(lambda e: steps.append(e) if isinstance(e, LoanStep) else None)
    plain = converse(LoanFlags())
    assert converse(FLAGS, bus) == plain
    assert len([s for s in steps if s.step == "restore"]) == 2  # startup and repeat
    releases = [s for s in steps if s.step == "release"]
    assert len(releases) == 2 and all(s.n_bytes > 0 for s in releases)
    # the verifier, the native head, the MTP block's experts and its draft head, each named
    assert all(label in releases[0].detail for label in LABELS.values()), releases[0].detail
    # a partial region of the nextn block's experts under the same loans: the same replies
    assert converse(FLAGS, mtp_experts=4) == plain


# --- files that are not what they say ------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "message"), [
    ("rope.dimension_count", 7, "rope.dimension_count' = 7 must be even and at most the head's 16"),
    ("rope.dimension_count", 32, "rope.dimension_count' = 32 must be even and at most the head's 16"),
    ("leading_dense_block_count", 3, "leading_dense_block_count 3 leaves none of the 3 main blocks"),
    ("expert_weights_norm", 1, "expert_weights_norm' = 1 is not a boolean"),
    ("expert_weights_scale", float("nan"), "expert_weights_scale' = nan is not a positive finite"),
])
def test_a_bad_glm4moe_key_is_one_line(glm_path: Path, key: str, value: object, message: str) -> None:
    from engine.errors import GGUFError, ModelError
    from engine.gguf.hparams import read_hparams
    from engine.gguf.reader import open_gguf

    mf = open_gguf(glm_path)
    mf.metadata[f"glm4moe.{key}"] = value
    with pytest.raises((GGUFError, ModelError)) as e:
        read_hparams(mf)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_missing_glm4moe_tensor_is_named(glm_path: Path) -> None:
    from engine.errors import GGUFError
    from engine.gguf.hparams import read_hparams
    from engine.gguf.reader import open_gguf

    for name in ("blk.1.exp_probs_b.bias", "blk.2.ffn_up_shexp.weight", "blk.0.ffn_down.weight",
                 "blk.1.attn_k.bias"):
        mf = open_gguf(glm_path)
        del mf.tensors[name]
        with pytest.raises(GGUFError, match=f"tensor '{name}' is missing"):
            read_hparams(mf)
    mf = open_gguf(glm_path)  # a router on the dense block: llama.cpp counts it as extra too
    mf.tensors["blk.0.ffn_gate_inp.weight"] = mf.tensors["blk.1.ffn_gate_inp.weight"]
    with pytest.raises(GGUFError, match="is not one a glm4moe model has"):
        read_hparams(mf)


def test_make_model_and_info_name_the_glm4moe_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    out = tmp_path / "glm.gguf"
    assert main(["make-model", str(out), "--preset", "tiny-glm", "--dense-ff", "96"]) == 0
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "architecture  glm4moe" in text
    assert "sigmoid + selection bias, normalised x 1.5" in text
    assert "dense blocks  1 leading (ffn 96), resident" in text
    assert "shared expert 1 beside the routed (ffn 64), resident" in text
    assert "RoPE on 8 of 16 dims" in text and re.search(r"\nattn_q\.bias +F32\n", text)
