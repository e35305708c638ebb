"""Wiring MTP speculative decoding into a runtime: the verifier, MTP experts and draft head
each in their own ledger region (the decode-only resources a loan releases), the MTP block's
dense weights with the dense weights and its KV with the KV."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.draft_head import DraftHead
from engine.experts.provider import kernel_ffn
from engine.memory.arena import Arena
from engine.model.mtp import MTPBlock, MTPDraft, MTPExperts, require_mtp
from engine.resources import DecodeResource
from engine.spec import SpecDecoder
from engine.verifier import Verifier

if TYPE_CHECKING:
    from engine.runtime import Runtime


def build_spec(rt: Runtime, dense: Arena, kv: Arena) -> tuple[SpecDecoder | None, list[DecodeResource]]:
    """The MTP resources of `--mtp`, and a SpecDecoder when `--spec T` >= 2."""
    o, m = rt.options, rt.model
    require_mtp(m)
    assert m.mtp_experts is not None
    exa = Arena(rt.ledger, "mtp.experts", rt.costs.mtp_expert_bytes)
    hda = Arena(rt.ledger, "mtp.draft_head", rt.costs.draft_head_bytes, float_dtype=rt.weight_dtype)
    head = DraftHead.from_model(m, o.draft_vocab, None, rt.xp, hda.to_device)
    experts = MTPExperts(m.mtp_experts, rt.xp, exa.to_device)
    if rt.on_cuda:  # compute the MTP experts from their resident quantized bytes
        layout = m.mtp_experts.layout
        experts.ffn = lambda layer, h, ids, w, used, counts: kernel_ffn(  # type: ignore[attr-defined]
            layout, {e: experts.blobs[e] for e in used}, h, ids, w, counts)
    items = [DecodeResource("mtp.experts", exa, experts), DecodeResource("mtp.draft_head", hda, head)]
    block = MTPBlock(m, head=head, experts=experts, xp=rt.xp, to_device=dense.to_device)
    if o.spec < 2:
        return None, items
    ver = Arena(rt.ledger, "verifier", rt.costs.verifier_bytes)
    verifier = Verifier.for_model(m, o.spec, rt.xp, ver.alloc)
    spec = SpecDecoder(o.spec, MTPDraft(block, kv_alloc=kv.alloc), verifier)
    spec.always = o.spec_always
    rt.session.on_hidden = spec.collect
    return spec, [DecodeResource("verifier", ver, verifier), *items]
