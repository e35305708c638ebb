"""Device bytes of every item the planner places, computed from the model's shapes.

Dense weights, heads and buffers are floats on the device (`wb` bytes per element: float32
on the simulated device, float16 on CUDA), except the linear weights and the head kept in
their quantized blocks with `--dense quant`; experts are their quantized GGUF blobs. Each
carved array is padded to the arena's alignment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gguf import GGMLQuantizationType

from engine.config import EngineOptions
from engine.gguf import names
from engine.gguf.hparams import HParams
from engine.gguf.quant import keeps_quantized, matrix_bytes
from engine.gguf.type_mix import layers_by_value
from engine.kernels.attention import DEFAULT_SCORE_BYTES as SCORE_BYTES
from engine.kernels.dequant import DECODE_SLICE_BYTES
from engine.kernels.flash import supported as flash_supported
from engine.kernels.moe import DEFAULT_SCRATCH_BYTES as MOE_SCRATCH_BYTES
from engine.kernels.moe import ROW_ALIGN
from engine.kv import kv_bytes_per_cell
from engine.memory.arena import padded
from engine.memory.plan_types import ModelCosts

F32 = 4
KV_READ_BYTES = {"q4_0": 2, "f16": 0, "int8": F32 + 2}  # a prompt chunk's K/V read, per value


@dataclass(frozen=True)
class Shapes:
    """What sizing needs from a model: its hyper-parameters and expert blob sizes. Built from
    a loaded `Model` or from a synthetic preset's spec (so `strata plan` needs no file).
    `blob_bytes` is the largest blob of any main layer: the size of a cache or ring slot."""

    hp: HParams
    blob_bytes: int
    mtp_blob_bytes: int
    qtypes: tuple[GGMLQuantizationType, ...] = ()  # experts' (main, MTP) and the embedding's
    # (tensor name, its quant type in the file) of every tensor; none known: all decoded
    tensor_qtypes: tuple[tuple[str, GGMLQuantizationType], ...] = ()
    layer_blob_bytes: tuple[int, ...] = ()  # [n_moe_layer] each main MoE layer's blob (empty: all alike)

    def blob_sizes(self) -> dict[int, list[int]]:
        """Blob bytes -> the main layers whose blobs have that size (one entry unless a
        quant mix gives layers different types)."""
        return layers_by_value(self.layer_blob_bytes or (self.blob_bytes,) * self.hp.n_moe_layer)

    @property
    def mean_blob_bytes(self) -> float:
        """The mean blob of the main layers (what an expert streamed or refilled moves)."""
        sizes = self.layer_blob_bytes or (self.blob_bytes,)
        return sum(sizes) / len(sizes)

    def slot_slack_share(self) -> float:
        """The share of a full cache's slot bytes left unused: every slot is as large as the
        largest blob, and smaller blobs fill only its front."""
        return 1.0 - self.mean_blob_bytes / self.blob_bytes

    @property
    def has_mtp(self) -> bool:
        return self.hp.n_nextn > 0

    @property
    def every_qtype(self) -> tuple[GGMLQuantizationType, ...]:
        """The quant types of every tensor (the experts' first): what the CUDA kernels load
        up front (engine/kernels/warmup.py)."""
        return tuple(dict.fromkeys((*self.qtypes, *(q for _, q in self.tensor_qtypes))))

    @functools.cached_property
    def qtypes_by_name(self) -> dict[str, GGMLQuantizationType]:
        return dict(self.tensor_qtypes)

    def qtype(self, name: str) -> GGMLQuantizationType:
        """The file's type of tensor `name` (F32, i.e. decoded, where unknown)."""
        return self.qtypes_by_name.get(name, GGMLQuantizationType.F32)

    @classmethod
    def of_spec(cls, spec) -> Shapes:  # type: ignore[no-untyped-def]
        """From a synthetic preset's `SynthSpec` (no file needed)."""
        *layers, mtp = spec.layer_blob_bytes(with_mtp=True)
        return cls(spec.hparams(), max(layers), mtp,
                   tensor_qtypes=tuple(spec.tensor_qtypes().items()),
                   layer_blob_bytes=tuple(layers))

    @classmethod
    def of(cls, model) -> Shapes:  # type: ignore[no-untyped-def]
        mtp = model.mtp_experts
        layouts = (*model.experts.layouts, *(mtp.layouts if mtp is not None else ()))
        embd = model.mf.tensor(names.TOKEN_EMBD).qtype
        qtypes = (*(q for lay in layouts for q in lay.qtypes), embd)
        return cls(model.hp, model.experts.blob_bytes, mtp.blob_bytes if mtp is not None else 0,
                   tuple(dict.fromkeys(qtypes)),
                   tuple((name, t.qtype) for name, t in model.mf.tensors.items()),
                   model.experts.layer_blob_bytes)


def stacked_bytes(model: Shapes, parts: tuple[tuple[str, int], ...], n_in: int, wb: int,
                  quant: bool) -> int:
    """Device bytes of one linear weight [sum of rows, n_in] made of `parts` (tensor name, its
    rows) stacked by rows (`engine.model.weights.WeightLoader.matrix`): their quantized blocks
    when their types are kept quantized (one array, or one a part where the types differ),
    else `wb` per element; padded per array."""
    kinds = {model.qtype(n) for n, _ in parts}
    if quant and len(kinds) > 1 and all(keeps_quantized(q) for q in kinds):  # a `QuantStack`
        return sum(padded(matrix_bytes(model.qtype(n), (r, n_in), wb, quant)) for n, r in parts)
    qtype = kinds.pop() if len(kinds) == 1 else GGMLQuantizationType.F32
    return padded(matrix_bytes(qtype, (sum(r for _, r in parts), n_in), wb, quant))


def ffn_dense_bytes(model: Shapes, i: int, suffix: str, n_ff: int, wb: int, quant: bool) -> int:
    """A resident SwiGLU FFN of block `i` (a dense block's, suffix "", or the shared expert's,
    "_shexp"): gate and up stacked, down."""
    name = lambda kind: names.block(kind + suffix, i)
    d = model.hp.n_embd
    return (stacked_bytes(model, ((name("ffn_gate"), n_ff), (name("ffn_up"), n_ff)), d, wb, quant)
            + stacked_bytes(model, ((name("ffn_down"), d),), n_ff, wb, quant))


def block_dense_bytes(model: Shapes, i: int, wb: int, quant: bool = False) -> int:
    """Block `i`'s resident weights, padded per array (`engine.model.weights.load_block`):
    attention (stacked q/k/v and output weights, the biases as one vector), norms, and the
    router with its selection bias, the shared expert, or a dense block's FFN."""
    hp = model.hp
    d = hp.n_embd
    vectors = [d, d]  # attention's and the FFN's norm
    if hp.qk_norm:
        vectors += [hp.head_dim, hp.head_dim]
    if hp.qkv_bias:
        vectors.append(hp.q_dim + 2 * hp.kv_dim)
    if hp.is_moe(i):
        vectors.append(hp.n_expert * d)  # the router [E, d]
        if hp.selection_bias:
            vectors.append(hp.n_expert)
    qkv = tuple((names.block(k, i), r) for k, r in
                (("attn_q", hp.q_dim), ("attn_k", hp.kv_dim), ("attn_v", hp.kv_dim)))
    total = (sum(padded(wb * n) for n in vectors)
             + stacked_bytes(model, qkv, d, wb, quant)
             + stacked_bytes(model, ((names.block("attn_output", i), d),), hp.q_dim, wb, quant))
    if not hp.is_moe(i):
        total += ffn_dense_bytes(model, i, "", hp.n_ff, wb, quant)
    elif hp.n_expert_shared:
        total += ffn_dense_bytes(model, i, "_shexp", hp.n_ff_shexp, wb, quant)
    return total


def dense_bytes(model: Shapes, with_mtp: bool, wb: int = F32, quant: bool = False) -> int:
    """Main blocks, the final norm and (with MTP) the nextn block's dense weights; `quant`:
    linear weights kept in their blocks (`--dense quant`)."""
    hp = model.hp
    total = sum(block_dense_bytes(model, i, wb, quant) for i in range(hp.n_layer)) + padded(wb * hp.n_embd)
    if with_mtp:
        d, i = hp.n_embd, hp.n_layer
        total += block_dense_bytes(model, i, wb, quant) + 3 * padded(wb * d)  # + 3 norms
        total += stacked_bytes(model, ((names.nextn("eh_proj", i), d),), 2 * d, wb, quant)
    return total


def head_bytes(model: Shapes, wb: int = F32, quant: bool = False) -> int:
    hp = model.hp
    return stacked_bytes(model, ((names.native_head(hp.has_output), hp.n_vocab),), hp.n_embd, wb, quant)


def draft_head_bytes(model: Shapes, draft_vocab: int, wb: int = F32, quant: bool = False) -> int:
    """The draft head's rows (`engine.speculative.draft_head`): the MTP block's own head, else the
    output head, else the tied embedding; `draft_vocab` rows (0: all). 0 where it is every row
    of the native head (`shares_native_head`: the native head itself, no region)."""
    hp = model.hp
    own = names.nextn("shared_head_head", hp.n_layer)
    n = min(draft_vocab or hp.n_vocab, hp.n_vocab)
    if own not in model.qtypes_by_name:
        if n == hp.n_vocab:
            return 0
        own = names.native_head(hp.has_output)
    return stacked_bytes(model, ((own, n),), hp.n_embd, wb, quant)


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
    down outputs, plus the MoE accumulator (and the shared expert's gate/up and output beside
    them), or a dense block's gate/up and output where that is more. Attention scores are
    computed in query blocks of bounded size (flash-style on the GPU), so they do not grow
    with the chunk."""
    hp = model.hp
    d, k, f = hp.n_embd, hp.n_expert_used, hp.n_ff_exp
    ffn = hp.n_expert + k * (2 * f + d)
    if hp.n_expert_shared:
        ffn += 3 * hp.n_ff_shexp + d  # gate/up [2F], the activation [F], the output
    if hp.n_dense_lead:
        ffn = max(ffn, 3 * hp.n_ff + d)
    per_token = 3 * d + 2 * hp.q_dim + 2 * hp.kv_dim + ffn
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
    """Multiply-add FLOPs of the FFN half of prefilling `n_tokens` through the main blocks:
    the router and k SwiGLU experts (gate + up + down) per token and MoE block, the shared
    expert beside them, and the dense blocks' FFN."""
    hp = model.hp
    d, f, k = hp.n_embd, hp.n_ff_exp, hp.n_expert_used
    per_moe = 2 * d * hp.n_expert + 6 * d * (k * f + hp.n_ff_shexp)
    return n_tokens * (hp.n_moe_layer * per_moe + hp.n_dense_lead * 6 * d * hp.n_ff)


def prefill_flops(model: Shapes, n_tokens: int, pos0: int = 0) -> int:
    """FLOPs of prefilling tokens pos0..pos0+n-1 through the main blocks: attention
    (`attention_flops`) and the FFNs (`moe_flops`). The prompt computes no logits (the first
    token's come after)."""
    return attention_flops(model, n_tokens, pos0) + moe_flops(model, n_tokens)


def gpu_chunk_fixed_bytes(model: Shapes, n_ctx: int, quant: bool = False, kv_kind: str = "f16") -> int:
    """Prompt-chunk bytes on CUDA that do not grow with the chunk: the MoE kernels' fp16
    expert scratch, the attention score block (none for the flash kernel, which keeps scores
    in registers; the cuBLAS path's for other head sizes), the keys and values read back
    from the cache for the whole context (`KV_READ_BYTES` per value of `kv_kind`: fp16 decoded
    from q4_0, f16 cells read in place, int8 as float32 and an fp16 copy), and (`quant`) the
    largest linear weight decoded to fp16 for a GEMM, and the MoE's rows rounded up to
    `ROW_ALIGN` per expert (fp16 outputs). (The MoE kernels' gathered rows and GEMM outputs
    grow with the chunk: `act_bytes_per_token` counts them.)"""
    hp = model.hp
    d = hp.n_embd
    decoded = min(DECODE_SLICE_BYTES, 2 * d * max(hp.q_dim, 2 * d)) if quant else 0
    kv_read = 2 * n_ctx * hp.kv_dim * KV_READ_BYTES[kv_kind]
    expert_fp16 = 3 * hp.n_embd * hp.n_ff_exp * 2
    moe = min(MOE_SCRATCH_BYTES, hp.n_expert * expert_fp16) + hp.n_expert * (ROW_ALIGN - 1) * 2 * d
    # cuBLAS path: 1,024-query score blocks at most
    scores = 0 if flash_supported(hp.head_dim) else min(SCORE_BYTES, 2 * hp.n_head * n_ctx * 1024)
    return moe + scores + kv_read + decoded


def model_costs(model: Shapes, options: EngineOptions, wb: int = F32,
                gpu: bool = False, quant: bool = False) -> ModelCosts:
    """What each planner item costs for `model` (a Shapes or a loaded Model) under `options`,
    with dense weights and heads at `wb` bytes per element (`quant`: linear weights and the
    head in their quantized blocks); `gpu`: the prompt chunk also holds the CUDA kernels'
    fixed scratch (`gpu_chunk_fixed_bytes`)."""
    if not isinstance(model, Shapes):
        model = Shapes.of(model)
    fixed = gpu_chunk_fixed_bytes(model, options.ctx, quant, options.kv) if gpu else 0
    use_mtp = options.mtp and model.has_mtp
    return ModelCosts(
        dense_bytes=dense_bytes(model, use_mtp, wb, quant),
        kv_bytes=kv_bytes(model, options.ctx, options.kv)
        + (mtp_kv_bytes(model, options.ctx, options.kv) if use_mtp else 0),
        expert_blob_bytes=model.blob_bytes,
        n_layer=model.hp.n_moe_layer,  # the layers with routed experts
        n_expert=model.hp.n_expert,
        n_expert_used=model.hp.n_expert_used,
        act_bytes_per_token=act_bytes_per_token(model),
        act_bytes_fixed=2 * padded(1) + fixed,
        verifier_bytes=verifier_bytes(model, options.spec) if use_mtp else 0,
        head_bytes=head_bytes(model, wb, quant),
        mtp_expert_bytes=mtp_expert_bytes(model) if use_mtp else 0,
        mtp_blob_bytes=model.mtp_blob_bytes if use_mtp else 0,
        mtp_expert_slots=model.hp.n_expert if use_mtp else 0,
        draft_head_bytes=draft_head_bytes(model, options.draft_vocab, wb, quant) if use_mtp else 0,
    )
