"""Tensor-name tables of the architectures strata runs (qwen3moe, glm4moe), exactly as
llama.cpp's converter writes them.

The MTP (nextn) layer follows the GLM-4.5 convention: it is block `n_layer_main`, counted in
`{arch}.block_count`, announced by `{arch}.nextn_predict_layers`, with its own attention and
routed experts plus the `nextn.*` tensors below.
"""

from __future__ import annotations

ARCH_QWEN3MOE = "qwen3moe"
ARCH_GLM4MOE = "glm4moe"  # GLM-4.5 / 4.5-Air / 4.6 / 4.7
SUPPORTED_ARCHS = (ARCH_QWEN3MOE, ARCH_GLM4MOE)

TOKEN_EMBD = "token_embd.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"

# Per-block tensors; `{i}` is the block index.
BLOCK = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "attn_q": "blk.{i}.attn_q.weight",
    "attn_k": "blk.{i}.attn_k.weight",
    "attn_v": "blk.{i}.attn_v.weight",
    "attn_output": "blk.{i}.attn_output.weight",
    "attn_q_norm": "blk.{i}.attn_q_norm.weight",
    "attn_k_norm": "blk.{i}.attn_k_norm.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "ffn_gate_inp": "blk.{i}.ffn_gate_inp.weight",
    "ffn_gate_exps": "blk.{i}.ffn_gate_exps.weight",
    "ffn_up_exps": "blk.{i}.ffn_up_exps.weight",
    "ffn_down_exps": "blk.{i}.ffn_down_exps.weight",
    # glm4moe: q/k/v biases, the FFN's norm under its own name, the expert-selection bias, a
    # shared expert beside the routed ones, and the dense FFN of the leading blocks
    "attn_q_bias": "blk.{i}.attn_q.bias",
    "attn_k_bias": "blk.{i}.attn_k.bias",
    "attn_v_bias": "blk.{i}.attn_v.bias",
    "post_attention_norm": "blk.{i}.post_attention_norm.weight",
    "exp_probs_b": "blk.{i}.exp_probs_b.bias",
    "ffn_gate_shexp": "blk.{i}.ffn_gate_shexp.weight",
    "ffn_up_shexp": "blk.{i}.ffn_up_shexp.weight",
    "ffn_down_shexp": "blk.{i}.ffn_down_shexp.weight",
    "ffn_gate": "blk.{i}.ffn_gate.weight",
    "ffn_up": "blk.{i}.ffn_up.weight",
    "ffn_down": "blk.{i}.ffn_down.weight",
}

# The tensors of a qwen3moe block (the training export writes these).
QWEN3MOE_BLOCK = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                  "attn_k_norm", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                  "ffn_down_exps")

# The norm before a block's FFN: qwen3moe's `ffn_norm`, glm4moe's `post_attention_norm`.
FFN_NORM = {ARCH_QWEN3MOE: "ffn_norm", ARCH_GLM4MOE: "post_attention_norm"}

# Extra tensors of the MTP block (GLM-4.5 nextn convention). The last two are optional:
# absent, the block shares the main model's token embedding and output head.
NEXTN = {
    "eh_proj": "blk.{i}.nextn.eh_proj.weight",
    "enorm": "blk.{i}.nextn.enorm.weight",
    "hnorm": "blk.{i}.nextn.hnorm.weight",
    "shared_head_norm": "blk.{i}.nextn.shared_head_norm.weight",
    "shared_head_head": "blk.{i}.nextn.shared_head_head.weight",
    "embed_tokens": "blk.{i}.nextn.embed_tokens.weight",
}
NEXTN_OPTIONAL = ("shared_head_head", "embed_tokens")

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def native_head(has_output: bool) -> str:
    """The tensor the output head's rows are: its own, or (tied) the token embedding's."""
    return OUTPUT if has_output else TOKEN_EMBD


def block(kind: str, i: int) -> str:
    return BLOCK[kind].format(i=i)


def nextn(kind: str, i: int) -> str:
    return NEXTN[kind].format(i=i)
