"""The quant-type mixes llama.cpp's quantizer writes (`llama-quantize ... Q4_K_M`), as a pure
function of tensor names, shapes and hyper-parameters: `strata make-model --mix q4_k_m`
writes the types this gives, layer by layer, so tests and benchmarks run the files people
download. tests/test_quant_corpus.py holds it against files the pinned oracle's quantizer
wrote (the same type for every tensor).

Our own reading of `llama_tensor_get_type` (src/llama-quant.cpp, llama-cpp-python 0.3.16's
vendored tree) for the tensors a qwen3moe file has. What it depends on, as the quantizer sees
the file:
- tensors are visited in layer order, then by name; `attn_v` is counted (`i_attention_wv`)
  in that order, so its index is its block, and there are `block_count` of them (the MTP
  block included);
- an expert tensor's layer is parsed from its name, out of `block_count` layers;
- `use_more_bits(i, n)`: the first and last eighth of the layers and every third between;
- a type whose block does not divide a row falls back (Q4_K -> Q5_0, Q6_K -> Q8_0, the
  IQ and low K types -> IQ4_NL, then F16).
Norms, the router (`ffn_gate_inp`) and 1-D tensors keep the source file's type. A few rules
depend on whether an importance matrix was given (IQ3_XXS's attn_v and ffn_down, IQ4_XS's
first ffn_down layers); the mixes in `NEEDS_IMATRIX` cannot be written without one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# --mix name -> the quantizer's default type for it (llama_model_quantize_impl's switch)
MIXES: dict[str, Q] = {
    "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q8_0": Q.Q8_0,
    "q2_k": Q.Q2_K, "q2_k_s": Q.Q2_K, "q3_k_s": Q.Q3_K, "q3_k_m": Q.Q3_K, "q3_k_l": Q.Q3_K,
    "q4_k_s": Q.Q4_K, "q4_k_m": Q.Q4_K, "q5_k_s": Q.Q5_K, "q5_k_m": Q.Q5_K, "q6_k": Q.Q6_K,
    "iq2_xxs": Q.IQ2_XXS, "iq2_xs": Q.IQ2_XS, "iq2_s": Q.IQ2_XS, "iq2_m": Q.IQ2_S,
    "iq1_s": Q.IQ1_S, "iq1_m": Q.IQ1_M, "iq3_xxs": Q.IQ3_XXS, "iq3_xs": Q.IQ3_S,
    "iq3_s": Q.IQ3_S, "iq3_m": Q.IQ3_S, "iq4_nl": Q.IQ4_NL, "iq4_xs": Q.IQ4_XS,
    "mxfp4_moe": Q.MXFP4,
}
# the mixes whose low-bit types the quantizer refuses to write without an importance matrix
NEEDS_IMATRIX = frozenset({"iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m", "q2_k_s",
                           "iq3_xxs"})
_IQ_LOW = ("iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m")
_FALLBACK = {
    Q.IQ2_XXS: Q.IQ4_NL, Q.IQ2_XS: Q.IQ4_NL, Q.IQ2_S: Q.IQ4_NL, Q.IQ3_XXS: Q.IQ4_NL,
    Q.IQ3_S: Q.IQ4_NL, Q.IQ1_S: Q.IQ4_NL, Q.IQ1_M: Q.IQ4_NL, Q.Q2_K: Q.IQ4_NL,
    Q.Q3_K: Q.IQ4_NL, Q.IQ4_XS: Q.IQ4_NL, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0,
}
_LAYER = re.compile(r"blk\.(\d+)\.")


def use_more_bits(i: int, n: int) -> bool:
    """The quantizer's layers that get more bits: first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the quantizer re-encodes this tensor (else it keeps the source type)."""
    return (name.endswith("weight") and len(shape) >= 2 and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def mix_types(mix: str, shapes: Mapping[str, tuple[int, ...]], *, n_head: int, n_head_kv: int,
              n_expert: int, imatrix: bool = False) -> dict[str, Q]:
    """The type the quantizer gives each re-encoded tensor of `shapes` (name -> numpy-order
    shape) under `mix`, with or without an importance matrix; tensors it keeps are left out.
    Raises KeyError for an unknown mix."""
    default = MIXES[mix]
    n_blocks = 1 + max((int(m.group(1)) for n in shapes if (m := _LAYER.match(n))), default=-1)
    has_output = "output.weight" in shapes
    gqa = n_head // n_head_kv
    out = {}
    for name, shape in shapes.items():
        if not quantized(name, shape):
            continue
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else -1
        qtype = _rule(mix, default, name, shape, layer, n_blocks, has_output, gqa, n_expert,
                      imatrix)
        out[name] = _fit(qtype, shape[-1])
    return out


def _fit(qtype: Q, n_cols: int) -> Q:
    if n_cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, Q.F16)
    return qtype if n_cols % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def _rule(mix: str, t: Q, name: str, shape: tuple[int, ...], i: int, n: int, has_output: bool,
          gqa: int, n_expert: int, imatrix: bool) -> Q:
    """llama_tensor_get_type for one tensor (i: its block, -1 outside; n: block count)."""
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        if mix == "mxfp4_moe" or shape[-1] % GGML_QUANT_SIZES[t][0]:
            return Q.Q8_0
        if mix in (*_IQ_LOW, "iq3_xxs"):
            return Q.Q5_K
        return t if t == Q.Q8_0 else Q.Q6_K
    if mix == "mxfp4_moe":
        return Q.MXFP4 if len(shape) == 3 else Q.Q8_0
    if name == "token_embd.weight":
        if mix in ("iq2_xxs", "iq2_xs", "iq1_s", "iq1_m"):
            return Q.Q2_K
        if mix in ("iq2_s", "iq2_m", "iq3_xxs"):
            return Q.IQ3_S
        return t
    if mix in _IQ_LOW:
        if "attn_v.weight" in name:
            if gqa >= 4 or n_expert >= 4:
                return Q.Q4_K
            return Q.IQ3_S if mix in ("iq2_s", "iq2_m") else Q.Q2_K
        if n_expert == 8 and "attn_k.weight" in name:
            return Q.Q4_K
        if "ffn_down" in name:
            # the quantizer compares a running count of ffn_down tensors (one per block here)
            if i < n // 8:
                return Q.IQ3_S if mix in ("iq2_s", "iq2_m") else Q.Q2_K
            return t
        if "attn_output.weight" in name:
            if n_expert == 8:
                return Q.Q5_K
            if mix in ("iq1_s", "iq1_m"):
                return Q.IQ2_XXS
            return Q.IQ3_S if mix in ("iq2_s", "iq2_m") else t
        return t
    if "attn_v.weight" in name:
        return _attn_v(mix, t, i, n, gqa, n_expert, imatrix)
    if "attn_k.weight" in name:
        if n_expert == 8:
            return Q.Q8_0
        return {"iq3_xs": Q.IQ3_XXS, "iq3_xxs": Q.IQ2_S}.get(mix, t)
    if "attn_q.weight" in name:
        return {"iq3_xs": Q.IQ3_XXS, "iq3_xxs": Q.IQ2_S}.get(mix, t)
    if "ffn_down" in name:
        return _ffn_down(mix, t, i, n, n_expert, imatrix)
    if "attn_output.weight" in name:
        if n_expert == 8:
            eight = ("q2_k", "iq3_xs", "iq3_xxs", "q3_k_s", "q3_k_m", "iq4_nl", "q4_k_s", "q4_k_m",
                     "iq3_s", "iq3_m", "iq4_xs")
            return Q.Q5_K if mix in eight else t
        return {"q2_k": Q.Q3_K, "iq3_xxs": Q.IQ3_S, "q3_k_m": Q.Q4_K, "q3_k_l": Q.Q5_K,
                "iq3_m": Q.Q4_K}.get(mix, t)
    if ("ffn_gate" in name or "ffn_up" in name) and mix == "iq3_xs" and n // 8 <= i < 7 * n // 8:
        return Q.IQ3_XXS
    return t


def _attn_v(mix: str, t: Q, i: int, n: int, gqa: int, n_expert: int, imatrix: bool) -> Q:
    if mix == "q2_k":
        t = Q.Q4_K if gqa >= 4 else Q.Q3_K
    elif mix == "q2_k_s" and gqa >= 4:
        t = Q.Q4_K
    elif mix == "iq3_xxs":
        t = Q.Q4_K if gqa >= 4 else Q.IQ3_XXS if imatrix else Q.IQ3_S
    elif (mix in ("iq3_xs", "iq3_s") and gqa >= 4) or mix == "iq3_m":
        t = Q.Q4_K
    elif mix == "q3_k_m":
        t = Q.Q5_K if i < 2 else Q.Q4_K
    elif mix == "q3_k_l" or (mix in ("iq4_nl", "iq4_xs") and gqa >= 4):
        t = Q.Q5_K
    elif mix in ("q4_k_m", "q5_k_m") and use_more_bits(i, n):
        t = Q.Q6_K
    elif mix == "q4_k_s" and i < 4:
        t = Q.Q5_K
    return Q.Q8_0 if n_expert == 8 else t


def _ffn_down(mix: str, t: Q, i: int, n: int, n_expert: int, imatrix: bool) -> Q:
    if mix == "q2_k":
        return Q.Q3_K
    if mix == "q2_k_s":
        return Q.Q4_K if i < n // 8 else t
    if mix == "iq3_xxs" and not imatrix:
        return Q.Q4_K if i < n // 8 else Q.Q3_K
    if mix == "q3_k_m":
        return Q.Q5_K if i < n // 16 else Q.Q4_K
    if mix == "iq3_m" and (i < n // 8 or (n_expert == 8 and use_more_bits(i, n))):
        return Q.Q4_K
    if mix == "q3_k_l":
        return Q.Q5_K
    if mix == "q4_k_m":
        return Q.Q6_K if use_more_bits(i, n) else t
    if mix in ("iq4_nl", "iq4_xs") and i < n // 8 and not imatrix:
        return Q.Q5_K
    if mix == "q5_k_m" and use_more_bits(i, n):
        return Q.Q6_K
    if mix == "q4_k_s" and i < n // 8:
        return Q.Q5_K
    if mix in ("q4_0", "q5_0") and imatrix and i < n // 8:
        return Q.Q4_1 if mix == "q4_0" else Q.Q5_1
    return t
