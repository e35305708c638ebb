"""The planner's inputs and outputs: model costs, user options, the prompt geometry and the
startup plan (frozen dataclasses, validated on construction). The planning functions are in
`engine.memory.planner`, which re-exports these names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from engine.errors import FlagError, ModelError
from engine.memory.arena import padded
from engine.memory.cache_layout import cache_region_bytes
from engine.memory.ledger import DECODE_ONLY_REGIONS, DEFAULT_SEGMENT_BYTES

STRATA_MIN_KEPT_SLOTS = 128
STRATA_MAX_LENT_SHARE = 0.9
Auto = Literal["auto"]
_POSITIVE = {"expert_blob_bytes", "n_layer", "n_expert", "n_expert_used", "act_bytes_per_token"}


@dataclass(frozen=True)
class ModelCosts:
    """Device bytes a model needs, per item; one expert blob is gate+up+down of one expert."""

    dense_bytes: int
    kv_bytes: int
    expert_blob_bytes: int
    n_layer: int  # blocks with routed experts (a dense leading block has none)
    n_expert: int
    n_expert_used: int
    act_bytes_per_token: int  # prompt-chunk activation bytes per token
    act_bytes_fixed: int = 0  # prompt-chunk bytes independent of the chunk length
    verifier_bytes: int = 0
    head_bytes: int = 0
    mtp_expert_bytes: int = 0  # the `mtp.experts` region: `mtp_expert_slots` blobs
    draft_head_bytes: int = 0
    mtp_blob_bytes: int = 0  # one expert of the nextn block
    mtp_expert_slots: int = 0  # how many of its `n_expert` experts the region holds

    def with_mtp_slots(self, n_slots: int) -> ModelCosts:
        """These costs with an `mtp.experts` region of `n_slots` (1..n_expert) blobs."""
        assert self.mtp_blob_bytes and 1 <= n_slots <= self.n_expert, (n_slots, self.n_expert)
        return replace(self, mtp_expert_slots=n_slots,
                       mtp_expert_bytes=padded(n_slots * self.mtp_blob_bytes))

    def __post_init__(self) -> None:
        bad = [f"{k}={v}" for k, v in vars(self).items() if v < 0 or (v == 0 and k in _POSITIVE)]
        if self.n_expert_used > self.n_expert:
            bad.append(f"n_expert_used={self.n_expert_used} > n_expert={self.n_expert}")
        if bad:
            raise ModelError(f"model costs out of range: {', '.join(bad)}")

    @property
    def n_blobs(self) -> int:
        """Every (layer, expert) of the model."""
        return self.n_layer * self.n_expert

    def decode_only_bytes(self) -> dict[str, int]:
        """Bytes of each decode-only region, in release order."""
        sizes = (self.verifier_bytes, self.head_bytes, self.mtp_expert_bytes, self.draft_head_bytes)
        return dict(zip(DECODE_ONLY_REGIONS, sizes, strict=True))

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """Activation bytes of a prompt chunk of `chunk_tokens` tokens (0 for no chunk)."""
        return self.act_bytes_fixed + chunk_tokens * self.act_bytes_per_token if chunk_tokens else 0

    def cache_bytes(self, n_slots: int) -> int:
        """Bytes of an expert cache of `n_slots` slots (its staged table included)."""
        return cache_region_bytes(self.n_layer, self.n_expert, self.expert_blob_bytes, n_slots)

    def min_kept_slots(self) -> int:
        """Strata's 128 kept slots, scaled (see engine.memory.planner's docstring)."""
        return min(STRATA_MIN_KEPT_SLOTS, self.n_layer * self.n_expert_used)


@dataclass(frozen=True)
class PlanOptions:
    """What the user asked for (CLI flags), validated on construction."""

    expert_cache: int | Auto = "auto"
    prefill: int | Auto = "auto"  # 0: no prompt chunking
    deferred: frozenset[str] = frozenset()  # decode-only regions a startup loan defers
    borrow: bool = True  # the prompt path may borrow the expert-cache tail
    reserve_bytes: int = 0
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    min_kept_slots: int | None = None  # None: `ModelCosts.min_kept_slots()`
    max_lent_share: float = STRATA_MAX_LENT_SHARE
    grid_tokens: int = 256
    max_chunk_tokens: int = 65536  # the flash kernel keeps no score block: memory decides
    owned_chunk_tokens: int = 2048
    ring_layers: int = 1  # the ring wants this many layers' experts (2 on CUDA: prefetch)
    mtp_expert_slots: int | Auto = "auto"  # nextn experts in `mtp.experts` (`fit_mtp_experts`)

    def __post_init__(self) -> None:
        bad = []
        for name in ("expert_cache", "prefill"):
            v = getattr(self, name)
            if v != "auto" and not (isinstance(v, int) and v >= 0):
                bad.append(f"{name.replace('_', '-')} '{v}' must be auto or a count >= 0")
        v = self.mtp_expert_slots
        if v != "auto" and not (isinstance(v, int) and v >= 1):
            bad.append(f"mtp-experts '{v}' must be auto or a count >= 1")
        if not self.deferred <= set(DECODE_ONLY_REGIONS):
            bad.append(f"deferred {sorted(self.deferred)} must be among {DECODE_ONLY_REGIONS}")
        if not 0.0 < self.max_lent_share <= 1.0:
            bad.append(f"max lent share {self.max_lent_share} must be in (0, 1]")
        for name in ("segment_bytes", "grid_tokens", "max_chunk_tokens", "owned_chunk_tokens",
                     "ring_layers"):
            if getattr(self, name) <= 0:
                bad.append(f"{name} {getattr(self, name)} must be positive")
        if self.reserve_bytes < 0 or (self.min_kept_slots or 0) < 0:
            bad.append(f"reserve {self.reserve_bytes} and min kept slots must be >= 0")
        if bad:
            raise FlagError(bad)

    def kept_slots(self, costs: ModelCosts) -> int:
        """Cache slots a loan never lends."""
        return costs.min_kept_slots() if self.min_kept_slots is None else self.min_kept_slots

    def lendable_slots(self, n_cache: int, costs: ModelCosts) -> int:
        """Slots of an `n_cache`-slot cache the prompt path may borrow."""
        share = math.floor(self.max_lent_share * n_cache)
        return max(0, min(n_cache - self.kept_slots(costs), share))


def chunk_count(n_tokens: int, chunk_tokens: int) -> int:
    """How many chunks a prompt of `n_tokens` takes (the one place this is counted). An empty
    prompt is refused before it is planned (ServeLoop), so chunks of 0 tokens are our bug."""
    assert n_tokens >= 0 and (chunk_tokens > 0 or n_tokens == 0), (n_tokens, chunk_tokens)
    return -(-n_tokens // chunk_tokens) if n_tokens else 0


@dataclass(frozen=True)
class PromptGeometry:
    """The prompt plan `chunk_tokens / ring_slots`, its bytes, and where they come from."""

    chunk_tokens: int
    ring_slots: int
    n_lent_slots: int  # cache-tail slots lent when borrowed: ceil((chunk + ring) / blob)
    chunk_bytes: int
    ring_bytes: int
    borrowed: bool
    reasons: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.chunk_bytes + self.ring_bytes

    @property
    def label(self) -> str:
        """The seed's form of the plan: "2,304 / 227"."""
        return f"{self.chunk_tokens:,} / {self.ring_slots:,}"


NO_PROMPT = PromptGeometry(0, 0, 0, 0, 0, False, ("prefill 0: no prompt chunking",))


@dataclass(frozen=True)
class RegionPlan:
    """One planned region: bytes asked and whole segments."""

    name: str
    n_bytes: int
    n_segments: int


@dataclass(frozen=True)
class StartupPlan:
    """Startup regions, cache size and prompt geometries, with the reasons for each choice."""

    capacity_bytes: int
    segment_bytes: int
    n_segments: int
    regions: tuple[RegionPlan, ...]  # reserved at startup, REGION_NAMES order
    deferred: tuple[RegionPlan, ...]  # decode-only regions a startup loan leaves free
    n_cache_slots: int
    prompt: PromptGeometry  # decode time: every decode-only region present
    startup_prompt: PromptGeometry  # the first request, with the deferred bytes lent
    reasons: tuple[str, ...] = field(default=())

    @property
    def free_bytes(self) -> int:
        """Bytes no startup region takes (deferred regions included)."""
        return (self.n_segments - sum(r.n_segments for r in self.regions)) * self.segment_bytes

    def region_bytes(self, name: str) -> int:
        """Planned bytes of region `name` (0 when not reserved at startup)."""
        return next((r.n_bytes for r in self.regions if r.name == name), 0)
