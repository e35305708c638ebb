"""`strata bench-spec`: decode speed and MTP draft acceptance per `--spec` window (a benchmark).

Runs are interleaved (every window size once per run, same prompt), each on a fresh session;
the table gives the median decode tok/s with its range, the acceptance rate, the mean number
of drafts accepted per verify step and its histogram, and whether the output equalled
`--spec 0` (it must).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.cli.options import add_sampling_args, integer, sampling_params
from engine.errors import FlagError, StrataError
from engine.experts.provider import DirectExperts
from engine.gguf.tokenizer import TokenType
from engine.model.loader import load_model
from engine.request.record import generate
from engine.request.sampler import SamplingParams
from engine.request.session import Session
from engine.speculative.decoder import SpecDecoder, check_spec
from engine.synth.demo import resolve_model
from engine.trace.timing import Timing


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-spec", help="benchmark MTP speculative decoding (--spec windows)")
    p.add_argument("--model", default="demo", help="a .gguf path, or a preset name such as 'demo'")
    p.add_argument("--spec", default="0,2,4", help="comma-separated windows; 0 is plain decoding")
    p.add_argument("--runs", type=integer, default=3, help="runs per window (default 3)")
    p.add_argument("--max-new", type=integer, default=64, help="tokens to generate (default 64)")
    p.add_argument(
        "--prompt-tokens", type=integer, default=32, help="random prompt length (default 32)"
    )
    p.add_argument(
        "--prompt", action="append", default=[], metavar="MESSAGE",
        help="a chat message (rendered with the model's template) instead of random tokens; "
        "repeat it for several: every run decodes each",
    )
    p.add_argument("--spec-always", action="store_true",
                   help="draft every step (default: the drafting policy decides)")
    p.add_argument("--draft-vocab", type=integer, default=0, help="draft head rows (0: all)")
    p.add_argument("--kv", choices=("f16", "int8", "q4_0"), default="f16")
    add_sampling_args(p)
    p.set_defaults(func=run)


@dataclass
class BenchRow:
    """Figures of one window size over all runs."""

    spec: int
    tok_s: list[float] = field(default_factory=list)
    offered: int = 0
    accepted: int = 0
    hist: dict[int, int] = field(default_factory=dict)
    spec_steps: int = 0
    drafted_steps: int = 0
    same_as_plain: bool | None = None  # every run's tokens equal --spec 0's (at any temperature)

    @property
    def n_steps(self) -> int:
        return sum(self.hist.values())

    @property
    def acceptance(self) -> float:
        return self.accepted / self.offered if self.offered else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.n_steps if self.n_steps else 0.0


def parse_specs(text: str) -> list[int]:
    try:
        specs = [integer(s.strip()) for s in text.split(",") if s.strip()]
    except argparse.ArgumentTypeError:
        raise FlagError(f"--spec '{text}' must be comma-separated integers, e.g. 0,2,4") from None
    for s in specs:
        if s:
            check_spec(s)
    if not specs:
        raise FlagError("--spec is empty; give at least one window, e.g. 0,2,4")
    return specs


def bench(
    model_path: str | Path,
    specs: list[int],
    runs: int,
    max_new: int,
    prompt_tokens: int,
    params: SamplingParams,
    draft_vocab: int = 0,
    kv: str = "f16",
    seed: int = 0,
    messages: list[str] | None = None,
    always: bool = False,
) -> list[BenchRow]:
    """Run every window `runs` times, interleaved; returns one row per window, in order.

    A run decodes one random prompt of `prompt_tokens` tokens, or each of `messages` (chat
    turns); its tok/s is all tokens generated over all decode time."""
    if runs < 1 or max_new < 1 or prompt_tokens < 1:
        raise StrataError("--runs, --max-new and --prompt-tokens must be at least 1")
    if max_new < 2:  # the first token is sampled from the prompt's logits
        raise StrataError(f"--max-new {max_new} runs no decode step, so there is no decode "
                          "speed to measure; give at least 2")
    if messages and not all(m.strip() for m in messages):
        raise StrataError("--prompt is empty; give a message")
    model = load_model(model_path)
    decoders = {t: SpecDecoder.with_mtp(model, t, draft_vocab) for t in specs if t}
    experts = DirectExperts(model.experts, model.transformer.backend)  # decoded once: every run warm
    for d in decoders.values():
        d.always = always
    tok = model.tokenizer
    chats = [
        tok.encode(tok.render_chat([{"role": "user", "content": m}], add_generation_prompt=True))
        for m in messages or []
    ]
    regular = np.nonzero(np.asarray(tok.token_types) == TokenType.NORMAL)[0]
    rows = {t: BenchRow(t) for t in specs}
    for r in range(runs):
        rng = np.random.default_rng([seed, r])
        prompts = chats or [[int(t) for t in rng.choice(regular, prompt_tokens)]]
        outputs: dict[int, list[list[int]]] = {}
        for t in specs:
            row, generated, decode_s = rows[t], 0, 0.0
            outputs[t] = []
            for prompt in prompts:
                session = Session(model, len(prompt) + max_new + 8, kv, experts=experts)
                timing = Timing()
                if t == 0:
                    gen = generate(session, prompt, max_new, params, timing=timing)
                else:
                    gen = generate(session, prompt, max_new, params, timing=timing, spec=decoders[t])
                outputs[t].append(list(gen))
                if timing.decoded:
                    generated, decode_s = generated + timing.generated, decode_s + timing.decode_s
                row.offered += timing.drafts_offered
                row.accepted += timing.drafts_accepted
                row.spec_steps += timing.spec_steps
                row.drafted_steps += timing.drafted_steps
                for k, n in timing.accepted_hist.items():
                    row.hist[k] = row.hist.get(k, 0) + n
            row.tok_s.append(generated / decode_s if decode_s > 0 else 0.0)
        if 0 in outputs:
            for t in specs:
                same = outputs[t] == outputs[0]
                rows[t].same_as_plain = (
                    same if rows[t].same_as_plain is None else (rows[t].same_as_plain and same)
                )
    return [rows[t] for t in specs]


def format_table(rows: list[BenchRow]) -> str:
    """A Markdown table of the rows."""
    lines = [
        (
            "| spec T | decode tok/s (median) | range | acceptance | mean accepted / step "
            "| accepted-length histogram | drafted steps | same tokens as spec 0 |"
        ),
        "|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in rows:
        med = statistics.median(row.tok_s)
        rng = f"{min(row.tok_s):.1f}-{max(row.tok_s):.1f}"
        if row.spec:
            acc = f"{100 * row.acceptance:.1f}% ({row.accepted}/{row.offered})"
            mean = f"{row.mean_accepted:.2f}"
            hist = " ".join(f"{k}:{n}" for k, n in sorted(row.hist.items()))
            drafted = f"{100 * row.drafted_steps / max(1, row.spec_steps):.0f}%"
        else:
            acc = mean = hist = drafted = "-"
        same = {None: "-", True: "yes", False: "NO"}[row.same_as_plain]
        lines.append(
            f"| {row.spec} | {med:.1f} | {rng} | {acc} | {mean} | {hist} | {drafted} | {same} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    specs = parse_specs(args.spec)
    rows = bench(
        resolve_model(args.model),
        specs,
        args.runs,
        args.max_new,
        args.prompt_tokens,
        sampling_params(args),
        args.draft_vocab,
        args.kv,
        args.seed,
        args.prompt,
        args.spec_always,
    )
    print(format_table(rows))
    return 0
