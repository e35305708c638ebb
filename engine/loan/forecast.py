"""The loan forecast: what a prefill will cost before it runs, with the loan and without it.

A prefill's time is a sum of parts, each linear in what the plan says the prefill will do (its
`Workload`), with coefficients of this device fitted to the requests it ran before (`Rates`):

    attention = attention FLOPs x s/FLOP      + layer-chunks x s   (q/k/v/o, causal attention)
    moe       = MoE FLOPs x s/FLOP            + layer-chunks x s   (router, k SwiGLU experts)
    stream    = streamed expert bytes x s/B                        (ring uploads; the CPU decodes)
    rest      = chunks x s + refilled bytes x s/B + fixed          (embedding, lend, refill, gaps)
    release   = released bytes x s/B + fixed                       (a repeat loan)
    restore   = restored bytes x s/B + fixed                       (every loan)

`moe` and `stream` are measured together (the MoE phase waits for its uploads). Streamed
bytes come from the plan: every expert a chunk routes to that is not resident while the prompt
path holds its lent slots, with routing odds from the expert profile (`routing_odds`).

The engine measures each part after every request (the prompt path's phase clock, the loan's
release and restore steps, the wall time) and keeps the observation (`Rates.observe`). A
forecast fits the coefficients to the earlier observations by non-negative least squares
weighted towards requests of similar geometry (chunk size and context length: a kernel's
efficiency changes with them) and pulled weakly towards per-device defaults, so it falls back
on those before the first request and between two observations splits time as they do.
Observations are stored per device in a JSON file beside the expert profile (`rates_path`).

Pure: plans and measurements in, seconds out; nothing here touches a device.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from engine.atomic_file import write_text_atomic
from engine.bounded_input import InputFileError, load_json
from engine.devices import device_traits
from engine.experts.profile import ExpertProfile
from engine.memory.costs import Shapes, attention_flops, moe_flops
from engine.memory.plan_types import PromptGeometry, chunk_count

FORMAT = "strata-prefill-rates"
VERSION = 1
MAX_RATES_BYTES = 4 << 20  # KEEP_TOTAL observations of a device take ~30 KB

# Part -> the workload features its time is linear in ("one": a fixed cost).
FEATURES: dict[str, tuple[str, ...]] = {
    "attention": ("attn_flops", "layer_chunks"),
    "moe": ("moe_flops", "layer_chunks", "streamed_bytes"),
    "rest": ("n_chunks", "refill_bytes", "one"),
    "release": ("released_bytes", "releases"),
    "restore": ("restored_bytes", "restores"),
}
PARTS = tuple(FEATURES)

# The fit: prior weight (relative coefficient units against residuals relative to a request's
# prefill time), geometry kernel widths (natural log units), weight every observation keeps,
# and how many observations are kept (per geometry bucket and in all).
PRIOR_WEIGHT = 1e-3
CHUNK_WIDTH = 0.35  # a chunk 1.4x larger weighs 0.6, 2x larger 0.14
CONTEXT_WIDTH = 0.5
WEIGHT_FLOOR = 0.02
RECENCY = 0.98
KEEP_PER_BUCKET = 4
KEEP_TOTAL = 64

# The automatic repeat loan (STRATA_PREFILL_REPEAT_MIN_TOKENS=auto) is taken when the forecast
# with it is at least this much shorter than without: the gain must exceed its cost (release
# and restore are in the loan's forecast) by more than the forecast's own error.
AUTO_MARGIN = 0.10


@dataclass(frozen=True)
class Workload:
    """What one prefill will do, from its plan: the features the parts are linear in."""

    kind: str | None  # the loan: None, "startup" or "repeat" (engine.loan.transaction)
    n_fresh: int
    pos0: int  # tokens already in the KV cache (the prompt's reused prefix)
    chunk_tokens: int  # the geometry fitted to the prompt
    ring_slots: int
    n_chunks: int
    layer_chunks: int
    attn_flops: float
    moe_flops: float
    streamed_bytes: float  # expected (an observation holds the measured bytes)
    refill_bytes: float
    released_bytes: float
    restored_bytes: float

    def features(self, part: str) -> np.ndarray:
        """The feature vector of `part` (FEATURES order)."""
        extra = {
            "one": 1.0,
            "releases": float(self.released_bytes > 0),
            "restores": float(self.restored_bytes > 0),
        }
        return np.array([extra[f] if f in extra else float(getattr(self, f))
                         for f in FEATURES[part]])

    @property
    def context_tokens(self) -> int:
        return self.pos0 + self.n_fresh


def routing_odds(profile: ExpertProfile | None, n_layer: int, n_expert: int,
                 n_expert_used: int) -> np.ndarray:
    """[L*E] the chance that one token routes to each (layer, expert), in the cache's fill
    order (`ExpertProfile.order()`: the first n_slots entries are the resident ones). Counts
    get one pseudo-count each; without a profile every expert is equally likely."""
    profile = profile or ExpertProfile.uniform(n_layer, n_expert)
    counts = profile.counts.astype(np.float64) + 1.0  # [L, E]
    odds = n_expert_used * counts / counts.sum(axis=1, keepdims=True)  # [L, E], rows sum to k
    layer, expert = np.array(profile.order()).T  # [L*E] each
    return np.minimum(odds[layer, expert], 1.0)


def expected_streamed(odds: np.ndarray, n_resident: int, chunk_tokens: int, n_fresh: int,
                      ring_slots: int) -> float:
    """Expected expert uploads of a prefill: per chunk, every non-resident expert that any of
    its tokens routes to. A ring that holds every non-resident expert keeps them across chunks
    (each is uploaded once)."""
    missing = odds[n_resident:]  # [M]
    if len(missing) == 0 or n_fresh == 0:
        return 0.0

    def used(n_tokens: int) -> float:
        return float(np.sum(1.0 - (1.0 - missing) ** n_tokens))

    if ring_slots >= len(missing):
        return used(n_fresh)
    n_full, last = divmod(n_fresh, chunk_tokens)
    return n_full * used(chunk_tokens) + (used(last) if last else 0.0)


def workload(kind: str | None, n_fresh: int, pos0: int, g: PromptGeometry, shapes: Shapes,
             n_cache_slots: int, n_lendable_slots: int, odds: np.ndarray,
             released_bytes: int = 0, restored_bytes: int = 0) -> Workload:
    """The workload of prefilling `n_fresh` tokens after `pos0` with geometry `g` (already
    fitted to the prompt). While borrowed, the lent cache-tail slots that held experts
    (at most the `n_lendable_slots` the cache may lend; the rest a loan grows are empty) are
    not resident, and the refill uploads them back."""
    hp, blob = shapes.hp, shapes.mean_blob_bytes  # a quant mix: blobs differ by layer
    n_chunks = chunk_count(n_fresh, g.chunk_tokens) if g.chunk_tokens else 0
    lent_resident = min(g.n_lent_slots, n_lendable_slots) if g.borrowed else 0
    n_resident = max(0, n_cache_slots - lent_resident)
    streamed = expected_streamed(odds, n_resident, max(g.chunk_tokens, 1), n_fresh, g.ring_slots)
    return Workload(
        kind=kind, n_fresh=n_fresh, pos0=pos0, chunk_tokens=g.chunk_tokens,
        ring_slots=g.ring_slots, n_chunks=n_chunks, layer_chunks=n_chunks * hp.n_layer,
        attn_flops=float(attention_flops(shapes, n_fresh, pos0)),
        moe_flops=float(moe_flops(shapes, n_fresh)), streamed_bytes=streamed * blob,
        refill_bytes=float(lent_resident * blob), released_bytes=float(released_bytes),
        restored_bytes=float(restored_bytes),
    )  # fmt: skip


# -- coefficients, observations, the fit ------------------------------------------------------


Coefs = dict[str, np.ndarray]  # part -> seconds per unit of each feature (FEATURES order)


def coefs(**parts: Sequence[float]) -> Coefs:
    """Coefficients from one sequence per part (FEATURES order), checked."""
    out = {p: np.array(parts[p], dtype=np.float64) for p in PARTS}
    for p, c in out.items():
        assert c.shape == (len(FEATURES[p]),) and (c > 0).all(), (p, c)
    return out


# Before the first request: rough rates of this project's machines (the 2-core EPYC VM's
# numpy path; an H200 with the qwen3-30b-a3b preset, docs/cuda.md). Every coefficient is
# positive: it is also the prior the fit leans on.
DEFAULTS: dict[str, Coefs] = {
    "sim": coefs(
        attention=(1 / 45e9, 2e-4),
        moe=(1 / 90e9, 1e-3, 1 / 125e6),
        rest=(2e-3, 1 / 2e9, 5e-3),
        release=(1 / 50e9, 2e-4),
        restore=(1 / 2e9, 2e-3),
    ),
    "cuda": coefs(
        attention=(1 / 420e12, 5e-4),
        moe=(1 / 175e12, 4e-3, 1 / 50e9),
        rest=(5e-3, 1 / 50e9, 0.05),
        release=(1 / 200e9, 2e-3),
        restore=(1 / 20e9, 0.03),
    ),
}


@dataclass(frozen=True)
class Observation:
    """One finished prefill: its workload (with the bytes it really streamed) and the
    seconds each part took; `prefill_s` is the request's whole prefill (release to restore)."""

    workload: Workload
    seconds: Mapping[str, float]  # part -> seconds ("moe" includes its streaming)
    prefill_s: float
    expected_bytes: float = 0.0  # what the routing odds expected it to stream (0: unknown)

    def as_json(self) -> dict:
        return {"workload": asdict(self.workload), "seconds": dict(self.seconds),
                "prefill_s": self.prefill_s, "expected_bytes": self.expected_bytes}

    @classmethod
    def from_json(cls, doc: dict) -> Observation:
        """An observation as `as_json` wrote it; ValueError or TypeError naming the first
        field that is not a finite non-negative number of its kind (a file may be edited)."""
        w = doc["workload"]
        if not isinstance(w, dict) or set(w) != {f.name for f in fields(Workload)}:
            raise ValueError("a workload without the fields of this version")
        if w["kind"] not in LOAN_KINDS:
            raise ValueError(f"workload kind {_shown(w['kind'])}")
        for f in fields(Workload):
            if f.name != "kind":
                _count(w[f.name], f.name, f.type == "int")
        seconds = {p: _count(doc["seconds"][p], p) for p in PARTS}
        return cls(Workload(**w), seconds, _count(doc["prefill_s"], "prefill_s"),
                   _count(doc.get("expected_bytes", 0.0), "expected_bytes"))


LOAN_KINDS = (None, "startup", "repeat")


def _count(value: object, name: str, integer: bool = False) -> float:
    """`value` of field `name` when it is a finite number >= 0 (an int where `integer`)."""
    kinds = (int,) if integer else (int, float)
    if type(value) not in kinds or not 0 <= value < math.inf:  # NaN fails the comparison
        raise ValueError(f"{name} {_shown(value)} is not a finite count")
    return value  # type: ignore[return-value]


def _shown(value: object) -> str:
    """A value from a file, cut short for a one-line message."""
    text = repr(value)
    return text if len(text) <= 24 else text[:24] + "..."


def measured_parts(workload: Workload, prefill_s: float, phases: Mapping[str, float],
                   release_s: float, restore_s: float, expected_bytes: float = 0.0) -> Observation:
    """An observation from what a request measured: the prompt path's phase totals
    (`attention`; every phase whose name starts with `moe`), the loan's release and restore,
    and the whole prefill; what the phases do not cover is `rest`."""
    attention = phases.get("attention", 0.0)
    moe = sum(s for name, s in phases.items() if name.startswith("moe"))
    rest = max(0.0, prefill_s - attention - moe - release_s - restore_s)
    seconds = {"attention": attention, "moe": moe, "rest": rest, "release": release_s,
               "restore": restore_s}
    return Observation(workload, seconds, prefill_s, expected_bytes)


def _nnls_with_prior(a: np.ndarray, b: np.ndarray, weight: float) -> np.ndarray:
    """argmin |a x - b|^2 + weight |x - 1|^2 over x >= 0, for a few columns: the optimum of a
    strictly convex problem is the best feasible least-squares solution over the subsets of
    free variables (the others at 0)."""
    n = a.shape[1]
    prior_a, prior_b = math.sqrt(weight) * np.eye(n), math.sqrt(weight) * np.ones(n)
    best, best_cost = np.zeros(n), math.inf
    for k in range(n, 0, -1):
        for free in itertools.combinations(range(n), k):
            cols = list(free)
            lhs = np.vstack([a[:, cols], prior_a[:, cols]])
            rhs = np.concatenate([b, prior_b])
            x_free = np.linalg.lstsq(lhs, rhs, rcond=None)[0]
            if (x_free < 0).any():
                continue
            x = np.zeros(n)
            x[cols] = x_free
            cost = float(np.sum((a @ x - b) ** 2) + weight * np.sum((x - 1) ** 2))
            if cost < best_cost:
                best, best_cost = x, cost
    return best


def _weights(w: Workload, observations: Sequence[Observation]) -> np.ndarray:
    """[N] how much each observation counts for a forecast of `w` (newest last)."""
    def log_ratio(a: float, b: float) -> float:
        return math.log(max(a, 1) / max(b, 1))

    out = []
    for age, o in enumerate(reversed(observations)):
        ow = o.workload
        d = (log_ratio(w.chunk_tokens, ow.chunk_tokens) / CHUNK_WIDTH) ** 2
        d += (log_ratio(w.context_tokens, ow.context_tokens) / CONTEXT_WIDTH) ** 2
        out.append((math.exp(-0.5 * d) + WEIGHT_FLOOR) * RECENCY**age)
    return np.array(out[::-1])


@dataclass(frozen=True)
class Forecast:
    """Predicted seconds of one prefill by part (`stream` split off `moe`), and how many
    earlier requests informed it (0: the device's defaults alone)."""

    workload: Workload
    seconds: Mapping[str, float]  # attention, moe, stream, rest, release, restore
    coefs: Coefs = field(repr=False, compare=False)
    n_observations: int = 0

    @property
    def total_s(self) -> float:
        return float(sum(self.seconds.values()))

    @property
    def loan(self) -> bool:
        return self.workload.kind is not None


@dataclass(frozen=True)
class Rates:
    """This device's defaults and the observations of its earlier requests."""

    device: str  # e.g. "sim AMD EPYC 7B13 x2", "cuda NVIDIA H200"
    defaults: Coefs = field(repr=False, compare=False)
    observations: tuple[Observation, ...] = ()

    @classmethod
    def fresh(cls, device: str) -> Rates:
        """No observation yet: the defaults of the device's kind (its traits' `rates`)."""
        return cls(device, DEFAULTS[device_traits(device).rates])

    def fit(self, w: Workload) -> Coefs:
        """Coefficients for a forecast of `w` (see the module docstring)."""
        if not self.observations:
            return dict(self.defaults)
        weights = _weights(w, self.observations)
        out: Coefs = {}
        for part in PARTS:
            prior = self.defaults[part]
            x = np.array([o.workload.features(part) for o in self.observations])  # [N, F]
            y = np.array([o.seconds[part] for o in self.observations])  # [N]
            scale = np.array([max(o.prefill_s, 1e-3) for o in self.observations])  # [N]
            rows = np.sqrt(weights)[:, None] / scale[:, None]
            a, b = x * prior[None, :] * rows, y * rows[:, 0]  # relative to the prior
            out[part] = prior * _nnls_with_prior(a, b, PRIOR_WEIGHT)
        return out

    def streaming_factor(self, w: Workload) -> float:
        """Measured over expected streamed bytes of the earlier requests most like `w` (1
        before any): the routing odds come from the expert profile, and a prompt whose
        routing differs (other text, other tokens) streams more or less than they say."""
        known = [o for o in self.observations if o.expected_bytes > 0]
        if not known:
            return 1.0
        weights = _weights(w, known)
        expected = float(np.dot(weights, [o.expected_bytes for o in known]))
        measured = float(np.dot(weights, [o.workload.streamed_bytes for o in known]))
        return measured / expected if expected > 0 else 1.0

    def forecast(self, w: Workload) -> Forecast:
        """Predicted seconds of `w` by part (its expected streaming scaled by what earlier
        requests streamed against their expectation)."""
        w = replace(w, streamed_bytes=w.streamed_bytes * self.streaming_factor(w))
        c = self.fit(w)
        seconds = {p: float(w.features(p) @ c[p]) for p in PARTS}
        stream = w.streamed_bytes * float(c["moe"][2])
        seconds["moe"] -= stream
        seconds = {"attention": seconds["attention"], "moe": seconds["moe"], "stream": stream,
                   "rest": seconds["rest"], "release": seconds["release"],
                   "restore": seconds["restore"]}
        return Forecast(w, seconds, c, len(self.observations))

    def observe(self, o: Observation) -> Rates:
        """These rates with `o` kept: at most KEEP_PER_BUCKET per geometry bucket (powers of
        two of the chunk and the context, loan or not), KEEP_TOTAL in all, oldest dropped."""
        kept = [*self.observations, o]
        buckets: dict[tuple, int] = {}
        keep = []
        for obs in reversed(kept):
            key = _bucket(obs.workload)
            buckets[key] = buckets.get(key, 0) + 1
            if buckets[key] <= KEEP_PER_BUCKET and len(keep) < KEEP_TOTAL:
                keep.append(obs)
        return replace(self, observations=tuple(reversed(keep)))

    def summary(self, c: Coefs) -> str:
        """The fitted rates in words: 'attention 47 GFLOP/s + 0.2 ms a layer-chunk, ...'."""
        def rate(sec_per_unit: float, unit: str, scale: float) -> str:
            return f"{1 / sec_per_unit / scale:,.3g} {unit}" if sec_per_unit > 0 else f"- {unit}"

        flops = device_traits(self.device).flops_unit
        fs = 1e12 if flops == "TFLOP/s" else 1e9
        att, moe, rest = c["attention"], c["moe"], c["rest"]
        return (
            f"attention {rate(att[0], flops, fs)} + {att[1] * 1e3:.2f} ms a layer-chunk; "
            f"MoE {rate(moe[0], flops, fs)} + {moe[1] * 1e3:.2f} ms a layer-chunk; "
            f"expert streaming {rate(moe[2], 'GB/s', 1e9)}; refill {rate(rest[1], 'GB/s', 1e9)}; "
            f"release {c['release'][1] * 1e3:.1f} ms + {rate(c['release'][0], 'GB/s', 1e9)}; "
            f"restore {c['restore'][1] * 1e3:.1f} ms + {rate(c['restore'][0], 'GB/s', 1e9)}"
        )


def _bucket(w: Workload) -> tuple:
    return (round(math.log2(max(w.chunk_tokens, 1))), round(math.log2(max(w.context_tokens, 1))),
            w.kind is None)


# -- persistence ------------------------------------------------------------------------------


class RatesError(ValueError):
    """A rates file that cannot be read (the engine starts from the defaults instead)."""


def rates_path(model_path: Path, profile_path: str | None, cache_dir: Path) -> Path:
    """Where a model's rates live: beside an `--expert-profile` file (`X.json` ->
    `X.rates.json`), else in the cache directory's profiles/ beside the calibration profiles,
    one file per model file."""
    if profile_path:
        p = Path(profile_path)
        return p.with_name(p.name.removesuffix(".json") + ".rates.json")
    key = abs(hash_text(str(model_path.resolve())))
    return cache_dir / "profiles" / f"{model_path.stem}-{key:012x}.rates.json"


def hash_text(text: str) -> int:
    """A stable 48-bit hash (Python's `hash` of a str changes per process)."""
    import hashlib

    return int(hashlib.sha1(text.encode()).hexdigest()[:12], 16)


def load_rates(path: Path, device: str) -> Rates:
    """The rates of `device` in the file at `path`; fresh rates when the file or the device's
    entry is absent. RatesError (one line) when the file is not a rates file."""
    rates = Rates.fresh(device)
    if not path.exists() and not path.is_symlink():
        return rates
    try:
        doc = load_json(path, MAX_RATES_BYTES, f"prefill rates {path}",
                        "delete it to start again")
    except InputFileError as e:
        raise RatesError(str(e)) from None
    try:
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"format {_shown(doc.get('format'))} version "
                             f"{_shown(doc.get('version'))}")
        entry = doc["devices"].get(device, [])
        if not isinstance(entry, list):
            raise TypeError(f"the entry of {device!r} is not a list")
        observations = tuple(Observation.from_json(o) for o in entry[-KEEP_TOTAL:])
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        raise RatesError(f"prefill rates {path} is not a {FORMAT} file version {VERSION} "
                         f"({str(e)[:80]}); delete it to start again") from None
    return replace(rates, observations=observations)


def save_rates(path: Path, rates: Rates) -> None:
    """Write `rates` into the file at `path` (other devices' entries kept), atomically."""
    try:
        doc = load_json(path, MAX_RATES_BYTES, f"prefill rates {path}")
        devices = doc["devices"] if doc.get("format") == FORMAT else {}
        if not isinstance(devices, dict):
            devices = {}
    except (InputFileError, TypeError, KeyError, AttributeError):
        devices = {}  # absent or not ours: written anew
    devices[rates.device] = [o.as_json() for o in rates.observations]
    write_text_atomic(path, json.dumps({"format": FORMAT, "version": VERSION, "devices": devices}) + "\n")


# -- the loan verdict -------------------------------------------------------------------------


@dataclass(frozen=True)
class LoanVerdict:
    """What a message would get, asked before it is sent: its token counts, the loan it would
    take ("startup", "repeat" or None) and why, and the forecast with and without a loan
    (`with_loan` None where no loan is possible: the loan flags are off)."""

    prompt_tokens: int
    fresh_tokens: int
    kind: str | None
    reason: str
    without_loan: Forecast
    with_loan: Forecast | None
    pays: bool | None = None  # `pays(without_loan, with_loan)`; None without a loan forecast

    @property
    def chosen(self) -> Forecast:
        """The forecast of what will run."""
        return self.with_loan if self.kind is not None and self.with_loan else self.without_loan

    def line(self) -> str:
        """'repeat loan: 5.0 s -> 3.9 s' or 'no loan (300 fresh < 1,024): 0.6 s'."""
        off = seconds_text(self.without_loan.total_s)
        if self.kind is not None and self.with_loan is not None:
            return f"{self.kind} loan: {off} -> {seconds_text(self.with_loan.total_s)}"
        return f"no loan ({self.reason}): {off}"


def seconds_text(s: float) -> str:
    """'12 s', '5.0 s', '320 ms', '4.5 ms': two or three significant figures."""
    if s >= 10:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.1f} s"
    return f"{s * 1e3:.0f} ms" if s >= 0.01 else f"{s * 1e3:.1f} ms"


def pays(without_loan: Forecast, with_loan: Forecast) -> bool:
    """The automatic decision: the loan's forecast (its release and restore included) beats
    the forecast without it by more than AUTO_MARGIN."""
    return with_loan.total_s * (1 + AUTO_MARGIN) < without_loan.total_s


# -- a table ----------------------------------------------------------------------------------

ROWS = (("attention", "attention (s)"), ("moe", "MoE (s)"), ("stream", "expert streaming (s)"),
        ("rest", "chunk overhead, refill (s)"), ("release", "release (s)"),
        ("restore", "restore (s)"))


def format_forecasts(columns: Sequence[tuple[str, Forecast | str]]) -> str:
    """Forecasts side by side (a column that is a string says why there is no forecast): the
    plan, chunks, expected streaming, each part and the prefill time."""
    from engine.memory.sizes import format_table

    def cells(f: Forecast | str) -> list[str]:
        if isinstance(f, str):
            return [f] + [""] * (len(ROWS) + 4)
        w = f.workload
        mib = w.streamed_bytes / (1 << 20)
        moved = {"release": w.released_bytes, "restore": w.restored_bytes}
        parts = [f"{f.seconds[p]:.3f}" if moved.get(p, 1) else "-" for p, _ in ROWS]
        pp = w.n_fresh / f.total_s if f.total_s > 0 else 0.0
        return [f"{w.chunk_tokens:,} / {w.ring_slots:,}", f"{w.n_chunks:,}", f"{mib:,.0f}",
                *parts, f"{f.total_s:.3f}", f"{pp:,.0f}"]

    labels = ["prompt plan (chunk / ring)", "chunks", "experts streamed (MiB)",
              *(label for _, label in ROWS), "prefill (s)", "PP (tok/s)"]
    table = [cells(f) for _, f in columns]
    rows = [[label, *(col[i] for col in table)] for i, label in enumerate(labels)]
    headers = ["", *(name for name, _ in columns)]
    return format_table(headers, rows, right=[False] + [True] * len(columns))
