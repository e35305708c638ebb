"""Decode speed of `--mtp --spec 2` against plain decoding on long engines: one engine per
configuration serves one prompt after another, as a chat or a server does (`strata bench`
builds a fresh engine for every run instead). `python -m scripts.spec_vs_plain [--model
random-demo] [--rounds 5]`; docs/spec-decoding.md.

Each round gives every configuration a prompt of `--prompt-tokens` random tokens, shifted by
a few tokens each round so nothing is reused, and `--max-new` new tokens; rounds interleave the
configurations after one short warm-up request each. Prints TG's median and range and the
drafted steps of every run.
"""

from __future__ import annotations

import argparse
import statistics

from engine.config import EngineOptions
from engine.runtime.serve import ServeLoop
from engine.tools.bench import prompt_tokens

CONFIGS = {
    "--mtp --spec 2 --cache-lend": {"mtp": True, "spec": 2, "cache_lend": True},
    "--mtp --spec 2": {"mtp": True, "spec": 2},
    "no MTP": {},
}


def run(model: str, n_prompt: int, max_new: int, rounds: int, device: str = "sim"
        ) -> dict[str, list[tuple[float, int]]]:
    """Per configuration, per round: (TG tok/s, drafted steps)."""
    loops = {name: ServeLoop.create(EngineOptions(model=model, device=device,
                                                  ctx=n_prompt + rounds * 8 + max_new + 64,
                                                  **kw))
             for name, kw in CONFIGS.items()}
    try:
        ids = prompt_tokens(next(iter(loops.values())), n_prompt + rounds * 8)
        for loop in loops.values():
            loop.complete(ids[:256], max_new=24)  # warm-up
        out: dict[str, list[tuple[float, int]]] = {name: [] for name in loops}
        for r in range(rounds):
            for name, loop in loops.items():
                t = loop.complete(ids[r * 8 : r * 8 + n_prompt], max_new=max_new).timing
                out[name].append((t.tg_tok_s, t.drafted_steps))
        return out
    finally:
        for loop in loops.values():
            loop.close()


def markdown(results: dict[str, list[tuple[float, int]]]) -> str:
    lines = ["| one engine per configuration | TG (tok/s), median (range) | drafted steps a run |",
             "|---|---:|---|"]
    for name, runs in results.items():
        tg = sorted(x for x, _ in runs)
        drafted = ", ".join(str(d) for _, d in runs) if CONFIGS[name].get("mtp") else "-"
        lines.append(f"| {name} | {statistics.median(tg):.1f} ({tg[0]:.1f}-{tg[-1]:.1f}) | "
                     f"{drafted} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random-demo")
    ap.add_argument("--device", default="sim")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    print(markdown(run(args.model, args.prompt_tokens, args.max_new, args.rounds, args.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
