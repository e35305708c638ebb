"""Hyper-parameters of a qwen3moe or glm4moe model, read from GGUF metadata and checked
against tensors.

glm4moe (GLM-4.5 / 4.5-Air / 4.6 / 4.7) is qwen3moe's block with: q/k/v biases, q/k norms only
in some files, partial RoPE (`rope.dimension_count` of a head's dims), dense leading blocks
(`leading_dense_block_count`, FFN `feed_forward_length`), sigmoid routing whose top-k is chosen
on the probabilities plus a per-expert bias (`exp_probs_b`) and whose weights are normalised
(`expert_weights_norm`) and scaled (`expert_weights_scale`), and a shared expert
(`expert_shared_count` x `expert_feed_forward_length` rows) beside the routed ones.

Every number is checked for its type, against a sane limit and against the tensors present
before anything is built from it: a hostile `block_count` of 4,000,000,000 is one line of
error, not four billion tensor names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import GGUFError, ModelError
from engine.gguf import names
from engine.gguf.container import show_value
from engine.gguf.reader import SUPPORTED_QTYPES, ModelFile

# Sane limits (inclusive) of the integer hyper-parameters, `{arch}.` keys: an order of magnitude
# above the largest published models, so only a corrupt or hostile file is refused.
HPARAM_LIMITS: dict[str, tuple[int, int]] = {
    "block_count": (1, 1024),  # Qwen3-235B-A22B has 94, DeepSeek-V3 61 + 1 MTP
    "nextn_predict_layers": (0, 1024),  # read_hparams runs at most one
    "embedding_length": (1, 1 << 16),  # Llama-3.1-405B: 16,384
    "attention.head_count": (1, 1024),  # Llama-3.1-405B: 128
    "attention.head_count_kv": (1, 1024),
    "attention.key_length": (2, 4096),  # 128 usually; DeepSeek's MLA: 576
    "expert_count": (1, 4096),  # Kimi-K2: 384, Qwen3-Next: 512
    "expert_used_count": (1, 4096),
    "expert_feed_forward_length": (1, 1 << 18),  # even a dense FFN: 53,248 (405B)
    "feed_forward_length": (1, 1 << 18),  # glm4moe's dense leading blocks (Air: 10,944)
    "leading_dense_block_count": (0, 1024),  # GLM-4.5: 3, Air: 1, DeepSeek-V3: 3
    "expert_shared_count": (0, 64),  # GLM-4.5: 1, DeepSeek-V2-Lite: 2
    "expert_gating_func": (0, 3),  # llama.cpp's: 0 none (the architecture's), 1 softmax, 2 sigmoid
    "rope.dimension_count": (2, 4096),  # GLM-4.5: 64 of a 128-dim head
    "context_length": (1, 1 << 24),  # Llama 4 Scout: 10,485,760
}
MAX_VOCAB = 1 << 22  # rows of token_embd; Gemma 3 has 262,144
GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values


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
    arch: str = names.ARCH_QWEN3MOE
    n_rot: int = 0  # dims of a head RoPE rotates (the first ones, NEOX pairs); 0: all of them
    n_dense_lead: int = 0  # leading blocks with a dense FFN instead of experts
    n_ff: int = 0  # rows of those blocks' dense FFN
    n_expert_shared: int = 0  # shared experts beside the routed ones, as one FFN
    gating: str = "softmax"  # router probabilities: "softmax" or "sigmoid"
    weights_norm: bool = True  # the top-k weights renormalised to sum 1
    weights_scale: float = 1.0  # then multiplied by this
    qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def qkv_bias(self) -> bool:
        """q, k and v projections with a bias (glm4moe's)."""
        return self.arch == names.ARCH_GLM4MOE

    @property
    def selection_bias(self) -> bool:
        """A per-expert bias on the probabilities for the top-k (glm4moe's `exp_probs_b`)."""
        return self.arch == names.ARCH_GLM4MOE

    @property
    def rot_dims(self) -> int:
        """Dims of a head RoPE rotates: all, or the first `n_rot` (partial RoPE)."""
        return self.n_rot or self.head_dim

    @property
    def n_moe_layer(self) -> int:
        """Main blocks with routed experts: all but the dense leading ones. The expert cache,
        profiles and routes count these, 0-based (`moe_index`)."""
        return self.n_layer - self.n_dense_lead

    @property
    def n_ff_shexp(self) -> int:
        """Rows of the shared expert (0 without one)."""
        return self.n_ff_exp * self.n_expert_shared

    def is_moe(self, i: int) -> bool:
        """Whether block `i` (the nextn block too) routes to experts."""
        return i >= self.n_dense_lead

    def moe_index(self, i: int) -> int:
        """Block `i`'s index among the MoE blocks (the expert cache's layer)."""
        return i - self.n_dense_lead

    def resident_ffn(self) -> str:
        """What runs beside the routed experts as resident weights, for a summary line:
        ' + 1 dense layer, 1 shared expert', or '' (qwen3moe)."""
        parts = []
        if self.n_dense_lead:
            parts.append(f"{self.n_dense_lead} dense layer{'s' if self.n_dense_lead > 1 else ''}")
        if self.n_expert_shared:
            parts.append(f"{self.n_expert_shared} shared expert{'s' if self.n_expert_shared > 1 else ''}")
        return " + " + ", ".join(parts) + " (resident)" if parts else ""

    @property
    def ffn_norm(self) -> str:
        """The tensor kind of the norm before a block's FFN."""
        return names.FFN_NORM[self.arch]

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
    n_block = _int(mf, "block_count")
    n_nextn = _int(mf, "nextn_predict_layers", 0)
    n_embd = _int(mf, "embedding_length")
    n_head = _int(mf, "attention.head_count")
    head_dim = _int(mf, "attention.key_length", n_embd // n_head)
    n_layer = n_block - n_nextn
    if n_layer < 1 or n_nextn > 1:
        raise ModelError(
            f"{mf.path.name}: block_count {n_block} with nextn_predict_layers {n_nextn} is not "
            "supported (need at least one main block and at most one MTP block)"
        )
    _check_blocks(mf, n_block)
    arch = _arch_hparams(mf, head_dim, n_layer)
    hp = HParams(
        n_vocab=_vocab_rows(mf),
        n_embd=n_embd,
        n_layer=n_layer,
        n_nextn=n_nextn,
        n_head=n_head,
        n_head_kv=_int(mf, "attention.head_count_kv", n_head),
        head_dim=head_dim,
        n_expert=_int(mf, "expert_count"),
        n_expert_used=_int(mf, "expert_used_count"),
        n_ff_exp=_int(mf, "expert_feed_forward_length"),
        n_ctx_train=_int(mf, "context_length", 4096),
        rms_eps=_float(mf, "attention.layer_norm_rms_epsilon", 1e-6, below=1.0),
        rope_base=_float(mf, "rope.freq_base", 10000.0),
        has_output=names.OUTPUT in mf.tensors,
        **arch,
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


def _arch_hparams(mf: ModelFile, head_dim: int, n_layer: int) -> dict:
    """The fields one architecture reads beyond qwen3moe's (as llama.cpp reads them)."""
    n_rot = _int(mf, "rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise GGUFError(
            f"{mf.path.name}: metadata key '{mf.arch}.rope.dimension_count' = {n_rot} must be even "
            f"and at most the head's {head_dim} dims; the file is corrupt"
        )
    out: dict = {"arch": mf.arch, "n_rot": 0 if n_rot == head_dim else n_rot}
    if mf.arch != names.ARCH_GLM4MOE:
        return out
    n_dense = _int(mf, "leading_dense_block_count", 0)
    if n_dense >= n_layer:
        raise ModelError(
            f"{mf.path.name}: leading_dense_block_count {n_dense} leaves none of the {n_layer} "
            "main blocks with experts; strata runs mixture-of-experts models"
        )
    gating = _int(mf, "expert_gating_func", 2)  # glm4moe: none means sigmoid
    out.update(
        n_dense_lead=n_dense,
        n_ff=_int(mf, "feed_forward_length") if n_dense else 0,
        n_expert_shared=_int(mf, "expert_shared_count", 0),
        gating=GATING.get(gating, "sigmoid"),
        weights_norm=_bool(mf, "expert_weights_norm", False),
        weights_scale=_float(mf, "expert_weights_scale", 1.0, below=1e6),
        qk_norm=names.block("attn_q_norm", 0) in mf.tensors,
    )
    return out


def _bool(mf: ModelFile, name: str, default: bool) -> bool:
    value = mf.key(name, default)
    if type(value) is not bool:
        raise GGUFError(
            f"{mf.path.name}: metadata key '{mf.arch}.{name}' = {show_value(value)} is not a "
            "boolean; the file is corrupt"
        )
    return value


def _int(mf: ModelFile, name: str, default: int | None = None) -> int:
    """`{arch}.name` as an int inside HPARAM_LIMITS[name] (`default` when absent, else required)."""
    value = mf.require(name) if default is None else mf.key(name, default)
    lo, hi = HPARAM_LIMITS[name]
    if type(value) is not int:  # a bool, float, string or list is a corrupt file
        raise GGUFError(
            f"{mf.path.name}: metadata key '{mf.arch}.{name}' = {show_value(value)} is not an "
            "integer; the file is corrupt"
        )
    if not lo <= value <= hi:
        raise GGUFError(
            f"{mf.path.name}: metadata key '{mf.arch}.{name}' = {value:,} is outside the sane "
            f"range {lo:,}..{hi:,}; the file is corrupt"
        )
    return value


def _float(mf: ModelFile, name: str, default: float, below: float = math.inf) -> float:
    """`{arch}.name` as a finite float in (0, below)."""
    value = mf.key(name, default)
    if type(value) not in (int, float) or not 0 < value < below:  # NaN fails the comparison
        bound = "" if below == math.inf else f" below {below:g}"
        raise GGUFError(
            f"{mf.path.name}: metadata key '{mf.arch}.{name}' = {show_value(value)} is not a "
            f"positive finite number{bound}; the file is corrupt"
        )
    return float(value)


def _check_blocks(mf: ModelFile, n_block: int) -> None:
    """The file's `blk.N.*` tensors are for exactly blocks 0..n_block-1 (one pass over names)."""
    present: set[int] = set()
    for name in mf.tensors:
        if not name.startswith("blk."):
            continue
        index = name.split(".", 2)[1]
        if not (index.isascii() and index.isdigit()):
            raise GGUFError(
                f"{mf.path.name}: tensor '{name}' has block index {index!r}, not a number; "
                "the file is corrupt"
            )
        block = int(index)
        if block >= n_block:
            raise GGUFError(
                f"{mf.path.name}: tensor '{name}' is in block {block} but metadata key "
                f"'{mf.arch}.block_count' = {n_block:,}; the file and its metadata disagree"
            )
        present.add(block)
    if len(present) < n_block:
        first = min(set(range(n_block)) - present)  # n_block is within HPARAM_LIMITS
        raise GGUFError(
            f"{mf.path.name}: metadata key '{mf.arch}.block_count' = {n_block:,} but the file "
            f"has tensors for {len(present):,} blocks (none for blk.{first}); the file and its "
            "metadata disagree"
        )


def _vocab_rows(mf: ModelFile) -> int:
    """The vocabulary size: rows of token_embd, which must be a matrix of sane height."""
    embd = mf.tensor(names.TOKEN_EMBD)
    if len(embd.shape) != 2:
        raise GGUFError(
            f"{mf.path.name}: tensor '{names.TOKEN_EMBD}' has shape {list(embd.shape)}, expected "
            "[n_vocab, n_embd]; the file is corrupt"
        )
    if not 1 <= embd.shape[0] <= MAX_VOCAB:
        raise GGUFError(
            f"{mf.path.name}: tensor '{names.TOKEN_EMBD}' has {embd.shape[0]:,} rows (the "
            f"vocabulary), outside the sane range 1..{MAX_VOCAB:,}; the file is corrupt"
        )
    return embd.shape[0]


def block_shapes(hp: HParams, i: int) -> dict[str, tuple[int, ...]]:
    """Tensor kind -> numpy-order shape of every tensor block `i` needs (the nextn block's
    own `nextn.*` tensors apart)."""
    d, q, kv, e, f, hd = hp.n_embd, hp.q_dim, hp.kv_dim, hp.n_expert, hp.n_ff_exp, hp.head_dim
    out: dict[str, tuple[int, ...]] = {
        "attn_norm": (d,),
        "attn_q": (q, d),
        "attn_k": (kv, d),
        "attn_v": (kv, d),
        "attn_output": (d, q),
    }
    if hp.qkv_bias:
        out.update(attn_q_bias=(q,), attn_k_bias=(kv,), attn_v_bias=(kv,))
    if hp.qk_norm:
        out.update(attn_q_norm=(hd,), attn_k_norm=(hd,))
    out[hp.ffn_norm] = (d,)
    if not hp.is_moe(i):
        return {**out, "ffn_gate": (hp.n_ff, d), "ffn_up": (hp.n_ff, d), "ffn_down": (d, hp.n_ff)}
    out.update(ffn_gate_inp=(e, d), ffn_gate_exps=(e, f, d), ffn_up_exps=(e, f, d),
               ffn_down_exps=(e, d, f))
    if hp.selection_bias:
        out["exp_probs_b"] = (e,)
    if hp.n_expert_shared:
        fs = hp.n_ff_shexp
        out.update(ffn_gate_shexp=(fs, d), ffn_up_shexp=(fs, d), ffn_down_shexp=(d, fs))
    return out


def expected_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its numpy-order shape."""
    d = hp.n_embd
    shapes: dict[str, tuple[int, ...]] = {
        names.TOKEN_EMBD: (hp.n_vocab, d),
        names.OUTPUT_NORM: (d,),
    }
    if hp.has_output:
        shapes[names.OUTPUT] = (hp.n_vocab, d)
    for i in range(hp.n_layer + hp.n_nextn):
        for kind, shape in block_shapes(hp, i).items():
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
    """Raise on the first missing tensor, shape mismatch or unsupported quant type, and on a
    tensor the model does not have (llama.cpp refuses one too: "wrong number of tensors")."""
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
    extra = [name for name in mf.tensors if name not in required and name not in optional]
    if extra:
        more = f" (and {len(extra) - 1:,} more)" if len(extra) > 1 else ""
        raise GGUFError(
            f"{mf.path.name}: tensor '{extra[0]}'{more} is not one a {mf.arch} model has "
            "(llama.cpp refuses it too: wrong number of tensors); the file is corrupt or from "
            "another converter"
        )
