"""Model names: 'demo' is the shipped trained model; a preset name is a synthetic model built
once into the user cache directory, then reused; anything else is a path."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from platformdirs import user_cache_dir

from engine.assets import DEMO_MODEL
from engine.synth.model import PRESETS, write_model

DEMO_NAME = "demo"


def cache_dir() -> Path:
    """Where built presets live; STRATA_CACHE_DIR overrides the platform default."""
    return Path(os.environ.get("STRATA_CACHE_DIR") or user_cache_dir("strata-chat"))


def preset_path(name: str) -> Path:
    spec = PRESETS[name]
    return cache_dir() / f"{name}-{spec.digest()}.gguf"


def ensure_preset(name: str, progress: Callable[[int, int], None] | None = None) -> Path:
    """Return the path of preset `name`, building it first if it is not cached yet."""
    path = preset_path(name)
    if not path.exists():
        write_model(path, PRESETS[name], progress)
    return path


def stderr_progress(label: str) -> Callable[[int, int], None]:
    """A one-line text progress bar on stderr."""
    start = time.perf_counter()

    def show(done: int, total: int) -> None:
        width = 30
        fill = int(width * done / total)
        sys.stderr.write(
            f"\r{label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} "
            f"{time.perf_counter() - start:.1f}s"
        )
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def is_model_name(arg: str) -> bool:
    """Whether `arg` names a model ('demo' or a preset) rather than a path."""
    return (arg == DEMO_NAME or arg in PRESETS) and not Path(arg).exists()


def resolve_model(arg: str, progress: Callable[[int, int], None] | None = None) -> Path:
    """'demo' -> the shipped model; a preset name -> its cached file (built on first use,
    reporting to `progress`, by default a bar on stderr); anything else is a path."""
    if not is_model_name(arg):
        return Path(arg)
    if arg == DEMO_NAME:
        return DEMO_MODEL
    label = f"building the {arg} model (first use)"
    return ensure_preset(arg, progress or stderr_progress(label))
