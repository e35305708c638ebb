"""Hyper-parameters of a qwen3moe model, read from GGUF metadata and checked against tensors."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import GGUFError, ModelError
from engine.gguf import names
from engine.gguf.reader import SUPPORTED_QTYPES, ModelFile


@dataclass(frozen=True)
class HParams:
    """Shapes of the model. `n_layer` counts main blocks only; the MTP block follows them."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_nextn: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    has_output: bool  # a native output head (else tied to token_embd)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def read_hparams(mf: ModelFile) -> HParams:
    """Read and validate hyper-parameters; every inconsistency is a one-line error."""
    if mf.arch not in names.SUPPORTED_ARCHS:
        raise GGUFError(
            f"{mf.path.name}: architecture '{mf.arch or '?'}' is not supported; "
            f"strata runs {', '.join(names.SUPPORTED_ARCHS)} models"
        )
    n_block = int(mf.require("block_count"))
    n_nextn = int(mf.key("nextn_predict_layers", 0) or 0)
    n_embd = int(mf.require("embedding_length"))
    n_head = int(mf.require("attention.head_count"))
    head_dim = int(mf.key("attention.key_length", n_embd // max(n_head, 1)))
    embd = mf.tensor(names.TOKEN_EMBD)
    hp = HParams(
        n_vocab=embd.shape[0],
        n_embd=n_embd,
        n_layer=n_block - n_nextn,
        n_nextn=n_nextn,
        n_head=n_head,
        n_head_kv=int(mf.key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_expert=int(mf.require("expert_count")),
        n_expert_used=int(mf.require("expert_used_count")),
        n_ff_exp=int(mf.require("expert_feed_forward_length")),
        n_ctx_train=int(mf.key("context_length", 4096)),
        rms_eps=float(mf.key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(mf.key("rope.freq_base", 10000.0)),
        has_output=names.OUTPUT in mf.tensors,
    )
    if hp.n_layer < 1 or n_nextn < 0 or n_nextn > 1:
        raise ModelError(
            f"{mf.path.name}: block_count {n_block} with nextn_predict_layers {n_nextn} is not "
            "supported (need at least one main block and at most one MTP block)"
        )
    if not 0 < hp.n_expert_used <= hp.n_expert:
        raise ModelError(
            f"{mf.path.name}: expert_used_count {hp.n_expert_used} must be in 1..{hp.n_expert}"
        )
    if hp.n_head % hp.n_head_kv:
        raise ModelError(
            f"{mf.path.name}: head_count {hp.n_head} is not a multiple of head_count_kv {hp.n_head_kv}"
        )
    if head_dim % 2:
        raise ModelError(f"{mf.path.name}: key_length {head_dim} must be even for NEOX RoPE")
    check_tensors(mf, hp)
    return hp


def expected_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its numpy-order shape."""
    d, q, kv, e, f = hp.n_embd, hp.q_dim, hp.kv_dim, hp.n_expert, hp.n_ff_exp
    shapes: dict[str, tuple[int, ...]] = {
        names.TOKEN_EMBD: (hp.n_vocab, d),
        names.OUTPUT_NORM: (d,),
    }
    if hp.has_output:
        shapes[names.OUTPUT] = (hp.n_vocab, d)
    per_block = {
        "attn_norm": (d,),
        "attn_q": (q, d),
        "attn_k": (kv, d),
        "attn_v": (kv, d),
        "attn_output": (d, q),
        "attn_q_norm": (hp.head_dim,),
        "attn_k_norm": (hp.head_dim,),
        "ffn_norm": (d,),
        "ffn_gate_inp": (e, d),
        "ffn_gate_exps": (e, f, d),
        "ffn_up_exps": (e, f, d),
        "ffn_down_exps": (e, d, f),
    }
    for i in range(hp.n_layer + hp.n_nextn):
        for kind, shape in per_block.items():
            shapes[names.block(kind, i)] = shape
    for i in range(hp.n_layer, hp.n_layer + hp.n_nextn):
        shapes[names.nextn("eh_proj", i)] = (d, 2 * d)
        for kind in ("enorm", "hnorm", "shared_head_norm"):
            shapes[names.nextn(kind, i)] = (d,)
    return shapes


def optional_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(hp.n_layer, hp.n_layer + hp.n_nextn):
        shapes[names.nextn("shared_head_head", i)] = (hp.n_vocab, hp.n_embd)
        shapes[names.nextn("embed_tokens", i)] = (hp.n_vocab, hp.n_embd)
    return shapes


def check_tensors(mf: ModelFile, hp: HParams) -> None:
    """Raise on the first missing tensor, shape mismatch or unsupported quant type."""
    required = expected_shapes(hp)
    optional = optional_shapes(hp)
    for name, shape in {**required, **optional}.items():
        if name not in mf.tensors:
            if name in optional:
                continue
            mf.tensor(name)  # raises the missing-tensor error
        t = mf.tensors[name]
        if t.shape != shape:
            raise GGUFError(
                f"{mf.path.name}: tensor '{name}' has shape {list(t.shape)}, expected "
                f"{list(shape)} from the metadata; the file and its metadata disagree"
            )
        if t.qtype not in SUPPORTED_QTYPES:
            raise GGUFError(
                f"{mf.path.name}: tensor '{name}' uses quant type {t.qtype.name}, which strata "
                "does not support; use one of " + ", ".join(sorted(q.name for q in SUPPORTED_QTYPES))
            )
