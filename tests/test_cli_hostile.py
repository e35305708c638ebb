"""Hostile command-line values and input files (issue 27, item 7): each one exit 2 and one
line before any work, bounded in time; a damaged profile or rates file beside the model is a
one-line warning and is recorded again; Ctrl+C during startup is exit 130 without a traceback.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.bounded_input import InputFileError, json_depth, load_json, read_capped
from engine.cli import main
from engine.errors import FlagError
from engine.experts.profile import ExpertProfile
from engine.loan.forecast import Observation, RatesError, load_rates
from engine.request.sampler import MAX_SEED, Sampler, SamplingParams, distribution


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:  # argparse errors exit from inside parse_args; ours return the code
        code = main(list(args))
    except SystemExit as e:
        code = e.code  # type: ignore[assignment]
    out = capsys.readouterr()
    return int(code or 0), out.out, out.err


def _one_line(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert err.startswith("strata: error:") and err.count("\n") == 1, err
    assert needle in err and "Traceback" not in err, (needle, err)


BIG = "9" * 5000
VALUE_CASES = [
    (["--seed", "-1"], "--seed -1 must be an integer in 0..2**64-1"),
    (["--seed", str(2**64)], f"--seed {2**64} must be an integer in 0..2**64-1"),
    (["--seed", BIG], "digits) is too large for any option"),
    (["--temperature", "nan"], "argument --temperature: 'nan' is not a decimal number"),
    (["--temperature", "inf"], "'inf' is not a decimal number"),
    (["--temperature", "1e309"], "'1e309' is too large (not a finite number)"),
    (["--temperature", "9" * 400], "is not a decimal number"),
    (["--temperature", "-0.5"], "--temperature -0.5 must be a finite number >= 0"),
    (["--top-p", "nan"], "argument --top-p: 'nan' is not a decimal number"),
    (["--top-p", "0.9\u0665"], "is not a decimal number in ASCII digits"),
    (["--ctx", "\u0661\u0662\u0663"], "argument --ctx: '١٢٣' is not an integer in ASCII digits"),
    (["--max-new", "1_0"], "argument --max-new: '1_0' is not an integer in ASCII digits"),
    (["--top-k", " 4"], "argument --top-k: ' 4' is not an integer"),
    (["--prefill", "\u0661\u0662"], "--prefill '١٢' must be 'auto' or an integer"),
    (["--expert-cache", "1_0"], "--expert-cache '1_0' must be 'auto' or an integer"),
    (["--mtp-experts", "0"], "--mtp-experts 0 must be 'auto' or >= 1"),
    (["--mtp-experts", "few"], "--mtp-experts 'few' must be 'auto' or an integer"),
    (["--vram-limit", ""], "--vram-limit is empty; give a size such as 8GiB"),
    (["--vram-limit", "\u0661GiB"], "--vram-limit '١GiB' is not a size"),
    (["--vram-limit", "1" + "0" * 30 + "GiB"], "is not a size"),
    (["--vram-limit", "99999999999GiB"], "is more than 2**60 bytes"),
    (["--device", "sim:1TiB"], "--device sim:1TiB: the simulated device lives in host memory"),
    (["--device", "sim:"], "--device sim: has no size"),
    (["--ctx", "9" * 19], "needs a simulated device of"),
    (["--vram-reserve-mib", "-100"], "--vram-reserve-mib -100 must be >= 0"),
    (["--expert-profile", ""], "--expert-profile is empty"),
    (["--expert-profile", "/dev/zero"],
     "expert profile /dev/zero is a character device, not a regular file"),
    (["--model", " "], "--model is empty"),
]


@pytest.mark.parametrize(("args", "needle"), VALUE_CASES, ids=[" ".join(a)[:30] for a, _ in
                                                                 VALUE_CASES])
def test_bad_values_are_one_line(args: list[str], needle: str, tiny_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = [] if "--model" in args else ["--model", str(tiny_path)]
    t0 = time.perf_counter()
    code, out, err = _main(capsys, "run", "--prompt", "hi", "--device", "sim", *model, *args)
    _one_line(code, err, needle)
    assert out == "" and time.perf_counter() - t0 < 5


def test_sim_size_names_what_fits(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.devices import host_memory_bytes

    host = host_memory_bytes()
    assert host is not None
    code, _, err = _main(capsys, "run", "--model", str(tiny_path), "--prompt", "hi",
                         "--device", "sim:1TiB")
    _one_line(code, err, f"give at most sim:{host // 2**20}MiB")


@pytest.mark.parametrize("temperature", ["1e-320", "5e-324", "1e-30"])
def test_tiny_temperatures_sample_the_greedy_token(temperature: str, tiny_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A temperature that divides the logits past float64's range is the greedy choice, with
    no NaN probability and no numpy warning."""
    run = ("run", "--model", str(tiny_path), "--device", "sim", "--prompt", "hello",
           "--max-new", "6")
    code, greedy, _ = _main(capsys, *run)
    assert code == 0 and greedy.strip()
    code, out, err = _main(capsys, *run, "--temperature", temperature, "--seed", str(MAX_SEED))
    assert code == 0 and out == greedy, err
    assert "Warning" not in err and "NaN" not in err


def test_sampling_params_are_the_one_owner_of_the_rule() -> None:
    """What the server's schema relies on: every bad value a FlagError naming it."""
    for bad, needle in [
        ({"temperature": math.nan}, "--temperature nan"),
        ({"temperature": math.inf}, "--temperature inf"),
        ({"temperature": "0.5"}, "--temperature '0.5'"),
        ({"top_k": True}, "--top-k True"),
        ({"top_k": 2.5}, "--top-k 2.5"),
        ({"top_p": math.nan}, "--top-p nan"),
        ({"seed": -1}, "--seed -1"),
        ({"seed": 2**64}, f"--seed {2**64}"),
        ({"seed": 1.0}, "--seed 1.0"),
    ]:
        with pytest.raises(FlagError) as e:
            SamplingParams(**bad)  # type: ignore[arg-type]
        assert needle in str(e.value), (bad, e.value)
    with pytest.raises(FlagError) as e:
        SamplingParams(temperature=-1, seed=-1)
    assert len(e.value.violations) == 2  # every problem at once


def test_no_distribution_holds_nan() -> None:
    logits = np.array([0.5, 3.0, -1e30, 3.0, np.nan, 2.0])  # [V]
    for t in (5e-324, 1e-320, 1e-8, 1.0, 1e300):
        for top_k, top_p in ((0, 1.0), (2, 0.5)):
            p = distribution(logits, SamplingParams(temperature=t, top_k=top_k, top_p=top_p))
            assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-12, (t, p)
            assert p[4] == 0  # a NaN logit is never drawn
    p = distribution(logits, SamplingParams(temperature=5e-324, top_k=0, top_p=1.0))
    assert p.tolist() == [0, 0.5, 0, 0.5, 0, 0]  # the ties of the greedy choice
    assert Sampler(SamplingParams(temperature=1e-320, seed=MAX_SEED)).sample(logits, 0) in (1, 3)


# --- input files: regular files only, a cap before reading ------------------------------------


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def test_read_capped_refuses_what_is_not_a_regular_file(tmp_path: Path, fifo: Path) -> None:
    for path, kind in ((fifo, "a FIFO (named pipe)"), (Path("/dev/zero"), "a character device"),
                       (tmp_path, "a directory")):
        t0 = time.perf_counter()
        with pytest.raises(InputFileError,
                           match=re.escape(f"x {path} is {kind}, not a regular file")):
            read_capped(path, 100, f"x {path}")
        assert time.perf_counter() - t0 < 1  # a FIFO with no writer does not block the open
    link = tmp_path / "zero-link"
    link.symlink_to("/dev/zero")
    with pytest.raises(InputFileError, match="is a character device"):
        read_capped(link, 100, "x")
    with pytest.raises(InputFileError, match=r"^x: No such file or directory; do this$"):
        read_capped(tmp_path / "absent", 100, "x", "do this")


def test_read_capped_checks_the_size_before_reading(tmp_path: Path) -> None:
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(100 << 20)  # sparse: 100 MB that cost nothing to make
    t0 = time.perf_counter()
    with pytest.raises(InputFileError, match="^big is 104,857,600 bytes, more than the limit "
                                             "of 1,048,576"):
        read_capped(big, 1 << 20, "big")
    assert time.perf_counter() - t0 < 0.1
    small = tmp_path / "small"
    small.write_bytes(b"12 34")
    assert read_capped(small, 5, "small") == b"12 34"


def test_json_depth_and_load_json(tmp_path: Path) -> None:
    assert json_depth(b'{"a": [1, {"b": "[[[[{{"}], "c\\"[": 2}') == 3
    assert json_depth(b"7") == 0
    deep = tmp_path / "deep.json"
    deep.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    t0 = time.perf_counter()
    with pytest.raises(InputFileError, match="nests 100,000 levels deep, more than the limit"):
        load_json(deep, 1 << 20, "deep.json")
    assert time.perf_counter() - t0 < 1
    for text, needle in ((b"\xff", "is not UTF-8 text"), (b"{", "is not JSON"),
                         (b"[" + b"9" * 5000 + b"]", "is not JSON")):
        deep.write_bytes(text)
        with pytest.raises(InputFileError, match=needle):
            load_json(deep, 1 << 20, "deep.json")


def test_tokens_file_hostile_files(tiny_path: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(100 << 20)
    run = ("run", "--model", str(tiny_path), "--device", "sim", "--tokens-file")
    for path, needle in (
        ("/dev/zero", "--tokens-file /dev/zero is a character device, not a regular file"),
        (str(tmp_path), "is a directory, not a regular file"),
        (str(big), ("big.txt is 104,857,600 bytes, more than the limit of 1,048,576; give a "
                    "file of token ids that fits --ctx (raise --ctx for a longer one)")),
    ):
        t0 = time.perf_counter()
        code, out, err = _main(capsys, *run, path)
        _one_line(code, err, needle)
        assert out == "" and time.perf_counter() - t0 < 2


def test_tokens_file_cap_follows_ctx(tiny_path: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.run import TOKEN_FILE_BYTES, tokens_file_limit

    assert tokens_file_limit(8192) == 1 << 20 and tokens_file_limit(1 << 16) == 2 << 20
    f = tmp_path / "t.txt"
    f.write_text(" ".join(["198"] * 300) + " " * (1 << 20))  # padded past a MiB
    code, _, err = _main(capsys, "run", "--model", str(tiny_path), "--device", "sim",
                         "--tokens-file", str(f), "--max-new", "1")
    _one_line(code, err, "more than the limit of 1,048,576")
    ctx = str((2 << 20) // TOKEN_FILE_BYTES)  # a larger --ctx takes it
    code, _, err = _main(capsys, "run", "--model", str(tiny_path), "--device", "sim:1GiB",
                         "--tokens-file", str(f), "--max-new", "1", "--ctx", ctx)
    assert code == 0 and "prompt 300 tokens" in err, err


@pytest.mark.parametrize("flag", ["--tokens-file", "--expert-profile"])
def test_a_fifo_never_hangs(flag: str, tiny_path: Path, fifo: Path) -> None:
    src = [] if flag == "--tokens-file" else ["--prompt", "hi"]
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", "--model", str(tiny_path),
                        "--device", "sim", *src, flag, str(fifo)],
                       check=False, capture_output=True, text=True, timeout=60)
    _one_line(r.returncode, r.stderr, "is a FIFO (named pipe), not a regular file")


# --- a damaged profile or rates file beside the model -----------------------------------------


def _profile_doc(**changes: object) -> str:
    doc = {"format": "strata-expert-profile", "version": 1, "n_layer": 2, "n_expert": 8,
           "n_tokens": 5, "counts": [[1] * 8, [2] * 8]}
    return json.dumps({**doc, **changes})


PROFILE_CASES = {
    "n_tokens many": _profile_doc(n_tokens="many"),
    "n_tokens inf": _profile_doc(n_tokens=1e999),
    "a list": "[1]",
    "100k deep": "[" * 100_000 + "]" * 100_000,
    "float counts": _profile_doc(counts=[[1.5] * 8, [2] * 8]),
    "string counts": _profile_doc(counts=[["7"] * 8, [2] * 8]),
    "not utf-8": b"\xff\xfe{}",
    "dev zero": Path("/dev/zero"),
    "20 MB": 20 << 20,
}


@pytest.mark.parametrize("case", list(PROFILE_CASES))
def test_a_hostile_profile_beside_the_model_is_recorded_again(
        case: str, tiny_nomtp_path: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_nomtp_path.read_bytes())
    beside = tmp_path / "m.profile.json"
    content = PROFILE_CASES[case]
    if isinstance(content, Path):
        beside.symlink_to(content)
    elif isinstance(content, int):
        with open(beside, "wb") as f:
            f.truncate(content)
    else:
        beside.write_bytes(content.encode() if isinstance(content, str) else content)
    code, out, err = _main(capsys, "run", "--model", str(model), "--device", "sim",
                           "--prompt", "hi", "--max-new", "2")
    assert code == 0 and out.strip(), err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"strata: warning: expert profile {beside} "), err
    assert warnings[0].endswith("(ignored: the calibration profile is recorded again)"), err
    assert "Traceback" not in err
    assert ExpertProfile.load(beside, n_layer=2, n_expert=8).n_tokens > 0  # recorded again


def _observation() -> dict:
    from engine.loan.forecast import Workload

    w = Workload(kind=None, n_fresh=16, pos0=0, chunk_tokens=16, ring_slots=8, n_chunks=1,
                 layer_chunks=2, attn_flops=1e6, moe_flops=1e6, streamed_bytes=0.0,
                 refill_bytes=0.0, released_bytes=0.0, restored_bytes=0.0)
    return Observation(w, dict.fromkeys(("attention", "moe", "rest", "release", "restore"),
                                        0.01), 0.05).as_json()


@pytest.mark.parametrize(("change", "needle"), [
    (lambda o: o["workload"].update(n_chunks="many"), "n_chunks 'many' is not a finite count"),
    (lambda o: o["workload"].update(attn_flops=-1.0), "attn_flops -1.0 is not a finite count"),
    (lambda o: o["workload"].update(kind="evil"), "workload kind 'evil'"),
    (lambda o: o["workload"].update(extra=1), "a workload without the fields"),
    (lambda o: o["seconds"].update(moe=float("nan")), "moe nan is not a finite count"),
    (lambda o: o.update(prefill_s=[1]), "prefill_s [1] is not a finite count"),
])
def test_a_hostile_rates_file_is_one_line(change: object, needle: str, tmp_path: Path) -> None:
    o = _observation()
    Observation.from_json(o)  # the good one reads
    change(o)  # type: ignore[operator]
    path = tmp_path / "r.rates.json"
    path.write_text(json.dumps({"format": "strata-prefill-rates", "version": 1,
                                "devices": {"dev": [o]}}))
    with pytest.raises(RatesError) as e:
        load_rates(path, "dev")
    assert needle in str(e.value) and "\n" not in str(e.value), e.value
    assert load_rates(path, "other").observations == ()  # another device's entry is not read


@pytest.mark.parametrize("case", ["deep", "dev zero", "bad count"])
def test_a_hostile_rates_file_warns_and_runs(case: str, tiny_nomtp_path: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "p.json"
    ExpertProfile.uniform(2, 8).save(profile)
    rates = tmp_path / "p.rates.json"
    if case == "dev zero":
        rates.symlink_to("/dev/zero")
    elif case == "deep":
        rates.write_text("[" * 100_000)
    else:
        o = _observation()
        o["workload"]["n_chunks"] = "many"
        rates.write_text(json.dumps({"format": "strata-prefill-rates", "version": 1,
                                     "devices": {"x": [o]}}))
        from engine.devices import hardware_name

        rates.write_text(rates.read_text().replace('"x"', json.dumps(hardware_name(None))))
    code, out, err = _main(capsys, "run", "--model", str(tiny_nomtp_path), "--device", "sim",
                           "--prompt", "hi", "--max-new", "2", "--expert-profile", str(profile))
    assert code == 0 and out.strip(), err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"prefill rates {rates}" in warnings[0], err
    assert warnings[0].endswith("the forecast starts from its defaults"), err
    assert "Traceback" not in err


# --- Ctrl+C while the command starts ----------------------------------------------------------


def _strata() -> list[str]:
    script = Path(sys.executable).with_name("strata")  # the console entry point
    return [str(script)] if script.exists() else [sys.executable, "-m", "engine.cli"]


def _importing_numpy(pid: int) -> bool:
    try:
        return "numpy" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
@pytest.mark.parametrize("when", ["imports", "0.3 s", "0.8 s"])
def test_ctrl_c_at_startup_is_exit_130_without_a_traceback(when: str, tiny_path: Path) -> None:
    """SIGINT while the sub-commands import (numpy and the engine: a second or more), or a
    little later: one line and exit code 130, never a KeyboardInterrupt traceback."""
    p = subprocess.Popen([*_strata(), "run", "--model", str(tiny_path), "--device", "sim",
                          "--prompt", "hi", "--max-new", "3000"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if when == "imports":  # right after the first numpy library is mapped
            deadline = time.monotonic() + 30
            while not _importing_numpy(p.pid) and time.monotonic() < deadline:
                time.sleep(0.002)
        else:
            time.sleep(float(when.split()[0]))
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.endswith("strata: interrupted\n"), err
