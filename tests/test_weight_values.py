"""Hostile weights end at load with one line naming the tensor: NaN, infinity or 1e30 in a
norm, the router or a block scale; two tensors sharing bytes; a tensor the model does not have.

Each case patches the payload (or the tensor table) of the `tiny` preset, as
tests/test_gguf_hostile.py patches headers; the CLI cases run `strata run` in a subprocess and
check the exit code, the one line and that no NUL byte (or any text) reached stdout.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.errors import GGUFError
from engine.gguf.container import read_container
from engine.gguf.reader import SUPPORTED_QTYPES, open_gguf
from engine.gguf.weight_values import (
    FLOAT16_MAX,
    IQ1_M_SCALES,
    MXFP4_NAN,
    SAMPLE_ROWS,
    SCALE_OFFSETS,
    check_values,
    tensor_problem,
)
from engine.model.loader import load_model
from engine.synth.blocks import SCALE_FIELDS, random_tensor
from engine.synth.model import PRESETS, synth_tensors, write_gguf
from engine.synth.vocab import build_vocab

Edit = Callable[[bytearray], None]
F16_NAN = struct.pack("<e", float("nan"))
F16_INF = struct.pack("<e", float("inf"))


def _info(path: Path, name: str) -> tuple[int, int, int]:
    """(absolute payload offset, relative data offset, offset of the info's offset field)."""
    c = read_container(path)
    t = next(t for t in c.tensors if t.name == name)
    raw = path.read_bytes()[: c.data_offset]
    needle = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(needle) + len(needle)
    (n_dims,) = struct.unpack_from("<I", raw, at)
    return t.offset, t.offset - c.data_offset, at + 4 + 8 * n_dims + 4


def f32(name: str, index: int, value: float) -> Callable[[Path], Edit]:
    """Element `index` of float32 tensor `name` set to `value`."""
    def at(path: Path) -> Edit:
        offset = _info(path, name)[0]
        return lambda data: struct.pack_into("<f", data, offset + 4 * index, value)
    return at


def scale(name: str, block: int, f16: bytes) -> Callable[[Path], Edit]:
    """The scale `d` (byte 0 of a Q8_0 or Q4_0 block) of block `block` of `name`."""
    def at(path: Path) -> Edit:
        offset = _info(path, name)[0]
        qtype = next(t.qtype for t in read_container(path).tensors if t.name == name)
        block_bytes = GGML_QUANT_SIZES[qtype][1]
        return lambda data: data.__setitem__(
            slice(offset + block * block_bytes, offset + block * block_bytes + 2), f16)
    return at


def same_offset(name: str, as_name: str) -> Callable[[Path], Edit]:
    """Tensor `name`'s data offset set to `as_name`'s: the two share bytes."""
    def at(path: Path) -> Edit:
        rel = _info(path, as_name)[1]
        field = _info(path, name)[2]
        return lambda data: struct.pack_into("<Q", data, field, rel)
    return at


NORM, ROUTER = "blk.0.attn_norm.weight", "blk.1.ffn_gate_inp.weight"
CASES = [
    ("nan in a norm", f32(NORM, 5, float("nan")), f"tensor '{NORM}' (F32) holds nan at element 5"),
    ("inf in a norm", f32("output_norm.weight", 0, float("inf")), "holds inf at element 0"),
    ("1e30 in a norm", f32(NORM, 63, 1e30),
     "holds 1e+30 at element 63, beyond float16's range of ±65,504"),
    ("-inf in the router", f32(ROUTER, 300, float("-inf")),
     f"tensor '{ROUTER}' (F32) holds -inf at element 300"),
    ("1e30 in the router", f32(ROUTER, 7, -1e30), "holds -1e+30 at element 7"),
    ("nan scale", scale("blk.0.attn_q.weight", 17, F16_NAN),
     ("tensor 'blk.0.attn_q.weight' (Q8_0) has a block scale that is NaN or infinite (block 1 "
      "of row 8)")),
    ("inf scale in the head", scale("output.weight", 0, F16_INF), "'output.weight' (Q8_0) has"),
    ("nan scale in an expert", scale("blk.1.ffn_down_exps.weight", 0, F16_NAN),
     ("'blk.1.ffn_down_exps.weight' (Q4_0) has a block scale that is NaN or infinite (block 0 "
      "of row 0)")),
    ("overlapping tensors", same_offset("blk.0.attn_k.weight", "blk.0.attn_q.weight"),
     "tensors 'blk.0.attn_q.weight' (bytes"),
]


def _hostile(tmp_path: Path, tiny_path: Path, make: Callable[[Path], Edit]) -> Path:
    data = bytearray(tiny_path.read_bytes())
    make(tiny_path)(data)
    p = tmp_path / "hostile.gguf"
    p.write_bytes(bytes(data))
    return p


@pytest.mark.parametrize(("case", "make", "needle"), CASES, ids=[c[0] for c in CASES])
def test_hostile_weights_refused_at_load(tmp_path: Path, tiny_path: Path, case: str,
                                         make: Callable[[Path], Edit], needle: str) -> None:
    p = _hostile(tmp_path, tiny_path, make)
    t0 = time.perf_counter()
    with pytest.raises(GGUFError) as e:
        load_model(p, build=False)
    msg = str(e.value)
    assert msg.startswith("hostile.gguf: ") and "\n" not in msg, msg
    assert needle in msg, (needle, msg)
    assert time.perf_counter() - t0 < 1.0


def test_overlap_names_both_tensors(tmp_path: Path, tiny_path: Path) -> None:
    p = _hostile(tmp_path, tiny_path, same_offset("output_norm.weight", "token_embd.weight"))
    with pytest.raises(GGUFError) as e:
        read_container(p)
    assert ("tensors 'token_embd.weight' (bytes" in str(e.value)
            and "and 'output_norm.weight' (from byte" in str(e.value)
            and "overlap" in str(e.value)), e.value


def test_an_extra_tensor_is_refused(tmp_path: Path) -> None:
    """A tensor no qwen3moe model has (written with our GGUF writer) is refused, as llama.cpp
    refuses it ("wrong number of tensors"), naming it."""
    spec = PRESETS["tiny"]
    tensors = synth_tensors(spec)
    tensors["blk.0.ffn_gate_shexp.weight"] = ((64, 64), Q.F32)
    from engine.synth.model import make_tensor

    data = (np.zeros(shape, np.float32) if name.endswith("shexp.weight")
            else make_tensor(name, shape, q, spec) for name, (shape, q) in tensors.items())
    p = write_gguf(tmp_path / "extra.gguf", spec, build_vocab(spec.n_vocab, seed=spec.seed),
                   tensors, data, "extra")
    with pytest.raises(GGUFError) as e:
        load_model(p, build=False)
    assert "extra.gguf: tensor 'blk.0.ffn_gate_shexp.weight' is not one a qwen3moe model " \
        "has" in str(e.value), e.value


@pytest.mark.parametrize("case", ["nan in a norm", "nan scale in an expert",
                                  "overlapping tensors"])
def test_cli_refuses_with_one_line_and_no_output(tmp_path: Path, tiny_path: Path,
                                                 case: str) -> None:
    make, needle = next((m, n) for c, m, n in CASES if c == case)
    p = _hostile(tmp_path, tiny_path, make)
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", "--model", str(p), "--device",
                        "sim", "--prompt", "hi", "--max-new", "4"],
                       check=False, capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert err.startswith("strata: error: hostile.gguf: ") and err.count("\n") == 1, err
    assert needle in err and "Traceback" not in err and "Warning" not in err, err
    assert r.stdout == b"", r.stdout  # nothing, NUL bytes least of all


def test_the_clean_model_passes(tiny_path: Path, demo_path: Path) -> None:
    for path in (tiny_path, demo_path):
        check_values(open_gguf(path))


# --- the scale fields, held against gguf.quants' decoders -------------------------------------

QUANTIZED = sorted((q for q in SUPPORTED_QTYPES if q not in (Q.F32, Q.F16, Q.BF16)),
                   key=lambda q: q.name)


def _decode(raw: np.ndarray, qtype: Q) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gq.dequantize(raw, qtype)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_a_bad_scale_is_found_where_the_decoder_reads_it(qtype: Q) -> None:
    """For every quant type: a NaN written into each scale field makes gguf.quants decode
    non-finite (or float16-overflowing) values, and `tensor_problem` names that block; a clean
    tensor decodes finite and passes."""
    from engine.gguf.reader import TensorView

    block, block_bytes = GGML_QUANT_SIZES[qtype]
    clean = random_tensor(np.random.default_rng(0), qtype, (4, 2 * block), 0.05)  # [4, row]
    assert np.isfinite(_decode(clean, qtype)).all()
    view = lambda raw: TensorView("w", qtype, (4, 2 * block), raw, raw.nbytes)
    assert tensor_problem(view(clean)) == ""

    def poison(raw: np.ndarray) -> list[np.ndarray]:
        """Copies of `raw` with one scale field of block 1 of row 2 made NaN, one per field."""
        out = []
        blocks = lambda r: r.reshape(4, 2, block_bytes)
        if qtype == Q.MXFP4:
            bad = raw.copy()
            blocks(bad)[2, 1, 0] = MXFP4_NAN
            return [bad]
        if qtype == Q.IQ1_M:
            bad = raw.copy()
            words = blocks(bad)[2, 1, IQ1_M_SCALES : IQ1_M_SCALES + 8].view(np.uint16)
            nan_bits = np.float16("nan").view(np.uint16)
            for w in range(4):
                words[w] = (words[w] & 0x0FFF) | (((nan_bits >> (4 * w)) & 0xF) << 12)
            return [bad]
        for offset in SCALE_OFFSETS[qtype]:
            bad = raw.copy()
            blocks(bad)[2, 1, offset : offset + 2] = np.frombuffer(F16_NAN, np.uint8)
            out.append(bad)
        return out

    for bad in poison(clean):
        x = _decode(bad, qtype)
        assert not (np.abs(x) <= FLOAT16_MAX).all(), "the decoder does not read this field"
        assert tensor_problem(view(bad)) == ("has a block scale that is NaN or infinite "
                                             "(block 1 of row 2)")


def test_scale_offsets_agree_with_the_synthetic_writer() -> None:
    """engine/synth/blocks.py writes the same fields (one table would be better; two are held
    equal here)."""
    for qtype, fields in SCALE_FIELDS.items():
        assert tuple(off for off, _ in fields) == SCALE_OFFSETS.get(qtype, ()), qtype.name


def test_expert_tensors_are_sampled(tiny_path: Path) -> None:
    """A routed-expert tensor is read on SAMPLE_ROWS rows spread evenly, first and last
    included: a NaN there is found, one between two sampled rows is not (the documented
    price of not reading gigabytes at startup)."""
    from dataclasses import replace

    t = open_gguf(tiny_path).tensors["blk.0.ffn_up_exps.weight"]  # [8, 64, 64] Q4_0
    n_rows = 8 * 64
    assert n_rows > SAMPLE_ROWS
    raw = np.array(t.raw).reshape(n_rows, -1)  # [512, row_bytes]
    for row, found in ((0, True), (n_rows - 1, True), (1, False)):
        bad = raw.copy()
        bad[row, 0:2] = np.frombuffer(F16_NAN, np.uint8)
        problem = tensor_problem(replace(t, raw=bad.reshape(t.raw.shape)), sampled=True)
        assert bool(problem) == found, (row, problem)
        assert bool(tensor_problem(replace(t, raw=bad.reshape(t.raw.shape))))  # all rows: found
