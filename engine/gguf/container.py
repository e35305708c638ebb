"""A fast parser of the GGUF container: header, metadata and tensor table, over one memory map.

Layout of a little-endian GGUF v2/v3 file (all integers little-endian):

    magic         4 bytes  b"GGUF"
    version       uint32   2 or 3
    tensor_count  uint64
    kv_count      uint64
    kv_count x    key: string, value_type: uint32, value (below)
    tensor_count x name: string, n_dims: uint32, dims: uint64[n_dims] (innermost first),
                  ggml_type: uint32, offset: uint64 (relative to the data section)
    padding       to a multiple of `general.alignment` (uint32 key, default 32)
    data section  tensor payloads, each at data_start + its offset

    string        uint64 byte length, then UTF-8 bytes (no terminator)
    value         by value_type: 0 uint8, 1 int8, 2 uint16, 3 int16, 4 uint32, 5 int32,
                  6 float32, 7 bool (1 byte), 8 string, 9 array, 10 uint64, 11 int64, 12 float64
    array         item_type: uint32, count: uint64, then `count` values of item_type (no tags)

`read_container(path)` returns a `GGUFContainer`; its `metadata` decodes every key the way
`gguf.GGUFReader` fields' `contents()` do, so callers see the same Python values:

    scalar numbers    int / float (a float32 widened to a Python float) / bool
    string            str (UTF-8; invalid bytes in a value become U+FFFD)
    array of numbers  list of int / float / bool
    array of strings  list of str
    nested array      one flat list of the leaf values (gguf-py flattens them too)
    GGUF.version, GGUF.tensor_count, GGUF.kv_count   the header's numbers, as int

Tensor payloads are views into the single read-only `np.memmap` (nothing is copied), shaped
as `GGUFReader.tensors[i].data` is: F16/F32/F64/I8/I16/I32/I64 typed with the element shape
in numpy order (dims reversed); every other type (BF16 and block-quantized) uint8
`[..., row_bytes]`.

Metadata and the tensor table are read with `struct.unpack_from` over a memoryview of the
map, arrays of numbers with `np.frombuffer`; that opens a 152k-token vocabulary in a fraction
of a second where `GGUFReader` (one numpy view per value) takes seconds.

Every problem is a one-line `GGUFError` naming the file. Every number of the header is checked
against the bytes that are left and against the sane limits below before anything is built
from it, so a hostile header (a count of 2^63, a string longer than the file) fails in
microseconds instead of allocating or looping.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import GGUFError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 16  # ggml has 4; more than this is a corrupt tensor table, not a tensor
HEADER_BYTES = 24  # magic, version, tensor_count, kv_count

# Sane limits, far above any published model and far below what would take minutes or memory.
MAX_TENSORS = 1 << 20  # DeepSeek-V3 has ~1,100 tensors; 256 unmerged experts x 61 x 3 is 47k
MAX_KVS = 1 << 20  # real files hold ~50 keys
MAX_KEY_BYTES = (1 << 16) - 1  # the GGUF spec's limit on a key
MAX_TENSOR_NAME_BYTES = 63  # ggml's GGML_MAX_NAME (64 with the terminator), as llama.cpp checks
MAX_STRING_BYTES = 1 << 26  # one string value; a chat template is ~10 KB
MAX_ARRAY_ITEMS = 1 << 24  # a 262,144-token vocabulary and its merges are far below
MAX_ARRAY_DEPTH = 8  # arrays of arrays (llama.cpp reads none; gguf-py reads any)
MAX_ELEMENTS = (1 << 63) - 1  # ggml counts elements in int64

# The fewest bytes one entry can take, to check a count against the bytes left before the loop.
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset

# GGUF metadata value types (numbering of gguf.GGUFValueType).
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL = range(8)
T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(8, 13)

# Fixed-size value types: struct format of one value, numpy dtype of an array of them.
_SCALAR_FORMATS: dict[int, str] = {
    T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
    T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d",
}
_SCALARS: dict[int, struct.Struct] = {t: struct.Struct(f) for t, f in _SCALAR_FORMATS.items()}
_DTYPES: dict[int, np.dtype] = {
    t: np.dtype(np.bool_ if t == T_BOOL else f) for t, f in _SCALAR_FORMATS.items()
}

# Tensor types whose payload GGUFReader types element-wise; all others are uint8 row bytes.
_TYPED_TENSORS: dict[GGMLQuantizationType, np.dtype] = {
    GGMLQuantizationType.F16: np.dtype(np.float16),
    GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F64: np.dtype(np.float64),
    GGMLQuantizationType.I8: np.dtype(np.int8),
    GGMLQuantizationType.I16: np.dtype(np.int16),
    GGMLQuantizationType.I32: np.dtype(np.int32),
    GGMLQuantizationType.I64: np.dtype(np.int64),
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_U64X2 = struct.Struct("<QQ")
# The fewest bytes one array item of a type takes: a string its length, an array its header.
_MIN_ITEM_BYTES: dict[int, int] = {
    **{t: st.size for t, st in _SCALARS.items()}, T_STRING: 8, T_ARRAY: 4 + 8,
}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table, with its payload as a view into the memory map."""

    name: str
    qtype: GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    offset: int  # absolute byte offset of the payload in the file
    n_bytes: int  # payload size: n_elements * type_size // block_size
    raw: np.ndarray  # typed [*reversed(dims)] or uint8 [*reversed(dims)[:-1], row_bytes]


@dataclass
class GGUFContainer:
    """A parsed GGUF file: decoded metadata, the tensor table and the whole-file map."""

    version: int
    metadata: dict[str, Any]  # key -> decoded value, in file order after the three GGUF.* keys
    value_types: dict[str, int]  # key -> GGUF value type of its value (T_* above)
    tensors: list[TensorInfo]  # in file order
    alignment: int
    data_offset: int  # start of the data section (aligned end of the tensor table)
    n_file_bytes: int
    data: np.memmap  # uint8 [n_file_bytes], read-only (mode 'r')


class _Corrupt(Exception):
    """The header cannot be parsed; the message says what was wrong (becomes a GGUFError)."""


class _Parser:
    """Reads the header from `buf` (a memoryview of the map), advancing `self.off`."""

    def __init__(self, buf: memoryview, size: int):
        self.buf = buf
        self.size = size
        self.off = 0
        self.where = "the header"  # what is being read, for error messages

    def need(self, n: int, what: str = "") -> None:
        """`n` more bytes must be in the file; `what` names the number that asks for them."""
        if self.off + n > self.size:
            raise _Corrupt(
                f"{self.where}{': ' + what if what else ''} needs {n:,} bytes at byte "
                f"{self.off:,} but the file ends at byte {self.size:,}"
            )

    def count(self, what: str, n: int, limit: int, item_bytes: int) -> None:
        """Check a count read from the file: at most `limit`, and `n` items of at least
        `item_bytes` each must fit in the bytes left (before any loop or list is made)."""
        if n > limit:
            raise _Corrupt(f"{self.where}: {what} {n:,} is more than the limit of {limit:,}")
        self.need(n * item_bytes, f"{what} {n:,}")

    def u32(self) -> int:
        self.need(4)
        (v,) = _U32.unpack_from(self.buf, self.off)
        self.off += 4
        return v

    def u64(self) -> int:
        self.need(8)
        (v,) = _U64.unpack_from(self.buf, self.off)
        self.off += 8
        return v

    def raw_string(self, limit: int = MAX_STRING_BYTES, what: str = "string") -> memoryview:
        n = self.u64()
        if n > limit:
            raise _Corrupt(f"{self.where}: {what} length {n:,} is more than the limit of {limit:,}")
        self.need(n, f"{what} length {n:,}")
        start = self.off
        self.off += n
        return self.buf[start : self.off]

    def name(self, what: str, limit: int) -> str:
        """A key or tensor name: invalid UTF-8 there is corruption, as in GGUFReader."""
        raw = self.raw_string(limit, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} {bytes(raw)[:40]!r} is not valid UTF-8") from None

    def value(self, vtype: int) -> Any:
        """One metadata value of type `vtype`, decoded as GGUFReader's field.contents()."""
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            self.need(scalar.size)
            (v,) = scalar.unpack_from(self.buf, self.off)
            self.off += scalar.size
            return v
        if vtype == T_STRING:
            return _text(self.raw_string())
        if vtype == T_ARRAY:
            return self.array()
        raise _Corrupt(f"{self.where} has unknown value type {vtype}")

    def array(self) -> list[Any]:
        itype = self.u32()
        count = self.u64()
        if count == 0:
            return []  # GGUFReader never looks at an empty array's item type
        if itype not in _MIN_ITEM_BYTES:
            raise _Corrupt(f"{self.where} is an array of unknown value type {itype}")
        self.count("array length", count, MAX_ARRAY_ITEMS, _MIN_ITEM_BYTES[itype])
        dtype = _DTYPES.get(itype)
        if dtype is not None:  # numbers: one frombuffer
            out = np.frombuffer(self.buf, dtype, count, self.off).tolist()
            self.off += count * dtype.itemsize
            return out
        if itype == T_STRING:
            return self.strings(count)
        return _flatten(*self.items(itype, count, depth=1))

    def strings(self, count: int) -> list[str]:
        """`count` consecutive strings: the hot loop of a tokenizer vocabulary."""
        buf, size, off = self.buf, self.size, self.off
        unpack = _U64.unpack_from
        out: list[str] = [""] * count
        try:
            for i in range(count):
                (n,) = unpack(buf, off)
                start = off + 8
                off = start + n
                if off > size:
                    break
                try:
                    out[i] = str(buf[start:off], "utf-8")
                except UnicodeDecodeError:
                    out[i] = _text(buf[start:off])
            else:
                self.off = off
                return out
        except struct.error:  # the length itself runs past the end
            pass
        raise _Corrupt(
            f"{self.where} (an array of {count:,} strings) runs past the end of the file "
            f"at byte {self.size:,}"
        )

    def items(
        self, itype: int, count: int, depth: int
    ) -> tuple[list[int], list[tuple[int, bytes]]]:
        """Mirror of GGUFReader._get_field_parts for an array of arrays (rare; not fast).

        Returns the type chain (ARRAY, then the first item's chain) and the leaves of all
        items flattened, as (value type, raw bytes).
        """
        if depth > MAX_ARRAY_DEPTH:
            raise _Corrupt(f"{self.where} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        if count and itype not in _MIN_ITEM_BYTES:
            raise _Corrupt(f"{self.where} has an array item of unknown value type {itype}")
        self.count("array length", count, MAX_ARRAY_ITEMS,
                   _MIN_ITEM_BYTES.get(itype, 0))
        types, leaves = [T_ARRAY], []
        for i in range(count):
            sub_types, sub_leaves = self.item(itype, depth)
            if i == 0:
                types += sub_types
            leaves += sub_leaves
        return types, leaves

    def item(self, vtype: int, depth: int) -> tuple[list[int], list[tuple[int, bytes]]]:
        if vtype == T_ARRAY:
            itype = self.u32()
            return self.items(itype, self.u64(), depth + 1)
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            self.need(scalar.size)
            start = self.off
            self.off += scalar.size
            return [vtype], [(vtype, bytes(self.buf[start : self.off]))]
        if vtype == T_STRING:
            return [vtype], [(vtype, bytes(self.raw_string()))]
        raise _Corrupt(f"{self.where} has an array item of unknown value type {vtype}")


def show_value(value: Any) -> str:
    """A decoded metadata value for an error message, cut short (a hostile one may be a long
    list)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(raw: memoryview | bytes) -> str:
    """A string value; invalid UTF-8 is replaced rather than refused (GGUFReader raised)."""
    return str(raw, "utf-8", errors="replace")


def _flatten(types: list[int], leaves: list[tuple[int, bytes]]) -> list[Any]:
    """GGUFReader's contents() of a nested array: flat, typed by the last type of the chain."""
    if types[-1] == T_STRING:
        return [_text(raw) for _, raw in leaves]
    out: list[Any] = []
    for vtype, raw in leaves:
        if vtype == T_STRING:  # a string leaf under a numeric chain reads as its bytes
            out += list(raw)
        else:
            out += np.frombuffer(raw, _DTYPES[vtype]).tolist()
    return out


def read_container(path: str | Path) -> GGUFContainer:
    """Memory-map `path` (an existing file) and parse its GGUF header, or raise `GGUFError`."""
    path = Path(path)
    try:
        n_file_bytes = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFError(f"{path.name}: cannot read the file ({exc.strerror or exc})") from None
    if n_file_bytes == 0:
        raise GGUFError(f"{path.name}: empty file (0 bytes), not a GGUF model; download it again")
    if magic != GGUF_MAGIC[: len(magic)]:
        raise GGUFError(f"{path.name}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    if n_file_bytes < HEADER_BYTES:
        raise GGUFError(
            f"{path.name}: the file is truncated: {n_file_bytes} bytes, where a GGUF header "
            f"alone takes {HEADER_BYTES}; download it again"
        )
    try:
        data = np.memmap(path, mode="r")
    except (OSError, ValueError) as exc:
        raise GGUFError(f"{path.name}: cannot map the file ({exc})") from None
    p = _Parser(memoryview(data), n_file_bytes)
    try:
        return _parse(p, path, data)
    except _Corrupt as exc:
        detail = str(exc)
    except (struct.error, RecursionError, MemoryError, OverflowError, ValueError) as exc:
        detail = f"{p.where}: {type(exc).__name__}: {exc}"  # not expected: bounds are checked
    raise GGUFError(
        f"{path.name}: cannot parse the GGUF header ({detail}); "
        "the file is truncated or corrupt, download it again"
    )


def _check_overlaps(path: Path, tensors: list[TensorInfo]) -> None:
    """No two tensors' payloads share a byte (writing one would change the other; llama.cpp
    wants each right after the last). One sort by offset: O(n log n) for any table."""
    spans = sorted((t for t in tensors if t.n_bytes), key=lambda t: t.offset)
    for a, b in itertools.pairwise(spans):
        if b.offset < a.offset + a.n_bytes:
            raise GGUFError(
                f"{path.name}: tensors '{a.name}' (bytes {a.offset:,}..{a.offset + a.n_bytes:,})"
                f" and '{b.name}' (from byte {b.offset:,}) overlap; the file is corrupt, "
                "download it again"
            )


def _parse(p: _Parser, path: Path, data: np.memmap) -> GGUFContainer:
    p.off = 4
    version = p.u32()
    if version not in SUPPORTED_VERSIONS:
        if version and version & 0xFFFF == 0:  # a small version number, byte-swapped
            raise GGUFError(f"{path.name}: a big-endian GGUF file; only little-endian is supported")
        raise GGUFError(
            f"{path.name}: GGUF version {version} is not supported (versions 2 and 3 are); "
            "convert the model again with a current llama.cpp"
        )
    tensor_count, kv_count = _U64X2.unpack_from(p.buf, p.off)
    p.off += 16
    p.count("tensor_count", tensor_count, MAX_TENSORS, MIN_TENSOR_INFO_BYTES)
    p.count("kv_count", kv_count, MAX_KVS, MIN_KV_BYTES)
    p.need(tensor_count * MIN_TENSOR_INFO_BYTES + kv_count * MIN_KV_BYTES,
           f"kv_count {kv_count:,} with tensor_count {tensor_count:,}")
    metadata: dict[str, Any] = {
        "GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count,
    }
    value_types = {"GGUF.version": T_UINT32, "GGUF.tensor_count": T_UINT64,
                   "GGUF.kv_count": T_UINT64}

    for i in range(kv_count):
        p.where = f"metadata entry {i}"
        key = p.name("metadata key", MAX_KEY_BYTES)
        p.where = f"metadata key '{key}'"
        vtype = p.u32()
        value = p.value(vtype)
        if key in metadata:
            raise _Corrupt(f"metadata key '{key}' appears twice")
        metadata[key] = value
        value_types[key] = vtype

    table: list[tuple[str, tuple[int, ...], int, int]] = []
    for i in range(tensor_count):
        p.where = f"tensor info {i}"
        name = p.name("tensor name", MAX_TENSOR_NAME_BYTES)
        p.where = f"the info of tensor '{name}'"
        n_dims = p.u32()
        if n_dims > MAX_DIMS:
            raise _Corrupt(f"tensor '{name}' has n_dims {n_dims:,}, at most {MAX_DIMS}")
        p.need(8 * n_dims, f"n_dims {n_dims}")
        dims = struct.unpack_from(f"<{n_dims}Q", p.buf, p.off)
        p.off += 8 * n_dims
        ggml_type = p.u32()
        rel_offset = p.u64()
        table.append((name, dims, ggml_type, rel_offset))

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        if value_types["general.alignment"] != T_UINT32:
            raise _Corrupt("general.alignment is not a uint32")
        alignment = metadata["general.alignment"]
        if alignment == 0 or alignment & (alignment - 1):
            raise _Corrupt(f"general.alignment {alignment} is not a power of two")
    data_offset = -(-p.off // alignment) * alignment

    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, dims, ggml_type, rel_offset in table:
        p.where = f"tensor '{name}'"
        if name in seen:
            raise _Corrupt(f"tensor '{name}' appears twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise _Corrupt(f"tensor '{name}' has unknown type {ggml_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = 1
        for d in dims:
            n_elements *= d
        if n_elements > MAX_ELEMENTS:
            raise _Corrupt(
                f"tensor '{name}' has dimensions {list(dims)}, {n_elements:,} elements, more "
                "than ggml can count (int64)"
            )
        if rel_offset % alignment:
            raise _Corrupt(
                f"tensor '{name}' has data offset {rel_offset:,}, not a multiple of the "
                f"alignment {alignment}"
            )
        n_bytes = n_elements * type_size // block_size
        offset = data_offset + rel_offset
        if offset > p.size:
            raise GGUFError(
                f"{path.name}: tensor '{name}' has data offset {rel_offset:,}, byte {offset:,} "
                f"of a file of {p.size:,} bytes; the file is truncated or corrupt, "
                "download it again"
            )
        end = offset + n_bytes
        if end > p.size:
            raise GGUFError(
                f"{path.name}: tensor '{name}' ends at byte {end:,} but the file has "
                f"{p.size:,}; the file is truncated, download it again"
            )
        shape = tuple(reversed(dims))  # numpy order
        dtype = _TYPED_TENSORS.get(qtype)
        if dtype is None:  # uint8 rows of blocks
            if not shape or shape[-1] % block_size:
                raise _Corrupt(
                    f"tensor '{name}' ({qtype.name}) has rows of {shape[-1] if shape else 0} "
                    f"elements, not a multiple of the block size {block_size}"
                )
            dtype = np.dtype(np.uint8)
            shape = (*shape[:-1], shape[-1] // block_size * type_size)
        raw = data[offset:end].view(dtype).reshape(shape)
        tensors.append(TensorInfo(name, qtype, dims, offset, n_bytes, raw))
    _check_overlaps(path, tensors)

    return GGUFContainer(
        version=version, metadata=metadata, value_types=value_types, tensors=tensors,
        alignment=alignment, data_offset=data_offset, n_file_bytes=p.size, data=data,
    )
