"""Speculative decoding: draft T-1 tokens, verify them in one batched window, keep the longest
agreeing prefix plus one token from the target.

One step, with `x` the last emitted token (not yet in the KV) at position n:

    drafts   = source.propose(x, T-1)                # MTP block, or a test source
    logits   = verifier.verify([x, d1..d_{T-1}])     # [T, V]; main KV grows to n+T
    k, bonus = accept(drafts, logits)                # longest prefix with d == the target's pick
    main KV -> n+1+k;  source.observe(hidden[:k+1], [d1..dk, bonus])

The output is token-identical to plain decoding at any temperature: a row's target is the
token plain decoding picks at that position (the argmax, or the Gumbel-max draw the seed and
the position fix, `engine.request.sampler`), and the drafts are picked with the same noise
from the draft model's logits, so a draft is accepted when both agree.

The MTP block needs the main model's hidden h[p] for every position it has a cell for. The
prompt's hidden is collected during prefill (`collect`, called per chunk) and fed to the block
in one pass once the first token is known (the loan has restored the MTP experts by then), or,
when the drafting policy will not draft for a long span, with the plain steps' rows before the
next draft or after the reply (`settle`); after each verify the block runs over the accepted
positions, whose hidden the verifier holds, and that same pass yields the next step's first
draft.

A request (engine.request.record.prompt_start) asks how many prompt tokens it keeps (the reuse
rule, `reused_tokens`, which asks the draft: a question) -> `begin` with them -> prefill with
`collect` on each chunk -> `decode` -> `settle` once the reply's timing is taken.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from engine.backend.base import Backend
from engine.config import DECODE_ROWS, SPEC_MIN
from engine.errors import FlagError, StrataError
from engine.loan.resources import Releasable
from engine.model.loader import Model
from engine.model.mtp import MTPBlock, MTPExperts, require_mtp
from engine.request.sampler import Sampler
from engine.request.session import Session
from engine.speculative.draft import Draft, DraftSource, MTPDraft
from engine.speculative.draft_head import draft_head_of
from engine.speculative.policy import LEND_MIN_STEPS, DraftPolicy
from engine.speculative.verifier import Verifier
from engine.trace.timing import Timing

MIN_WINDOW, MAX_WINDOW = SPEC_MIN, DECODE_ROWS  # a verify window is one decode step


def check_spec(n_window: int) -> None:
    if not MIN_WINDOW <= n_window <= MAX_WINDOW:
        raise FlagError(
            f"--spec {n_window} must be 0 (off) or {MIN_WINDOW}..{MAX_WINDOW} (window tokens)"
        )


def accept(drafts: list[int], logits: Any, sampler: Sampler, pos: int, be: Backend) -> tuple[int, int]:
    """logits [T, V] of a window whose row j predicts position pos + j -> (drafts accepted
    k, the token after them). Each row's target is the token plain decoding picks there
    (`Sampler.sample`: the argmax, or the draw the seed and position fix); the drafts agreeing
    with their targets are kept, and the first target that disagrees (or the last row's)
    follows them. Greedy rows are compared on the device, one download of T ids; sampled
    rows come down one at a time, as far as the drafts agree."""
    if sampler.params.greedy:
        picks = be.download(be.xp.argmax(logits, axis=-1))  # [T]
        target: Callable[[int], int] = lambda j: int(picks[j])
    else:
        target = lambda j: sampler.sample(be.download(logits[j]), pos + j)
    for k, d in enumerate(drafts):
        t = target(k)
        if d != t:
            return k, t
    return len(drafts), target(len(drafts))


class Lender(Protocol):
    """Lends the draft model's memory over plain spans (engine/loan/cache_lend.py)."""

    def lend(self) -> None: ...

    def repay(self) -> None: ...


class HostRows:
    """Host rows [n, d] kept as the blocks they arrived in (the prefill chunks' hidden, then a
    plain step's row at a time): a slice is copied from the blocks it spans, so a long
    prompt's rows (31k x 2048 float32 = 256 MB) are never joined into one array."""

    def __init__(self, blocks: list[np.ndarray] | None = None):
        self.blocks: list[np.ndarray] = []
        self.starts = [0]  # [n_blocks + 1] first row of each block, then the end
        for b in blocks or []:
            self.append(b)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.starts[-1], *(self.blocks[0].shape[1:] if self.blocks else ()))

    def append(self, block: np.ndarray) -> None:
        """Rows [k, d] after the last."""
        self.blocks.append(block)
        self.starts.append(self.starts[-1] + len(block))

    def head(self, n: int) -> HostRows:
        """The first `n` rows (views of the same blocks, none joined)."""
        return HostRows([blk[: n - s] for blk, s in zip(self.blocks, self.starts) if s < n])

    def __getitem__(self, rows: slice) -> np.ndarray:
        a, b, step = rows.indices(self.shape[0])
        assert step == 1, "HostRows takes contiguous slices"
        parts = [blk[max(a - s, 0) : b - s] for blk, s in zip(self.blocks, self.starts)
                 if s < b and s + len(blk) > a]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class SpecDecoder:
    """`--spec T`: the decode loop with drafts checked by the verifier."""

    def __init__(self, n_window: int, draft: DraftSource, verifier: Verifier):
        check_spec(n_window)
        assert verifier.n_window >= n_window, (verifier.n_window, n_window)
        self.n_window, self.draft, self.verifier = n_window, draft, verifier
        self.always = False  # --spec-always: draft every step (else `DraftPolicy` decides)
        # the draft model's memory lent to the expert cache over long plain spans (the
        # runtime's `engine.loan.cache_lend.CacheLend`), or None
        self.lender: Lender | None = None
        self.policy = DraftPolicy()  # the last request's (its measured rates, for traces)
        # rows the draft has not seen (a deferred prompt, plain steps' rows): (first
        # position, their hidden in host memory, the ids after them); `_session`: whose
        self._unseen: tuple[int, HostRows, list[int]] | None = None
        self._session: Session | None = None
        self._pos0: int | None = None  # first prompt position whose hidden `collect` expects
        self._hidden: list[Any] = []  # [T, d] per prefill chunk since `begin`, host memory
        self._backend: Backend | None = None  # the prefilling session's (`begin`)

    @classmethod
    def with_mtp(
        cls,
        model: Model,
        n_window: int,
        draft_vocab: int = 0,
        to_device: Callable[[np.ndarray], Any] | None = None,
        mtp_expert_slots: int | None = None,
    ) -> SpecDecoder:
        """MTP drafts through a `draft_vocab`-row head, on the built model's backend, the
        nextn block's experts in `mtp_expert_slots` slots (None: all resident); `ModelError`
        without a nextn block."""
        check_spec(n_window)
        head = draft_head_of(model, draft_vocab, to_device)
        experts = None
        if mtp_expert_slots is not None:
            require_mtp(model)
            assert model.mtp_experts is not None and model.transformer is not None
            experts = MTPExperts(model.mtp_experts, model.transformer.backend, to_device,
                                 mtp_expert_slots)
        block = MTPBlock(model, head=head, experts=experts, to_device=to_device)
        return cls(n_window, MTPDraft(block), Verifier.for_model(model, n_window, block.xp))

    def resources(self) -> list[Releasable]:
        """Decode-only regions in the loan's release order (restore runs it backwards)."""
        return [self.verifier, *self.draft.resources()]

    def check_integrity(self) -> None:
        for r in self.resources():
            r.check_integrity()
        self.draft.check_integrity()

    # -- the runtime's three calls ---------------------------------------------------------
    def begin(self, session: Session, keep: int) -> None:
        """Before prefill, with the `keep` prompt tokens the request reuses (the reuse rule,
        engine.request.record.reused_tokens, asked once the last request is settled): the
        draft follows `session` (its KV made on first use) and is cut to them; the caller
        truncates the session to them and prefills the rest, calling `collect`."""
        self.draft.bind(session)
        self.draft.truncate(keep)
        self._pos0, self._hidden, self._backend = keep, [], session.backend

    def collect(self, pos0: int, hidden: Any) -> None:
        """Prefill hook: the main model's pre-norm hidden [T, d] of positions pos0.. ."""
        if self._pos0 is None:  # not prefilling (a verify window, a test draft's forward)
            return
        have = self._pos0 + sum(len(h) for h in self._hidden)
        assert pos0 == have, f"prefill hidden arrives for position {pos0}, expected {have}"
        # kept in host memory: a long prompt's rows are big (31k x 2048 float32 = 256 MB)
        assert self._backend is not None
        self._hidden.append(self._backend.download(hidden))

    def decode(
        self,
        session: Session,
        logits: Any,
        sampler: Sampler,
        max_new: int,
        stop_ids: frozenset[int] = frozenset(),
        timing: Timing | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """Tokens after the prompt, from its last logits [.., V]. Whenever it stops, the KV
        holds the prompt and every generated token but the last, as plain decoding does."""
        timing = timing if timing is not None else Timing()
        n_start = len(session.tokens)
        pos0, hidden = self._take_hidden(session, n_start)
        emitted: list[int] = []
        self.policy = policy = self.new_policy()
        self._unseen = None
        try:
            out = [sampler.sample(session.backend.download(logits[-1]), n_start)]
            while True:
                for tok in out:
                    emitted.append(tok)
                    timing.generated += 1
                    yield tok
                    n_kv = n_start + len(emitted) - 1  # what plain decoding holds now
                    if (
                        tok in stop_ids
                        or len(emitted) >= max_new
                        or n_kv >= session.n_ctx
                        or (cancel is not None and cancel.is_set())
                    ):
                        return
                if hidden is not None:  # first token known: the draft reads the prompt now,
                    # or (no draft for a long span) when drafting resumes or after the reply
                    after = [*session.tokens[pos0 + 1 :], tok]
                    if policy.plain_ahead(rows=len(after)) >= LEND_MIN_STEPS:
                        self._unseen = pos0, hidden, after
                    else:
                        self._observe(session, pos0, hidden, after)
                    hidden = None
                self._lend_or_repay(policy)
                n_draft = min(
                    self.n_window - 1,
                    max_new - len(emitted) - 1,
                    session.n_ctx - len(session.tokens) - 1,
                ) if policy.drafting() else 0
                t0 = time.perf_counter()
                out = self._step(session, out[-1], n_draft, sampler, timing)
                policy.measured(time.perf_counter() - t0, len(out))
        finally:
            n_keep = n_start + max(len(emitted) - 1, 0)
            if len(session.tokens) > n_keep:
                session.truncate(n_keep)
                self.draft.truncate(n_keep)
            failure = sys.exc_info()[1]
            if failure is None or isinstance(failure, GeneratorExit):  # done, or closed early
                if hidden is not None and emitted:  # it ended at the first token: the draft
                    # reads the prompt in `settle`, or the next request would recompute it
                    self._unseen = pos0, hidden, [*session.tokens[pos0 + 1 : n_start], emitted[0]]
                self._session = session  # `settle` catches the draft up on every kept position
            else:  # an error: no more device work; the next request re-reads what the draft lacks
                self._unseen = None

    def settle(self, quiet: bool = False) -> None:
        """After a reply (the serve loop calls it once the reply's timing is taken; the next
        request's start calls it too): the memory lent to the expert cache back, then the
        draft model over the rows it has not seen (those still in the session), so the next
        request continues from every kept position as after an always-drafting request.
        `quiet`: after a failed request, nothing raises (the next loan restores what is still
        released)."""
        self._repay(quiet)
        session, self._session = self._session, None
        if quiet:
            self._unseen = None
        elif session is not None:
            self._catch_up(session)

    def _lend_or_repay(self, policy: DraftPolicy) -> None:
        """Before a step: the draft model's memory back if the step drafts, lent to the expert
        cache if a long plain span starts."""
        if self.lender is None:
            return
        if policy.drafting():
            self.lender.repay()
        elif policy.plain_ahead() >= LEND_MIN_STEPS:
            self.lender.lend()

    def _repay(self, quiet: bool) -> None:
        """The lent memory back at the end of a request; `quiet`: another error is on its way
        (that one is reported; the next loan restores what is still released)."""
        if self.lender is None:
            return
        try:
            self.lender.repay()
        except StrataError:
            if not quiet:
                raise

    def new_policy(self) -> DraftPolicy:
        """A request's drafting policy, going on from the last request's: measured at any
        temperature (a seed's text does not depend on which steps draft: `Sampler`). It asks
        the decoder how many rows a probe would catch the draft model up on."""
        policy = DraftPolicy(always=self.always, prior=self.policy)
        policy.backlog = self._backlog
        return policy

    def _backlog(self) -> int:
        """Rows the draft model has not seen (a deferred prompt, plain steps since a draft)."""
        return len(self._unseen[2]) if self._unseen is not None else 0

    def _observe(self, session: Session, first: int, rows: Any, ids: list[int]) -> None:
        """The draft model over `rows` (hidden [n, d]) in one pass, timed for the policy (what
        a probe's catch-up costs a row)."""
        t0 = time.perf_counter()
        self.draft.observe(session, first, rows, ids)
        self.policy.caught_up(time.perf_counter() - t0, len(ids))

    def _catch_up(self, session: Session) -> None:
        """Feed the draft the hidden rows of the plain steps since it last observed (those
        still in the session), in one pass."""
        if self._unseen is None:
            return
        first, rows, ids = self._unseen
        self._unseen = None
        n = min(rows.shape[0], len(session.tokens) - first)
        if n > 0:
            self._observe(session, first, rows.head(n), ids[:n])

    def _take_hidden(self, session: Session, n_start: int) -> tuple[int, Any]:
        pos0, parts = self._pos0, self._hidden
        self._pos0, self._hidden = None, []
        assert pos0 is not None, "SpecDecoder.begin() must come before prefill and decode"
        hidden = HostRows(parts) if parts else None  # [n_start - pos0, d] host, not joined
        n = 0 if hidden is None else hidden.shape[0]
        assert pos0 + n == n_start and n > 0, (
            f"the draft needs the prefill's hidden for positions {pos0}..{n_start - 1}, got {n} "
            "rows; route every prefill chunk's hidden to SpecDecoder.collect"
        )
        return pos0, hidden

    def _step(
        self, session: Session, x: int, n_draft: int, sampler: Sampler, timing: Timing
    ) -> list[int]:
        """One window [x, d1..d_n]: returns the accepted drafts plus the bonus token. A step
        without drafts leaves its hidden row for the draft to see before it next proposes."""
        n0 = len(session.tokens)
        if n_draft:
            self._catch_up(session)
        draft = self.draft.propose(session, x, n_draft, sampler) if n_draft else Draft([])
        assert len(session.tokens) == n0 and len(draft.tokens) == n_draft
        logits = self.verifier.verify(session, [x, *draft.tokens])  # [w, V], row j: position n0+1+j
        be = session.backend
        k, bonus = accept(draft.tokens, logits, sampler, n0 + 1, be)
        session.truncate(n0 + 1 + k)
        timing.spec_steps += 1
        if not n_draft:  # a plain step: the draft model runs once drafting resumes, over every such row
            first, rows, ids = self._unseen or (n0, HostRows(), [])
            rows.append(be.download(self.verifier.hidden[:1]))  # [1, d]
            self._unseen = first, rows, [*ids, bonus]
        else:
            self.draft.observe(session, n0, self.verifier.hidden[: k + 1], [*draft.tokens[:k], bonus])
            timing.drafted_steps += 1
            timing.drafts_offered += n_draft
            timing.drafts_accepted += k
            timing.accepted_hist[k] = timing.accepted_hist.get(k, 0) + 1
        return [*draft.tokens[:k], bonus]
