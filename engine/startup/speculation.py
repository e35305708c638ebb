"""Wiring MTP speculative decoding into a runtime: the verifier, MTP experts and draft head
each in their own ledger region (the decode-only resources a loan releases; a draft head that
is the whole native head is that head, with no region of its own), the MTP block's dense
weights with the dense weights and its KV with the KV."""

from __future__ import annotations

from typing import Any

from engine.config import EngineOptions
from engine.loan.resources import DecodeResource
from engine.memory.arena import Arena
from engine.memory.ledger import Ledger
from engine.memory.plan_types import ModelCosts
from engine.model.loader import Model
from engine.model.mtp import MTPBlock, MTPExperts, require_mtp
from engine.speculative.decoder import SpecDecoder
from engine.speculative.draft import MTPDraft
from engine.speculative.draft_head import DraftHead, NativeDraftHead, shares_native_head
from engine.speculative.verifier import Verifier


def build_spec(
    o: EngineOptions, m: Model, ledger: Ledger, costs: ModelCosts, *,
    weight_dtype: Any, dense: Arena, kv: Arena,
) -> tuple[SpecDecoder | None, list[DecodeResource]]:
    """The MTP resources of `--mtp`, and a SpecDecoder when `--spec T` >= 2 (the caller
    feeds it the session's hidden states: `Session.on_hidden = spec.collect`)."""
    require_mtp(m)
    assert m.mtp_experts is not None and m.transformer is not None
    be = m.transformer.backend
    exa = Arena(ledger, "mtp.experts", costs.mtp_expert_bytes)
    experts = MTPExperts(m.mtp_experts, be, exa.to_device, costs.mtp_expert_slots, exa.alloc)
    items = [DecodeResource("mtp.experts", exa, experts)]
    head: NativeDraftHead | DraftHead
    if shares_native_head(m, o.draft_vocab):  # the native head itself: no region of its own
        head = NativeDraftHead(m.transformer)
    else:
        hda = Arena(ledger, "mtp.draft_head", costs.draft_head_bytes, float_dtype=weight_dtype)
        head = DraftHead.from_model(m, o.draft_vocab, None, hda.to_device)
        items.append(DecodeResource("mtp.draft_head", hda, head))
    block = MTPBlock(m, head=head, experts=experts, to_device=dense.to_device)
    if o.spec < 2:
        return None, items
    ver = Arena(ledger, "verifier", costs.verifier_bytes)
    verifier = Verifier.for_model(m, o.spec, be.xp, ver.alloc)
    spec = SpecDecoder(o.spec, MTPDraft(block, kv_alloc=kv.alloc), verifier)
    spec.always = o.spec_always
    return spec, [DecodeResource("verifier", ver, verifier), *items]
