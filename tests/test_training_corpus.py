"""The demo model's conversation corpus (issue 29): multi-turn chats rendered as the engine
renders them, the persona, unknown words with "did you mean", long pastes, synonym lists
without repeats, and the acceptance sets and scores (no model, no PyTorch)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from tests.test_training import DATA_ADJ, DATA_NOUN, INDEX_ADJ, INDEX_NOUN
from training import acceptance, conversations, corpus, data, persona, unknown, wordnet
from training.pastes import PasteMaker

# A few more everyday nouns than test_training's fixture: typos need neighbours to be named.
DATA_NOUN_MORE = DATA_NOUN + """\
02084071 05 n 02 dog 0 domestic_dog 0 001 @ 09448361 n 0000 | a member of the genus Canis; "the dog barked all night"
03544360 06 n 01 house 0 000 | a dwelling that serves as living quarters for one or more families; "he has a house on Cape Cod"
03546340 06 n 01 horse 0 000 | solid-hoofed herbivorous quadruped domesticated since prehistoric times
14845743 27 n 02 water 0 H2O 0 000 | binary compound that occurs at room temperature as a clear colorless odorless tasteless liquid
03546341 06 n 01 hose 0 000 | a flexible pipe for conveying a liquid or gas
"""
INDEX_NOUN_MORE = INDEX_NOUN + """\
dog n 1 1 @ 1 9 02084071
house n 1 0 1 30 03544360
horse n 1 0 1 12 03546340
water n 1 0 1 40 14845743
hose n 1 0 1 2 03546341
watercourse n 1 0 1 3 09448361
"""


@pytest.fixture(scope="module")
def wn(tmp_path_factory: pytest.TempPathFactory) -> wordnet.WordNet:
    d = tmp_path_factory.mktemp("wordnet")
    files = {"data.noun": DATA_NOUN_MORE, "data.adj": DATA_ADJ,
             "index.noun": "".join(sorted(INDEX_NOUN_MORE.splitlines(keepends=True))),
             "index.adj": INDEX_ADJ}
    for name in wordnet.FILES:
        (d / name).write_text(files.get(name, ""), encoding="utf-8")
    return wordnet.load(d)


@pytest.fixture(scope="module")
def sp(wn: wordnet.WordNet) -> unknown.Speller:
    return unknown.Speller(wn)


def _tok():
    from training.tokenizer import tokenizer_of, train_vocab

    texts = ["river (noun): a large natural stream of water", "What does 'river' mean?",
             "I don't know the word 'hous'. Did you mean 'house'?", "hello", "Synonyms of dog?"]
    return tokenizer_of(train_vocab(texts * 50, 600))


def test_synonym_lists_never_repeat_nor_name_the_asked_word(wn: wordnet.WordNet) -> None:
    assert corpus.distinct(["Big", "big", "large", "Large", "great"], "big") == ["large", "great"]
    rng = random.Random(0)
    replies = {p.lemma: p.reply for w in wn.senses for p in corpus.pairs_for(wn, w, rng)
               if p.kind == "synonym"}  # fmt: skip
    assert replies["river"] == "WordNet gives no other word for 'river'."  # no invention
    assert replies["dog"] == "Words like 'dog': domestic dog."
    listed = replies["hello"].split(": ", 1)[1].rstrip(".").split(", ")
    assert "hello" not in listed and len(listed) == len(set(listed))


def test_did_you_mean_names_the_most_used_lemma_one_edit_away(sp: unknown.Speller) -> None:
    assert unknown.distance("hous", "house") == 1 and unknown.distance("hosue", "house") == 1
    assert unknown.distance("kitten", "sitting") == 3
    assert sp.suggest("hous") == "house"  # 'hose' is one edit away too, but used less
    assert sp.suggest("watr") == "water" and sp.suggest("dgo") == "dog"
    assert sp.suggest("zzzz") is None
    assert sp.suggest("watercourze") == "watercourse"
    assert sp.suggest("watrcourze") == "watercourse"  # a long word: two edits away
    assert sp.suggest("hoxxe") is None  # a short one: two edits is too far
    assert unknown.reply("hous", "house") == "I don't know the word 'hous'. Did you mean 'house'?"
    assert unknown.reply("bonjour", None) == "I don't know the word 'bonjour'."


def test_nonwords_are_never_lemmas_and_split_train_from_eval(wn: wordnet.WordNet,
                                                              sp: unknown.Speller) -> None:
    train = list(unknown.nonwords(wn, sp, 300, random.Random(0)))
    evals = list(unknown.nonwords(wn, sp, 60, random.Random(0), for_eval=True))
    words = [w for w, _ in train]
    once = [w for w, how in train if how != "foreign"]  # the ~100 foreign words come back
    assert len(set(once)) == len(once) and not any(sp.is_lemma(w) for w in words)
    assert len({w for w, _ in evals}) == len(evals), "an evaluation word is asked once"
    assert {how for _, how in train} == {"typo", "made-up", "foreign"}
    assert not {w for w, _ in evals} & set(words)
    assert all(unknown.eval_only(w) for w, _ in evals) and not any(unknown.eval_only(w) for w in words)
    assert "chat" not in unknown.foreign_words(sp) or not sp.is_lemma("chat")
    pairs = unknown.pairs(wn, sp, 50, random.Random(1), corpus.DEFINE)
    assert all(p.reply.startswith(f"I don't know the word '{p.lemma}'.") for p in pairs)
    assert all(p.lemma in p.user.lower() for p in pairs)


def _typo_sources(wn: wordnet.WordNet) -> list[str]:
    return sorted(w for w, n in wn.tagged.items() if n and w.isalpha() and len(w) >= 4)


def test_every_everyday_lemma_has_a_typo_in_the_pool(wn: wordnet.WordNet,
                                                     sp: unknown.Speller) -> None:
    sources = _typo_sources(wn)
    assert len(sources) == 8  # house, horse, water, hose, watercourse, river, hello, happy
    pool = unknown.pairs(wn, sp, len(sources), random.Random(3), corpus.DEFINE)
    typos = [p.lemma for p in pool if p.kind == "unknown-typo"]
    for lemma in sources:
        near = [t for t in typos if unknown.distance(t, lemma) == 1]
        assert near, f"no typo of {lemma!r} in {typos}"
    assert not any(sp.is_lemma(t) or unknown.eval_only(t) for t in typos)
    for p in pool:  # answered with the most used lemma one edit away, as before
        assert p.reply == unknown.reply(p.lemma, sp.suggest(p.lemma)) and "Did you mean" in p.reply
    with pytest.raises(ValueError, match="8 everyday lemmas"):
        unknown.pairs(wn, sp, len(sources) - 1, random.Random(3), corpus.DEFINE)


def test_the_unknown_count_is_fixed_whatever_the_dictionary_pairs(
        wn: wordnet.WordNet, tmp_path: Path) -> None:
    small = _small_wordnet(tmp_path)  # test_training's synsets: fewer pairs, fewer typos to make
    for n in (20, 40):  # at least the cover: 2 typos of each of the 8 everyday lemmas
        mix = conversations.Mix(n_unknown=n, persona_each=1)
        counts = []
        for w in (wn, small):
            items = conversations.exchanges(w, 0, mix)
            odd = [p for p in items if data.kind_of(p) == "unknown"]
            counts.append((len(odd), len(items) - len(odd)))
        assert [c[0] for c in counts] == [n, n]
        assert counts[0][1] > counts[1][1]  # the dictionary pairs differ; the count does not


def _small_wordnet(d: Path) -> wordnet.WordNet:
    files = {"data.noun": DATA_NOUN, "data.adj": DATA_ADJ, "index.noun": INDEX_NOUN,
             "index.adj": INDEX_ADJ}
    for name in wordnet.FILES:
        (d / name).write_text(files.get(name, ""), encoding="utf-8")
    return wordnet.load(d)


def test_no_persona_message_is_an_evaluation_message() -> None:
    asked = conversations.PERSONA_ASKS
    wanted = ("Set a timer for 5 minutes", "Book me a flight", "Write a haiku", "howdy",
              "yo what's up", "hey bot", "who made you", "what are you")
    assert {conversations.norm(w) for w in wanted} <= asked  # imperatives, slang, itself
    evaluation = {conversations.norm(m) for m in acceptance.persona_messages()}
    assert len(evaluation) == 50 and not asked & evaluation
    assert conversations.norm("Hey, what's up?") == conversations.norm("hey what's up")
    rng = random.Random(0)
    for kind, messages in persona.MESSAGES.items():
        assert len(messages) >= 100, f"{kind}: {len(messages)} shapes"
        met = {m for m in messages if conversations.norm(m) in evaluation}
        assert not met, f"{kind}: {sorted(met)}"
        for m in rng.sample(messages, 50):  # as typed: case and end punctuation only
            assert conversations.norm(persona.typed(m, rng)) == conversations.norm(m)
    assert asked == {conversations.norm(m) for ms in persona.MESSAGES.values() for m in ms}


def test_a_suggestion_is_a_question_the_corpus_answers(wn: wordnet.WordNet) -> None:
    rng = random.Random(0)
    answers: dict[str, dict[str, str]] = {}  # lemma -> kind -> the corpus's reply
    for w in wn.senses:
        for p in corpus.pairs_for(wn, w, rng):
            answers.setdefault(w, {})[p.kind] = p.reply
    forms = {  # a suggested question -> the kind of pair the corpus must hold for its word
        r"opposite of '([^']+)'": "antonym",
        r"What is an? ([a-z ]+)\?": "kind",
        r"Synonyms of ([a-z ]+)\?|A word like '([^']+)'": "synonym",
        r"Use '([^']+)' in a sentence": "example",
    }
    seen = dict.fromkeys(forms.values(), 0)
    for p in persona.pairs(conversations.suggestable(wn), 30, rng):
        for pattern, kind in forms.items():
            m = re.search(pattern, p.reply)
            if m:
                word = next(g for g in m.groups() if g)
                answer = answers[word].get(kind, "")
                assert answer and not answer.startswith("WordNet gives no"), p.reply
                seen[kind] += 1
    assert all(seen.values()), seen  # every form was suggested, only where it works
    pool = dict(conversations.suggestable(wn))
    assert pool["happy"] == ("define", "antonym", "example")  # no other word for 'happy'
    assert pool["river"] == ("define", "kind", "example")


def test_persona_replies_say_what_it_is_and_suggest_a_real_lemma(wn: wordnet.WordNet) -> None:
    pool = conversations.suggestable(wn)
    assert pool and all(w in wn.senses and not corpus.held_out(wn, w) for w, _ in pool)
    assert "hello" not in dict(pool)  # a persona message is not suggested as a word
    pairs = persona.pairs(pool, 20, random.Random(0))
    assert {p.kind for p in pairs} == {f"persona-{k}" for k in persona.ASKS}
    assert len({p.reply for p in pairs}) > len(pairs) // 2  # varied
    for p in pairs:
        assert acceptance.persona_ok(p.reply), p.reply
        assert f"'{p.lemma}'" in p.reply or f" {p.lemma}" in p.reply


def test_a_paste_reply_names_a_lemma_that_occurs_in_it(wn: wordnet.WordNet) -> None:
    maker = PasteMaker(wn)
    rng = random.Random(0)
    for style in ("licence", "code", "prose"):
        text = maker.text(style, 3000, rng)
        assert len(text) >= 3000
        lemma = maker.lemma_in(text, rng)
        assert lemma in wn.senses and lemma in text.lower()
    p = maker.pair(rng, 500, 2000)
    assert p.kind.startswith("paste-") and "long" in p.reply
    named = acceptance.SUGGESTS.search(p.reply) or "'" in p.reply
    assert named


def test_conversations_hold_every_kind_and_are_deterministic(wn: wordnet.WordNet) -> None:
    mix = conversations.Mix(n_unknown=30, persona_each=3, paste_share=0.3)
    a = conversations.build(wn, 0, mix)
    assert a == conversations.build(wn, 0, mix)  # the same seed, the same corpus
    assert a != conversations.build(wn, 1, mix)
    families = {data.kind_of(p) for c in a for p in c}
    assert {"define", "persona", "unknown", "paste"} <= families
    assert all(1 <= len(c) <= mix.max_turns + 1 for c in a)
    assert any(len(c) >= mix.min_turns for c in a)
    users = {conversations.norm(p.user) for c in a for p in c if not p.kind.startswith("persona")}
    assert not users & conversations.PERSONA_ASKS  # 'hello' is a greeting, not a definition
    held = set(corpus.lemmas(wn, "heldout"))
    assert not any(p.lemma in held for c in a for p in c if data.kind_of(p) in corpus.KINDS)


def test_conversations_render_and_encode_as_the_engine_does(wn: wordnet.WordNet) -> None:
    tok = _tok()
    convs = [c for c in conversations.build(wn, 0, conversations.Mix(n_unknown=30, paste_share=0.5))
             if len(c) >= 3][:4]
    enc = data.encode(tok, convs)
    assert enc.n_conversations == 4
    for i, conv in enumerate(convs):
        text = "".join(t for p in conv for t in data.render(p))
        assert text == tok.render_chat(data.messages(conv), add_generation_prompt=False)
        ids = enc.ids[enc.starts[i] : enc.starts[i + 1]].tolist()
        assert ids == tok.encode(text)  # the parts' ids are the whole text's ids
        mask = enc.mask[enc.starts[i] : enc.starts[i + 1]]
        prompt = tok.render_chat(data.messages(conv)[:-1], add_generation_prompt=True)
        n_prompt = len(tok.encode(prompt))
        assert mask[n_prompt:-1].all() and not mask[-1]  # the last reply, not its '\n'
        assert tok.decode(np.asarray(ids)[mask].tolist()) == "".join(
            p.reply + "<|im_end|>" for p in conv)  # every reply carries the loss


def test_an_epoch_packs_whole_conversations_from_their_start(wn: wordnet.WordNet) -> None:
    tok = _tok()
    convs = conversations.build(wn, 0, conversations.Mix(n_unknown=30, paste_share=0.0))
    enc = data.encode(tok, convs)
    pad = tok.n_vocab - 3  # <|endoftext|>
    seq = int(np.diff(enc.starts).max()) + 40
    ids, mask = data.epoch(enc, seq, np.random.default_rng(0), pad)
    assert ids.shape[1] == seq and mask.sum() == enc.mask.sum()  # no reply lost or doubled
    im_start = tok.encode("<|im_start|>")[0]
    assert (ids[:, 0] == im_start).all()  # a row starts a conversation
    assert not mask[ids == pad].any()
    again, _ = data.epoch(enc, seq, np.random.default_rng(0), pad)
    assert (again == ids).all()


def test_statistics_count_every_exchange(wn: wordnet.WordNet) -> None:
    p = data.prepare(wn, 0, 2, 600, conversations.Mix(n_unknown=50, persona_each=2, paste_share=0.2))
    s = p.stats
    assert len(p.encoded) == 2 and p.vocab.n_vocab == 600
    assert s["exchanges"] == sum(s["by_kind"].values()) == sum(s["by_family"].values())
    assert s["by_family"]["unknown"] == 50
    assert sum(s["tokens_by_family"].values()) == s["tokens"]
    assert s["tokens_by_family"].keys() == s["by_family"].keys()
    assert s["conversations"] == sum(s["turns"].values())
    assert s["tokens"] == len(p.encoded[0].ids) > s["loss_tokens"] > 0


def test_scores_read_replies_as_the_issue_counts_them(sp: unknown.Speller) -> None:
    gloss = "a large natural stream of water (larger than a creek)"
    assert acceptance.first_content_word(gloss) == "large"
    assert acceptance.definition_hit("river (noun): a large natural stream", gloss)
    assert not acceptance.definition_hit("river (noun): a body of water", gloss)
    assert acceptance.persona_ok("Hello! I'm a small dictionary model trained on WordNet.")
    assert acceptance.persona_ok("I can't write stories. Try: What does 'river' mean?")
    assert not acceptance.persona_ok("hello (noun): an expression of greeting; try 'hi'")
    assert not acceptance.persona_ok("tell za is a good story.")
    assert acceptance.is_definition("tell za (noun): informal terms for money")
    assert acceptance.says_unknown("I don't know the word 'hous'. Did you mean 'house'?")
    assert not acceptance.says_unknown("beautifull (verb): provide with an outdoor lamp")
    assert acceptance.suggested("I don't know the word 'hous'. Did you mean 'House'?") == "house"
    assert acceptance.suggestion_ok("Did you mean 'house'?", "hosue", sp.is_lemma)
    assert acceptance.suggestion_ok("Did you mean 'hose'?", "hosue", sp.is_lemma)  # one edit
    assert not acceptance.suggestion_ok("Did you mean 'horse'?", "hosue", sp.is_lemma)  # two
    assert not acceptance.suggestion_ok("Did you mean 'housse'?", "hous", sp.is_lemma)  # no lemma
    assert not acceptance.suggestion_ok("I don't know the word 'hous'.", "hous", sp.is_lemma)


def test_the_evaluation_persona_messages_are_never_trained_on(wn: wordnet.WordNet) -> None:
    messages = acceptance.persona_messages()
    assert len(messages) == 50 == len(set(messages))
    trained = conversations.PERSONA_ASKS | {
        conversations.norm(p.user) for c in conversations.build(wn, 0) for p in c}
    assert not {conversations.norm(m) for m in messages} & trained


def test_measure_sets_are_seeded_and_disjoint(wn: wordnet.WordNet, sp: unknown.Speller) -> None:
    rng = random.Random(0)
    turns = acceptance.history(wn, PasteMaker(wn), lambda t: len(t) // 4, rng, ["river"])
    assert len(turns) == 3 and sum(len(t.user) > 400 for t in turns) == 1
    paste = next(t for t in turns if len(t.user) > 400)
    assert len(paste.user) // 4 <= acceptance.PASTE_TOKENS
    assert all("'river'" not in t.user for t in turns)
    words = acceptance.nonword_set(wn, sp, 30)
    assert words == acceptance.nonword_set(wn, sp, 30)
    assert all(not sp.is_lemma(w) and e == sp.suggest(w) for w, _, e in words)


def test_the_real_wordnet_if_present() -> None:
    deb = Path("/var/cache/apt/archives/wordnet-base_1%3a3.0-37_all.deb")
    if not deb.exists():
        pytest.skip("wordnet-base is not in the apt cache")
    big = wordnet.load(deb)
    s = unknown.Speller(big)
    assert s.suggest("beautifull") == "beautiful" and s.suggest("recieve") == "receive"
    assert not s.is_lemma("wasser") and "bonjour" in unknown.foreign_words(s)
    seen: set[str] = set()
    cover = unknown.typo_cover(big, s, random.Random(0), seen)
    sources = _typo_sources(big)
    assert len(cover) == len(sources) == len(seen) > 16_000 and conversations.Mix().n_unknown >= len(cover)
    assert all(unknown.distance(t, w) == 1 for t, w in zip(cover, sources, strict=True))
    assert not any(s.is_lemma(t) or unknown.eval_only(t) for t in cover)


def test_encoding_in_batches_gives_the_same_ids(wn: wordnet.WordNet,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _tok()
    convs = conversations.build(wn, 0, conversations.Mix(n_unknown=30, paste_share=0.3))[:9]
    whole = data.encode(tok, convs)
    monkeypatch.setattr(data, "ENCODE_BATCH", 2)
    parts = data.encode(tok, convs)
    assert (parts.ids == whole.ids).all() and (parts.mask == whole.mask).all()
    assert (parts.starts == whole.starts).all() and parts.n_conversations == 9
