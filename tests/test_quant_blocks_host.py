"""The CUDA block decoders of engine/kernels/quant_blocks.cu, compiled for the host with g++.

quant_blocks.cu is plain C++ apart from QB_FN and the f16 conversions (its QB_HOST switch), so
this harness supplies those, includes the file and calls every decoder's `dec8` for every group
of 8 values of random blocks; the result must equal `gguf.quants.dequantize`. A second build
with UBSan's alignment check runs each decoder on blocks placed at the lowest alignment the
.cu's rule allows them (min(ALIGN, 16), ALIGN the largest power of two dividing TS).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.kernels.dequant import (
    DECODERS,
    _groups_per_thread,
    block_layout,
    check_layouts,
    declared_layouts,
    decoder_align,
    lookup_table,
)

GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found: the host check needs it")

_CU = Path(__file__).resolve().parents[1] / "engine" / "kernels" / "quant_blocks.cu"

_HARNESS = r"""
#define QB_HOST
#include <cstring>
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
#define QB_FN inline
inline float h2f(u16 h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
inline u16 f2h(float f) { _Float16 x = (_Float16)f; u16 h; std::memcpy(&h, &x, 2); return h; }
inline int popc8(u32 v) { return __builtin_popcount(v); }
#include "quant_blocks.cu"

template <class BT>
static void run(const u8* blocks, int n_blocks, const u32* tab, float* out) {
  for (i64 i = 0; i < n_blocks; ++i)
    for (int j = 0; j < BT::QK / 8; ++j)
      BT::dec8(blocks + i * BT::TS, j, out + i * BT::QK + 8 * j, tab);
}

// decode: 0, or -1 for an unknown decoder; layout: QK, TS and NTAB (TabWords) of a decoder
#define DECODE(T) if (!std::strcmp(type, #T)) { run<T>(blocks, n_blocks, tab, out); return 0; }
#define LAYOUT(T) \
  if (!std::strcmp(type, #T)) { qk_ts_ntab[0] = T::QK; qk_ts_ntab[1] = T::TS; \
                                qk_ts_ntab[2] = TabWords<T>::N; return 0; }
extern "C" int decode(const char* type, const u8* blocks, int n_blocks, const u32* tab,
                      float* out) {
  DECODERS(DECODE)
  return -1;
}
extern "C" int layout(const char* type, int* qk_ts_ntab) {
  DECODERS(LAYOUT)
  return -1;
}
"""


def _build(out_dir: Path, name: str, *flags: str) -> Path:
    src = out_dir / "harness.cpp"
    listed = " ".join(f"X({s})" for s in DECODERS.values())
    src.write_text(f"#define DECODERS(X) {listed}\n" + _HARNESS)
    lib = out_dir / name
    cmd = [GXX, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-shared",
           "-fPIC", *flags, f"-I{_CU.parent}", str(src), "-o", str(lib)]  # fmt: skip
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if r.returncode:
        raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr[-4000:])
    return lib


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    path = _build(tmp_path_factory.mktemp("quant_blocks"), "decoders.so")
    so = ctypes.CDLL(str(path))
    so.decode.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                          ctypes.c_void_p]  # fmt: skip
    so.layout.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    return so


def _decode(so: ctypes.CDLL, qtype: Q, raw: np.ndarray) -> np.ndarray:
    """uint8 [n_blocks, TS] blocks -> float32 [n_blocks * QK] through the .cu decoder."""
    qk, ts = block_layout(qtype)
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, ts)
    tab = np.ascontiguousarray(lookup_table(qtype))
    tab = tab if tab.size else np.zeros(1, dtype=np.uint32)
    out = np.full(raw.shape[0] * qk, np.nan, dtype=np.float32)
    rc = so.decode(DECODERS[qtype].encode(), raw.ctypes.data, raw.shape[0], tab.ctypes.data,
                   out.ctypes.data)  # fmt: skip
    assert rc == 0, f"the harness has no decoder {DECODERS[qtype]}"
    return out


# f16 fields of each type's block (byte offsets): set to finite values in random blocks
_F16_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
    Q.IQ4_XS: (0,), Q.IQ4_NL: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ1_S: (0,),
    Q.IQ1_M: (), Q.MXFP4: (),  # d split over nibbles; an E8M0 byte: both handled below
}  # fmt: skip
_FLOATS = (Q.F32, Q.F16, Q.BF16)


def _random_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite f16 scales of either sign over 2^-14 .. 2^3, a few zeros and subnormals."""
    d = rng.choice([-1.0, 1.0], n) * rng.uniform(1, 2, n) * 2.0 ** rng.integers(-14, 3, n)
    d[rng.random(n) < 0.02] = 0.0
    d[rng.random(n) < 0.02] = 2.0**-20  # an f16 subnormal
    return d.astype(np.float16)


def _random_blocks(rng: np.random.Generator, qtype: Q, n_blocks: int) -> np.ndarray:
    """uint8 [n_blocks, TS]: random bytes, f16 scale fields finite."""
    qk, ts = block_layout(qtype)
    if qtype in _FLOATS:  # finite values, any sign and size, zeros too
        lo, hi = (-30, 13) if qtype == Q.F16 else (-20, 20)  # F16: subnormals to 2^15
        x = rng.standard_normal(n_blocks * qk) * 2.0 ** rng.integers(lo, hi, n_blocks * qk)
        x[::7] = 0.0
        x = x.astype(np.float32)
        if qtype == Q.F16:
            return x.astype(np.float16).view(np.uint8).reshape(n_blocks, ts)
        if qtype == Q.BF16:
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, ts)
        return x.view(np.uint8).reshape(n_blocks, ts)
    raw = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        raw[:, off : off + 2] = _random_scales(rng, n_blocks).view(np.uint8).reshape(-1, 2)
    if qtype == Q.IQ1_M:  # nibble w of d goes to the top nibble of scale word w (bytes 48..55)
        d = _random_scales(rng, n_blocks).view(np.uint16).astype(np.uint16)
        words = raw[:, 48:56].copy().view(np.uint16)  # [n_blocks, 4]
        for w in range(4):
            words[:, w] = (words[:, w] & 0x0FFF) | (((d >> (4 * w)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    if qtype == Q.MXFP4:  # every E8M0 exponent; the values of e >= 253 overflow to inf
        raw[:, 0] = np.arange(n_blocks) % 256
    return raw


def _assert_matches(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Equal up to float32 rounding: non-finite values identical, finite ones within 1e-6 of
    the largest |value| of their block group (ref's blocks of QK)."""
    fin = np.isfinite(ref)
    assert np.array_equal(fin, np.isfinite(got)), f"{what}: non-finite values differ"
    assert np.array_equal(got[~fin], ref[~fin], equal_nan=True), f"{what}: inf/nan differ"
    scale = np.abs(np.where(fin, ref, 0)).max() if fin.any() else 0.0
    err = np.abs(got[fin].astype(np.float64) - ref[fin])
    tol = 1e-6 * np.abs(ref[fin]) + 1e-6 * scale
    bad = np.flatnonzero(err > tol)
    assert bad.size == 0, (
        f"{what}: {bad.size} of {err.size} values differ, first at {bad[0]}: "
        f"got {got[fin][bad[0]]!r}, gguf {ref[fin][bad[0]]!r}"
    )


def _can_quantize(qtype: Q) -> bool:
    try:
        gq.quantize(np.zeros((1, GGML_QUANT_SIZES[qtype][0] * 8), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def test_harness_covers_every_decoder() -> None:
    assert len(DECODERS) == 23
    assert {Q.Q2_K, Q.Q3_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL,
            Q.MXFP4} <= set(DECODERS)  # fmt: skip
    assert set(_F16_FIELDS) | set(_FLOATS) == set(DECODERS)


@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda q: q.name)
def test_decoder_matches_gguf(lib: ctypes.CDLL, qtype: Q) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    raw = _random_blocks(rng, qtype, 512)
    with np.errstate(over="ignore"):  # MXFP4's largest exponents
        ref = gq.dequantize(raw.reshape(-1), qtype).reshape(-1)
    _assert_matches(_decode(lib, qtype, raw), ref, f"{qtype.name} random blocks")
    if _can_quantize(qtype):  # blocks gguf itself writes, from floats
        x = rng.standard_normal((16, GGML_QUANT_SIZES[qtype][0] * 8)).astype(np.float32)
        q = gq.quantize(x, qtype).reshape(-1).view(np.uint8)
        _assert_matches(_decode(lib, qtype, q), gq.dequantize(q, qtype).reshape(-1),
                        f"{qtype.name} quantized floats")  # fmt: skip


def test_f16_conversion_of_the_harness_is_ieee(lib: ctypes.CDLL) -> None:
    """The harness's h2f, through the F16 decoder, on every one of the 65536 bit patterns."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    ref = bits.view(np.float16).astype(np.float32)
    got = _decode(lib, Q.F16, bits)
    assert np.array_equal(got, ref, equal_nan=True)


def test_layouts_and_table_sizes(lib: ctypes.CDLL) -> None:
    check_layouts()
    declared = declared_layouts()
    for qtype, struct in DECODERS.items():
        qk_ts_ntab = np.zeros(3, dtype=np.int32)
        assert lib.layout(struct.encode(), qk_ts_ntab.ctypes.data) == 0
        qk, ts, ntab = (int(v) for v in qk_ts_ntab)
        assert (qk, ts) == block_layout(qtype), struct
        assert ntab == declared[qtype][2], f"{struct}: the parsed NTAB differs from the compiler's"
        assert lookup_table(qtype).size <= ntab, f"{struct}: its table overflows NTAB = {ntab}"
        assert ntab * 4 <= 8192, f"{struct}: shared table of {ntab * 4} bytes"
    assert _groups_per_thread(lookup_table(Q.Q4_K).size, 1 << 30) == 1
    assert _groups_per_thread(lookup_table(Q.IQ3_XXS).size, 1 << 30) == 1


def test_tables_come_from_gguf() -> None:
    for qtype, cls in ((Q.IQ2_XXS, gq.IQ2_XXS), (Q.IQ2_XS, gq.IQ2_XS), (Q.IQ2_S, gq.IQ2_S),
                       (Q.IQ3_S, gq.IQ3_S)):  # fmt: skip
        cls.init_grid()
        grid = lookup_table(qtype).view(np.uint8).reshape(cls.grid_shape)
        assert np.array_equal(grid, np.asarray(cls.grid).reshape(cls.grid_shape))
    gq.IQ1_S.init_grid()
    words = lookup_table(Q.IQ1_S)
    assert np.array_equal(words, lookup_table(Q.IQ1_M))
    points = np.stack([words & 0xFFFF, words >> 16], axis=1).reshape(-1)  # [2048]
    codes = (points[:, None] >> (2 * np.arange(8))) & 3
    assert np.array_equal(codes.astype(np.float32) - 1, np.asarray(gq.IQ1_S.grid).reshape(2048, 8))
    assert lookup_table(Q.MXFP4).view(np.int8).tolist() == list(gq.MXFP4.kvalues)
    assert lookup_table(Q.IQ4_NL).view(np.int8).tolist() == list(gq.IQ4_NL.kvalues)
    # the decoders expand a 7-bit sign index with an even-parity bit 7: gguf's ksigns
    ksigns = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)
    parity = np.array([i.bit_count() & 1 for i in range(128)])
    assert np.array_equal(ksigns, np.arange(128) | (parity << 7))


def test_alignment_rule(tmp_path: Path) -> None:
    """Each decoder on blocks at the lowest alignment allowed (MXFP4: odd addresses), built with
    UBSan's alignment check: a load wider than the rule allows aborts the subprocess."""
    for qtype in DECODERS:
        ts = block_layout(qtype)[1]
        assert decoder_align(qtype) == min(4, ts & -ts), qtype.name
    try:
        so = _build(tmp_path, "decoders_ubsan.so", "-fsanitize=alignment",
                    "-fno-sanitize-recover=alignment")  # fmt: skip
    except subprocess.CalledProcessError as e:
        pytest.skip(f"g++ cannot build with -fsanitize=alignment: {e.stderr.strip()[:200]}")
    code = f"""
import ctypes, sys
import numpy as np
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from engine.kernels.dequant import DECODERS, block_layout, lookup_table
so = ctypes.CDLL({str(so)!r})
rng = np.random.default_rng(5)
for qtype, struct in DECODERS.items():
    qk, ts = block_layout(qtype)
    a = min(ts & -ts, 16)
    n = 64
    buf = np.zeros(n * ts + 64, dtype=np.uint8)
    start = (-buf.ctypes.data) % 32 + a  # a multiple of a, not of 2 * a
    buf[start : start + n * ts] = rng.integers(0, 256, n * ts, dtype=np.uint8)
    tab = np.ascontiguousarray(lookup_table(qtype))
    tab = tab if tab.size else np.zeros(1, dtype=np.uint32)
    out = np.empty(n * qk, dtype=np.float32)
    with np.errstate(all="ignore"):
        assert so.decode(struct.encode(), ctypes.c_void_p(buf.ctypes.data + start), n,
                         ctypes.c_void_p(tab.ctypes.data), ctypes.c_void_p(out.ctypes.data)) == 0
print("ok", len(DECODERS))
"""
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0 and "runtime error" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.strip() == f"ok {len(DECODERS)}"
