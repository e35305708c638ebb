"""A copy of a GGUF file without its MTP (nextn) block, for loaders that do not take one.

llama.cpp's qwen3moe loader (the pinned oracle's) counts the nextn block as one more main
block and refuses its `nextn.*` tensors ("wrong number of tensors"). The copy drops every
tensor of the nextn blocks, lowers `block_count` by their number and removes
`nextn_predict_layers`; every other key and tensor is copied byte for byte, or with
`float32` every tensor dequantized to F32 (the same weights for an engine that then computes
without quantizing its activations: llama.cpp's CPU kernels quantize them to 8 bits for
quantized weights).
"""

from __future__ import annotations

import re
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from engine.errors import GGUFError

_BLOCK = re.compile(r"blk\.(\d+)\.")


def strip_mtp(src: str | Path, dst: str | Path, float32: bool = False) -> int:
    """Write `src` without its nextn blocks to `dst` (every tensor as F32 with `float32`);
    returns how many blocks were dropped."""
    r = GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    n_block = int(r.fields[f"{arch}.block_count"].contents())
    nextn = r.fields.get(f"{arch}.nextn_predict_layers")
    n_nextn = int(nextn.contents()) if nextn is not None else 0
    if n_nextn == 0:
        raise GGUFError(f"{src}: the model has no MTP (nextn) block to strip")
    n_main = n_block - n_nextn
    dst = Path(dst)
    tmp = dst.with_suffix(dst.suffix + ".part")
    w = GGUFWriter(tmp, arch)
    for field in r.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name in ("general.architecture", nextn.name):
            continue
        value = n_main if name == f"{arch}.block_count" else field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in r.tensors:
        m = _BLOCK.match(t.name)
        if m and int(m.group(1)) >= n_main:
            continue
        if float32 and t.tensor_type != GGMLQuantizationType.F32:
            w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype("float32"))
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return n_nextn
