"""When speculative decoding drafts: measured seconds per token of drafted and plain steps.

A drafted step verifies a window of rows and runs the draft model; it pays off only when the
drafts it gets accepted outweigh that cost. The cost depends on the machine and the model (in
an MoE verify window every row may route to other experts, so a window reads more expert bytes
than one row) and acceptance depends on the text, so the policy measures instead of guessing:

    home mode (start: draft) for `span` steps -> the other mode for `probe` steps -> the mode
    with fewer seconds per emitted token becomes home; `span` grows when home stays home (x4
    when it won by more than a quarter, else x2; up to `max_span`) and falls back to
    `first_span` when it changes, or to `CLEAR_WIN_SPAN` x `first_span` when the new home won
    by more than a quarter: each probe of a mode that loses clearly costs its steps and (for
    drafts) the draft model's catch-up over the plain rows since, so it comes rarely.

A probe of drafting from a plain home first catches the draft model up over every row it has
not seen (a deferred prompt, the plain steps since): over a long prompt that pass costs more
than hundreds of plain steps (31k rows: 0.3-0.6 s on an H200). So a probe waits until its
catch-up, estimated from the rows waiting (`backlog`) and the last pass's seconds per row,
is at most `PROBE_SHARE` of the plain time decoded since the last probe; until then home
stays home, a span at a time. Drafts that do not pay then cost at most that share of
decoding, however long the context.

A request's policy goes on from the previous request's (`prior`): its home, span and measured
rates, so drafts that do not pay are probed rarely from the second request on (a few steps in
a few hundred) instead of being measured again from scratch on every message. The serve loop
keeps the last request's policy per device beside the forecast's rates (`save` / `load`), so
a new engine on the same model and machine goes on from it too.

A mode's first step after a switch is not measured (it may capture a token graph for a new
row count or bring the draft model's state up to date). The output does not depend on the
policy at any temperature: speculative decoding is token-identical to plain decoding, a
sampled token being fixed by the seed and its position (`engine.request.sampler`), so the
policy measures sampled requests as it does greedy ones. `always=True` (`--spec-always`)
drafts on every step.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from pathlib import Path

from engine.atomic_file import write_text_atomic

DRAFT, PLAIN = "draft", "plain"
CLEAR_WIN_SPAN = 64  # x first_span: the first span of a home that won by more than a quarter
LEND_MIN_STEPS = 32  # plain steps ahead worth lending the draft model's memory for
PROBE_SHARE = 0.03  # a probe's catch-up, at most this share of the plain time since the last
CATCH_UP_SAMPLE_ROWS = 64  # a catch-up of at least this many rows measures the time per row


class DraftPolicy:
    """`drafting()` before a step, `measured(seconds, tokens)` after it."""

    def __init__(
        self,
        always: bool = False,
        first_span: int = 2,
        probe: int = 2,
        max_span: int = 256,
        window: int = 8,
        prior: DraftPolicy | None = None,
    ):
        assert probe >= 2 and first_span >= 2 and max_span >= first_span, (probe, first_span)
        self.always, self.first_span, self.probe, self.max_span = always, first_span, probe, max_span
        self.home = self.mode = DRAFT
        self.span = first_span
        self.left = first_span  # steps before the next switch
        self.fresh = True  # the mode's first step since a switch: not measured
        self._steps: dict[str, deque[tuple[float, int]]] = {
            DRAFT: deque(maxlen=window), PLAIN: deque(maxlen=window),
        }  # fmt: skip
        self.row_s: float | None = None  # the draft model's catch-up, seconds per row (measured)
        self.plain_s = 0.0  # seconds of plain steps since the last probe of drafting
        # rows the draft model has not seen (the decoder's), what a probe would catch up on
        self.backlog: Callable[[], int] | None = None
        if prior is not None and not prior.always:  # go on where the last request stopped
            self.home, self.mode, self.span, self.left = prior.home, prior.mode, prior.span, prior.left
            for mode, steps in prior._steps.items():
                self._steps[mode].extend(steps)
        if prior is not None:
            self.row_s, self.plain_s = prior.row_s, prior.plain_s

    def drafting(self) -> bool:
        """Whether the next step drafts."""
        return self.always or self.mode == DRAFT

    def plain_ahead(self, rows: int = 0) -> int:
        """Plain steps before the policy next drafts (0 while it drafts), with `rows` more
        rows waiting for the draft model than now: when the probe that ends this span could
        not pay its catch-up yet, at least one span more. A span this long is worth lending
        the draft model's memory to the expert cache for, and deferring a prompt's pass
        (`LEND_MIN_STEPS`)."""
        if self.drafting():
            return 0
        if self.home == PLAIN and not self._probe_pays(rows):
            return self.left + self.span
        return self.left

    def seconds_per_token(self, mode: str) -> float | None:
        """The mode's measured seconds per emitted token (None before a measured step)."""
        steps = self._steps[mode]
        tokens = sum(n for _, n in steps)
        return sum(s for s, _ in steps) / tokens if tokens else None

    def caught_up(self, seconds: float, rows: int) -> None:
        """The draft model caught up over `rows` rows in `seconds` (a pass long enough to
        measure the time per row)."""
        if rows >= CATCH_UP_SAMPLE_ROWS:
            self.row_s = seconds / rows

    def probe_cost(self, rows: int = 0) -> float:
        """Seconds a probe of drafting would spend catching the draft model up now, with
        `rows` more rows waiting (0 before the time per row is measured)."""
        waiting = (self.backlog() if self.backlog is not None else 0) + rows
        return waiting * (self.row_s or 0.0)

    def _probe_pays(self, rows: int = 0) -> bool:
        """A probe's catch-up is at most `PROBE_SHARE` of the plain time since the last."""
        return self.probe_cost(rows) <= PROBE_SHARE * self.plain_s

    def measured(self, seconds: float, tokens: int) -> None:
        """A step of the current mode took `seconds` and emitted `tokens`."""
        if self.always:
            return
        if not self.fresh:
            self._steps[self.mode].append((seconds, tokens))
        if self.mode == PLAIN:
            self.plain_s += seconds
        self.fresh = False
        self.left -= 1
        if self.left > 0:
            return
        if self.mode == self.home:  # probe the other mode
            if self.home == PLAIN:
                if not self._probe_pays():
                    self.left = self.span  # not yet: its catch-up would cost too much
                    return
                self.plain_s = 0.0
            self._switch(PLAIN if self.home == DRAFT else DRAFT, self.probe)
            return
        best, growth = self._best(), self._growth()
        if best == self.home:
            self.span = min(growth * self.span, self.max_span)
        else:  # a clear win starts long: probing the loser costs a step at its price
            self.home = best
            self.span = min(self.first_span * (CLEAR_WIN_SPAN if growth == 4 else 1), self.max_span)
        self._switch(best, self.span)

    def rates(self) -> str:
        """' (25.1 ms/token; plain 14.2 ms/token)': the measured modes, for traces ('' when
        neither was measured)."""
        rates = [(m, self.seconds_per_token(m)) for m in (DRAFT, PLAIN)]
        shown = "; ".join(f"{'' if m == DRAFT else 'plain '}{r * 1e3:.1f} ms/token"
                          for m, r in rates if r is not None)
        return f" ({shown})" if shown else ""

    def _best(self) -> str:
        d, p = self.seconds_per_token(DRAFT), self.seconds_per_token(PLAIN)
        if d is None or p is None:
            return self.home
        return DRAFT if d <= p else PLAIN

    def _growth(self) -> int:
        """How much longer the next span is: x4 after a clear win (one mode over 1.25x the
        other's seconds per token), else x2."""
        d, p = self.seconds_per_token(DRAFT), self.seconds_per_token(PLAIN)
        if d is None or p is None:
            return 2
        return 4 if max(d, p) > 1.25 * min(d, p) else 2

    def as_json(self) -> dict:
        """What a later engine goes on from: home, mode, span, steps left, measured steps."""
        return {"home": self.home, "mode": self.mode, "span": self.span, "left": self.left,
                "steps": {m: [list(x) for x in q] for m, q in self._steps.items()},
                "row_s": self.row_s, "plain_s": self.plain_s}

    @classmethod
    def from_json(cls, doc: dict) -> DraftPolicy:
        """A policy as `as_json` wrote it (ValueError, TypeError or KeyError when it is not)."""
        p = cls()
        modes = (DRAFT, PLAIN)
        if doc["home"] not in modes or doc["mode"] not in modes:
            raise ValueError(f"modes {doc['home']!r}, {doc['mode']!r}")
        span, left = int(doc["span"]), int(doc["left"])
        if not (p.first_span <= span <= p.max_span and 0 <= left <= p.max_span):
            raise ValueError(f"span {span}, left {left}")
        p.home, p.mode, p.span, p.left = doc["home"], doc["mode"], span, left
        for mode in modes:
            p._steps[mode].extend((float(s), int(n)) for s, n in doc["steps"][mode])
        row_s = doc.get("row_s")  # absent in files written before the probe's cost was kept
        p.row_s = None if row_s is None else float(row_s)
        p.plain_s = float(doc.get("plain_s", 0.0))
        return p

    def _switch(self, mode: str, steps: int) -> None:
        if mode != self.mode:
            self.fresh = True
        self.mode, self.left = mode, steps



POLICY_FORMAT, POLICY_VERSION = "strata-draft-policy", 1


def policy_path(rates_file: Path) -> Path:
    """Where the drafting policy lives: beside the forecast's rates (`X.rates.json` ->
    `X.policy.json`)."""
    return rates_file.with_name(rates_file.name.removesuffix(".rates.json") + ".policy.json")


def load(path: Path, device: str) -> DraftPolicy | None:
    """The policy saved for `device`, or None (no file, no entry, or not a policy file: the
    engine then measures from scratch)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != POLICY_FORMAT or doc.get("version") != POLICY_VERSION:
            return None
        entry = doc["devices"].get(device)
        return None if entry is None else DraftPolicy.from_json(entry)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def save(path: Path, device: str, policy: DraftPolicy) -> None:
    """Keep `policy` as `device`'s (other devices' entries kept); OSError as the file system
    says."""
    try:
        devices = json.loads(path.read_text(encoding="utf-8"))["devices"]
    except (OSError, ValueError, TypeError, KeyError):
        devices = {}
    if not isinstance(devices, dict):
        devices = {}
    devices[device] = policy.as_json()
    doc = {"format": POLICY_FORMAT, "version": POLICY_VERSION, "devices": devices}
    write_text_atomic(path, json.dumps(doc) + "\n")
