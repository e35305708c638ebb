"""Device bytes of every item the planner places, computed from the model's shapes.

Dense weights, heads and buffers are float32 on the device (what the kernels read); experts
are their quantized GGUF blobs. Each carved array is padded to the arena's alignment.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from engine.config import EngineOptions
from engine.gguf import names
from engine.gguf.hparams import HParams
from engine.kernels.attention import DEFAULT_SCORE_BYTES as SCORE_BYTES
from engine.kernels.flash import supported as flash_supported
from engine.kernels.moe import DEFAULT_SCRATCH_BYTES as MOE_SCRATCH_BYTES
from engine.kv import kv_bytes_per_cell
from engine.memory.arena import padded
from engine.memory.plan_types import ModelCosts

F32 = 4


@dataclass(frozen=True)
class Shapes:
    """What sizing needs from a model: its hyper-parameters and expert blob sizes. Built from
    a loaded `Model` or from a synthetic preset's spec (so `strata plan` needs no file)."""

    hp: HParams
    blob_bytes: int
    mtp_blob_bytes: int
    qtypes: tuple[GGMLQuantizationType, ...] = ()  # experts' (main, MTP) and the embedding's

    @property
    def has_mtp(self) -> bool:
        return self.hp.n_nextn > 0

    @classmethod
    def of_spec(cls, spec) -> Shapes:  # type: ignore[no-untyped-def]
        """From a synthetic preset's `SynthSpec` (no file needed)."""
        blob = spec.expert_blob_bytes()
        return cls(spec.hparams(), blob, blob if spec.n_nextn else 0)

    @classmethod
    def of(cls, model) -> Shapes:  # type: ignore[no-untyped-def]
        mtp = model.mtp_experts
        qtypes = (*model.experts.layout.qtypes, *(mtp.layout.qtypes if mtp is not None else ()),
                  model.mf.tensor(names.TOKEN_EMBD).qtype)
        return cls(model.hp, model.experts.blob_bytes, mtp.blob_bytes if mtp is not None else 0,
                   tuple(dict.fromkeys(qtypes)))


def block_dense_bytes(d: int, q: int, kv: int, head_dim: int, n_expert: int, wb: int) -> int:
    """One block's attention + norms + router, `wb` bytes per element, padded per array."""
    arrays = [d, q * d, kv * d, kv * d, d * q, head_dim, head_dim, d, n_expert * d]
    return sum(padded(wb * n) for n in arrays)


def dense_bytes(model: Shapes, with_mtp: bool, wb: int = F32) -> int:
    """Main blocks, the final norm and (with MTP) the nextn block's dense weights."""
    hp = model.hp
    one = block_dense_bytes(hp.n_embd, hp.q_dim, hp.kv_dim, hp.head_dim, hp.n_expert, wb)
    total = hp.n_layer * one + padded(wb * hp.n_embd)
    if with_mtp:
        d = hp.n_embd
        total += one + padded(wb * d * 2 * d) + 3 * padded(wb * d)  # eh_proj, 3 norms
    return total


def head_bytes(model: Shapes, wb: int = F32) -> int:
    return padded(wb * model.hp.n_vocab * model.hp.n_embd)


def draft_head_bytes(model: Shapes, draft_vocab: int, wb: int = F32) -> int:
    n = draft_vocab or model.hp.n_vocab
    return padded(wb * min(n, model.hp.n_vocab) * model.hp.n_embd)


def mtp_expert_bytes(model: Shapes) -> int:
    return padded(model.hp.n_expert * model.mtp_blob_bytes) if model.has_mtp else 0


def verifier_bytes(model: Shapes, spec: int) -> int:
    """Window buffers: logits [T, V] and hidden [T, d], float32."""
    if spec < 2:
        return 0
    return padded(F32 * spec * model.hp.n_vocab) + padded(F32 * spec * model.hp.n_embd)


def kv_bytes(model: Shapes, n_ctx: int, kind: str) -> int:
    hp = model.hp
    return kv_bytes_per_cell(kind, hp.n_layer, hp.kv_dim, hp.n_head_kv) * n_ctx + 4 * padded(1)


def mtp_kv_bytes(model: Shapes, n_ctx: int, kind: str) -> int:
    hp = model.hp
    return kv_bytes_per_cell(kind, 1, hp.kv_dim, hp.n_head_kv) * n_ctx + 4 * padded(1) if hp.n_nextn else 0


def act_bytes_per_token(model: Shapes) -> int:
    """Peak activations one prompt token needs in a layer, float32: residual and normed
    stream, q/k/v and attention output, router probabilities, and its k experts' gate, up and
    down outputs, plus the MoE accumulator. Attention scores are computed in query blocks of
    bounded size (flash-style on the GPU), so they do not grow with the chunk."""
    hp = model.hp
    d, k, f = hp.n_embd, hp.n_expert_used, hp.n_ff_exp
    per_token = 3 * d + 2 * hp.q_dim + 2 * hp.kv_dim + hp.n_expert + k * (2 * f + d)
    return F32 * per_token


def attention_flops(model: Shapes, n_tokens: int, pos0: int = 0) -> int:
    """Multiply-add FLOPs (2 per MAC) of the attention half of prefilling tokens
    pos0..pos0+n-1 through the main blocks: q/k/v/o projections and causal attention (4 * H * D
    per visible key)."""
    hp = model.hp
    d = hp.n_embd
    per_token = 2 * d * (hp.q_dim + 2 * hp.kv_dim) + 2 * hp.q_dim * d  # projections
    visible = n_tokens * pos0 + n_tokens * (n_tokens + 1) // 2  # sum of keys each query sees
    return hp.n_layer * (n_tokens * per_token + 4 * hp.n_head * hp.head_dim * visible)


def moe_flops(model: Shapes, n_tokens: int) -> int:
    """Multiply-add FLOPs of the MoE half of prefilling `n_tokens` through the main blocks:
    the router and k SwiGLU experts (gate + up + down) per token."""
    hp = model.hp
    d, f, k = hp.n_embd, hp.n_ff_exp, hp.n_expert_used
    return hp.n_layer * n_tokens * (2 * d * hp.n_expert + 6 * k * d * f)


def prefill_flops(model: Shapes, n_tokens: int, pos0: int = 0) -> int:
    """FLOPs of prefilling tokens pos0..pos0+n-1 through the main blocks: attention
    (`attention_flops`) and MoE (`moe_flops`). The prompt computes no logits (the first
    token's come after)."""
    return attention_flops(model, n_tokens, pos0) + moe_flops(model, n_tokens)


def gpu_chunk_fixed_bytes(model: Shapes, n_ctx: int) -> int:
    """Prompt-chunk bytes on CUDA that do not grow with the chunk: the MoE kernels' fp16
    expert scratch, the attention score block (none for the flash kernel, which keeps scores
    in registers; the cuBLAS path's for other head sizes), and the keys and values read back
    from the cache for the whole context (float32 and their fp16 copies). (The MoE kernels'
    gathered rows and GEMM outputs grow with the chunk: `act_bytes_per_token` counts them.)"""
    hp = model.hp
    kv_read = 2 * n_ctx * hp.kv_dim * (F32 + 2)
    expert_fp16 = 3 * hp.n_embd * hp.n_ff_exp * 2
    moe = min(MOE_SCRATCH_BYTES, hp.n_expert * expert_fp16)
    # cuBLAS path: 1,024-query score blocks at most
    scores = 0 if flash_supported(hp.head_dim) else min(SCORE_BYTES, 2 * hp.n_head * n_ctx * 1024)
    return moe + scores + kv_read


def model_costs(model: Shapes, options: EngineOptions, wb: int = F32,
                gpu: bool = False) -> ModelCosts:
    """What each planner item costs for `model` (a Shapes or a loaded Model) under `options`,
    with dense weights and heads at `wb` bytes per element; `gpu`: the prompt chunk also
    holds the CUDA kernels' fixed scratch (`gpu_chunk_fixed_bytes`)."""
    if not isinstance(model, Shapes):
        model = Shapes.of(model)
    fixed = gpu_chunk_fixed_bytes(model, options.ctx) if gpu else 0
    use_mtp = options.mtp and model.has_mtp
    return ModelCosts(
        dense_bytes=dense_bytes(model, use_mtp, wb),
        kv_bytes=kv_bytes(model, options.ctx, options.kv)
        + (mtp_kv_bytes(model, options.ctx, options.kv) if use_mtp else 0),
        expert_blob_bytes=model.blob_bytes,
        n_layer=model.hp.n_layer,
        n_expert=model.hp.n_expert,
        n_expert_used=model.hp.n_expert_used,
        act_bytes_per_token=act_bytes_per_token(model),
        act_bytes_fixed=2 * padded(1) + fixed,
        verifier_bytes=verifier_bytes(model, options.spec) if use_mtp else 0,
        head_bytes=head_bytes(model, wb),
        mtp_expert_bytes=mtp_expert_bytes(model) if use_mtp else 0,
        draft_head_bytes=draft_head_bytes(model, options.draft_vocab, wb) if use_mtp else 0,
    )
