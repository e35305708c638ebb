"""The memory planner: pure functions from device capacity and model costs to region sizes.

Nothing here allocates. `plan_startup` decides the startup regions, the expert-cache size and
the decode-time prompt geometry; `plan_prompt` sizes a prompt geometry for a byte budget;
`plan_loan` re-plans it when a loan frees decode-only memory. Every region is rounded up to whole
segments exactly as the ledger rounds it, so reserving the planned regions leaves `free_bytes`.

Constants, scaled from Strata (which keeps 128 cache slots and lends at most 90% of the cache,
on a 48-layer x 512-expert model):

- kept slots: `min(128, n_layer * n_expert_used)`. 128 slots is less than one token's experts on
  Strata's model (48 x 10); a small model keeps one token's experts across all layers, so a
  4-layer, top-2 model keeps 8, not 128 of its 32 blobs;
- lent share: 90%, a share and so already scale-free; the kept floor binds first on small caches.
- grid: 256 tokens; auto chunks are multiples of it and at most `max_chunk_tokens` (65,536;
  below it the byte budget decides).
- owned prompt path under `--prefill auto`: when it cannot borrow and memory is contended by the
  cache, it takes at most `owned_chunk_tokens` (2,048, llama.cpp's default batch) so the cache
  keeps the rest; when every expert already fits, it takes all that is left.

The ring rule is in `engine.memory.ring` (chunk first, ring gets the rest up to one layer).
"""

from __future__ import annotations

from dataclasses import replace

from engine.errors import PlanError
from engine.memory.arena import padded
from engine.memory.ledger import REGION_NAMES
from engine.memory.plan_types import (  # noqa: F401  (re-exported: the planner's vocabulary)
    NO_PROMPT,
    STRATA_MAX_LENT_SHARE,
    STRATA_MIN_KEPT_SLOTS,
    Auto,
    ModelCosts,
    PlanOptions,
    PromptGeometry,
    RegionPlan,
    StartupPlan,
)
from engine.memory.ring import ring_slots_min, ring_slots_wanted
from engine.memory.sizes import ceil_div, format_mib, format_table


def plan_startup(capacity_bytes: int, costs: ModelCosts, opts: PlanOptions) -> StartupPlan:
    """Plan startup memory (DESIGN §4); raises PlanError with a table when it does not fit.

    Deferred decode-only items still count for the fit (they come back before the first token);
    their segments stay free at startup and `startup_prompt` lends them to the first request.
    """
    seg = opts.segment_bytes
    n_segments = capacity_bytes // seg
    need = [_region(n, b, seg) for n, b in _mandatory(costs, opts)]
    n_need = sum(r.n_segments for r in need)
    if n_need > n_segments:
        _raise_short(need, opts, n_segments, seg)
    reasons = [f"mandatory items take {n_need} of {n_segments} segments of {format_mib(seg)} MiB"]
    if costs.mtp_expert_bytes and costs.mtp_expert_slots < costs.n_expert:
        reasons.append(
            f"mtp.experts holds {costs.mtp_expert_slots} of the nextn block's {costs.n_expert} "
            f"experts (the most lately drafted); a draft uploads the others it routes to"
        )
    if opts.deferred:
        reasons.append(f"deferred by the startup loan: {', '.join(sorted(opts.deferred))}")
    n_cache, prompt = _split(n_segments - n_need, costs, opts, reasons)
    regions = [r for r in need if r.name not in opts.deferred]
    if n_cache:
        regions.append(_region("experts.cache", costs.cache_bytes(n_cache), seg))
    if prompt.chunk_tokens and not prompt.borrowed:
        regions.append(_region("prompt.chunk", prompt.chunk_bytes, seg))
        regions.append(_region("prompt.ring", prompt.ring_bytes, seg))
    regions.sort(key=lambda r: REGION_NAMES.index(r.name))
    deferred = tuple(r for r in need if r.name in opts.deferred)
    plan = StartupPlan(
        capacity_bytes, seg, n_segments, tuple(regions), deferred, n_cache, prompt, prompt,
        tuple(reasons),
    )  # fmt: skip
    if deferred:
        freed = sum(r.n_segments for r in deferred) * seg
        plan = replace(plan, startup_prompt=plan_loan(plan, freed, costs, opts))
    return plan


def fit_mtp_experts(capacity_bytes: int, costs: ModelCosts, opts: PlanOptions) -> ModelCosts:
    """`costs` with the `mtp.experts` region sized: `opts.mtp_expert_slots` where asked; auto:
    every expert of the nextn block where they fit beside the other mandatory items and the
    smallest prompt path, else half of the segments left there (at least two draft tokens'
    experts, `2 * n_expert_used`), filling the region's last segment. The rest of the
    segments go to the expert cache and the prompt path (`plan_startup`)."""
    if not costs.mtp_expert_bytes:
        return costs
    n_expert, blob, seg = costs.n_expert, costs.mtp_blob_bytes, opts.segment_bytes
    if opts.mtp_expert_slots != "auto":
        return costs.with_mtp_slots(max(1, min(opts.mtp_expert_slots, n_expert)))
    others = sum(ceil_div(b, seg) for n, b in _mandatory(costs, opts) if n != "mtp.experts")
    room = capacity_bytes // seg - others - _smallest_prompt_segments(costs, opts)
    if ceil_div(costs.mtp_expert_bytes, seg) <= room:
        return costs
    n_seg = max(room // 2, ceil_div(2 * costs.n_expert_used * blob, seg))
    n = n_seg * seg // blob
    while n > 1 and padded(n * blob) > n_seg * seg:  # the array's alignment fits too
        n -= 1
    return costs.with_mtp_slots(max(1, min(n, n_expert)))


def plan_prompt(
    lendable_bytes: int, costs: ModelCosts, opts: PlanOptions, n_cache_slots: int
) -> PromptGeometry:
    """The prompt geometry for `lendable_bytes`: cache-tail bytes when `opts.borrow` (further
    limited by the kept floor and the lent share of `n_cache_slots`), else the bytes of the owned
    prompt regions. Raises PlanError when not even the smallest geometry fits."""
    if opts.prefill == 0:
        return NO_PROMPT
    blob, seg = costs.expert_blob_bytes, opts.segment_bytes
    if opts.borrow:
        units, unit_bytes = (
            min(lendable_bytes // blob, opts.lendable_slots(n_cache_slots, costs)),
            blob,
        )
        why = _borrow_reason(units, n_cache_slots, costs, opts)
    else:
        units, unit_bytes = lendable_bytes // seg, seg
        why = f"the prompt path owns {units} segments"
    geometry = _fit(units, unit_bytes, costs, opts, opts.max_chunk_tokens, opts.borrow, why)
    if geometry is None:
        _raise_no_prompt(units, unit_bytes, costs, opts, borrowed=opts.borrow)
    return geometry


def plan_loan(
    plan: StartupPlan, freed_bytes: int, costs: ModelCosts, opts: PlanOptions
) -> PromptGeometry:
    """The prompt geometry while a loan has released `freed_bytes` of decode-only segments.

    Borrowed: the cache grows by the freed segments; its new slots are empty, so all of them are
    lendable on top of what the cache may lend. Owned: the prompt regions grow by the freed bytes.
    A fixed `--prefill N` keeps its geometry (the A/B control).
    """
    prompt = plan.prompt
    if prompt.chunk_tokens == 0:
        return prompt
    if opts.prefill != "auto":
        return replace(prompt, reasons=prompt.reasons + ("fixed --prefill: the loan keeps it",))
    seg, blob = opts.segment_bytes, costs.expert_blob_bytes
    freed = f"the loan frees {format_mib(freed_bytes)} MiB"
    if prompt.borrowed:
        n = plan.n_cache_slots
        mapped = ceil_div(costs.cache_bytes(n), seg) * seg + freed_bytes
        grown = (mapped - costs.cache_bytes(0)) // blob - n
        units, unit_bytes = grown + opts.lendable_slots(n, costs), blob
        why = f"{freed}: the cache grows by {grown:,} empty slots, all lendable"
    else:
        owned = ceil_div(prompt.chunk_bytes, seg) + ceil_div(prompt.ring_bytes, seg)
        units, unit_bytes = owned + freed_bytes // seg, seg
        why = f"{freed}: the owned prompt regions grow to {units} segments"
    geometry = _fit(units, unit_bytes, costs, opts, opts.max_chunk_tokens, prompt.borrowed, why)
    assert geometry is not None, "a loan never shrinks the prompt budget"
    return geometry


def format_plan_table(plan: StartupPlan) -> str:
    """The plan as a table (region, MiB and segments mapped, share) and the `prompt plan C / S`
    line, followed by the planner's reasons."""
    seg, total = plan.segment_bytes, plan.n_segments

    def row(name: str, n_seg: int) -> list[str]:
        return [name, format_mib(n_seg * seg), str(n_seg), f"{100.0 * n_seg / total:.1f}%"]

    rows = [row(r.name, r.n_segments) for r in plan.regions]
    # Deferred regions are free at startup (counted in `free`); shown with what they take back.
    rows += [
        [f"{r.name} (deferred)", format_mib(r.n_segments * seg), "-", "-"] for r in plan.deferred
    ]
    rows += [row("free", plan.free_bytes // seg), row("total", total)]
    lines = [format_table(["region", "MiB", "segments", "share"], rows, right=[0, 1, 1, 1])]
    lines.append(f"expert cache {plan.n_cache_slots:,} slots")
    lines.append(_prompt_line("prompt plan", plan.prompt))
    if plan.deferred:
        lines.append(_prompt_line("startup prompt plan", plan.startup_prompt))
    lines += [f"- {r}" for r in plan.reasons + plan.prompt.reasons]
    if plan.deferred:
        lines += [f"- startup loan: {r}" for r in plan.startup_prompt.reasons]
    return "\n".join(lines)


# -- helpers --------------------------------------------------------------------------------------


def _mandatory(costs: ModelCosts, opts: PlanOptions) -> list[tuple[str, int]]:
    """What every plan reserves (deferred decode-only items included): (region, bytes)."""
    items = [("weights.dense", costs.dense_bytes), ("kv", costs.kv_bytes)]
    items += [("reserve", opts.reserve_bytes)]
    return items + [(n, b) for n, b in costs.decode_only_bytes().items() if b > 0]


def _smallest_prompt(costs: ModelCosts, opts: PlanOptions) -> tuple[int, int, int, int]:
    """The smallest prompt path: (chunk tokens, ring slots, chunk bytes, ring bytes) of a grid
    chunk (or the --prefill chunk) beside its minimum ring."""
    tokens = opts.grid_tokens if opts.prefill == "auto" else opts.prefill
    _, ring = _chunk_tokens(0, 1, costs, replace(opts, prefill=tokens), tokens)
    return tokens, ring, costs.chunk_bytes(tokens), ring * costs.expert_blob_bytes


def _smallest_prompt_segments(costs: ModelCosts, opts: PlanOptions) -> int:
    """Segments the smallest prompt path owns (0 without prompt chunking)."""
    if opts.prefill == 0:
        return 0
    _, _, chunk, ring = _smallest_prompt(costs, opts)
    return ceil_div(chunk, opts.segment_bytes) + ceil_div(ring, opts.segment_bytes)


def _region(name: str, n_bytes: int, seg: int) -> RegionPlan:
    return RegionPlan(name, n_bytes, ceil_div(n_bytes, seg))


def _split(
    avail_segments: int, costs: ModelCosts, opts: PlanOptions, reasons: list[str]
) -> tuple[int, PromptGeometry]:
    """Share the segments left after mandatory items between the cache and the prompt path."""
    seg, blob, n_all = opts.segment_bytes, costs.expert_blob_bytes, costs.n_blobs

    def slots_in(n_seg: int) -> int:
        return max(0, min(n_all, (n_seg * seg - costs.cache_bytes(0)) // blob))

    def cache_segments(n: int) -> int:
        return ceil_div(costs.cache_bytes(n), seg) if n else 0

    def owned(n_seg: int, cap: int) -> PromptGeometry | None:
        why = f"the prompt path owns its buffers in {n_seg} segments"
        return _fit(n_seg, seg, costs, opts, cap, False, why)

    if opts.expert_cache == "auto":
        n_cache = slots_in(avail_segments)
        reasons.append(f"expert cache auto: {n_cache:,} of {n_all:,} experts take the rest")
    else:
        n_cache = min(opts.expert_cache, n_all)
        if n_cache < opts.expert_cache:
            reasons.append(f"--expert-cache {opts.expert_cache:,} capped at {n_all:,} experts")
        if cache_segments(n_cache) > avail_segments:
            raise PlanError(
                f"--expert-cache {opts.expert_cache} needs {cache_segments(n_cache)} segments, "
                f"{avail_segments} are left after the mandatory items (room for "
                f"{slots_in(avail_segments):,} slots); lower --expert-cache or use auto"
            )
    if opts.prefill == 0:
        return n_cache, NO_PROMPT
    left = avail_segments - cache_segments(n_cache)
    if n_cache == n_all and (g := owned(left, opts.max_chunk_tokens)) is not None:
        reasons.append("every expert is resident: the prompt path owns what is left")
        return n_cache, g
    if opts.borrow and n_cache:
        n_lend = opts.lendable_slots(n_cache, costs)
        why = _borrow_reason(n_lend, n_cache, costs, opts)
        if (g := _fit(n_lend, blob, costs, opts, opts.max_chunk_tokens, True, why)) is not None:
            return n_cache, g
        reasons.append(f"the cache tail ({n_lend:,} lendable slots) cannot hold a prompt path")
    if opts.expert_cache != "auto":
        room = left
        g = owned(left, opts.max_chunk_tokens)
    else:  # the owned prompt path takes memory from the cache: keep the floor, cap the chunk
        keep = cache_segments(min(n_all, opts.kept_slots(costs)))
        room = avail_segments - keep
        g = owned(room, opts.owned_chunk_tokens)
        if g is None and keep:  # the floor and the smallest prompt path do not both fit
            room, g = avail_segments, owned(avail_segments, opts.owned_chunk_tokens)
            if g is not None:
                reasons.append(f"the cache's floor of {opts.kept_slots(costs):,} slots does not "
                               f"fit beside the prompt path: the prompt path comes first")
        if g is not None:
            used = ceil_div(g.chunk_bytes, seg) + ceil_div(g.ring_bytes, seg)
            n_cache = slots_in(avail_segments - used)
            reasons.append(f"expert cache shrinks to {n_cache:,} slots for the owned prompt path")
    if g is None:
        _raise_no_prompt(max(room, 0), seg, costs, opts)
    return n_cache, g


def _fit(units: int, unit_bytes: int, costs: ModelCosts, opts: PlanOptions, cap_tokens: int,
         borrowed: bool, why: str) -> PromptGeometry | None:  # fmt: skip
    """Chunk first, then the ring, in `units` of `unit_bytes` (cache slots or segments)."""
    blob = costs.expert_blob_bytes
    tokens, ring_min = _chunk_tokens(units, unit_bytes, costs, opts, cap_tokens)
    chunk_bytes = costs.chunk_bytes(tokens)
    chunk_units = ceil_div(chunk_bytes, unit_bytes)
    if tokens <= 0 or chunk_units + ceil_div(ring_min * blob, unit_bytes) > units:
        return None
    one_layer = ring_slots_wanted(tokens, costs.n_expert, costs.n_expert_used)
    wanted = opts.ring_layers * one_layer
    ring = min(wanted, (units - chunk_units) * unit_bytes // blob)
    n_lent = ceil_div(chunk_bytes + ring * blob, blob) if borrowed else 0
    how = "--prefill" if opts.prefill != "auto" else f"on the {opts.grid_tokens}-token grid"
    reasons = [why, f"chunk {tokens:,} tokens ({how}, beside a {ring_min}-slot ring)"]
    layers = "one layer's" if opts.ring_layers == 1 else f"{opts.ring_layers} layers'"
    reasons.append(f"ring {ring} slots = min({layers} {wanted} wanted, what is left)")
    if borrowed:
        reasons.append(f"lends {n_lent:,} cache-tail slots = ceil((chunk + ring) / {blob:,} B)")
    return PromptGeometry(tokens, ring, n_lent, chunk_bytes, ring * blob, borrowed, tuple(reasons))


def _chunk_tokens(
    units: int, unit_bytes: int, costs: ModelCosts, opts: PlanOptions, cap_tokens: int
) -> tuple[int, int]:
    """The chunk (the largest on the grid under `--prefill auto`) and its minimum ring."""
    ring_min = ring_slots_min(costs.n_expert, costs.n_expert_used)
    if opts.prefill != "auto":  # a tiny fixed chunk may want fewer slots than the minimum
        wanted = ring_slots_wanted(opts.prefill, costs.n_expert, costs.n_expert_used)
        return opts.prefill, min(ring_min, wanted)
    ring_units = ceil_div(ring_min * costs.expert_blob_bytes, unit_bytes)
    room = (units - ring_units) * unit_bytes - costs.act_bytes_fixed
    grid = opts.grid_tokens
    return min(room // costs.act_bytes_per_token, cap_tokens) // grid * grid, ring_min


def _borrow_reason(n_lend: int, n_cache: int, costs: ModelCosts, opts: PlanOptions) -> str:
    return (
        f"the prompt path borrows the cache tail: {n_lend:,} of {n_cache:,} slots lendable "
        f"(keep >= {opts.kept_slots(costs):,}, lend <= {opts.max_lent_share:.0%})"
    )


def _prompt_line(title: str, g: PromptGeometry) -> str:
    where = f"borrowed: {g.n_lent_slots:,} cache-tail slots lent" if g.borrowed else "owned"
    where = where if g.chunk_tokens else "no prompt chunking"
    return f"{title} {g.label} (chunk tokens / ring slots), {where}"


def _raise_short(need: list[RegionPlan], opts: PlanOptions, n_segments: int, seg: int) -> None:
    n_need = sum(r.n_segments for r in need)
    rows = [
        [r.name + (" (deferred)" if r.name in opts.deferred else ""), format_mib(r.n_bytes),
         str(r.n_segments), format_mib(r.n_segments * seg)]
        for r in need
    ]  # fmt: skip
    short = n_need - n_segments
    for label, n in (("total needed", n_need), ("device budget", n_segments), ("short by", short)):
        rows.append([label, "", str(n), format_mib(n * seg)])
    headers = ["item", "MiB", "segments", f"MiB in {format_mib(seg)} MiB segments"]
    raise PlanError(
        f"the mandatory items need {format_mib(n_need * seg)} MiB, the device budget is "
        f"{format_mib(n_segments * seg)} MiB: short by {format_mib(short * seg)} MiB; lower "
        f"--ctx, use a smaller --kv type or raise the device size",
        format_table(headers, rows, right=[0, 1, 1, 1]),
    )


def _raise_no_prompt(room: int, unit_bytes: int, costs: ModelCosts, opts: PlanOptions,
                     borrowed: bool = False) -> None:
    """The smallest prompt path (a grid chunk or the --prefill chunk, and its minimum ring)
    against the `room` left for it, both in its units: whole segments of `unit_bytes` for
    owned regions, cache slots when `borrowed` (chunk and ring share the lent slots)."""
    tokens, ring, chunk_bytes, ring_bytes = _smallest_prompt(costs, opts)
    units = [ceil_div(chunk_bytes, unit_bytes), ceil_div(ring_bytes, unit_bytes)]
    if borrowed:
        need, what = ceil_div(chunk_bytes + ring_bytes, unit_bytes), "cache slots"
    else:
        need, what = sum(units), f"segments of {format_mib(unit_bytes)} MiB"
    rows = [
        [f"chunk ({tokens:,} tokens)", format_mib(chunk_bytes), str(units[0])],
        [f"ring ({ring} slots)", format_mib(ring_bytes), str(units[1])],
        ["left for it", format_mib(room * unit_bytes), str(room)],
    ]
    cache = "lower --expert-cache, " if opts.expert_cache != "auto" and not borrowed else ""
    raise PlanError(
        f"the prompt path needs {format_mib(need * unit_bytes)} MiB ({need} {what}) for a "
        f"{tokens:,}-token chunk and a {ring}-slot ring, {format_mib(room * unit_bytes)} MiB "
        f"are left for it; {cache}lower --prefill or --ctx, or give the device more memory",
        format_table(["item", "MiB", what.split(" of ")[0]], rows, right=[0, 1, 1]),
    )
