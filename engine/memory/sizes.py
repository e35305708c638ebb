"""Byte sizes as people write them ("8GiB", "512MiB") and MiB tables as people read them.

Binary units (KiB, MiB, GiB, TiB) and their one-letter forms (K, M, G, T) are powers of 1024;
SI units (KB, MB, GB, TB) are powers of 1000, as the names say. A bare number is bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from engine.errors import FlagError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "m": MiB,
    "mib": MiB,
    "g": GiB,
    "gib": GiB,
    "t": TiB,
    "tib": TiB,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
# ASCII digits only (`\d` would take '١٢' and float() '1_0'); at most 18 of them
_SIZE_RE = re.compile(r"^ *([0-9]{1,18}(?:\.[0-9]{1,18})?) *([a-zA-Z]*) *$", re.ASCII)
MAX_SIZE_BYTES = 1 << 60  # an exbibyte: past any device, far below float's exactness limits


def parse_size(text: str, *, what: str = "size") -> int:
    """Parse "8GiB", "512MiB", "1.5G" or "4096" into bytes; `what` names the flag in errors."""
    m = _SIZE_RE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise FlagError(
            f"{what} '{shown}' is not a size; write it like 8GiB, 512MiB or 4096 (bytes)"
        )
    n_bytes = int(float(m.group(1)) * _UNITS[unit])
    if n_bytes <= 0:
        raise FlagError(f"{what} '{text}' is zero; give a positive size such as 512MiB")
    if n_bytes > MAX_SIZE_BYTES:
        raise FlagError(f"{what} '{text}' is more than 2**60 bytes, past any "
                        "device; give a size such as 8GiB")
    return n_bytes


def mib(n_bytes: int) -> float:
    """Bytes as (fractional) MiB."""
    return n_bytes / MiB


def format_size(n_bytes: int) -> str:
    """The largest binary unit that keeps the number >= 1: "8 GiB", "1.5 GiB", "512 MiB"."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n_bytes) >= scale:
            value = n_bytes / scale
            text = f"{value:.0f}" if value == int(value) else f"{value:.1f}"
            return f"{text} {unit}"
    return f"{n_bytes} B"


def format_mib(n_bytes: int) -> str:
    """Bytes as MiB with one decimal, the unit every table in strata uses: "512.0"."""
    return f"{mib(n_bytes):,.1f}"


def ceil_div(a: int, b: int) -> int:
    """Integer ceiling of a / b for non-negative a and positive b."""
    return -(-a // b)


def align_up(n_bytes: int, alignment: int) -> int:
    """The smallest multiple of `alignment` that is >= n_bytes."""
    return ceil_div(n_bytes, alignment) * alignment


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool] = ()
) -> str:
    """A Markdown table; `right[i]` right-aligns column i (numbers)."""
    right = list(right) + [False] * (len(headers) - len(right))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    dashes = ["-" * (w + 1) + ":" if r else "-" * (w + 2) for w, r in zip(widths, right)]
    rule = "|" + "|".join(dashes) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])
