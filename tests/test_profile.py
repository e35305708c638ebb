"""Expert profiles: the file format, the fill order, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.experts.profile import ExpertProfile, ProfileError, ProfileRecorder


def test_order_is_most_used_first() -> None:
    profile = ExpertProfile.from_counts(np.array([[5, 0, 9], [1, 7, 2]]))
    assert profile.order() == [(0, 2), (1, 1), (0, 0), (1, 2), (1, 0), (0, 1)]


def test_ties_spread_over_layers_deterministically() -> None:
    assert ExpertProfile.uniform(2, 3).order() == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    # Equal counts across layers: the expert ranked higher inside its own layer comes first.
    profile = ExpertProfile.from_counts(np.array([[4, 4, 9], [4, 1, 1]]))
    assert profile.order() == [(0, 2), (1, 0), (0, 0), (0, 1), (1, 1), (1, 2)]
    assert profile.order() == profile.order()


def test_order_lists_every_expert_once() -> None:
    counts = np.random.default_rng(3).integers(0, 5, (6, 10))
    order = ExpertProfile.from_counts(counts).order()
    assert sorted(order) == [(layer, e) for layer in range(6) for e in range(10)]
    ranked = [counts[layer, e] for layer, e in order]
    assert ranked == sorted(ranked, reverse=True)


def test_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    profile = ExpertProfile.from_counts(np.arange(12).reshape(3, 4), n_tokens=77)
    profile.save(path)
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["n_layer"], doc["n_expert"]) == (
        "strata-expert-profile", 1, 3, 4,
    )  # fmt: skip
    loaded = ExpertProfile.load(path, n_layer=3, n_expert=4)
    assert np.array_equal(loaded.counts, profile.counts) and loaded.n_tokens == 77
    assert not loaded.counts.flags.writeable


def test_wrong_model_shape(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    ExpertProfile.uniform(8, 16).save(path)
    with pytest.raises(ProfileError) as e:
        ExpertProfile.load(path, n_layer=4, n_expert=16)
    assert str(e.value) == (
        f"expert profile {path} has 8 layers, model has 4; record a new one with `strata profile`"
    )
    with pytest.raises(ProfileError, match="^profile has 8 layers, model has 4 and 16 experts"):
        ExpertProfile.uniform(8, 16).check_model(4, 32)


HEADER = {"format": "strata-expert-profile", "version": 1}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("not json", "is not JSON"),
        ('{"format": "gguf"}', "has format 'gguf', expected 'strata-expert-profile'"),
        ('{"format": "strata-expert-profile", "version": 2}', "is version 2, this strata reads"),
        (
            json.dumps(HEADER | {"n_layer": 2, "n_expert": 2, "counts": [[1, 2], [3]]}),
            "counts are not a table, header says 2x2",
        ),
        (
            json.dumps(HEADER | {"n_layer": 1, "n_expert": 2, "counts": [[1, -2]]}),
            "counts are 1x2, header says 1x2 of non-negative integers",
        ),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=words) as e:
        ExpertProfile.load(path)
    assert "\n" not in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="No such file or directory; check --expert-profile"):
        ExpertProfile.load(tmp_path / "absent.json")


def test_recorder_counts_router_choices() -> None:
    rec = ProfileRecorder(2, 4)
    rec.add(0, np.array([[0, 1], [1, 3], [1, 2]]))  # [tokens, top-k]
    rec.add(1, np.array([[2, 3], [2, 0], [2, 1]]))
    profile = rec.profile()
    assert profile.n_tokens == 3
    assert profile.counts.tolist() == [[1, 3, 1, 1], [1, 1, 3, 1]]
    assert profile.order()[:2] == [(0, 1), (1, 2)]
