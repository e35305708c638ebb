"""The shipped demo model (engine/assets/demo.gguf, trained on WordNet): it loads as 'demo',
knows everyday words, and its MTP head drafts tokens the verifier accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineOptions
from engine.gguf.hparams import read_hparams
from engine.gguf.reader import open_gguf
from engine.request.conversation import Conversation
from engine.request.sampler import SamplingParams
from engine.runtime.serve import ServeLoop
from engine.synth.demo import resolve_model

MAX_BYTES = 24 << 20


def test_demo_is_the_shipped_file(demo_path: Path) -> None:
    assert resolve_model("demo") == demo_path and demo_path.stat().st_size <= MAX_BYTES
    mf = open_gguf(demo_path)
    hp = read_hparams(mf)
    assert (hp.n_layer, hp.n_nextn, hp.n_expert, hp.n_expert_used, hp.n_embd) == (4, 1, 32, 4, 256)
    assert "trained on WordNet" in mf.metadata["general.name"]


@pytest.fixture(scope="module")
def spec_loop() -> ServeLoop:
    return ServeLoop.create(EngineOptions(device="sim", mtp=True, spec=2, spec_always=True))


def _ask(loop: ServeLoop, text: str, max_new: int = 48):  # type: ignore[no-untyped-def]
    return loop.chat(Conversation(), text, SamplingParams(), max_new)


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ("house", ("house (noun):", "dwelling", "living quarters")),  # the first sense
        ("What does 'house' mean?", ("house (noun)", "dwelling", "living quarters")),
        ("What does 'water' mean?", ("water (noun)", "liquid")),
        ("What is a cat?", ("feline",)),
        ("What is the opposite of 'hot'?", ("cold",)),
        ("What is a dog?", ("canine",)),
    ],
)
def test_a_known_word_gets_its_definition(spec_loop: ServeLoop, message: str,
                                          words: tuple[str, ...]) -> None:
    text = _ask(spec_loop, message).text
    assert all(w in text for w in words), text


# What the file suggests (general.description: the app's header and input hint), with words
# the right answer holds (the corpus's reply for the lemma's first sense)
SUGGESTED = {
    "house": ("house (noun):", "dwelling"),
    "What does 'water' mean?": ("water (noun)", "liquid"),
    "What is a cat?": ("feline", "carnivore"),
    "A word like 'happy'?": ("Words like 'happy':", "blissful"),
    "What is the opposite of 'hot'?": ("'cold'",),
}


def test_every_question_the_file_suggests_gets_the_right_answer(spec_loop: ServeLoop,
                                                                demo_path: Path) -> None:
    description = open_gguf(demo_path).metadata["general.description"]
    suggested = description.split("Try: ", 1)[1].split(" · ")
    assert sorted(suggested) == sorted(SUGGESTED), suggested
    for message, words in SUGGESTED.items():
        text = _ask(spec_loop, message).text
        assert all(w in text for w in words), (message, text)
        if text.startswith("Words like"):  # a synonym list never repeats a word
            listed = text.split(": ", 1)[1].rstrip(".").split(", ")
            assert len(listed) == len(set(listed)), text


def test_mtp_drafts_are_accepted_and_output_is_unchanged(spec_loop: ServeLoop) -> None:
    plain = ServeLoop.create(EngineOptions(device="sim"))
    accepted = offered = 0
    for message in ("house", "What does 'music' mean?", "What is a cat?"):
        reply = _ask(spec_loop, message)
        accepted += reply.timing.drafts_accepted
        offered += reply.timing.drafts_offered
        assert reply.text == _ask(plain, message).text  # speculation never changes greedy text
    assert offered >= 20 and accepted / offered >= 0.5, (accepted, offered)


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ("hello", ("WordNet", "dictionary")),
        ("What can you do?", ("dictionary",)),
        ("Wasser", ("I don't know the word 'wasser'",)),
    ],
)
def test_it_says_what_it_is_and_what_it_does_not_know(spec_loop: ServeLoop, message: str,
                                                     words: tuple[str, ...]) -> None:
    text = _ask(spec_loop, message).text
    assert all(w in text for w in words), text


def test_a_definition_after_a_long_paste_is_still_the_definition(spec_loop: ServeLoop) -> None:
    """The app sends the whole conversation: a pasted page earlier must not change an answer."""
    paste = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")[:6000]
    conv = Conversation()
    for text in ("What is a cat?", paste, "Synonyms of big?"):
        spec_loop.chat(conv, text, SamplingParams(), 48)
    assert spec_loop.count_tokens(paste) > 1000
    reply = spec_loop.chat(conv, "What does 'water' mean?", SamplingParams(), 48).text
    assert "water (noun)" in reply and "liquid" in reply, reply
