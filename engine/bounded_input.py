"""Small input files a user names (a tokens file, an expert profile, a rates file) read with
bounds: a regular file only, its size checked against a cap before a byte is read, and JSON
with its nesting depth checked before `json.loads`.

A FIFO with no writer would block `open` forever and `/dev/zero` never ends; both are refused
from `fstat` after an `O_NONBLOCK` open, before any read. Every refusal is one `InputFileError`
line that names the file (as the caller calls it: `what`) and what to do.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import StrataError

MAX_JSON_DEPTH = 32  # our JSON files nest 4 deep; Python's parser recurses once per level

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a JSON string, escapes included


class InputFileError(StrataError):
    """An input file that cannot be read within its bounds (one line, naming the file)."""


def read_capped(path: str | Path, limit_bytes: int, what: str, hint: str = "") -> bytes:
    """The bytes of the regular file at `path`, at most `limit_bytes` of them; else
    InputFileError `{what} ...`, with `hint` (what to do) after a semicolon. FileNotFoundError
    is an InputFileError too (callers that treat absence apart check `exists()` first)."""
    tail = f"; {hint}" if hint else ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InputFileError(f"{what}: {e.strerror or e}{tail}") from None
    try:
        info = os.fstat(fd)
        kind = next((name for test, name in _KINDS if test(info.st_mode)), None)
        if kind is not None or not stat.S_ISREG(info.st_mode):
            raise InputFileError(f"{what} is {kind or 'not a regular file'}, not a regular "
                                 f"file{tail}")
        if info.st_size > limit_bytes:
            raise InputFileError(f"{what} is {info.st_size:,} bytes, more than the limit of "
                                 f"{limit_bytes:,}{tail}")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            data = f.read(limit_bytes + 1)  # a file that grew since fstat stops here
    except OSError as e:
        raise InputFileError(f"{what}: {e.strerror or e}{tail}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit_bytes:
        raise InputFileError(f"{what} is more than the limit of {limit_bytes:,} bytes{tail}")
    return data


def json_depth(data: bytes) -> int:
    """How deep arrays and objects nest in JSON text `data` (brackets inside strings do not
    count), without parsing it: linear time, no recursion."""
    bare = np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)
    step = np.isin(bare, (ord("["), ord("{"))).astype(np.int32)  # [n] +1 opens
    step -= np.isin(bare, (ord("]"), ord("}")))  # -1 closes
    return int(np.cumsum(step).max(initial=0))


def load_json(path: str | Path, limit_bytes: int, what: str, hint: str = "",
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON document in the file at `path`, read with `read_capped` and its nesting
    checked against `max_depth` before it is parsed; InputFileError when it is not UTF-8
    JSON or nests deeper."""
    data = read_capped(path, limit_bytes, what, hint)
    tail = f"; {hint}" if hint else ""
    depth = json_depth(data)
    if depth > max_depth:
        raise InputFileError(f"{what} nests {depth:,} levels deep, more than the limit of "
                             f"{max_depth}{tail}")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InputFileError(f"{what} is not UTF-8 text (byte {e.start:,}){tail}") from None
    except (ValueError, RecursionError) as e:  # ValueError: also a 5,000-digit number
        detail = e.msg if isinstance(e, json.JSONDecodeError) else str(e)[:60]
        raise InputFileError(f"{what} is not JSON ({detail}){tail}") from None
