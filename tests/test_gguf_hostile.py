"""Hostile GGUF headers finish fast with one line: every header number is checked first.

Each case patches a few bytes of the `tiny` preset (a valid 0.4 MB file) or is a few
hand-written bytes, and loads it the way `strata plan` and `strata run` do; each must end in
under a second with a one-line error naming what was wrong. The end-to-end test runs the CLI
in a subprocess (a hang there is a timeout, a traceback is text on stderr).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGUFValueType as V

from engine.errors import GGUFError, TokenizerError
from engine.gguf.hparams import read_hparams
from engine.gguf.reader import open_gguf
from engine.gguf.tokenizer import Tokenizer
from engine.model.loader import load_model

ARCH = "qwen3moe"
Edit = Callable[[bytearray], None]


# --- finding and patching header fields of the tiny file --------------------------------------


def _after_string(data: bytearray, text: str) -> int:
    """Offset just past the one length-prefixed `text` in the header (a key or tensor name)."""
    raw = text.encode()
    needle = struct.pack("<Q", len(raw)) + raw
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, text
    return at + len(needle)


def value(key: str, fmt: str, v: float, vtype: int | None = None) -> Edit:
    """Overwrite the value of metadata `key` (same byte size), optionally its value type."""

    def edit(data: bytearray) -> None:
        at = _after_string(data, key)
        if vtype is not None:
            struct.pack_into("<I", data, at, vtype)
        struct.pack_into(fmt, data, at + 4, v)

    return edit


def array(key: str, *, count: int | None = None, itype: int | None = None) -> Edit:
    """Overwrite the item type and/or the length of the array `key`."""

    def edit(data: bytearray) -> None:
        at = _after_string(data, key) + 4  # past the value type (ARRAY)
        if itype is not None:
            struct.pack_into("<I", data, at, itype)
        if count is not None:
            struct.pack_into("<Q", data, at + 4, count)

    return edit


def string_length(text: str, n: int, skip: int = 0) -> Edit:
    """Overwrite a length prefix: of `text` itself (skip=0), or of the string value that
    follows key `text` (skip=4, past the value type)."""

    def edit(data: bytearray) -> None:
        at = _after_string(data, text)
        if skip:
            struct.pack_into("<Q", data, at + skip, n)
        else:
            struct.pack_into("<Q", data, at - len(text.encode()) - 8, n)

    return edit


def tensor(name: str, *, n_dims: int | None = None, dims: tuple[int, ...] | None = None,
           qtype: int | None = None, offset: int | None = None) -> Edit:
    """Overwrite fields of tensor `name`'s info: n_dims, dims (same count), type, offset."""

    def edit(data: bytearray) -> None:
        at = _after_string(data, name)
        (nd,) = struct.unpack_from("<I", data, at)
        if dims is not None:
            assert len(dims) == nd
            struct.pack_into(f"<{nd}Q", data, at + 4, *dims)
        if qtype is not None:
            struct.pack_into("<I", data, at + 4 + 8 * nd, qtype)
        if offset is not None:
            struct.pack_into("<Q", data, at + 8 + 8 * nd, offset)
        if n_dims is not None:
            struct.pack_into("<I", data, at, n_dims)

    return edit


def header(*, tensor_count: int | None = None, kv_count: int | None = None) -> Edit:
    def edit(data: bytearray) -> None:
        if tensor_count is not None:
            struct.pack_into("<Q", data, 8, tensor_count)
        if kv_count is not None:
            struct.pack_into("<Q", data, 16, kv_count)

    return edit


def rename(old: str, new: str) -> Edit:
    """Rename a key or tensor in place (the new name has as many UTF-8 bytes)."""

    def edit(data: bytearray) -> None:
        at = _after_string(data, old)
        raw = new.encode()
        assert len(raw) == len(old.encode())
        data[at - len(raw) : at] = raw

    return edit


def whole(raw: bytes) -> Edit:
    """Replace the whole file by `raw`."""

    def edit(data: bytearray) -> None:
        data[:] = raw

    return edit


def _nested(depth: int) -> bytes:
    """A GGUF file with one key: an int32 array nested `depth` arrays deep."""
    value_ = struct.pack("<IQi", V.INT32, 1, 7)
    for _ in range(depth - 1):
        value_ = struct.pack("<IQ", V.ARRAY, 1) + value_
    kv = struct.pack("<Q", 1) + b"k" + struct.pack("<I", V.ARRAY) + value_
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv


U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1
EMBD, NORM = "token_embd.weight", "output_norm.weight"

# (id, edit, what the one line must say). GGUFError unless the id starts with "tok:".
CASES: list[tuple[str, Edit, str]] = [
    # sizes of the file
    ("empty file", whole(b""), "empty file (0 bytes)"),
    ("two bytes", whole(b"GG"), "truncated: 2 bytes"),
    ("header cut", whole(b"GGUF\x03\x00\x00\x00"), "truncated: 8 bytes"),
    # the header's counts
    ("tensor_count u64 max", header(tensor_count=U64_MAX), f"tensor_count {U64_MAX:,} is more"),
    ("tensor_count 4e9", header(tensor_count=4_000_000_000), "tensor_count 4,000,000,000 is more"),
    ("tensor_count past file", header(tensor_count=100_000),
     "the header: tensor_count 100,000 needs 2,400,000 bytes"),
    ("kv_count u64 max", header(kv_count=U64_MAX), f"kv_count {U64_MAX:,} is more"),
    ("kv_count past file", header(kv_count=50_000), "kv_count 50,000 needs"),
    # strings
    ("key length", string_length("general.architecture", 2**40),
     "metadata entry 0: metadata key length 1,099,511,627,776 is more than the limit of 65,535"),
    ("string value length", string_length("general.name", 2**63, skip=4),
     "string length 9,223,372,036,854,775,808 is more"),
    ("chat template length", string_length("tokenizer.chat_template", 2**26, skip=4),
     "string length 67,108,864 needs"),
    ("tensor name length", string_length(NORM, 64),
     "tensor info 1: tensor name length 64 is more than the limit of 63"),
    ("tensor name u64 max", string_length(EMBD, U64_MAX), f"tensor name length {U64_MAX:,}"),
    # arrays: lengths and item types
    ("vocab length 2^62", array("tokenizer.ggml.tokens", count=2**62),
     "array length 4,611,686,018,427,387,904 is more"),
    ("vocab length at limit", array("tokenizer.ggml.tokens", count=1 << 24),
     "array length 16,777,216 needs 134,217,728 bytes"),
    ("merges u64 max", array("tokenizer.ggml.merges", count=U64_MAX), "array length"),
    ("token_type 2^40 int32", array("tokenizer.ggml.token_type", count=2**40), "array length"),
    ("array item type", array("tokenizer.ggml.token_type", itype=99), "unknown value type 99"),
    ("array of arrays", array("tokenizer.ggml.tokens", itype=V.ARRAY), "array length"),
    ("value type", value(f"{ARCH}.block_count", "<I", 3, vtype=99), "unknown value type 99"),
    ("nested 9 deep", whole(_nested(9)), "nests arrays more than 8 deep"),
    # tensor infos
    ("n_dims 4e9", tensor(EMBD, n_dims=4_000_000_000), "n_dims 4,000,000,000, at most 16"),
    ("dims overflow", tensor(EMBD, dims=(2**32, 2**32)), "more than ggml can count (int64)"),
    ("dims past file", tensor(EMBD, dims=(64, 2**20)), "tensor 'token_embd.weight' ends at byte"),
    ("unknown qtype", tensor(NORM, qtype=4_000_000_000), "unknown type 4000000000"),
    ("offset unaligned", tensor(NORM, offset=69_633),
     "'output_norm.weight' has data offset 69,633, not a multiple of the alignment 32"),
    ("offset 2^63", tensor(NORM, offset=2**63), "data offset 9,223,372,036,854,775,808, byte"),
    ("offset past end", tensor(NORM, offset=1 << 20), "data offset 1,048,576, byte"),
    # hyper-parameters: sane limits
    ("block_count 4e9", value(f"{ARCH}.block_count", "<I", 4_000_000_000),
     f"'{ARCH}.block_count' = 4,000,000,000 is outside the sane range 1..1,024"),
    ("block_count 0", value(f"{ARCH}.block_count", "<I", 0), "'qwen3moe.block_count' = 0 is out"),
    ("block_count float", value(f"{ARCH}.block_count", "<f", 3.0, vtype=V.FLOAT32),
     "'qwen3moe.block_count' = 3.0 is not an integer"),
    ("nextn 4e9", value(f"{ARCH}.nextn_predict_layers", "<I", 4_000_000_000),
     "'qwen3moe.nextn_predict_layers' = 4,000,000,000 is outside"),
    ("nextn -1", value(f"{ARCH}.nextn_predict_layers", "<i", -1, vtype=V.INT32),
     "'qwen3moe.nextn_predict_layers' = -1 is outside"),
    ("expert_count max", value(f"{ARCH}.expert_count", "<I", U32_MAX),
     f"'qwen3moe.expert_count' = {U32_MAX:,} is outside"),
    ("expert_used 4e9", value(f"{ARCH}.expert_used_count", "<I", 4_000_000_000),
     "'qwen3moe.expert_used_count' = 4,000,000,000 is outside"),
    ("expert ffn 0", value(f"{ARCH}.expert_feed_forward_length", "<I", 0),
     "'qwen3moe.expert_feed_forward_length' = 0 is outside"),
    ("embedding 4e9", value(f"{ARCH}.embedding_length", "<I", 4_000_000_000),
     "'qwen3moe.embedding_length' = 4,000,000,000 is outside"),
    ("head_count 0", value(f"{ARCH}.attention.head_count", "<I", 0),
     "'qwen3moe.attention.head_count' = 0 is outside"),
    ("head_count_kv 0", value(f"{ARCH}.attention.head_count_kv", "<I", 0),
     "'qwen3moe.attention.head_count_kv' = 0 is outside"),
    ("key_length 4e9", value(f"{ARCH}.attention.key_length", "<I", 4_000_000_000),
     "'qwen3moe.attention.key_length' = 4,000,000,000 is outside"),
    ("context 0", value(f"{ARCH}.context_length", "<I", 0), "'qwen3moe.context_length' = 0 is out"),
    ("context max", value(f"{ARCH}.context_length", "<I", U32_MAX),
     f"'qwen3moe.context_length' = {U32_MAX:,} is outside the sane range 1..16,777,216"),
    ("rms eps nan", value(f"{ARCH}.attention.layer_norm_rms_epsilon", "<f", float("nan")),
     "layer_norm_rms_epsilon' = nan is not a positive finite number below 1"),
    ("rope base -1", value(f"{ARCH}.rope.freq_base", "<f", -1.0), "freq_base' = -1.0 is not"),
    # hyper-parameters against the tensors present
    ("block_count 1000", value(f"{ARCH}.block_count", "<I", 1000),
     "'qwen3moe.block_count' = 1,000 but the file has tensors for 3 blocks (none for blk.3)"),
    ("block_count 2", value(f"{ARCH}.block_count", "<I", 2),
     "tensor 'blk.2.attn_norm.weight' is in block 2 but metadata key 'qwen3moe.block_count' = 2"),
    ("block index", rename("blk.0.attn_norm.weight", "blk.x.attn_norm.weight"),
     "tensor 'blk.x.attn_norm.weight' has block index 'x', not a number"),
    ("block index unicode", rename("blk.1.attn_norm.weight", "blk.\u0661.attn_norm.weigh"),
     "has block index '\u0661', not a number"),
    ("expert_count 9", value(f"{ARCH}.expert_count", "<I", 9),
     "'blk.0.ffn_gate_inp.weight' has shape [8, 64], expected [9, 64]"),
    ("embedding 128", value(f"{ARCH}.embedding_length", "<I", 128), "expected [1024, 128]"),
    ("vocab 2^23", tensor(EMBD, dims=(0, 2**23)),
     "'token_embd.weight' has 8,388,608 rows (the vocabulary), outside the sane range"),
    # tokenizer metadata of the wrong type
    ("tok: token_type floats", array("tokenizer.ggml.token_type", itype=V.FLOAT32),
     "'tokenizer.ggml.token_type' = [1.4"),
    ("tok: bos float", value("tokenizer.ggml.bos_token_id", "<f", 1.0, vtype=V.FLOAT32),
     "'tokenizer.ggml.bos_token_id' = 1.0 is not a token id"),
]


def _load(path: Path) -> None:
    """What `strata plan` and `strata run` do before any device work."""
    load_model(path, build=False)


@pytest.mark.parametrize(("case", "edit", "needle"), CASES, ids=[c[0] for c in CASES])
def test_hostile_header(tmp_path: Path, tiny_path: Path, case: str, edit: Edit,
                        needle: str) -> None:
    data = bytearray(tiny_path.read_bytes())
    edit(data)
    p = tmp_path / "hostile.gguf"
    p.write_bytes(bytes(data))
    t0 = time.perf_counter()
    with pytest.raises(TokenizerError if case.startswith("tok:") else GGUFError) as e:
        _load(p)
    seconds = time.perf_counter() - t0
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert needle in msg, (needle, msg)
    assert seconds < 1.0, f"{case}: {seconds:.2f} s"


def test_the_patches_keep_a_valid_file_valid(tmp_path: Path, tiny_path: Path) -> None:
    """The patcher finds the right bytes: same values written back, or an int where a float
    may be, still load."""
    data = bytearray(tiny_path.read_bytes())
    for edit in (value(f"{ARCH}.block_count", "<I", 3), tensor(NORM, offset=69_632),
                 value(f"{ARCH}.rope.freq_base", "<i", 7, vtype=V.INT32),
                 array("tokenizer.ggml.tokens", count=1024), header(tensor_count=43, kv_count=27)):
        edit(data)
    p = tmp_path / "same.gguf"
    p.write_bytes(bytes(data))
    assert load_model(p, build=False).hp.rope_base == 7.0


def test_token_embd_must_be_a_matrix(tiny_path: Path) -> None:
    mf = open_gguf(tiny_path)
    t = mf.tensors[EMBD]
    mf.tensors[EMBD] = replace(t, shape=(t.shape[0] * t.shape[1],))
    with pytest.raises(GGUFError) as e:
        read_hparams(mf)
    assert "'token_embd.weight' has shape [65536], expected [n_vocab, n_embd]" in str(e.value)


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [
        (5, "'tokenizer.ggml.tokens' = 5 is not an array of str values"),
        (list(range(4)), "'tokenizer.ggml.tokens' = [0, 1, 2, 3] is not an array of str values"),
        ("abc", "'tokenizer.ggml.tokens' = 'abc' is not an array"),
    ],
)
def test_tokenizer_arrays_of_the_wrong_type(tiny_path: Path, tokens: object, needle: str) -> None:
    meta = {**open_gguf(tiny_path).metadata, "tokenizer.ggml.tokens": tokens}
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_metadata(meta)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("tokenizer.ggml.merges", 7),
        ("tokenizer.ggml.merges", [1, 2]),
        ("tokenizer.ggml.token_type", 3),
        ("tokenizer.ggml.token_type", ["a"] * 1024),
        ("tokenizer.ggml.bos_token_id", "x"),
        ("tokenizer.ggml.eos_token_id", [1]),
        ("tokenizer.ggml.eot_token_id", "x"),
    ],
)
def test_tokenizer_metadata_of_the_wrong_type(tiny_path: Path, key: str, bad: object) -> None:
    meta = {**open_gguf(tiny_path).metadata, key: bad}
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_metadata(meta)
    assert f"'{key}' = {bad!r:.40}" in str(e.value) and "\n" not in str(e.value)


# --- the CLI, end to end ----------------------------------------------------------------------

CLI_CASES = {
    "block_count": value(f"{ARCH}.block_count", "<I", 4_000_000_000),
    "head_count_kv": value(f"{ARCH}.attention.head_count_kv", "<I", 0),
    "tensor_count": header(tensor_count=U64_MAX),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_exits_2_with_one_line(tmp_path: Path, tiny_path: Path, case: str) -> None:
    data = bytearray(tiny_path.read_bytes())
    CLI_CASES[case](data)
    p = tmp_path / "hostile.gguf"
    p.write_bytes(bytes(data))
    for args in (["info", str(p)], ["plan", "--model", str(p), "--device", "sim"],
                 ["run", "--model", str(p), "--device", "sim", "--prompt", "hi", "--max-new", "1"]):
        r = subprocess.run([sys.executable, "-m", "engine.cli", *args], check=False,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("strata: error: hostile.gguf: "), (args, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (args, r.stderr)
        assert r.stdout == "", (args, r.stdout)
