"""The demo model's acceptance figures, measured with the engine itself on the CPU.

The four measures of issue 29 (`training/acceptance.py` builds their sets and scores them):
definitions of held-out and training lemmas alone, the same questions as the 4th turn after
other words and a ~2,000-token paste, greetings and out-of-scope requests, non-words and
typos. Then the MTP drafts: the share the verifier accepts over 50 replies at `--spec 2`, and
per draft position at `--spec 4` (drafting every step).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from engine.config import EngineOptions
from engine.request.conversation import Conversation
from engine.request.sampler import SamplingParams
from engine.runtime.serve import ServeLoop
from training import acceptance, corpus, unknown, wordnet
from training.acceptance import QUESTION, rate
from training.pastes import PasteMaker

HISTORY_GROUP = 40  # measure 2: questions asked after one history (its KV read once)
MAX_NEW = 64


def _loop(model: str, spec: int) -> ServeLoop:
    options = EngineOptions(model=model, device="sim", mtp=spec > 0, spec=spec, spec_always=True)
    return ServeLoop.create(options)


def ask(loop: ServeLoop, text: str, conv: Conversation | None = None) -> tuple[str, object]:
    """The greedy reply to `text` (after `conv`'s messages, which it leaves as they were)."""
    conv = conv if conv is not None else Conversation()
    n = len(conv.messages)
    reply = loop.chat(conv, text, SamplingParams(), MAX_NEW)
    while len(conv.messages) > n:
        conv.pop()
    return reply.text, reply.timing


def definitions(loop: ServeLoop, wn: wordnet.WordNet, lemmas: dict[str, list[str]]) -> dict:
    """Measure 1 (and the drafts of the first 50 training questions)."""
    out: dict = {"drafts": {"accepted": 0, "offered": 0}}
    for split, words in lemmas.items():
        rows = []
        for i, w in enumerate(words):
            text, timing = ask(loop, QUESTION.format(w=w))
            gloss = acceptance.gloss(wn, w)
            rows.append({"lemma": w, "want": acceptance.first_content_word(gloss), "reply": text,
                         "ok": acceptance.definition_hit(text, gloss)})
            if split == "train" and i < 50:
                out["drafts"]["accepted"] += timing.drafts_accepted
                out["drafts"]["offered"] += timing.drafts_offered
        out[split] = {"hits": sum(r["ok"] for r in rows), "n": len(rows), "rows": rows}
    return out


def in_conversation(loop: ServeLoop, wn: wordnet.WordNet, lemmas: dict[str, list[str]]) -> dict:
    """Measure 2: each question as the 4th turn; HISTORY_GROUP questions share a history."""
    maker, rng = PasteMaker(wn), random.Random(4)
    out: dict = {}
    for split, words in lemmas.items():
        rows = []
        for g in range(0, len(words), HISTORY_GROUP):
            group = words[g : g + HISTORY_GROUP]
            conv = Conversation()
            for e in acceptance.history(wn, maker, loop.count_tokens,
                                        rng, group):
                conv.add("user", e.user)
                conv.add("assistant", e.reply)
            for w in group:
                text, _ = ask(loop, QUESTION.format(w=w), conv)
                rows.append({"lemma": w, "reply": text,
                             "ok": acceptance.definition_hit(text, acceptance.gloss(wn, w))})
        out[split] = {"hits": sum(r["ok"] for r in rows), "n": len(rows), "rows": rows}
    return out


def persona(loop: ServeLoop) -> dict:
    """Measure 3."""
    rows = []
    for m in acceptance.persona_messages():
        text, _ = ask(loop, m)
        rows.append({"message": m, "reply": text, "ok": acceptance.persona_ok(text),
                     "definition": acceptance.is_definition(text)})
    return {"hits": sum(r["ok"] for r in rows), "definitions": sum(r["definition"] for r in rows),
            "n": len(rows), "rows": rows}


def nonwords(loop: ServeLoop, wn: wordnet.WordNet, sp: unknown.Speller) -> dict:
    """Measure 4."""
    rows = []
    for word, how, expect in acceptance.nonword_set(wn, sp):
        text, _ = ask(loop, QUESTION.format(w=word))
        one_away = expect is not None and unknown.distance(word, expect) <= 1
        rows.append({"word": word, "how": how, "expect": expect, "reply": text,
                     "unknown": acceptance.says_unknown(text), "one_away": one_away,
                     "named": one_away and acceptance.suggestion_ok(text, word, sp.is_lemma)})
    near = [r for r in rows if r["one_away"]]
    return {"unknown": sum(r["unknown"] for r in rows), "n": len(rows), "one_away": len(near),
            "named": sum(r["named"] for r in near), "rows": rows}


def everyday(model: str, wordnet_path: Path, n: int) -> int:
    """Measure 1 on everyday words alone (`acceptance.everyday_lemmas`), printed: a quick
    comparison of two builds on what a new user asks first. Then "What is a X?" for the nouns
    among them: a reply scores when it names the first sense's first hypernym as the corpus
    does ("a kind of feline")."""
    wn = wordnet.load(wordnet_path)
    loop = _loop(model, 0)
    words = acceptance.everyday_lemmas(wn, n)
    hits = sum(acceptance.definition_hit(ask(loop, QUESTION.format(w=w))[0], acceptance.gloss(wn, w))
               for w in words)
    print(f"everyday words: {hits} of {len(words)} replies hold the gloss's first content word "
          f"({100 * rate(hits, len(words)):.1f}%)")
    chains = {w: c for w in words if (c := corpus.kinds_of(wn, w))}
    kinds = sum(f"kind of {c[0]}" in ask(loop, f"What is {corpus._article(w)} {w}?")[0]
                for w, c in chains.items())
    print(f"kinds: {kinds} of {len(chains)} 'What is a X?' replies name the first hypernym "
          f"({100 * rate(kinds, len(chains)):.1f}%)")
    return 0


def spec4(model: str, words: list[str]) -> dict:
    """Per-position draft acceptance at --spec 4 over `words`' definitions."""
    loop4 = _loop(model, 4)
    hist: dict[int, int] = {}
    for w in words:
        _, timing = ask(loop4, QUESTION.format(w=w))
        for k, c in timing.accepted_hist.items():
            hist[k] = hist.get(k, 0) + c
    windows = sum(hist.values())
    per_pos = [sum(c for k, c in hist.items() if k > j) / max(1, windows) for j in range(3)]
    return {"hist": hist, "per_position": per_pos}


def main(model: str, wordnet_path: Path, n: int, json_out: Path | None) -> int:
    """Every figure, printed; all replies in `json_out`."""
    wn = wordnet.load(wordnet_path)
    sp = unknown.Speller(wn)
    lemmas = acceptance.definition_lemmas(wn, n)
    loop = _loop(model, 2)
    m1 = definitions(loop, wn, lemmas)
    for split in lemmas:
        h, k = m1[split]["hits"], m1[split]["n"]
        print(f"1. {split}: {h} of {k} replies hold the gloss's first content word "
              f"({100 * rate(h, k):.1f}%)")
    d = m1["drafts"]
    print(f"drafts at --spec 2 over 50 replies: {d['accepted']} of {d['offered']} accepted "
          f"({100 * rate(d['accepted'], d['offered']):.1f}%)")
    m2 = in_conversation(loop, wn, lemmas)
    for split in lemmas:
        h, k = m2[split]["hits"], m2[split]["n"]
        single = rate(m1[split]["hits"], m1[split]["n"])
        print(f"2. {split} as turn {acceptance.TURN}: {h} of {k} ({100 * rate(h, k):.1f}%), "
              f"{100 * rate(h, k) / max(single, 1e-9):.0f}% of the single-turn score")
    m3 = persona(loop)
    print(f"3. persona: {m3['hits']} of {m3['n']} say what the model is or suggest a question "
          f"({100 * rate(m3['hits'], m3['n']):.0f}%); {m3['definitions']} definitions")
    m4 = nonwords(loop, wn, sp)
    print(f"4. non-words: {m4['unknown']} of {m4['n']} said unknown "
          f"({100 * rate(m4['unknown'], m4['n']):.0f}%); 'did you mean' named a lemma one edit "
          f"away in {m4['named']} of {m4['one_away']} ({100 * rate(m4['named'], m4['one_away']):.0f}%)")
    s4 = spec4(model, lemmas["train"][:50])
    print("--spec 4 over 50 replies: windows by drafts accepted "
          + json.dumps(dict(sorted(s4["hist"].items()))) + "; accepted at position 1, 2, 3: "
          + ", ".join(f"{100 * p:.1f}%" for p in s4["per_position"]))
    if json_out:
        json_out.write_text(json.dumps({"definitions": m1, "in_conversation": m2, "persona": m3,
                                        "nonwords": m4, "spec4": s4}, indent=1))
    return 0
