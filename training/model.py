"""The demo's qwen3moe + MTP model in PyTorch, computing exactly what the engine computes.

Same tensors as the GGUF (numpy order [out, in]), RMSNorm, per-head q/k RMSNorm, NEOX RoPE,
grouped-query attention, softmax router with renormalised top-k, SwiGLU experts, and the
nextn block of `engine/model/mtp.py` (cell p reads h[p] and t[p+1] and predicts t[p+2]).
Experts run grouped: each token's top-k choices sorted by expert, then either three grouped
GEMMs over the jagged rows (`torch.nn.functional.grouped_mm`, offsets on the device: no host
read) or, where torch has none or on the CPU, one padded batch [E, C, d] and three batched
GEMMs; the outputs weighted and added back to their tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.synth.model import SynthSpec


# torch's grouped GEMM (public from 2.9, private before), or None
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def rope_neox(x: Tensor, base: float) -> Tensor:
    """x: [B, T, H, D] at positions 0..T-1."""
    t, d = x.shape[1], x.shape[-1]
    half = d // 2
    inv = base ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) * 2.0 / d)
    ang = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * inv  # [T, D/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]  # [1, T, 1, D/2]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


@dataclass
class MoEStats:
    aux: Tensor  # load-balancing loss of the layer (Switch Transformer form)


class Block(nn.Module):
    """One transformer block: attention + routed experts (GGUF names in comments)."""

    def __init__(self, s: SynthSpec, grouped: bool = False):
        super().__init__()
        d, q, kv = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        self.s = s
        self.grouped = grouped  # jagged grouped GEMMs (CUDA, bf16) instead of a padded batch
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.attn_q = nn.Parameter(torch.empty(q, d))
        self.attn_k = nn.Parameter(torch.empty(kv, d))
        self.attn_v = nn.Parameter(torch.empty(kv, d))
        self.attn_output = nn.Parameter(torch.empty(d, q))
        self.attn_q_norm = nn.Parameter(torch.ones(s.head_dim))
        self.attn_k_norm = nn.Parameter(torch.ones(s.head_dim))
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.ffn_gate_inp = nn.Parameter(torch.empty(s.n_expert, d))
        self.ffn_gate_exps = nn.Parameter(torch.empty(s.n_expert, s.n_ff_exp, d))
        self.ffn_up_exps = nn.Parameter(torch.empty(s.n_expert, s.n_ff_exp, d))
        self.ffn_down_exps = nn.Parameter(torch.empty(s.n_expert, d, s.n_ff_exp))

    def attention(self, x: Tensor) -> Tensor:
        s = self.s
        b, t, _ = x.shape
        h = rms_norm(x, self.attn_norm, s.rms_eps)  # [B, T, d]
        q = (h @ self.attn_q.T).view(b, t, s.n_head, s.head_dim)  # [B, T, H, D]
        k = (h @ self.attn_k.T).view(b, t, s.n_head_kv, s.head_dim)  # [B, T, Hkv, D]
        v = (h @ self.attn_v.T).view(b, t, s.n_head_kv, s.head_dim)
        q = rope_neox(rms_norm(q, self.attn_q_norm, s.rms_eps), s.rope_base)
        k = rope_neox(rms_norm(k, self.attn_k_norm, s.rms_eps), s.rope_base)
        group = s.n_head // s.n_head_kv
        k = k.repeat_interleave(group, dim=2)  # head h reads kv head h // group
        v = v.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # [B, H, T, D]
        return out.transpose(1, 2).reshape(b, t, -1) @ self.attn_output.T  # [B, T, d]

    def moe(self, x: Tensor) -> tuple[Tensor, MoEStats]:
        s = self.s
        k, n_exp = s.n_expert_used, s.n_expert
        h = rms_norm(x, self.ffn_norm, s.rms_eps)  # [B, T, d]
        probs = torch.softmax((h @ self.ffn_gate_inp.T).float(), -1)  # [B, T, E]
        top_w, top_i = probs.topk(k, -1)  # [B, T, k]
        top_w = top_w / top_w.sum(-1, keepdim=True)
        hf = h.reshape(-1, h.shape[-1])  # [N, d]
        flat = top_i.reshape(-1)  # [N*k] expert of each (token, choice)
        order = torch.argsort(flat, stable=True)  # the choices grouped by expert
        rows = order // k  # [N*k] the token of each sorted choice
        counts = torch.bincount(flat, minlength=n_exp)  # [E]
        if self.grouped and hf.is_cuda and GROUPED_MM is not None:
            y = self._experts_jagged(hf[rows], counts)  # [N*k, d]
        else:
            y = self._experts_padded(hf[rows], flat[order], counts)
        y = y * top_w.reshape(-1)[order, None].to(y.dtype)  # [N*k, d]
        out = hf.new_zeros(hf.shape).index_add_(0, rows, y.to(hf.dtype)).view_as(x)  # [B, T, d]
        load = torch.zeros_like(probs).scatter(-1, top_i, 1.0).mean((0, 1))  # [E] share routed
        aux = n_exp * (load * probs.mean((0, 1))).sum() / k
        return out, MoEStats(aux)

    def _experts_jagged(self, xs: Tensor, counts: Tensor) -> Tensor:
        """xs [M, d] sorted by expert, counts [E] -> SwiGLU expert outputs [M, d] (bf16)."""
        offs = torch.cumsum(counts, 0).to(torch.int32)  # [E] end of each expert's rows
        xs = xs.to(torch.bfloat16)

        def by_expert(a: Tensor, w: Tensor) -> Tensor:  # w [E, out, in] -> a @ w[e].T
            return GROUPED_MM(a, w.to(torch.bfloat16).transpose(1, 2), offs=offs)

        gate, up = by_expert(xs, self.ffn_gate_exps), by_expert(xs, self.ffn_up_exps)  # [M, f]
        return by_expert(F.silu(gate) * up, self.ffn_down_exps)  # [M, d]

    def _experts_padded(self, xs: Tensor, expert: Tensor, counts: Tensor) -> Tensor:
        """The same through one padded batch [E, C, d] (one host read a layer for C)."""
        starts = torch.cumsum(counts, 0) - counts  # [E]
        slot = torch.arange(len(expert), device=xs.device) - starts[expert]  # row in its expert
        buf = xs.new_zeros(len(counts), int(counts.max()), xs.shape[1])  # [E, C, d]
        buf[expert, slot] = xs
        gate = torch.bmm(buf, self.ffn_gate_exps.transpose(1, 2).to(buf.dtype))  # [E, C, f]
        up = torch.bmm(buf, self.ffn_up_exps.transpose(1, 2).to(buf.dtype))
        y = torch.bmm(F.silu(gate) * up, self.ffn_down_exps.transpose(1, 2).to(buf.dtype))
        return y[expert, slot]  # [M, d]

    def forward(self, x: Tensor) -> tuple[Tensor, MoEStats]:
        x = x + self.attention(x)
        ffn, stats = self.moe(x)
        return x + ffn, stats


class DemoModel(nn.Module):
    """Main blocks + the nextn (MTP) block; the MTP block shares the embedding and head."""

    def __init__(self, s: SynthSpec, grouped: bool = False):
        super().__init__()
        assert s.n_nextn == 1 and not s.tied_output
        d = s.n_embd
        self.s = s
        self.token_embd = nn.Parameter(torch.empty(s.n_vocab, d))
        self.blocks = nn.ModuleList(Block(s, grouped) for _ in range(s.n_layer))
        self.output_norm = nn.Parameter(torch.ones(d))
        self.output = nn.Parameter(torch.empty(s.n_vocab, d))
        self.mtp = Block(s, grouped)
        self.eh_proj = nn.Parameter(torch.empty(d, 2 * d))
        self.enorm = nn.Parameter(torch.ones(d))
        self.hnorm = nn.Parameter(torch.ones(d))
        self.shared_head_norm = nn.Parameter(torch.ones(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("attn_output", "ffn_down_exps")):
                nn.init.normal_(p, std=std / math.sqrt(2 * (self.s.n_layer + 1)))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """tokens [B, T] -> (logits [B, T, V], MTP logits [B, T-1, V] where row p predicts
        t[p+2], aux loss, main hidden [B, T, d])."""
        x, m, aux = self.hidden(tokens)
        return self.head(x), self.mtp_head(m), aux, x

    def hidden(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [B, T] -> (main hidden [B, T, d], MTP hidden [B, T-1, d], aux loss): what
        the two heads read, so training can apply them to the rows that carry the loss."""
        s = self.s
        x = self.token_embd[tokens]  # [B, T, d]
        aux = x.new_zeros((), dtype=torch.float32)
        for blk in self.blocks:
            x, st = blk(x)
            aux = aux + st.aux
        e = self.token_embd[tokens[:, 1:]]  # [B, T-1, d]: t[p+1]
        u = torch.cat(
            [rms_norm(e, self.enorm, s.rms_eps), rms_norm(x[:, :-1], self.hnorm, s.rms_eps)], -1
        )  # [B, T-1, 2d]: embedding first, then hidden
        m, st = self.mtp(u @ self.eh_proj.T)
        return x, m, aux + st.aux

    def head(self, x: Tensor) -> Tensor:
        """Main hidden [..., d] -> logits [..., V]."""
        return rms_norm(x, self.output_norm, self.s.rms_eps) @ self.output.T

    def mtp_head(self, m: Tensor) -> Tensor:
        """MTP hidden [..., d] -> logits [..., V] (the shared head behind its own norm)."""
        return rms_norm(m, self.shared_head_norm, self.s.rms_eps) @ self.output.T

    def gguf_tensors(self) -> dict[str, Tensor]:
        """Every tensor under its GGUF name (float32, CPU)."""
        from engine.gguf import names

        out = {
            names.TOKEN_EMBD: self.token_embd,
            names.OUTPUT_NORM: self.output_norm,
            names.OUTPUT: self.output,
        }
        for i, blk in enumerate([*self.blocks, self.mtp]):
            for kind in names.QWEN3MOE_BLOCK:
                out[names.block(kind, i)] = getattr(blk, kind)
        i = self.s.n_layer
        for kind in ("eh_proj", "enorm", "hnorm", "shared_head_norm"):
            out[names.nextn(kind, i)] = getattr(self, kind)
        return {k: v.detach().float().cpu() for k, v in out.items()}
