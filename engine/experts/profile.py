"""Expert profiles: how often the router picked each (layer, expert); the cache fills by it.

File format (JSON, UTF-8), written by `strata profile` and read by `--expert-profile PATH`:

    {
      "format": "strata-expert-profile",
      "version": 1,
      "n_layer": 4,               # main layers of the model the profile was recorded on
      "n_expert": 8,              # routed experts per layer
      "n_tokens": 12288,          # tokens routed while recording (information only)
      "counts": [[...], ...]      # n_layer rows of n_expert non-negative integers
    }

`order()` is the fill order: the most used expert first. Ties are broken by the expert's rank
inside its own layer, then by layer, then by expert index, so equal counts spread over layers
(a uniform profile fills expert 0 of every layer, then expert 1, ...) and the order is
deterministic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.atomic_file import write_text_atomic
from engine.bounded_input import InputFileError, load_json
from engine.errors import StrataError

FORMAT = "strata-expert-profile"
VERSION = 1
# The largest file `--expert-profile` reads: a 94-layer, 512-expert model's profile is ~0.5 MB
MAX_PROFILE_BYTES = 16 << 20


class ProfileError(StrataError):
    """An expert profile file cannot be used (unreadable, wrong format, wrong model)."""


@dataclass(frozen=True)
class ExpertProfile:
    """Routing counts int64 [n_layer, n_expert] (read-only) and the tokens they came from."""

    counts: np.ndarray  # [L, E]
    n_tokens: int = 0

    def __post_init__(self) -> None:
        counts = np.array(self.counts, dtype=np.int64)  # [L, E], our own copy
        assert counts.ndim == 2 and (counts >= 0).all(), counts.shape
        counts.flags.writeable = False
        object.__setattr__(self, "counts", counts)

    @property
    def n_layer(self) -> int:
        return self.counts.shape[0]

    @property
    def n_expert(self) -> int:
        return self.counts.shape[1]

    @classmethod
    def from_counts(cls, counts: np.ndarray, n_tokens: int = 0) -> ExpertProfile:
        """A profile from a count array [n_layer, n_expert]."""
        return cls(np.asarray(counts), n_tokens)

    @classmethod
    def uniform(cls, n_layer: int, n_expert: int) -> ExpertProfile:
        """Every expert equally used: the fill order when no profile was recorded."""
        return cls(np.ones((n_layer, n_expert), dtype=np.int64))

    def order(self) -> list[tuple[int, int]]:
        """Every (layer, expert), most used first (ties: see the module docstring)."""
        n_layer, n_expert = self.counts.shape
        by_layer = np.argsort(-self.counts, axis=1, kind="stable")  # [L, E] experts, best first
        rank = np.empty_like(by_layer)  # [L, E] place of each expert inside its layer
        np.put_along_axis(rank, by_layer, np.arange(n_expert)[None, :], axis=1)
        layer, expert = np.indices((n_layer, n_expert)).reshape(2, -1)  # [L*E] each
        keys = (expert, layer, rank.reshape(-1), -self.counts.reshape(-1))
        flat = np.lexsort(keys)  # [L*E], last key is the primary one
        return [(int(layer[i]), int(expert[i])) for i in flat]

    def check_model(self, n_layer: int, n_expert: int, *, source: str = "profile") -> None:
        """Raise ProfileError when the profile was recorded on a model of another shape."""
        problems = []
        if self.n_layer != n_layer:
            problems.append(f"{self.n_layer} layers, model has {n_layer}")
        if self.n_expert != n_expert:
            problems.append(f"{self.n_expert} experts per layer, model has {n_expert}")
        if problems:
            raise ProfileError(
                f"{source} has {' and '.join(problems)}; record a new one with `strata profile`"
            )

    def save(self, path: str | Path) -> None:
        """Write the profile file (format in the module docstring)."""
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "n_tokens": self.n_tokens,
            "counts": self.counts.tolist(),
        }
        # atomic: a reader never sees half a file, and a symlink in the way (to /dev/zero, say)
        # is replaced rather than written through
        write_text_atomic(Path(path), json.dumps(doc, separators=(",", ":")) + "\n")

    @classmethod
    def load(
        cls, path: str | Path, *, n_layer: int | None = None, n_expert: int | None = None
    ) -> ExpertProfile:
        """Read a profile file; with `n_layer`/`n_expert`, also check it fits that model."""
        path = Path(path)
        try:
            doc = load_json(path, MAX_PROFILE_BYTES, f"expert profile {path}",
                            "check --expert-profile, or record one with `strata profile`")
        except InputFileError as e:
            raise ProfileError(str(e)) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ProfileError(
                f"expert profile {path} has format {_shown(_get(doc, 'format'))}, expected "
                f"{FORMAT!r}; record one with `strata profile`"
            )
        if doc.get("version") != VERSION:
            raise ProfileError(
                f"expert profile {path} is version {_shown(doc.get('version'))}, this strata "
                f"reads version {VERSION}; record a new one with `strata profile`"
            )
        counts = _counts(doc, path)
        n_tokens = doc.get("n_tokens", 0)
        if type(n_tokens) is not int or n_tokens < 0:
            raise ProfileError(
                f"expert profile {path} has n_tokens {_shown(n_tokens)}, expected a token "
                f"count; record a new one with `strata profile`"
            )
        profile = cls(counts, n_tokens)
        if n_layer is not None and n_expert is not None:
            profile.check_model(n_layer, n_expert, source=f"expert profile {path}")
        return profile


class ProfileRecorder:
    """Counts router choices while a model runs; `profile()` freezes them."""

    def __init__(self, n_layer: int, n_expert: int):
        self.counts = np.zeros((n_layer, n_expert), dtype=np.int64)  # [L, E]
        self.n_tokens = 0

    def add(self, layer: int, experts: np.ndarray) -> None:
        """Record the experts chosen in `layer`: int [n_tokens, n_expert_used] (or [n])."""
        np.add.at(self.counts[layer], np.asarray(experts).reshape(-1), 1)
        if layer == 0:
            self.n_tokens += len(experts)

    def profile(self) -> ExpertProfile:
        """The counts so far as a profile."""
        return ExpertProfile(self.counts, self.n_tokens)


def _shown(value: object) -> str:
    """A value from the file, cut short for a one-line message."""
    text = repr(value)
    return text if len(text) <= 24 else text[:24] + "..."


def _get(doc: object, key: str) -> object:
    return doc.get(key) if isinstance(doc, dict) else None


def _counts(doc: dict, path: Path) -> np.ndarray:
    n_layer, n_expert, rows = doc.get("n_layer"), doc.get("n_expert"), doc.get("counts")
    counts = np.zeros(0)
    if isinstance(rows, list) and all(
        isinstance(row, list) and all(type(c) is int for c in row) for row in rows
    ):  # integers only: numpy would truncate 1.5 and read "7" as 7
        try:
            counts = np.array(rows, dtype=np.int64)  # [L, E]
        except (ValueError, OverflowError):  # ragged rows, a count past int64
            pass
    if counts.ndim != 2 or counts.shape != (n_layer, n_expert) or (counts < 0).any():
        shape = "x".join(map(str, counts.shape)) if counts.ndim == 2 else "not a table"
        raise ProfileError(
            f"expert profile {path} counts are {shape}, header says {_shown(n_layer)}x"
            f"{_shown(n_expert)} of "
            f"non-negative integers; record a new one with `strata profile`"
        )
    return counts
