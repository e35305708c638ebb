"""The demo model's acceptance figures, measured with the engine itself on the CPU.

1. Definitions: for `n` training lemmas (a seeded sample), does the greedy reply to
   "What does 'X' mean?" contain the first content word of the lemma's first gloss?
   Ten held-out lemmas' replies are printed verbatim.
2. Drafts: the share of MTP-drafted tokens the verifier accepts over 50 replies at
   `--spec 2`, and per draft position at `--spec 4` (drafting every step).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from engine.config import EngineOptions
from engine.conversation import Conversation
from engine.sampler import SamplingParams
from engine.serve import ServeLoop
from training import corpus, wordnet

STOP_WORDS = (
    "a an the of or and to in on by for as at with from that which who any some one its it "
    "be is are being having has have not no into out up usually especially e.g. etc"
)
STOP = frozenset(STOP_WORDS.split(" "))
QUESTION = "What does '{w}' mean?"


def first_content_word(definition: str) -> str:
    for word in re.findall(r"[A-Za-z][A-Za-z'-]*", definition):
        if word.lower() not in STOP:
            return word.lower()
    return definition.split()[0].lower() if definition.split() else ""


def _loop(model: str, spec: int) -> ServeLoop:
    options = EngineOptions(model=model, device="sim", mtp=spec > 0, spec=spec, spec_always=True)
    return ServeLoop.create(options)


def ask(loop: ServeLoop, text: str, max_new: int = 64) -> tuple[str, object]:
    reply = loop.chat(Conversation(), text, SamplingParams(), max_new)
    return reply.text, reply.timing


def main(model: str, wordnet_path: Path, n: int, json_out: Path | None) -> int:
    wn = wordnet.load(wordnet_path)
    rng = random.Random(1234)
    train = rng.sample(corpus.lemmas(wn, "train"), n)
    heldout = rng.sample(corpus.lemmas(wn, "heldout"), 10)
    loop = _loop(model, 2)
    hits, accepted, offered, rows = 0, 0, 0, []
    for i, w in enumerate(train):
        gloss = wn.synsets[wn.senses[w][0]].definition
        want = first_content_word(gloss)
        text, timing = ask(loop, QUESTION.format(w=w))
        ok = want in text.lower()
        hits += ok
        if i < 50:
            accepted += timing.drafts_accepted
            offered += timing.drafts_offered
        rows.append({"lemma": w, "want": want, "ok": ok, "reply": text})
    print(f"definitions: {hits} of {n} replies hold the gloss's first content word "
          f"({100 * hits / n:.1f}%)")
    print(f"drafts at --spec 2 over 50 replies: {accepted} of {offered} accepted "
          f"({100 * accepted / max(1, offered):.1f}%)")
    print("held-out lemmas (never trained on as a subject), verbatim:")
    held = []
    for w in heldout:
        gloss = wn.synsets[wn.senses[w][0]].definition
        text, _ = ask(loop, QUESTION.format(w=w))
        held.append({"lemma": w, "gloss": gloss, "reply": text})
        print(f"  {QUESTION.format(w=w)}\n    reply: {text}\n    gloss: {gloss}")
    loop4 = _loop(model, 4)
    hist: dict[int, int] = {}
    for w in train[:50]:
        _, timing = ask(loop4, QUESTION.format(w=w))
        for k, c in timing.accepted_hist.items():
            hist[k] = hist.get(k, 0) + c
    windows = sum(hist.values())
    per_pos = [sum(c for k, c in hist.items() if k > j) / max(1, windows) for j in range(3)]
    print("--spec 4 over 50 replies: windows by drafts accepted " + json.dumps(dict(sorted(hist.items())))
          + "; accepted at position 1, 2, 3: " + ", ".join(f"{100 * p:.1f}%" for p in per_pos))
    if json_out:
        json_out.write_text(json.dumps({
            "definitions": {"n": n, "hits": hits, "rows": rows},
            "spec2": {"accepted": accepted, "offered": offered},
            "spec4": {"hist": hist, "per_position": per_pos}, "heldout": held,
        }, indent=1))
    return 0
