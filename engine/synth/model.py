"""Deterministic synthetic qwen3moe and glm4moe GGUF files (`strata make-model`), written with
GGUFWriter.

Tensors are streamed to disk one at a time, so the `qwen3-30b-a3b` preset (about 17 GB of
4-bit experts) never sits in memory. The same spec and seed always give the same bytes.
"""

from __future__ import annotations

import math
import os
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, ExpertGatingFuncType, GGUFWriter, LlamaFileType
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.gguf import names
from engine.gguf.hparams import HParams, expected_shapes, optional_shapes
from engine.synth.blocks import random_tensor
from engine.synth.mixes import MIXES, NEEDS_IMATRIX, mix_types
from engine.synth.vocab import MAX_N_VOCAB, MIN_N_VOCAB, PRE, VocabSpec, build_vocab, write_vocab

GROUPS = ("embd", "attn", "router", "experts", "output", "norm", "nextn")
_POSITIVE = ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_expert",
             "n_expert_used", "n_ff_exp", "n_ctx")


@dataclass(frozen=True)
class SynthSpec:
    """Shapes, quant types per tensor group and seed of a synthetic model."""

    n_vocab: int = 8192
    n_embd: int = 256
    n_layer: int = 4
    n_nextn: int = 1
    n_head: int = 8
    n_head_kv: int = 2
    head_dim: int = 32
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 256
    n_ctx: int = 16384
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    tied_output: bool = False
    readable_head: bool = True  # see head_row_scale
    centered: bool = False  # random quantized blocks symmetric around zero (blocks._center)
    seed: int = 0
    # a llama.cpp quantizer mix (`q4_k_m`, engine/synth/mixes.py): the types it gives each
    # tensor it re-encodes, layer by layer, in place of `qtypes` (norms and router keep theirs)
    mix: str = ""
    # glm4moe (`arch`): dense leading blocks (`n_ff` rows), a shared expert, partial RoPE
    # (`n_rot` of a head's dims, 0: all), q/k norms or not, and the routed weights' norm and
    # scale; sigmoid routing with a selection bias and q/k/v biases come with the architecture
    arch: str = names.ARCH_QWEN3MOE
    n_dense_lead: int = 0
    n_ff: int = 0
    n_expert_shared: int = 0
    n_rot: int = 0
    qk_norm: bool = True
    weights_norm: bool = True
    weights_scale: float = 1.0
    qtypes: dict[str, str] = field(
        default_factory=lambda: {
            "embd": "Q8_0",
            "attn": "Q8_0",
            "router": "F32",
            "experts": "Q4_0",
            "output": "Q8_0",
            "norm": "F32",
            "nextn": "Q8_0",
        }
    )

    def hparams(self) -> HParams:
        glm = self.arch == names.ARCH_GLM4MOE
        return HParams(
            n_vocab=self.n_vocab,
            n_embd=self.n_embd,
            n_layer=self.n_layer,
            n_nextn=self.n_nextn,
            n_head=self.n_head,
            n_head_kv=self.n_head_kv,
            head_dim=self.head_dim,
            n_expert=self.n_expert,
            n_expert_used=self.n_expert_used,
            n_ff_exp=self.n_ff_exp,
            n_ctx_train=self.n_ctx,
            rms_eps=self.rms_eps,
            rope_base=self.rope_base,
            has_output=not self.tied_output,
            arch=self.arch,
            n_rot=0 if self.n_rot == self.head_dim else self.n_rot,
            n_dense_lead=self.n_dense_lead,
            n_ff=self.n_ff if self.n_dense_lead else 0,
            n_expert_shared=self.n_expert_shared,
            gating="sigmoid" if glm else "softmax",
            weights_norm=self.weights_norm,
            weights_scale=self.weights_scale,
            qk_norm=self.qk_norm or not glm,
        )

    def with_qtype(self, group: str, qtype: str) -> SynthSpec:
        if group == "all":
            return replace(self, qtypes={g: qtype for g in GROUPS})
        return replace(self, qtypes={**self.qtypes, group: qtype})

    def tensor_qtypes(self) -> dict[str, Q]:
        """Every tensor's quant type as the file would store it: name -> type."""
        return {name: qtype for name, (_, qtype) in synth_tensors(self).items()}

    def expert_blob_bytes(self) -> int:
        """Bytes of the largest (layer, expert) gate+up+down blob of the main layers as this
        spec quantizes experts (a mix may give layers different types): a cache slot's size."""
        return max(self.layer_blob_bytes())

    def layer_blob_bytes(self, with_mtp: bool = False) -> list[int]:
        """Bytes of one (layer, expert) blob of each main layer with experts (`with_mtp`: and
        then of the MTP block, 0 without one)."""
        tensors = synth_tensors(self)

        def blob(i: int) -> int:
            parts = (tensors[names.block(k, i)] for k in names.EXPERT_TENSORS)
            return sum(_nbytes(shape[1:], qtype) for shape, qtype in parts)  # one expert's rows

        out = [blob(i) for i in range(self.n_dense_lead, self.n_layer)]
        if with_mtp:
            out.append(blob(self.n_layer) if self.n_nextn else 0)
        return out

    def problems(self, label: Mapping[str, str] | None = None) -> list[str]:
        """Every reason the engine would refuse this model, or it could not be written, in
        words; `label` says how the user set a field (make-model: 'n_layer' -> '--layers')."""
        label = label or {}

        def named(f: str) -> str:
            return f"{label.get(f, f)} {getattr(self, f)}"

        out = [f"{named(f)} must be at least 1" for f in _POSITIVE if getattr(self, f) < 1]
        if not 0 <= self.n_nextn <= 1:
            out.append(f"{named('n_nextn')} must be 0 or 1 (MTP blocks after the main ones)")
        if self.seed < 0:
            out.append(f"{named('seed')} must be >= 0")
        if self.mix and self.mix not in MIXES:
            out.append(f"{named('mix')} is not a quantizer mix; use one of {', '.join(MIXES)}")
        if self.arch not in names.SUPPORTED_ARCHS:
            out.append(f"{named('arch')} is not one strata runs; use one of "
                       f"{', '.join(names.SUPPORTED_ARCHS)}")
        if self.arch != names.ARCH_GLM4MOE and (self.n_dense_lead or self.n_expert_shared):
            out.append("dense leading blocks and shared experts are glm4moe's; set the arch")
        if self.n_dense_lead < 0 or 1 <= self.n_layer <= self.n_dense_lead:
            out.append(f"{named('n_dense_lead')} must leave a block with experts (below "
                       f"{named('n_layer')})")
        if self.n_dense_lead and self.n_ff < 1:
            out.append(f"{named('n_ff')} must be at least 1 for the dense leading blocks")
        if self.n_rot < 0 or self.n_rot % 2 or self.n_rot > self.head_dim:
            out.append(f"{named('n_rot')} must be even and at most {named('head_dim')} (0: all)")
        if out:  # the checks below need positive shapes
            return out
        if not MIN_N_VOCAB <= self.n_vocab <= MAX_N_VOCAB:
            out.append(f"{named('n_vocab')} must be in {MIN_N_VOCAB}..{MAX_N_VOCAB}")
        if self.n_expert_used > self.n_expert:
            out.append(f"{named('n_expert_used')} must be at most {named('n_expert')}")
        if self.n_head % self.n_head_kv:
            out.append(f"{named('n_head')} must be a multiple of {named('n_head_kv')}")
        if self.head_dim % 2:
            out.append(f"{named('head_dim')} must be even (NEOX RoPE rotates pairs)")
        rows = {  # a tensor kind whose rows are not n_embd long -> what sets its row length
            "attn_output": f"{named('n_head')} x {named('head_dim')}",
            "ffn_down_exps": named("n_ff_exp"),
            "ffn_down_shexp": f"{named('n_ff_exp')} x {named('n_expert_shared')}",
            "ffn_down": named("n_ff"),
            "attn_q_norm": named("head_dim"),
            "attn_k_norm": named("head_dim"),
            "eh_proj": f"2 x {named('n_embd')}",
        }
        short: dict[str, dict[str, list[str]]] = {}  # row length -> quant type -> groups
        one = replace(self, n_layer=self.n_dense_lead + 1)  # a block of each kind
        for name, (shape, qtype) in synth_tensors(one).items():
            if shape[-1] % GGML_QUANT_SIZES[qtype][0]:
                kind = next((k for k in rows if f".{k}." in name), "")
                groups = short.setdefault(rows.get(kind) or named("n_embd"), {})
                groups.setdefault(qtype.name, [])
                if _group(name) not in groups[qtype.name]:
                    groups[qtype.name].append(_group(name))
        for what, groups in short.items():
            block = math.lcm(*(GGML_QUANT_SIZES[Q[q]][0] for q in groups))
            types = " and ".join(f"{q} ({', '.join(g)})" for q, g in groups.items())
            out.append(f"rows of {what} values must be a multiple of {block} for {types}; "
                       "change the shape or the type")
        return out

    def tensor_bytes(self) -> int:
        """Bytes of every tensor as written; the file adds metadata and padding."""

        def total(n_layer: int, n_nextn: int) -> int:
            shapes = synth_tensors(replace(self, n_layer=n_layer, n_nextn=n_nextn))
            return sum(
                math.prod(shape) // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
                for shape, qtype in shapes.values()
            )

        if self.mix or self.n_dense_lead:  # a mix gives layers their own types
            return total(self.n_layer, self.n_nextn)
        base = total(0, 0)  # blocks are alike: count one of each kind, not all of them
        return base + self.n_layer * (total(1, 0) - base) + self.n_nextn * (total(0, 1) - base)

    def digest(self) -> str:
        """The spec's identity (in cached file names). `centered` counts only when set, so the
        models made before it existed keep their names and caches."""
        fields = asdict(self)
        for name in ("centered", "mix"):  # only when set: older models keep their names
            if not fields[name]:
                del fields[name]
        for name in _LATER_FIELDS:  # likewise, the fields added with glm4moe
            if fields[name] == _DEFAULTS[name]:
                del fields[name]
        return f"{zlib.crc32(repr(sorted(fields.items())).encode()):08x}"


_LATER_FIELDS = ("arch", "n_dense_lead", "n_ff", "n_expert_shared", "n_rot", "qk_norm",
                 "weights_norm", "weights_scale")
_DEFAULTS = {name: getattr(SynthSpec, name) for name in _LATER_FIELDS}

PRESETS: dict[str, SynthSpec] = {
    # The shape of the shipped demo (engine/assets/demo.gguf) with random weights: small
    # enough for a 2-core CPU, big enough that the expert cache of the default simulated
    # device cannot hold every expert.
    "random-demo": SynthSpec(),
    # For unit tests: seconds to build and run.
    "tiny": SynthSpec(
        n_vocab=1024, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16,
        n_expert=8, n_expert_used=2, n_ff_exp=64, n_ctx=4096,
    ),
    # Qwen3-30B-A3B's real shapes (4-bit experts) plus one MTP block, for GPU benchmarks.
    "qwen3-30b-a3b": SynthSpec(
        n_vocab=151936, n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
        n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx=131072,
        qtypes={"embd": "Q8_0", "attn": "Q8_0", "router": "F32", "experts": "Q4_0",
                "output": "Q8_0", "norm": "F32", "nextn": "Q8_0"},
        centered=True,  # balanced routing through 48 layers, as a trained model's
    ),
    # glm4moe for unit tests and the oracle: a dense leading block, a shared expert, partial
    # RoPE, q/k/v biases, sigmoid routing with a selection bias, and the MTP block.
    "tiny-glm": SynthSpec(
        n_vocab=1024, n_embd=64, n_layer=3, n_head=4, n_head_kv=2, head_dim=16,
        n_expert=8, n_expert_used=2, n_ff_exp=64, n_ctx=4096, rope_base=10000.0,
        arch=names.ARCH_GLM4MOE, n_dense_lead=1, n_ff=128, n_expert_shared=1, n_rot=8,
        qk_norm=False, weights_scale=1.5,
    ),
    # GLM-4.5-Air's real shapes (106B total, 12B active: 46 layers, the first dense, 128
    # experts top-8 and one shared, partial RoPE over half of each 128-dim head, no q/k norm,
    # routed weights scaled by 1.0) with its nextn block, for GPU benchmarks. 4-bit weights
    # (Q4_0: the shared expert's 1,408 and the dense FFN's 10,944 columns are no multiple of
    # the 256 a K-quant block needs) so the resident part (3.3 GiB) fits --vram-limit 8GiB with
    # a 31k q4_0 KV cache; with Q8_0 attention it alone would be 6.3 GiB (docs/glm4moe.md).
    "glm4.5-air": SynthSpec(
        n_vocab=151552, n_embd=4096, n_layer=46, n_head=96, n_head_kv=8, head_dim=128,
        n_expert=128, n_expert_used=8, n_ff_exp=1408, n_ctx=131072, rope_base=1_000_000.0,
        rms_eps=1e-5, arch=names.ARCH_GLM4MOE, n_dense_lead=1, n_ff=10944, n_expert_shared=1,
        n_rot=64, qk_norm=False, weights_scale=1.0,
        qtypes={"embd": "Q8_0", "attn": "Q4_0", "router": "F32", "experts": "Q4_0",
                "output": "Q8_0", "norm": "F32", "nextn": "Q8_0"},
        centered=True,
    ),
}


def _group(name: str) -> str:
    """A tensor's quant-type group: a shared expert's and a dense block's FFN go with attention
    (resident dense weights), biases with the norms (vectors, F32)."""
    if name == names.TOKEN_EMBD:
        return "embd"
    if name == names.OUTPUT:
        return "output"
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return "norm"
    if ".nextn." in name:
        return "nextn"
    if "_exps" in name:
        return "experts"
    if "ffn_gate_inp" in name:
        return "router"
    return "attn"


def _std(name: str, spec: SynthSpec) -> float:
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return 0.1
    if name == names.TOKEN_EMBD:
        return 1.0
    fan_in = spec.n_ff_exp if "ffn_down" in name else spec.n_embd
    if "ffn_down_shexp" in name:
        fan_in = spec.n_ff_exp * spec.n_expert_shared
    elif ".ffn_down." in name:  # a dense block's
        fan_in = spec.n_ff
    if "attn_output" in name:
        fan_in = spec.n_head * spec.head_dim
    if "eh_proj" in name:
        fan_in = 2 * spec.n_embd
    return 1.0 / np.sqrt(fan_in)


def synth_tensors(spec: SynthSpec) -> dict[str, tuple[tuple[int, ...], Q]]:
    """Every tensor of the model: name -> (numpy-order shape, quant type)."""
    hp = spec.hparams()
    shapes = expected_shapes(hp)
    if spec.arch == names.ARCH_GLM4MOE:  # llama.cpp's glm4moe loader requires the nextn
        shapes.update(optional_shapes(hp))  # block's own embedding and head
    # the mixes that need an importance matrix exist only with one; the others are as the
    # quantizer writes them without
    mixed = mix_types(spec.mix, shapes, n_head=spec.n_head, n_head_kv=spec.n_head_kv,
                      n_expert=spec.n_expert, imatrix=spec.mix in NEEDS_IMATRIX) \
        if spec.mix in MIXES else {}
    out = {}
    for name, shape in shapes.items():
        out[name] = (shape, mixed.get(name) or Q[spec.qtypes[_group(name)]])
    return out


def make_tensor(name: str, shape: tuple[int, ...], qtype: Q, spec: SynthSpec) -> np.ndarray:
    """Deterministic contents of one tensor, independent of the order tensors are made in."""
    rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
    if name.endswith("norm.weight"):
        x = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return x if qtype == Q.F32 else gq.quantize(x, qtype)
    if name == names.OUTPUT and spec.readable_head and qtype in QUANTIZABLE:
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(_std(name, spec))
        x *= head_row_scale(spec)[:, None]  # [V, d]
        return x if qtype == Q.F32 else gq.quantize(x, qtype)
    return random_tensor(rng, qtype, shape, _std(name, spec), spec.centered)


# Types gguf.quants can quantize from floats (the others get random blocks).
QUANTIZABLE = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1})


def head_row_scale(spec: SynthSpec) -> np.ndarray:
    """Output-head row norms that make random output read as words: rows of space-led
    words and punctuation keep their norm, the rest (word pieces, bytes, specials) shrink,
    so the argmax of random logits lands on a whole word with a space before it."""
    spec_vocab = build_vocab(spec.n_vocab, seed=spec.seed)
    scale = np.full(spec.n_vocab, 0.35, dtype=np.float32)  # [V]
    for i, t in enumerate(spec_vocab.tokens):
        if (t.startswith("\u0120") and t[1:].isalpha()) or t in (".", ",", "\u010a"):
            scale[i] = 1.0
    return scale


def write_model(
    path: str | Path,
    spec: SynthSpec,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write `spec` as a GGUF of its architecture at `path` (atomically: temp file, then rename)."""
    tensors = synth_tensors(spec)
    return write_gguf(
        path,
        spec,
        build_vocab(spec.n_vocab, seed=spec.seed),
        tensors,
        _made_in_order(tensors, spec),
        f"strata synthetic {spec.arch} with random weights ({spec.digest()})",
        progress,
    )


def write_gguf(
    path: str | Path,
    spec: SynthSpec,
    vocab: VocabSpec,
    tensors: dict[str, tuple[tuple[int, ...], Q]],
    data: Iterable[np.ndarray],
    title: str,
    progress: Callable[[int, int], None] | None = None,
    description: str = "",
) -> Path:
    """Write a GGUF of `spec`'s architecture and shapes: `tensors` (name -> (shape, quant type)) with
    their encoded bytes from `data` in the same order (atomically: temp file, then rename).
    `title` is `general.name`; `description` (`general.description`) is what the app shows
    a newcomer before the first message."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    w = GGUFWriter(tmp, spec.arch)
    _write_metadata(w, spec, title)
    if description:
        w.add_description(description)
    write_vocab(w, vocab, pre="glm4" if spec.arch == names.ARCH_GLM4MOE else PRE)
    for name, (shape, qtype) in tensors.items():
        # logical shape + raw_dtype: the writer records the quant type and our byte count
        w.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = len(tensors)
    for i, array in enumerate(data):
        w.write_tensor_data(array)
        if progress:
            progress(i + 1, total)
    w.close()
    tmp.replace(path)
    return path


def _made_in_order(tensors: dict[str, tuple[tuple[int, ...], Q]], spec: SynthSpec,
                   ahead: int | None = None) -> Iterator[np.ndarray]:
    """`make_tensor` of every tensor, in order, computed on a thread pool `ahead` tensors in
    advance (NumPy's generators and array operations release the GIL; each tensor's contents
    depend only on its name, so the file is the same byte for byte)."""
    ahead = ahead or min(8, os.cpu_count() or 1)
    items = list(tensors.items())
    with ThreadPoolExecutor(max_workers=ahead) as pool:
        pending: deque[Future[np.ndarray]] = deque()
        for name, (shape, qtype) in items:
            pending.append(pool.submit(make_tensor, name, shape, qtype, spec))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * type_bytes


def _write_metadata(w: GGUFWriter, spec: SynthSpec, title: str) -> None:
    w.add_name(title)
    w.add_block_count(spec.n_layer + spec.n_nextn)
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff if spec.n_dense_lead else spec.n_ff_exp)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_freq_base(spec.rope_base)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.n_nextn:
        w.add_nextn_predict_layers(spec.n_nextn)
    if spec.arch == names.ARCH_GLM4MOE:  # the keys llama.cpp's glm4moe loader reads
        w.add_rope_dimension_count(spec.n_rot or spec.head_dim)
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_shared_count(spec.n_expert_shared)
        w.add_expert_weights_scale(spec.weights_scale)
        w.add_expert_weights_norm(spec.weights_norm)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if spec.mix:
        w.add_file_type(int(LlamaFileType["MOSTLY_" + spec.mix.upper()]))
    else:
        w.add_file_type(int(Q[spec.qtypes["experts"]]))
