"""Our GGUF container parser gives exactly what the `gguf.GGUFReader` path gave, and fast.

`reference_open` below is the previous `open_gguf` (GGUFReader fields decoded with
`contents()`); it lives only here, as the oracle the new parser is compared against.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from engine.errors import GGUFError
from engine.gguf.container import read_container
from engine.gguf.reader import ModelFile, TensorView, open_gguf

# --- the oracle -------------------------------------------------------------------------------


def _reference_field(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def reference_open(path: Path) -> ModelFile:
    """open_gguf as it was, through GGUFReader (valid files only)."""
    reader = GGUFReader(path, "r")
    metadata = {name: _reference_field(field) for name, field in reader.fields.items()}
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = TensorView(t.name, Q(int(t.tensor_type)), shape, t.data, int(t.n_bytes))
    return ModelFile(path=path, metadata=metadata, tensors=tensors,
                     n_file_bytes=path.stat().st_size, data=reader.data)


def _same_values(a: Any, b: Any) -> bool:
    """Equal, and of the same Python types all the way down (1 == 1.0 == True is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def assert_same_model_file(new: ModelFile, ref: ModelFile) -> None:
    assert list(new.metadata) == list(ref.metadata)
    for key, value in ref.metadata.items():
        assert _same_values(new.metadata[key], value), key
    assert new.n_file_bytes == ref.n_file_bytes
    assert list(new.tensors) == list(ref.tensors)
    for name, r in ref.tensors.items():
        t = new.tensors[name]
        assert (t.name, t.qtype, t.shape, t.n_bytes) == (r.name, r.qtype, r.shape, r.n_bytes), name
        assert type(t.qtype) is type(r.qtype) and all(type(d) is int for d in t.shape)
        assert t.raw.dtype == r.raw.dtype and t.raw.shape == r.raw.shape, name
        assert t.raw.tobytes() == r.raw.tobytes(), name
        assert not t.raw.flags.writeable
        assert t.raw.size == 0 or np.shares_memory(t.raw, new.data)
    assert new.data is not None and ref.data is not None
    assert new.data.dtype == np.uint8 and new.data.shape == (new.n_file_bytes,)
    assert isinstance(new.data, np.memmap) and new.data.mode == "r"
    assert not new.data.flags.writeable


# --- synthetic models -------------------------------------------------------------------------


def test_tiny_model_matches_gguf_reader(tiny_path: Path) -> None:
    assert_same_model_file(open_gguf(tiny_path), reference_open(tiny_path))


def test_demo_model_matches_gguf_reader(demo_path: Path) -> None:
    assert_same_model_file(open_gguf(demo_path), reference_open(demo_path))


# --- every value type -------------------------------------------------------------------------

V = GGUFValueType

SCALARS: list[tuple[str, Any, GGUFValueType]] = [
    ("t.u8", 255, V.UINT8), ("t.i8", -128, V.INT8), ("t.u16", 65535, V.UINT16),
    ("t.i16", -32768, V.INT16), ("t.u32", 4_000_000_000, V.UINT32), ("t.i32", -2_000_000_000, V.INT32),
    ("t.f32", 0.1, V.FLOAT32), ("t.f32_inf", float("-inf"), V.FLOAT32), ("t.f32_nan", float("nan"), V.FLOAT32),
    ("t.u64", 2**64 - 1, V.UINT64), ("t.i64", -(2**63), V.INT64), ("t.f64", 0.1, V.FLOAT64),
    ("t.true", True, V.BOOL), ("t.false", False, V.BOOL),
    ("t.str", "héllo wörld 🎉 <|im_end|>\n\t\x00end", V.STRING), ("t.str_space", " ", V.STRING),
]

ARRAYS: list[tuple[str, list[Any], GGUFValueType]] = [
    ("a.u8", [0, 1, 255], V.UINT8), ("a.i8", [-1, 0, 127], V.INT8),
    ("a.u16", [0, 65535], V.UINT16), ("a.i16", [-32768, 5], V.INT16),
    ("a.u32", [1, 2**32 - 1], V.UINT32), ("a.i32", [-(2**31), 7], V.INT32),
    ("a.f32", [0.1, -2.5, 1e30], V.FLOAT32), ("a.u64", [2**64 - 1, 3], V.UINT64),
    ("a.i64", [-(2**63), 9], V.INT64), ("a.f64", [0.1, -1e300], V.FLOAT64),
    ("a.bool", [True, False, True], V.BOOL),
    ("a.str", ["a", "", "ü", "Ġthe", "\n\n", "🎉" * 50], V.STRING),
]

NESTED: list[tuple[str, list[Any]]] = [  # written with inferred item types (INT32, STRING...)
    ("n.ints", [[1, 2, 3], [4], [5, 6]]),
    ("n.strs", [["a", "bc"], ["d"]]),
    ("n.floats", [[0.5], [1.5, 2.5]]),
    ("n.deep", [[[1, 2], [3]], [[4]]]),
    ("n.mixed", [[1, 2], ["xy"]]),  # numbers first: the string's bytes come out as ints
    ("n.mixed_str", [["xy"], [1]]),  # strings first: the int32 1's bytes come out as a string
]


def write_all_types(path: Path, *, alignment: int | None = None) -> Path:
    w = GGUFWriter(path, "test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype in SCALARS:
        w.add_key_value(key, value, vtype)
    for key, value, vtype in ARRAYS:
        w.add_key_value(key, value, V.ARRAY, sub_type=vtype)
    w.add_array("a.inferred_ints", [1, -2, 3])
    w.add_array("a.inferred_floats", [1.0, 0.25])
    w.add_array("a.bytes", b"\x00\x01\xff")  # bytes are written as a uint8 array
    w.add_array("a.big_strs", [f"tok{i}" for i in range(5000)])
    for key, value in NESTED:
        w.add_array(key, value)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 3, 4)).astype(np.float16))
    w.add_tensor("f64", rng.standard_normal(7))
    w.add_tensor("i8", rng.integers(-100, 100, (4, 2), dtype=np.int8))
    w.add_tensor("i16", rng.integers(-100, 100, (5,), dtype=np.int16))
    w.add_tensor("i32", rng.integers(-100, 100, (2, 2), dtype=np.int32))
    w.add_tensor("i64", rng.integers(-100, 100, (3,), dtype=np.int64))
    w.add_tensor("bf16", rng.integers(0, 2**16, (3, 8), dtype=np.uint16), raw_dtype=Q.BF16)
    w.add_tensor("q8_0", rng.integers(0, 256, (2, 34 * 2), dtype=np.uint8), raw_dtype=Q.Q8_0)
    w.add_tensor("q4_k", rng.integers(0, 256, (3, 144), dtype=np.uint8), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_every_value_type_round_trips(tmp_path: Path, alignment: int | None) -> None:
    p = write_all_types(tmp_path / "all.gguf", alignment=alignment)
    new, ref = open_gguf(p), reference_open(p)
    assert_same_model_file(new, ref)
    md = new.metadata
    assert md["GGUF.version"] == 3 and md["GGUF.tensor_count"] == 10
    for key, value, vtype in SCALARS:
        if vtype == V.FLOAT32:
            value = float(np.float32(value))
        assert _same_values(md[key], value), key
    for key, value, vtype in ARRAYS:
        if vtype == V.FLOAT32:
            value = np.asarray(value, np.float32).tolist()
        assert _same_values(md[key], value), key
    assert md["a.inferred_ints"] == [1, -2, 3] and md["a.bytes"] == [0, 1, 255]
    assert md["a.big_strs"][4321] == "tok4321"
    assert md["n.ints"] == [1, 2, 3, 4, 5, 6] and md["n.strs"] == ["a", "bc", "d"]
    assert md["n.deep"] == [1, 2, 3, 4]
    assert md["n.mixed"] == [1, 2, ord("x"), ord("y")]
    assert md["n.mixed_str"] == ["xy", "\x01\x00\x00\x00"]
    c = read_container(p)
    assert c.alignment == (alignment or 32) and c.data_offset % c.alignment == 0
    # typed payloads keep their dtype; BF16 and block types are uint8 rows
    t = new.tensors
    assert t["f16"].raw.dtype == np.float16 and t["f16"].shape == (2, 3, 4)
    assert t["bf16"].raw.dtype == np.uint8 and t["bf16"].raw.shape == (3, 16)
    assert t["q8_0"].shape == (2, 64) and t["q8_0"].raw.shape == (2, 68)
    assert t["q4_k"].shape == (3, 256) and t["q4_k"].raw.shape == (3, 144)


# --- hand-built files: what GGUFWriter cannot write -------------------------------------------


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_bytes(kvs: list[bytes], tensors: list[bytes] = (), version: int = 3,
               payload: bytes = b"") -> bytes:
    """A GGUF file from pre-encoded kv entries (key + type + value) and tensor infos."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs)
    head += b"".join(tensors)
    return head + bytes(-len(head) % 32) + payload


def kv(key: str, vtype: int, value: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + value


def arr(itype: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", itype, len(items)) + b"".join(items)


def tinfo(name: str, dims: tuple[int, ...], qtype: int, offset: int = 0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)


def test_empty_and_odd_arrays_match_gguf_reader(tmp_path: Path) -> None:
    p = tmp_path / "odd.gguf"
    i32 = [struct.pack("<i", v) for v in (7, 8)]
    p.write_bytes(gguf_bytes([
        kv("e.u32", V.ARRAY, arr(V.UINT32, [])),
        kv("e.str", V.ARRAY, arr(V.STRING, [])),
        kv("e.unknown_item", V.ARRAY, arr(99, [])),  # never read: empty
        kv("e.nested_empty_first", V.ARRAY, arr(V.ARRAY, [arr(V.INT32, []), arr(V.INT32, i32)])),
        kv("e.nested_all_empty", V.ARRAY, arr(V.ARRAY, [arr(V.STRING, [])])),
        kv("e.empty_str", V.STRING, _s("")),
    ], version=2))
    new, ref = open_gguf(p), reference_open(p)
    assert_same_model_file(new, ref)
    assert new.metadata["e.u32"] == [] and new.metadata["e.str"] == []
    assert new.metadata["e.nested_empty_first"] == [7, 8]
    assert new.metadata["GGUF.version"] == 2 and new.metadata["e.empty_str"] == ""


def test_zero_dim_and_empty_tensors_match_gguf_reader(tmp_path: Path) -> None:
    p = tmp_path / "t.gguf"
    payload = np.arange(12, dtype=np.float32).tobytes()
    p.write_bytes(gguf_bytes([], [
        tinfo("scalar", (), Q.F32, 0),
        tinfo("empty", (0, 3), Q.F32, 0),  # offsets are multiples of the alignment, even here
        tinfo("empty_q", (0, 2), Q.Q8_0, 0),
        tinfo("vec", (3,), Q.F32, 32),  # not over the scalar: overlapping tensors are refused
    ], payload=payload))
    new, ref = open_gguf(p), reference_open(p)
    assert_same_model_file(new, ref)
    assert new.tensors["scalar"].raw.shape == () and new.tensors["vec"].raw.tolist() == [8, 9, 10]


def test_invalid_utf8_value_is_replaced(tmp_path: Path) -> None:
    """GGUFReader raised UnicodeDecodeError here (a traceback); we keep the file usable."""
    p = tmp_path / "u.gguf"
    p.write_bytes(gguf_bytes([
        kv("s", V.STRING, _s(b"ok\xffok")),
        kv("a", V.ARRAY, arr(V.STRING, [_s("fine"), _s(b"\xc3")])),
    ]))
    md = open_gguf(p).metadata
    assert md["s"] == "ok\ufffdok" and md["a"] == ["fine", "\ufffd"]


def test_large_string_array(tmp_path: Path) -> None:
    """A vocabulary-sized string array (150,000 entries) parses completely and in order."""
    n = 150_000
    tokens = [f"Ġtok{i}" if i % 3 else f"ü{i}🎉" for i in range(n)]
    w = GGUFWriter(tmp_path / "v.gguf", "test")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", [f"a{i} b{i}" for i in range(n)])
    w.add_array("tokenizer.ggml.token_type", [1] * n)
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(n)])
    w.add_tensor("w", np.ones((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    md = open_gguf(tmp_path / "v.gguf").metadata
    assert md["tokenizer.ggml.tokens"] == tokens
    assert len(md["tokenizer.ggml.merges"]) == n and md["tokenizer.ggml.merges"][-1] == f"a{n-1} b{n-1}"
    assert md["tokenizer.ggml.token_type"] == [1] * n
    assert md["tokenizer.ggml.scores"][123_456] == 123_456.0


# --- errors: one line, GGUFError, never a traceback -------------------------------------------


def one_line_error(path: Path) -> str:
    with pytest.raises(GGUFError) as e:
        open_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(path.name), msg
    return msg


def test_every_truncation_of_the_header(tmp_path: Path) -> None:
    src = write_all_types(tmp_path / "all.gguf")
    data = src.read_bytes()
    data_start = read_container(src).data_offset
    p = tmp_path / "cut.gguf"
    for n in [*range(4, 64), *range(64, data_start + 1, 7), data_start, data_start + 1]:
        p.write_bytes(data[:n])
        assert "truncated" in one_line_error(p), n


def test_corrupt_headers(tmp_path: Path) -> None:
    p = tmp_path / "bad.gguf"
    cases: list[tuple[bytes, str]] = [
        (gguf_bytes([], version=1), "GGUF version 1 is not supported"),
        (gguf_bytes([], version=4), "GGUF version 4 is not supported"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
        (gguf_bytes([kv("k", 13, b"")]), "unknown value type 13"),
        (gguf_bytes([kv("k", V.ARRAY, arr(42, [b"x"]))]), "unknown value type 42"),
        (gguf_bytes([kv("k", V.ARRAY, arr(V.ARRAY, [arr(42, [b"x"])]))]), "unknown value type 42"),
        (gguf_bytes([kv("k", V.UINT8, b"\x01"), kv("k", V.UINT8, b"\x02")]), "appears twice"),
        (gguf_bytes([kv("GGUF.version", V.UINT8, b"\x01")]), "appears twice"),
        (gguf_bytes([kv("general.alignment", V.UINT64, struct.pack("<Q", 32))]), "not a uint32"),
        (gguf_bytes([kv("general.alignment", V.UINT32, struct.pack("<I", 24))]), "power of two"),
        (gguf_bytes([kv("general.alignment", V.UINT32, struct.pack("<I", 0))]), "power of two"),
        (gguf_bytes([kv("k", V.STRING, struct.pack("<Q", 2**63))]), "truncated"),
        (gguf_bytes([kv("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2**62))]), "truncated"),
        (gguf_bytes([kv("k", V.ARRAY, struct.pack("<IQ", V.FLOAT64, 2**62))]), "truncated"),
        (gguf_bytes([_s(b"\xff") + struct.pack("<I", V.UINT8) + b"\x00"]), "not valid UTF-8"),
        (gguf_bytes([], [tinfo("t", (4,), 1000)], payload=bytes(64)), "unknown type 1000"),
        (gguf_bytes([], [tinfo("t", (4,), Q.F32)] * 2, payload=bytes(64)), "appears twice"),
        (gguf_bytes([], [tinfo("t", (33,), Q.Q8_0)], payload=bytes(64)), "block size 32"),
        (gguf_bytes([], [tinfo("t", (1,) * 40, Q.F32)], payload=bytes(64)),
         "n_dims 40, at most 16"),
        (gguf_bytes([], [tinfo("t", (2**40, 2**40), Q.F32)]), "the file is truncated"),
        (gguf_bytes([], [tinfo("t", (4,), Q.F32, 2**63)]), "the file is truncated"),
        (b"GGUF" + struct.pack("<IQQ", 3, 2**63, 0), "truncated"),
    ]
    for data, expected in cases:
        p.write_bytes(data)
        msg = one_line_error(p)
        assert expected in msg, (expected, msg)


def test_big_endian_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "be.gguf"
    w = GGUFWriter(p, "test", endianess=GGUFEndian.BIG)
    w.add_uint32("k", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "big-endian" in one_line_error(p)


def test_tensor_past_the_end(tmp_path: Path) -> None:
    p = tmp_path / "short.gguf"
    p.write_bytes(gguf_bytes([], [tinfo("blk.0.w", (8, 2), Q.F32)], payload=bytes(60)))
    msg = one_line_error(p)
    assert "tensor 'blk.0.w' ends at byte" in msg and "truncated" in msg
