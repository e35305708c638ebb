"""Kernel sources as compiled: `common.cuh` (short integer names, fp16 conversions) first, then
the named `.cu` files of this package, for `cupy.RawModule(code=...)`."""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).parent


def cuda_source(*names: str) -> str:
    """common.cuh + the files `names` (e.g. "moe.cu"), joined by newlines."""
    return "\n".join((_DIR / n).read_text() for n in ("common.cuh", *names))
