"""Bad model files give one-line GGUFError/ModelError messages, and the CLI exits with 2."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from engine.cli import main
from engine.errors import GGUFError, ModelError
from engine.gguf.hparams import read_hparams
from engine.gguf.reader import open_gguf
from engine.model.loader import load_model
from engine.synth.model import PRESETS, write_model


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def test_wrong_magic(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GGUFError) as e:
        open_gguf(p)
    assert "not a GGUF file" in one_line(e)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError) as e:
        open_gguf(tmp_path / "nope.gguf")
    assert "no such model file" in one_line(e)


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.01])
def test_truncated(tmp_path: Path, tiny_path: Path, keep: float) -> None:
    data = tiny_path.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(GGUFError) as e:
        open_gguf(p)
    assert "truncated" in one_line(e)


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray], kv: dict[str, int]) -> None:
    w = GGUFWriter(path, arch)
    for k, v in kv.items():
        w.add_uint32(f"{arch}.{k}", v)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_arch(tmp_path: Path) -> None:
    p = tmp_path / "llama.gguf"
    _write(p, "llama", {"token_embd.weight": np.zeros((4, 8), np.float32)}, {"block_count": 1})
    with pytest.raises(GGUFError) as e:
        read_hparams(open_gguf(p))
    assert "architecture 'llama' is not supported" in one_line(e)


def test_missing_tensor_and_shape_mismatch(tmp_path: Path, tiny_path: Path) -> None:
    mf = open_gguf(tiny_path)
    del mf.tensors["blk.1.attn_q.weight"]
    with pytest.raises(GGUFError) as e:
        read_hparams(mf)
    assert "tensor 'blk.1.attn_q.weight' is missing" in one_line(e)

    mf = open_gguf(tiny_path)
    t = mf.tensors["blk.0.attn_k.weight"]
    mf.tensors[t.name] = replace(t, shape=(t.shape[0] + 1, t.shape[1]))
    with pytest.raises(GGUFError) as e:
        read_hparams(mf)
    assert "has shape" in one_line(e) and "expected" in str(e.value)


def test_unsupported_quant_type(tmp_path: Path, tiny_path: Path) -> None:
    mf = open_gguf(tiny_path)
    t = mf.tensors["blk.0.attn_v.weight"]
    mf.tensors[t.name] = replace(t, qtype=Q.TQ2_0)
    with pytest.raises(GGUFError) as e:
        read_hparams(mf)
    assert "TQ2_0" in one_line(e) and "does not support" in str(e.value)


def test_bad_expert_count(tmp_path: Path) -> None:
    spec = replace(PRESETS["tiny"], n_expert_used=9)
    p = write_model(tmp_path / "bad.gguf", spec)
    with pytest.raises(ModelError) as e:
        load_model(p)
    assert "expert_used_count 9" in one_line(e)


def test_cli_bad_file_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"nope")
    assert main(["info", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("strata: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_truncated_run(tmp_path: Path, tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "cut.gguf"
    shutil.copy(tiny_path, p)
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)
    assert main(["run", "--model", str(p), "--prompt", "hi", "--max-new", "2"]) == 2
    assert "truncated" in capsys.readouterr().err
