"""Open a GGUF file: decoded metadata and memory-mapped, zero-copy tensor views.

The container itself is parsed by `engine.gguf.container` (our own parser: `gguf.GGUFReader`
takes seconds on a 150k-token vocabulary). Every failure becomes a one-line `GGUFError`
naming the file and what to do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import GGUFError
from engine.gguf.container import GGUF_MAGIC, read_container

__all__ = ["GGUF_MAGIC", "SUPPORTED_QTYPES", "ModelFile", "TensorView", "open_gguf"]

# Quant types the engine core computes with (CPU decode via gguf.quants).
SUPPORTED_QTYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
         "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
         "IQ4_NL", "IQ4_XS", "MXFP4"]
    )
)


@dataclass(frozen=True)
class TensorView:
    """One tensor of a GGUF file, still in the file's bytes.

    `shape` is the logical element shape in numpy order (outermost first, so a linear weight
    is `[n_out, n_in]`); `raw` is the memory-mapped payload: uint8 `[..., row_bytes]` for
    block-quantized types, a typed array for F32/F16/BF16-as-uint16.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray
    n_bytes: int

    @property
    def row_bytes(self) -> int:
        block, type_bytes = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * type_bytes


@dataclass
class ModelFile:
    """A parsed GGUF file: decoded metadata and tensor views (no tensor data copied)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorView]
    n_file_bytes: int
    data: np.ndarray | None = None  # uint8 [n_file_bytes]: the whole memory map

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def key(self, name: str, default: Any = None) -> Any:
        """Architecture-scoped metadata: key('block_count') reads '{arch}.block_count'."""
        return self.metadata.get(f"{self.arch}.{name}", default)

    def require(self, name: str) -> Any:
        full = f"{self.arch}.{name}"
        if full not in self.metadata:
            raise GGUFError(f"{self.path.name}: metadata key '{full}' is missing; re-export the model")
        return self.metadata[full]

    def tensor(self, name: str) -> TensorView:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(
                f"{self.path.name}: tensor '{name}' is missing; the file is incomplete or not a "
                f"{self.arch} model"
            ) from None


def open_gguf(path: str | os.PathLike[str]) -> ModelFile:
    """Memory-map `path` and return its metadata and tensor views, or raise `GGUFError`."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such model file; pass a .gguf path or 'demo'")
    c = read_container(path)
    tensors = {
        t.name: TensorView(t.name, t.qtype, tuple(reversed(t.dims)), t.raw, t.n_bytes)
        for t in c.tensors
    }
    return ModelFile(path=path, metadata=c.metadata, tensors=tensors,
                     n_file_bytes=c.n_file_bytes, data=c.data)
