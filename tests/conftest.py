"""Shared fixtures: small synthetic models built once per test session."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine.synth.model import PRESETS, SynthSpec, write_model


def build(tmp_dir: Path, name: str, spec: SynthSpec) -> Path:
    path = tmp_dir / f"{name}.gguf"
    if not path.exists():
        write_model(path, spec)
    return path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_path(models_dir: Path) -> Path:
    """The 'tiny' preset: 2 blocks + 1 MTP block, 8 experts, vocab 1024."""
    return build(models_dir, "tiny", PRESETS["tiny"])


@pytest.fixture(scope="session")
def tiny_nomtp_path(models_dir: Path) -> Path:
    return build(models_dir, "tiny-nomtp", replace(PRESETS["tiny"], n_nextn=0))


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Presets and profiles are built into a per-session cache, never the user's."""
    import os

    os.environ["STRATA_CACHE_DIR"] = str(tmp_path_factory.mktemp("strata-cache"))


@pytest.fixture(scope="session", autouse=True)
def _config_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The app's settings file (app/settings.py) is read and written in a per-session
    directory, never the user's."""
    import os

    os.environ["STRATA_CONFIG_DIR"] = str(tmp_path_factory.mktemp("strata-config"))


@pytest.fixture(scope="session")
def demo_path() -> Path:
    """The shipped demo model (trained on WordNet: 4 blocks + MTP, 32 experts, vocab 8192)."""
    from engine.assets import DEMO_MODEL

    return DEMO_MODEL


@pytest.fixture(scope="session")
def random_demo_path(_cache_dir: None) -> Path:
    """The demo's shapes with random weights (the 'random-demo' preset), built once."""
    from engine.synth.demo import ensure_preset

    return ensure_preset("random-demo")


@pytest.fixture(scope="module")
def cp():  # type: ignore[no-untyped-def]
    """The cupy module for gpu-marked tests, or a skip where CuPy is missing or finds no GPU."""
    cupy = pytest.importorskip("cupy")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        n = 0
    if n == 0:
        pytest.skip("CuPy finds no CUDA device")
    return cupy
