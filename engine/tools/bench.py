"""Benchmarks that print tables (never timed unit tests): `strata bench`.

Every run starts a fresh engine and closes it (`Runtime.close`) before the next, so one
configuration's device memory never stays behind under another's; configurations are interleaved (off, on, off, on, ...) and
serialized; each cell is the median of the runs with the range beside it. Scenarios follow
seed 000's tables: the fixed-planner A/B (same plan, loan off and on), the automatic planner,
and a repeat prefill (a short first message, then a long one with the repeat loan); decode at
depth on sampled text (temperature 1.0, a fixed seed) with greedy rows beside it, with and
without MTP drafts; plus a sweep of chunk sizes (prefill tok/s and bytes streamed against the
chunk). Every table but the decode one decodes greedily (its replies' CRCs then agree across
configurations that must compute the same tokens).

Before the measured runs one short request warms what a process does once (kernel
compilation, the calibration profile, the model file in the page cache), so the first row is
not charged for it; it generates enough tokens for drafted and plain decode steps of every
window size to compile their kernels (NVRTC, seconds each on a fresh machine). Given the
machine's host-to-device bandwidth and peak FLOP/s, each row also shows its prefill time over
the lower bound max(streamed bytes / H2D, FLOPs / peak).

Each run's "GPU peak" is the most device memory the process held from the engine's start to
its close: on CUDA NVML's count for this process (context, cuBLAS, kernels and CuPy's pool
included), polled by `PeakSampler`; on the simulated device its own high-water mark. A run whose
peak passes `--vram-limit` is marked in the table and named in a line under it.
"""

from __future__ import annotations

import json
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.backend import SimBackend
from engine.backend.process_memory import DEVICE, PROCESS, MemoryReading, PeakSampler
from engine.config import REPEAT_MIN_FLOOR, EngineOptions, LoanFlags
from engine.devices import peak_sampler, vram_limit_bytes
from engine.memory.costs import Shapes, prefill_flops
from engine.memory.sizes import MiB
from engine.request.sampler import SamplingParams
from engine.runtime.serve import ServeLoop
from engine.startup.profile_record import calibration_text
from engine.trace.events import EventBus, PlanChosen, TraceLine

SIMULATED = "simulated device"  # the peak's source on the sim backend
PEAK_HEADERS = {  # the peak column's header by where the peak was read
    PROCESS: "GPU peak (MiB)",
    DEVICE: "GPU peak (MiB, device used - baseline)",
    SIMULATED: "Sim device peak (MiB)",
}

LOAN_ON = LoanFlags.make(elastic_loan=True, mtp_loan=True, head_loan=True,
                         retain_startup_chunk=True, repeat_loan=True)


@dataclass(frozen=True)
class Config:
    label: str
    options: EngineOptions
    flags: LoanFlags = field(default_factory=LoanFlags)
    warmup_tokens: int = 0  # repeat scenario: a short first message before the measured one
    params: SamplingParams = field(default_factory=SamplingParams)  # greedy unless given


@dataclass
class Sample:
    plan: str
    pp: float
    tg: float
    prefill_s: float
    mib_streamed: float
    loan: bool
    arena_peak_mib: float = 0.0  # CUDA: the prompt temporaries' peak inside the chunk buffer
    arena_spill_mib: float = 0.0  # CUDA: temporaries that did not fit it
    bound_ratio: float = 0.0  # prefill time / lower bound (0: no `Hardware` given)
    decode_hits: int = 0  # routed experts found in the expert cache while decoding
    decode_misses: int = 0  # ... and read from host memory
    spec_steps: int = 0  # speculative decoding: verify steps, and how many of them drafted
    drafted_steps: int = 0
    generated: int = 0  # tokens the run generated (TG at depth wants TG_MIN_TOKENS)
    peak_mib: float = 0.0  # the process's device memory at its highest (see the module docstring)
    peak_source: str = ""  # PROCESS or DEVICE (NVML), SIMULATED; "" when unknown
    limit_mib: float = 0.0  # --vram-limit of the run (0: none)
    reply_crc: str = ""  # CRC-32 of the reply's text (greedy runs of two configurations agree)
    decode_promoted: int = 0  # decode misses then put into the cache (--cache-policy adaptive)
    decode_mib: float = 0.0  # the decode misses' bytes over the host-to-device link (MiB)

    @property
    def over_limit(self) -> bool:
        """The peak passed the run's --vram-limit."""
        return 0 < self.limit_mib < self.peak_mib

    @property
    def decode_hit_pct(self) -> float:
        n = self.decode_hits + self.decode_misses
        return 100.0 * self.decode_hits / n if n else 0.0

    @property
    def promoted_per_token(self) -> float:
        return self.decode_promoted / self.generated if self.generated else 0.0

    @property
    def link_mib_per_token(self) -> float:
        """MiB the decode steps copied over the link per generated token."""
        return self.decode_mib / self.generated if self.generated else 0.0

    @property
    def drafted_pct(self) -> float:
        return 100.0 * self.drafted_steps / self.spec_steps if self.spec_steps else 0.0


@dataclass(frozen=True)
class Hardware:
    """What the prefill lower bound divides by: host-to-device bytes/s and peak FLOP/s."""

    h2d_bytes_per_s: float
    peak_flops: float

    def bound_s(self, streamed_bytes: float, flops: float) -> float:
        return max(streamed_bytes / self.h2d_bytes_per_s, flops / self.peak_flops)


@dataclass
class Row:
    label: str
    samples: list[Sample] = field(default_factory=list)

    def cell(self, key: str, fmt: str = "{:.1f}") -> str:
        values = [getattr(s, key) for s in self.samples]
        med = statistics.median(values)
        if len(values) == 1:
            return fmt.format(med)
        return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    def plans(self) -> str:
        return " / ".join(sorted({s.plan for s in self.samples}, key=self._order)) if self.samples else ""

    @staticmethod
    def _order(label: str) -> int:
        return int(label.split("/")[0].replace(",", "").strip())


def prompt_tokens(loop: ServeLoop, n: int, salt: int = 0) -> list[int]:
    """n token ids of English-looking text (the calibration generator, grown to length)."""
    tok = loop.rt.model.tokenizer
    ids: list[int] = []
    seed = salt
    while len(ids) < n:
        ids += tok.encode(calibration_text(2000, seed=seed))
        seed += 1
    return ids[:n]


PROMPT_LINES = ("prefill phases", "prompt temporaries", "token graph", "speculation")  # passed on


def run_once(cfg: Config, n_tokens: int, max_new: int, hw: Hardware | None = None,
             log: Callable[[str], None] | None = None, bus: EventBus | None = None) -> Sample:
    """A fresh engine, one measured request (after the warmup message, if any), the engine
    closed; `log` gets the prompt path's trace lines (its phases with STRATA_TRACE=1, the CUDA
    temporaries) and the run's warnings; `bus` (optional) gets the run's events, down to the
    closed ledger's last snapshot."""
    bus = bus or EventBus()
    plans: list[PlanChosen] = []
    bus.subscribe(lambda e: plans.append(e) if isinstance(e, PlanChosen) else None)
    if log is not None:
        bus.subscribe(lambda e: log(e.text)
                      if isinstance(e, TraceLine) and e.text.startswith(PROMPT_LINES) else None)
    sampler = peak_sampler(cfg.options.device)
    if sampler is not None:
        sampler.start()
    try:
        loop = ServeLoop.create(cfg.options, cfg.flags, bus)
        try:
            sample = _measure(loop, cfg, n_tokens, max_new, hw, plans)
            peak = _peak(sampler, loop)
        finally:
            if log is not None:  # a fallback (e.g. the token graph gave up) changes the figures
                for line in loop.rt.report.warnings:
                    log(line)
            loop.close()
    finally:
        if sampler is not None:
            sampler.stop()
    limit = vram_limit_bytes(cfg.options)
    return replace(sample, peak_mib=peak.n_bytes / MiB if peak else 0.0,
                   peak_source=peak.source if peak else "",
                   limit_mib=limit / MiB if limit else 0.0)


def _measure(loop: ServeLoop, cfg: Config, n_tokens: int, max_new: int, hw: Hardware | None,
             plans: list[PlanChosen]) -> Sample:
    if cfg.warmup_tokens:
        loop.complete(prompt_tokens(loop, cfg.warmup_tokens, salt=99), max_new=2)
    ids = prompt_tokens(loop, n_tokens)
    if cfg.warmup_tokens:  # continue the same sequence so only the new part is fresh
        ids = list(loop.rt.session.tokens) + ids
    reply = loop.complete(ids, cfg.params, max_new=max_new)
    t = reply.timing
    loop.rt.check_integrity()
    p = plans[-1]
    arena = loop.rt.prompt.arena_stats
    ratio = 0.0
    if hw is not None:
        flops = prefill_flops(Shapes.of(loop.rt.model), n_tokens, pos0=len(ids) - n_tokens)
        ratio = t.prefill_s / hw.bound_s(t.bytes_streamed, flops)
    return Sample(f"{p.chunk_tokens:,} / {p.ring_slots}", t.pp_tok_s, t.tg_tok_s, t.prefill_s,
                  t.bytes_streamed / (1 << 20), p.loan,
                  arena.peak_bytes / (1 << 20) if arena else 0.0,
                  arena.spilled_bytes / (1 << 20) if arena else 0.0, ratio,
                  t.decode_hits, t.decode_misses, t.spec_steps, t.drafted_steps,
                  generated=t.generated, decode_promoted=t.decode_promoted,
                  decode_mib=t.decode_bytes / MiB,
                  reply_crc=f"{zlib.crc32(reply.text.encode()):08x}")


def _peak(sampler: PeakSampler | None, loop: ServeLoop) -> MemoryReading | None:
    """The run's peak so far: NVML's (the sampler's), the simulated device's own, or None
    (CUDA without NVML)."""
    if sampler is not None:
        sampler.sample()
        return sampler.peak
    backend = loop.rt.backend
    if isinstance(backend, SimBackend):
        return MemoryReading(backend.peak_bytes, SIMULATED)
    return None


WARMUP_NEW = 24  # tokens the warm-up generates: drafted windows, then the policy's plain probe


def run_bench(configs: list[Config], n_tokens: int, max_new: int, runs: int,
              progress: Callable[[str], None] | None = None, warmup: bool = True,
              hw: Hardware | None = None) -> list[Row]:
    """Interleave configs run by run (after one short unmeasured request with the first
    config, unless `warmup` is off); returns one row per config."""
    rows = [Row(c.label) for c in configs]
    if warmup:
        t0 = time.perf_counter()
        run_once(replace(configs[0], warmup_tokens=0), min(n_tokens, 256), min(max_new, WARMUP_NEW))
        if progress:
            progress(f"warm-up: {time.perf_counter() - t0:.1f} s")
    for r in range(runs):
        for cfg, row in zip(configs, rows):
            t0 = time.perf_counter()
            s = run_once(cfg, n_tokens, max_new, hw, progress)
            row.samples.append(s)
            if progress:
                peak = f", peak {s.peak_mib:,.0f} MiB" if s.peak_source else ""
                over = f" (over --vram-limit {s.limit_mib:,.0f} MiB)" if s.over_limit else ""
                progress(f"run {r + 1}/{runs} {cfg.label}: {time.perf_counter() - t0:.1f} s"
                         f"{peak}{over}")
    return rows


# Columns shown only when some sample has data for them: (header, Row.cell key and format, test)
OPTIONAL_COLUMNS: tuple[tuple[str, str, str, Callable[[Sample], bool]], ...] = (
    ("Temporaries peak (MiB)", "arena_peak_mib", "{:.0f}", lambda s: s.arena_peak_mib > 0),
    ("Spilled (MiB)", "arena_spill_mib", "{:.0f}", lambda s: s.arena_peak_mib > 0),
    ("Prefill / lower bound", "bound_ratio", "{:.1f}x", lambda s: s.bound_ratio > 0),
    ("Decode cache hits (%)", "decode_hit_pct", "{:.0f}", lambda s: s.decode_hits + s.decode_misses > 0),
    ("Promoted / token", "promoted_per_token", "{:.2f}", lambda s: s.decode_promoted > 0),
    ("Link / token (MiB)", "link_mib_per_token", "{:.1f}", lambda s: s.decode_mib > 0),
    ("Drafted steps (%)", "drafted_pct", "{:.0f}", lambda s: s.spec_steps > 0),
)


def markdown(rows: list[Row], title: str) -> str:
    """The table; optional columns where some run has their data: the process's device peak
    (NVML on CUDA, the simulated device's own), on CUDA the prompt temporaries' peak and spill
    (MiB), the lower-bound ratio when a `Hardware` was given, the decode steps' expert-cache
    hit share and the MiB their misses copied over the link per token, and with speculative
    decoding the share of steps that drafted (the drafting policy runs plain steps when drafts
    do not pay). A peak past --vram-limit is marked `*`
    and each such configuration gets a line under the table."""
    samples = [s for r in rows for s in r.samples]
    extra = [c for c in OPTIONAL_COLUMNS if any(c[3](s) for s in samples)]
    source = next((s.peak_source for s in samples if s.peak_source), "")
    peak = [PEAK_HEADERS.get(source, f"Peak (MiB, {source})")] if source else []
    lines = [
        f"### {title}", "",
        "| Configuration | Prompt plan | PP (tok/s) | TG (tok/s) | Prefill (s) | Streamed (MiB) |"
        + "".join(f" {h} |" for h in peak) + "".join(f" {c[0]} |" for c in extra),
        "|---|---|---:|---:|---:|---:|" + "---:|" * (len(peak) + len(extra)),
    ]
    for row in rows:
        over = " *" if any(s.over_limit for s in row.samples) else ""
        lines.append(
            f"| {row.label} | {row.plans()} | {row.cell('pp')} | {row.cell('tg')} | "
            f"{row.cell('prefill_s', '{:.2f}')} | {row.cell('mib_streamed', '{:.0f}')} |"
            + (f" {row.cell('peak_mib', '{:.0f}')}{over} |" if peak else "")
            + "".join(f" {row.cell(key, fmt)} |" for _, key, fmt, _ in extra)
        )
    notes = [over_limit_line(row) for row in rows if any(s.over_limit for s in row.samples)]
    short = tg_note(rows)
    notes += [short] if short else []
    first = first_run_note(rows)
    notes += [first] if first else []
    return "\n".join(lines + ([""] + notes if notes else []))


TG_MIN_TOKENS, TG_MIN_RUNS = 128, 3


def tg_note(rows: list[Row]) -> str | None:
    """A line under the table when its TG is not a TG-at-depth figure: decoding after the
    prompt wants at least TG_MIN_TOKENS tokens and the median of TG_MIN_RUNS runs."""
    samples = [s for r in rows for s in r.samples if s.tg > 0]
    if not samples:
        return None
    fewest = min(s.generated for s in samples)
    runs = min(len(r.samples) for r in rows)
    if fewest >= TG_MIN_TOKENS and runs >= TG_MIN_RUNS:
        return None
    return (f"TG: {fewest} tokens, {runs} run{'s' if runs != 1 else ''} per configuration; TG at "
            f"depth wants at least {TG_MIN_TOKENS} tokens and {TG_MIN_RUNS} runs "
            f"(--max-new {TG_MIN_TOKENS} --runs {TG_MIN_RUNS}).")


def first_run_note(rows: list[Row]) -> str | None:
    """A line under the table comparing each configuration's first measured TG with the median
    of its later runs (a first run that stalls on something later runs do not pay shows here);
    None when no configuration has two runs with TG."""
    parts = []
    for row in rows:
        tg = [s.tg for s in row.samples if s.tg > 0]
        if len(tg) >= 2:
            later = statistics.median(tg[1:])
            parts.append(f"{row.label} {tg[0]:.1f} against {later:.1f} "
                         f"({100 * (tg[0] / later - 1):+.1f}%)")
    if not parts:
        return None
    return "TG, the first measured run against the median of the later ones: " + "; ".join(parts) + "."


def over_limit_line(row: Row) -> str:
    """The line under the table for a configuration whose peak passed --vram-limit."""
    over = [s for s in row.samples if s.over_limit]
    worst = max(over, key=lambda s: s.peak_mib)
    return (f"Marked *: {row.label}: the GPU peak passed --vram-limit {worst.limit_mib:,.0f} MiB in "
            f"{len(over)} of {len(row.samples)} runs (highest {worst.peak_mib:,.0f} MiB, "
            f"{worst.peak_mib - worst.limit_mib:,.0f} MiB over; {worst.peak_source})")


def merged(texts: dict[str, str]) -> dict[str, list[Row]]:
    """Scenario -> rows of several `--json` files (source name -> its text), the runs of a
    configuration pooled in the order given. Raises ValueError naming a file that is not one."""
    out: dict[str, dict[str, Row]] = {}
    for source, text in texts.items():
        try:
            for name, rows in json.loads(text).items():
                by_label = out.setdefault(name, {})
                for r in rows:
                    row = by_label.setdefault(r["label"], Row(r["label"]))
                    row.samples += [Sample(**s) for s in r["samples"]]
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{source}: not a sample file written by `strata bench --json` "
                             f"({type(e).__name__}: {e})") from None
    return {name: list(rows.values()) for name, rows in out.items()}


def as_json(rows: list[Row]) -> str:
    return json.dumps([{"label": r.label, "samples": [asdict(s) for s in r.samples]} for r in rows],
                      indent=1)


TITLES = {
    "ab": "Fixed-planner A/B (same plan)",
    "auto": "Automatic planner",
    "repeat": "Repeat prefill (second message)",
    "plain": "No MTP (plain decoding)",
    "chunks": "Chunk size sweep",
    "decode": "Decode at depth, sampled and greedy",
}
SCENARIOS = tuple(TITLES)
DEFAULT_SCENARIOS = ("ab", "auto", "repeat", "decode")
SAMPLED = SamplingParams(temperature=1.0, seed=1)  # the decode table's sampled rows


def sampling_label(p: SamplingParams) -> str:
    """'greedy' or 'sampled (T 1.0, top-k 40, top-p 0.95, seed 1)'."""
    if p.greedy:
        return "greedy"
    filters = (f", top-k {p.top_k}" if p.top_k else "") + (f", top-p {p.top_p}" if p.top_p < 1 else "")
    return f"sampled (T {p.temperature}{filters}, seed {p.seed})"


def _no_mtp(base: EngineOptions) -> EngineOptions:
    """The automatic planner without the MTP block or drafts."""
    return replace(base, serve=True, vram_elastic=True, mtp=False, spec=0, prefill="auto")


def scenario(name: str, base: EngineOptions, n_tokens: int,
             sampled: SamplingParams = SAMPLED) -> tuple[str, list[Config]]:
    """The title and configurations of one named scenario; `sampled` is what the decode
    table's sampled rows draw with (every other row decodes greedily)."""
    loan_base = replace(base, serve=True, vram_elastic=True, mtp=True, spec=base.spec or 4)
    if name == "ab":
        fixed = base.prefill if isinstance(base.prefill, int) else 256
        off = replace(loan_base, prefill=fixed)
        return TITLES[name], [
            Config("Loan flags off", off), Config("Loan flags on, same plan", off, LOAN_ON)]
    if name == "auto":
        auto = replace(loan_base, prefill="auto")
        return TITLES[name], [
            Config("Loan flags off, automatic planner", auto),
            Config("Loan flags on, automatic planner", auto, LOAN_ON)]
    if name == "repeat":
        auto = replace(loan_base, prefill="auto")
        repeat = LoanFlags.make(**{**LOAN_ON.as_kwargs(), "repeat_min_tokens": 256})
        return TITLES[name], [
            Config("Loan flags off", auto, LoanFlags(), warmup_tokens=64),
            Config("Repeat loan on", auto, repeat, warmup_tokens=64)]
    if name == "plain":  # the automatic planner without the MTP block: what --mtp is held to
        # (without it the loan has nothing to lend: the head loan needs --mtp --spec)
        return TITLES[name], [Config("No MTP, automatic planner", _no_mtp(base))]
    if name == "decode":  # sampled text is the honest decode workload: greedy text of a random-
        # weight file loops, and the adaptive expert cache learns the loop (docs/decode.md)
        plain = _no_mtp(base)
        decoders = [("no MTP", plain)]
        if base.mtp:
            spec = base.spec or 2
            decoders.append((f"--mtp --spec {spec}", replace(plain, mtp=True, spec=spec)))
        return TITLES[name], [
            Config(f"{sampling_label(params)}, {how}", opts, params=params)
            for params in (sampled, SamplingParams()) for how, opts in decoders]
    if name == "chunks":
        return TITLES[name], [
            Config(f"--prefill {p}", replace(base, prefill=p))
            for p in (256, 512, 1024, 2048, "auto")]
    raise ValueError(name)


@dataclass
class SoakResult:
    requests: int
    loans: int
    max_lent_after: int
    ledger_drift_bytes: int
    rss_start_mib: float
    rss_end_mib: float
    rss_max_mib: float
    seconds: float
    # the automatic decision (STRATA_PREFILL_REPEAT_MIN_TOKENS=auto): every request also ran
    # with the other choice (its twin), so each decision is checked against the measured other
    auto: bool = False
    slower_loans: int = 0  # loans whose prefill was slower than the twin without the loan
    worst_loan: float = 0.0  # the largest loan / no-loan prefill ratio of the loans taken
    declined: int = 0  # requests the forecast kept off the loan
    missed: int = 0  # ... whose twin with the loan was faster
    best_missed: float = 0.0  # the smallest loan / no-loan ratio among those declined

    def markdown(self) -> str:
        head = ("| Requests | Repeat loans | Max slots lent after a request | Ledger drift (bytes) "
                "| RSS start / end / max (MiB) | Time (s) |")
        rule = "|---:|---:|---:|---:|---|---:|"
        row = (f"| {self.requests} | {self.loans} | {self.max_lent_after} | "
               f"{self.ledger_drift_bytes} | {self.rss_start_mib:.0f} / {self.rss_end_mib:.0f} / "
               f"{self.rss_max_mib:.0f} | {self.seconds:.0f} |")
        if self.auto:
            head += (" Loans slower than without (worst loan / no loan) | Declined | Declined "
                     "but the loan was faster (best loan / no loan) |")
            rule += "---:|---:|---:|"
            worst = f" ({self.worst_loan:.2f})" if self.loans else ""
            best = f" ({self.best_missed:.2f})" if self.declined else ""
            row += f" {self.slower_loans}{worst} | {self.declined} | {self.missed}{best} |"
        return f"{head}\n{rule}\n{row}"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def soak(options: EngineOptions, requests: int, long_tokens: int | Sequence[int],
         short_tokens: int, progress: Callable[[str], None] | None = None,
         auto: bool = False) -> SoakResult:
    """Alternate long messages (cycling through `long_tokens`) and short ones in one
    conversation-less engine; after every request the ledger's region bytes and the lent
    slots are back to baseline. The repeat loan's threshold is the smallest long message (at
    most 1,024); with `auto` the forecast decides instead, and every request also runs with
    the other choice (its KV dropped first, so every token is fresh again): a loan taken
    without the loan, a loan declined with it, each pair in alternating order."""
    longs = [long_tokens] if isinstance(long_tokens, int) else list(long_tokens)
    manual = LOAN_ON.with_changes(repeat_min_tokens=min(*longs, 1024))
    flags = LOAN_ON.with_changes(repeat_auto=True) if auto else manual
    loop = ServeLoop.create(replace(options, serve=True, vram_elastic=True, mtp=True,
                                    spec=options.spec or 4), flags, EventBus())
    loop.complete(prompt_tokens(loop, 32, salt=7), max_new=1)  # the startup loan
    base = loop.rt.ledger.snapshot().regions
    rss0 = rss_max = _rss_mib()
    drift = max_lent = loans = 0
    out = SoakResult(requests, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, auto=auto)
    t0 = time.perf_counter()
    for i in range(requests):
        n = longs[(i // 2) % len(longs)] if i % 2 == 0 else short_tokens
        ids = prompt_tokens(loop, n, salt=i)  # new ids: all fresh
        if auto and n >= REPEAT_MIN_FLOOR:  # below it no loan is taken, auto or not
            took, ratio = _decide_and_twin(loop, ids, flags, manual, twin_first=i % 4 >= 2)
            _count(out, took, ratio)
        else:
            verdict = loop.complete(ids, max_new=2).verdict
            took = verdict is not None and verdict.kind is not None
        loans += took
        loop.rt.check_integrity()
        regions = loop.rt.ledger.snapshot().regions
        drift = max(drift, abs(sum(r.used_bytes for r in regions) - sum(r.used_bytes for r in base)))
        max_lent = max(max_lent, loop.rt.cache.n_lent if loop.rt.cache else 0)
        rss_max = max(rss_max, _rss_mib())
        if progress and (i + 1) % 20 == 0:
            progress(f"soak {i + 1}/{requests}: rss {_rss_mib():.0f} MiB, {loans} loans")
    seconds = time.perf_counter() - t0
    loop.close()
    return replace(out, loans=loans, max_lent_after=max_lent, ledger_drift_bytes=drift,
                   rss_start_mib=rss0, rss_end_mib=_rss_mib(), rss_max_mib=rss_max,
                   seconds=seconds)


def _decide_and_twin(loop: ServeLoop, ids: list[int], auto: LoanFlags, manual: LoanFlags,
                     twin_first: bool) -> tuple[bool, float]:
    """Run `ids` with the automatic decision and again with the other choice (the KV dropped
    before each, so both prefill every token); returns (loan taken, loan / no-loan prefill)."""
    def run(flags: LoanFlags) -> Any:
        loop.rt.rollback(0)
        if loop.set_flags(flags):
            raise AssertionError(f"the soak's own flags were refused: {flags}")
        return loop.complete(ids, max_new=2)

    def other(took: bool) -> LoanFlags:
        return LoanFlags() if took else manual.with_changes(repeat_min_tokens=256)

    twin = None
    if twin_first:  # the forecast's decision as it stands now; the twin runs first
        twin = run(other(loop.verdict(len(ids), 0).kind is not None))
    reply = run(auto)
    took = reply.verdict.kind is not None
    if twin is None or (twin.verdict.kind is not None) == took:  # the twin ran the same choice
        twin = run(other(took))
    if loop.set_flags(auto):
        raise AssertionError("the soak's own flags were refused")
    with_loan, without = (reply, twin) if took else (twin, reply)
    return took, with_loan.timing.prefill_s / without.timing.prefill_s


def _count(out: SoakResult, took: bool, ratio: float) -> None:
    if took:
        out.slower_loans += ratio > 1.0
        out.worst_loan = max(out.worst_loan, ratio)
    else:
        out.declined += 1
        out.missed += ratio < 1.0
        out.best_missed = ratio if out.declined == 1 else min(out.best_missed, ratio)
