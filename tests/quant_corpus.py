"""A test corpus made by llama.cpp itself: a synthetic qwen3moe written in F16 by our writer
(with its MTP block), quantized by the pinned oracle's quantizer (`llama_model_quantize`) to
each mix; cached between runs under `.cache/quant-corpus/` (or `STRATA_CORPUS_DIR`), keyed by
the source's digest and the quantizer's version.

The low-bit IQ mixes (IQ1_S ... IQ3_XXS) are refused without an importance matrix. The
library takes one as a pointer to a C++ `std::unordered_map<std::string, std::vector<float>>`
(what its quantize tool reads from an imatrix file), so a few lines of C++ compiled here with
the same compiler build one: every weight 1 (each column alike), for every tensor.

Importing this module skips the importing test module where llama-cpp-python is absent.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import LlamaFileType

from engine.gguf.reader import open_gguf
from engine.gguf.strip_mtp import strip_mtp
from engine.synth.model import PRESETS, SynthSpec, write_model

llama_cpp = pytest.importorskip("llama_cpp")

# 8 main blocks + MTP: enough layers for every mix's layer rules to give two types (Q4_K_M's
# Q6_K on blocks 0, 3, 6-8; IQ4_XS's Q5_K on block 0), rows of 256 so K- and IQ quants apply
# without fallbacks; 16 experts (the quantizer has rules of its own for exactly 8).
SOURCE: SynthSpec = (
    replace(PRESETS["tiny"], n_vocab=768, n_embd=256, n_layer=8, n_nextn=1, n_head=4,
            n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=2, n_ff_exp=256, seed=26)
    .with_qtype("all", "F16").with_qtype("norm", "F32").with_qtype("router", "F32")
)
# every mix the quantizer writes without an importance matrix that a qwen3moe user downloads
MIXES = ("q2_k", "q3_k_m", "q4_k_s", "q4_k_m", "q5_k_m", "q6_k", "q8_0", "iq4_xs", "mxfp4_moe")
# the mixes written with an importance matrix (the quantizer refuses them without one)
IMATRIX_MIXES = ("iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m")
_IMATRIX_CPP = r"""
#include <string>
#include <unordered_map>
#include <vector>
typedef std::unordered_map<std::string, std::vector<float>> imatrix;
extern "C" void* imatrix_new() { return new imatrix(); }
extern "C" void imatrix_put(void* m, const char* name, long n) {
  (*static_cast<imatrix*>(m))[name] = std::vector<float>(n, 1.0f);
}
extern "C" void imatrix_free(void* m) { delete static_cast<imatrix*>(m); }
"""


def corpus_dir() -> Path:
    root = os.environ.get("STRATA_CORPUS_DIR") or Path(__file__).parents[1] / ".cache" / "quant-corpus"
    return Path(root)


# the same model written in BF16 (what converters write for BF16 checkpoints)
SOURCE_BF16: SynthSpec = SOURCE.with_qtype("all", "BF16").with_qtype("norm", "F32") \
    .with_qtype("router", "F32")


def corpus_file(mix: str, source: SynthSpec = SOURCE) -> Path:
    """`source` quantized to `mix` by llama.cpp's quantizer (built once, then cached)."""
    folder = corpus_dir()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{source.digest()}-{llama_cpp.__version__}-{mix}.gguf"
    if out.exists():
        return out
    src = folder / f"{source.digest()}-source.gguf"
    if not src.exists():
        write_model(src, source)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(LlamaFileType["MOSTLY_" + mix.upper()])
    params.nthread = 2
    lib = matrix = None
    if mix in IMATRIX_MIXES:
        lib = _imatrix_lib(folder)
        matrix = lib.imatrix_new()
        for t in open_gguf(src).tensors.values():  # n_per_row values per expert
            lib.imatrix_put(matrix, t.name.encode(), t.shape[-1] * (t.shape[0] if len(t.shape) == 3 else 1))
        params.imatrix = matrix
    part = out.with_suffix(".part")
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(),
                                            ctypes.byref(params))
    finally:
        if lib is not None:
            lib.imatrix_free(matrix)
    assert rc == 0, f"llama_model_quantize({mix}) returned {rc}"
    part.replace(out)
    return out


def _imatrix_lib(folder: Path) -> ctypes.CDLL:
    """The importance-matrix builder, compiled once (skips the test where g++ is missing)."""
    so = folder / "imatrix.so"
    if not so.exists():
        gxx = shutil.which("g++")
        if gxx is None:
            pytest.skip("g++ is needed to hand llama.cpp's quantizer an importance matrix")
        cpp = folder / "imatrix.cpp"
        cpp.write_text(_IMATRIX_CPP)
        subprocess.run([gxx, "-O1", "-shared", "-fPIC", str(cpp), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.imatrix_new.restype = ctypes.c_void_p
    lib.imatrix_put.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_long]
    lib.imatrix_free.argtypes = [ctypes.c_void_p]
    return lib


def without_mtp(path: Path) -> Path:
    """A copy without the MTP block (llama.cpp's qwen3moe loader refuses it), cached beside."""
    out = path.with_name(path.stem + "-nomtp.gguf")
    if not out.exists():
        part = out.with_suffix(".part")
        strip_mtp(path, part)
        part.replace(out)
    return out
