"""`python -m training build|eval|plot`: rebuild the demo model, measure it, draw its loss.

    python -m training build --wordnet wordnet-base.deb --out demo.gguf --steps N   # GPU
    python -m training eval --model demo.gguf --wordnet wordnet-base.deb           # CPU
    python -m training corpus --wordnet wordnet-base.deb --seed 0    # the data step's statistics
    python -m training plot --log loss.jsonl --out docs/demo-loss.svg
    python -m training pace --steps 30 --profile     # the training step's time, each variant (GPU)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="corpus -> tokenizer -> train (CUDA) -> GGUF")
    b.add_argument("--wordnet", type=Path, required=True, help="wordnet-base .deb or directory")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--steps", type=int, default=0, help="0: as many as fit --minutes")
    b.add_argument("--minutes", type=float, default=6.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--log-dir", type=Path, default=Path("out/train"))
    b.add_argument("--batch", type=int, default=16, help="sequences a step")
    b.add_argument("--seq-tokens", type=int, default=4096)
    b.add_argument("--device", default="cuda")
    b.add_argument("--also-q8", type=Path, help="also export with Q8_0 experts here")
    b.add_argument("--padded", action="store_true",
                   help="experts as one padded batch (default: jagged grouped GEMMs)")
    b.add_argument("--eager", action="store_true", help="the loss not compiled")
    pa = sub.add_parser("pace", help="the training step's time for each variant (GPU)")
    pa.add_argument("--steps", type=int, default=30)
    pa.add_argument("--batch", type=int, default=16)
    pa.add_argument("--seq-tokens", type=int, default=4096)
    pa.add_argument("--profile", action="store_true", help="also each variant's CUDA kernels")
    c = sub.add_parser("corpus", help="the data step alone: corpus statistics and its time")
    c.add_argument("--wordnet", type=Path, required=True)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--phrasings", type=int, default=1)
    e = sub.add_parser("eval", help="the acceptance figures of a model file (CPU)")
    e.add_argument("--model", default="demo")
    e.add_argument("--wordnet", type=Path, required=True)
    e.add_argument("--n", type=int, default=200)
    e.add_argument("--json", type=Path)
    e.add_argument("--everyday", action="store_true",
                   help="only definitions of --n everyday words (a quick comparison of builds)")
    pl = sub.add_parser("plot", help="loss.jsonl -> an SVG line plot")
    pl.add_argument("--log", type=Path, required=True)
    pl.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.cmd == "build":
        from training.train import Recipe, build

        also = {"Q8_0": a.also_q8} if a.also_q8 else None
        rec = build(a.wordnet, a.out, Recipe(seed=a.seed, steps=a.steps, minutes=a.minutes, batch=a.batch,
                                                    seq_tokens=a.seq_tokens, device=a.device,
                                                    grouped=not a.padded, compile=not a.eager),
                    a.log_dir, also)
        print(json.dumps(rec, indent=1))
    elif a.cmd == "pace":
        from training.pace import main as pace

        return pace(a.steps, a.batch, a.seq_tokens, a.profile)
    elif a.cmd == "corpus":
        from engine.synth.model import PRESETS
        from training import data, wordnet

        n_vocab = PRESETS["random-demo"].n_vocab  # the demo's (training.train.SPEC)
        prepared = data.prepare(wordnet.load(a.wordnet), a.seed, a.phrasings, n_vocab)
        print(json.dumps(prepared.stats, indent=1))
    elif a.cmd == "eval":
        from training.evaluate import everyday
        from training.evaluate import main as evaluate

        if a.everyday:
            return everyday(a.model, a.wordnet, a.n)
        return evaluate(a.model, a.wordnet, a.n, a.json)
    else:
        from training.plot import write_svg

        write_svg(a.log, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
