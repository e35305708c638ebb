"""The demo model's build recipe (training/): WordNet parsing, chat pairs, the tokenizer, the
training ids, and (where PyTorch is installed: the `train` extra) the PyTorch model against
the engine's forward pass."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.gguf.tokenizer import TokenType
from engine.synth.model import PRESETS
from engine.synth.vocab import SPECIAL_TOKENS
from training import corpus, data, wordnet
from training.tokenizer import train_vocab

# A few synsets in WordNet 3.0's own file formats (wndb(5WN)): offsets, pointers, glosses.
DATA_NOUN = """\
  1 This software and database is being provided to you, the LICENSEE, by Princeton
09448361 17 n 03 stream 0 watercourse 0 rill 0 001 @ 09225146 n 0000 | a natural body of running water flowing on or under the earth
09225146 17 n 02 body_of_water 0 water 0 000 | the part of the earth's surface covered with water
09411430 17 n 01 river 0 001 @ 09448361 n 0000 | a large natural stream of water (larger than a creek); "the river was navigable for 50 miles"
06632511 10 n 05 hello 0 hullo 0 hi 0 howdy 0 how-do-you-do 0 000 | an expression of greeting; "every morning they exchanged polite hellos"
"""
DATA_ADJ = """\
01148283 00 a 01 happy 0 002 ! 01149494 a 0101 & 01148283 a 0000 | enjoying or showing or marked by joy or pleasure; "a happy smile"
01149494 00 a 01 unhappy 0 001 ! 01148283 a 0101 | experiencing or marked by or causing sadness or sorrow or discontent
"""
INDEX_NOUN = """\
  1 This software and database is being provided to you, the LICENSEE, by Princeton
stream n 1 1 @ 1 0 09448361
body_of_water n 1 0 1 0 09225146
river n 1 1 @ 1 1 09411430
hello n 1 0 1 1 06632511
"""
INDEX_ADJ = """\
happy a 1 2 ! & 1 1 01148283
unhappy a 1 1 ! 1 0 01149494
"""


@pytest.fixture(scope="module")
def wn(tmp_path_factory: pytest.TempPathFactory) -> wordnet.WordNet:
    d = tmp_path_factory.mktemp("wordnet")
    files = {"data.noun": DATA_NOUN, "data.adj": DATA_ADJ, "index.noun": INDEX_NOUN,
             "index.adj": INDEX_ADJ}
    for name in wordnet.FILES:
        (d / name).write_text(files.get(name, ""), encoding="utf-8")
    return wordnet.load(d)


def test_wordnet_synsets_glosses_and_pointers(wn: wordnet.WordNet) -> None:
    river = wn.synsets[wn.senses["river"][0]]
    assert river.lemmas == ["river"] and river.pos == "n"
    assert river.definition == "a large natural stream of water (larger than a creek)"
    assert river.examples == ["the river was navigable for 50 miles"]
    assert river.hypernyms == [9448361]
    happy = wn.synsets[wn.senses["happy"][0]]
    assert happy.antonyms == [(1149494, 0)] and happy.similar == [1148283]
    assert wn.synsets[("n", 9225146)].lemmas == ["body of water", "water"]  # '_' -> ' '
    assert wn.tagged["river"] == 1 and wn.tagged["stream"] == 0


def test_a_deb_that_is_not_one_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "wordnet.deb"
    bad.write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="not a .deb"):
        wordnet.read_files(bad)


def test_pairs_use_the_first_sense_and_the_dictionary_words(wn: wordnet.WordNet) -> None:
    import random

    pairs = list(corpus.pairs_for(wn, "river", random.Random(0)))
    kinds = [p.kind for p in pairs]
    assert kinds.count("define") == corpus.COMMON_DEFINE_COPIES  # 'river' is sense-tagged
    define = next(p for p in pairs if p.kind == "define")
    assert define.reply == (
        "river (noun): a large natural stream of water (larger than a creek); "
        "'the river was navigable for 50 miles'"
    )
    kind = next(p for p in pairs if p.kind == "kind")
    assert kind.reply == "A river is a kind of stream, itself a kind of body of water."
    assert next(p for p in pairs if p.kind == "example").reply == (
        "The river was navigable for 50 miles."
    )
    happy = {p.kind: p.reply for p in corpus.pairs_for(wn, "happy", random.Random(0))}
    assert happy["antonym"].startswith("The opposite of 'happy' is 'unhappy': experiencing")
    hello = {p.kind: p.reply for p in corpus.pairs_for(wn, "hello", random.Random(0))}
    assert hello["synonym"] == "Words like 'hello': hullo, hi, howdy, how-do-you-do."


def test_held_out_lemmas_are_rare_and_stable(wn: wordnet.WordNet) -> None:
    assert not corpus.held_out(wn, "river")  # everyday (sense-tagged) words are never held out
    rare = [w for w in wn.senses if not wn.tagged.get(w)]
    assert [corpus.held_out(wn, w) for w in rare] == [corpus.held_out(wn, w) for w in rare]
    train, held = corpus.lemmas(wn, "train"), corpus.lemmas(wn, "heldout")
    assert not set(train) & set(held) and len(train) + len(held) == len(wn.senses)


def _texts() -> list[str]:
    base = ["river (noun): a large natural stream of water", "What does 'river' mean?",
            "hello (noun): an expression of greeting", "A word like 'happy'?"]
    return base * 50


def test_trained_vocabulary_has_the_engine_layout() -> None:
    from training.tokenizer import tokenizer_of

    vocab = train_vocab(_texts(), 600)
    assert len(vocab.tokens) == len(vocab.token_types) == 600
    assert vocab.tokens[-3:] == list(SPECIAL_TOKENS)
    assert vocab.token_types[-1] == TokenType.CONTROL and vocab.eos_id == 597
    tok = tokenizer_of(vocab)
    text = "river (noun): a large natural stream of water"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("river")) == 1  # a trained word is one token
    assert tok.encode_many([text, "hello"]) == [tok.encode(text), tok.encode("hello")]


def test_ids_mask_the_reply_and_its_end_only() -> None:
    from training.tokenizer import tokenizer_of

    tok = tokenizer_of(train_vocab(_texts(), 600))
    pair = corpus.Pair("What does 'river' mean?", "river (noun): a stream", "river", "define")
    enc = data.encode(tok, [(pair,), (pair,)])  # two conversations of one exchange
    prompt, reply = data.render(pair)
    n_prompt, n_reply = len(tok.encode(prompt)), len(tok.encode(reply))
    assert enc.n_conversations == 2 and len(enc.ids) == 2 * (n_prompt + n_reply)
    one = enc.mask[: n_prompt + n_reply]
    assert not one[:n_prompt].any() and one[n_prompt : n_prompt + n_reply - 1].all()
    assert not one[-1]  # the '\n' after <|im_end|> is context, not a target
    assert tok.decode(enc.ids[n_prompt : n_prompt + n_reply - 1].tolist()).endswith("<|im_end|>")
    ids, mask = data.epoch(enc, n_prompt + n_reply, np.random.default_rng(0), pad_id=0)
    assert ids.shape == mask.shape == (2, n_prompt + n_reply)  # a row a conversation


def test_the_pytorch_model_computes_what_the_engine_computes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from engine.model.loader import load_model
    from engine.model.mtp import MTPBlock
    from engine.request.session import Session
    from engine.speculative.draft_head import DraftHead
    from engine.synth.model import synth_tensors, write_gguf
    from engine.synth.vocab import build_vocab
    from training.model import DemoModel
    from training.train import _encoded

    spec = replace(PRESETS["tiny"], n_nextn=1).with_qtype("all", "F32")
    torch.manual_seed(0)
    m = DemoModel(spec)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if "exps" in name or "gate_inp" in name else 0.1))
        tokens = [5, 17, 300, 42, 9, 700, 123, 64, 1, 250, 511, 33]
        logits, mtp_logits, _, _ = m(torch.tensor([tokens]))
    path = write_gguf(tmp_path / "m.gguf", spec, build_vocab(spec.n_vocab), synth_tensors(spec),
                      _encoded(m.gguf_tensors(), spec), "test")
    model = load_model(path)
    res = Session(model, n_ctx=64).forward(tokens, logits="all")
    scale = float(logits.abs().max())
    assert np.abs(np.asarray(res.logits) - logits[0].numpy()).max() < 3e-3 * scale  # f16 KV
    block = MTPBlock(model, DraftHead.from_model(model))
    out = block.forward(np.asarray(res.hidden)[:-1], np.asarray(tokens[1:]), 0,
                        block.new_kv(64), logits="all")
    assert np.abs(np.asarray(out.logits) - mtp_logits[0].numpy()).max() < 6e-3 * scale


@pytest.mark.gpu
def test_the_jagged_expert_gemms_compute_what_the_padded_batch_computes() -> None:
    """The build's grouped GEMMs (offsets on the device) against the padded batch: the same
    loss and the same gradients, so the faster path trains the same model."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for PyTorch")
    from training.model import GROUPED_MM, DemoModel
    from training.train import SPEC, losses

    if GROUPED_MM is None:
        pytest.skip(f"torch {torch.__version__} has no grouped GEMM")
    torch.manual_seed(0)
    ids = torch.randint(0, SPEC.n_vocab, (2, 512), device="cuda")  # [B, T]
    mask = torch.rand(2, 512, device="cuda") < 0.5
    results = []
    for grouped in (False, True):
        torch.manual_seed(1)
        m = DemoModel(SPEC, grouped=grouped).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            main, mtp, aux = losses(m, ids, mask)
        (main + mtp + aux).backward()
        grads = {n: p.grad.float().clone() for n, p in m.named_parameters()}
        results.append(([main.item(), mtp.item(), aux.item()], grads))
    (l0, g0), (l1, g1) = results
    assert np.allclose(l0, l1, rtol=2e-3), (l0, l1)
    for name in g0:
        scale = float(g0[name].abs().max()) + 1e-12
        err = float((g0[name] - g1[name]).abs().max())
        assert err < 3e-2 * scale, (name, err, scale)


def test_the_loss_plot_names_the_builds_gpu(tmp_path: Path) -> None:
    import json

    from training.plot import write_svg

    log = tmp_path / "run9-loss.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 5.0 / s, "mtp_loss": 6.0 / s,
                                       "seconds": s * 0.05}) + "\n" for s in (50, 100, 150)))
    write_svg(log, tmp_path / "a.svg")
    assert "150 steps, 8 s on a GPU)" in (tmp_path / "a.svg").read_text()
    (tmp_path / "run9-build.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3"}))
    write_svg(log, tmp_path / "b.svg")
    svg = (tmp_path / "b.svg").read_text()
    assert "on an NVIDIA H100 80GB HBM3)" in svg and "polyline" in svg and "0.03" in svg


def test_pace_says_it_needs_a_gpu_where_there_is_none(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the gpu-marked test times the real step")
    from training.__main__ import main

    assert main(["pace", "--steps", "2"]) == 1
    assert "no CUDA device" in capsys.readouterr().out
