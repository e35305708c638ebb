"""Writing a small state file so a reader never sees half of it: a temporary file beside it,
then one rename (the forecast's rates, the drafting policy); and the name a damaged file is
moved aside to."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` (its directory made if needed) through a temporary file and a
    rename: the old contents or the new, never a mix. OSError as the filesystem says."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def aside_path(path: Path) -> Path:
    """A free name beside `path` for a file that cannot be used, moved aside rather than
    deleted: `<name>.bad-<time>` (`-2`, `-3`, ... when taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    bad = path.with_name(f"{path.name}.bad-{stamp}")
    n = 1
    while bad.exists():
        n += 1
        bad = path.with_name(f"{path.name}.bad-{stamp}-{n}")
    return bad
