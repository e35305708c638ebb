"""Seed 000's guards: every refused combination is named, all at once, before anything is
deferred; the six STRATA_PREFILL_* variables parse with the seed's defaults and clamps."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cli import main
from engine.config import EngineOptions, LoanFlags
from engine.devices import device_traits, segment_bytes
from engine.errors import FlagError
from engine.loan.guards import validate
from engine.memory.sizes import GiB, MiB

GOOD = EngineOptions(serve=True, vram_elastic=True, mtp=True, spec=4)
ALL = LoanFlags.make(elastic_loan=True, mtp_loan=True, head_loan=True,
                     retain_startup_chunk=True, repeat_loan=True)
CUDA, SIM = device_traits("cuda:0"), device_traits("sim")


def check(options: EngineOptions, flags: LoanFlags, device: str = "sim", has_mtp: bool = True,
          head: bool = True) -> list[str]:
    return validate(options, flags, device_traits(device), has_mtp, head)


def test_valid_combination_passes() -> None:
    assert check(GOOD, ALL) == []
    assert check(EngineOptions(), LoanFlags()) == []  # flags absent: default path unchanged


@pytest.mark.parametrize(
    ("options", "flags", "device", "has_mtp", "head", "needle"),
    [
        (GOOD.with_changes(serve=False), ALL, "sim", True, True, "needs --serve"),
        (GOOD.with_changes(vram_elastic=False), ALL, "sim", True, True, "needs --vram-elastic"),
        (GOOD.with_changes(vram_segment_mib=32), ALL, "cuda:0", True, True, "--vram-segment-mib >= 64"),
        (GOOD.with_changes(batch_slots=2), ALL, "sim", True, True, "refuses --batch-slots 2"),
        (GOOD.with_changes(prefill_head_alias=True), ALL, "sim", True, True, "--prefill-head-alias"),
        (GOOD, ALL, "hip:0", True, True, "not supported on HIP"),
        (GOOD.with_changes(mtp=False, spec=0), ALL, "sim", True, True,
         "STRATA_PREFILL_MTP_LOAN=1 needs --mtp with --spec >= 2"),
        (GOOD.with_changes(spec=0), ALL, "sim", True, True, "STRATA_PREFILL_HEAD_LOAN=1 needs --mtp"),
        (GOOD, ALL, "sim", True, False, "needs a native output head"),
        (GOOD, ALL, "sim", False, True, "no MTP (nextn) layer"),
        (GOOD, LoanFlags.make(mtp_loan=True), "sim", True, True,
         "STRATA_PREFILL_MTP_LOAN=1 needs the master switch"),
        (GOOD, LoanFlags.make(repeat_loan=True, retain_startup_chunk=True), "sim", True, True,
         "STRATA_PREFILL_REPEAT_LOAN=1 needs the master switch"),
        (EngineOptions(spec=4), LoanFlags(), "sim", True, True, "--spec 4 needs --mtp"),
    ],
)
def test_each_refusal_is_named(options, flags, device, has_mtp, head, needle) -> None:  # type: ignore[no-untyped-def]
    violations = check(options, flags, device, has_mtp, head)
    assert any(needle in v for v in violations), violations


def test_every_violation_at_once() -> None:
    bad = EngineOptions(batch_slots=3, prefill_head_alias=True, mtp=False, spec=0)
    v = check(bad, ALL, device="hip:0", has_mtp=True, head=False)
    for needle in ("--serve", "--vram-elastic", "--batch-slots 3", "--prefill-head-alias", "HIP",
                   "MTP_LOAN=1 needs --mtp", "HEAD_LOAN=1 needs --mtp", "native output head"):
        assert any(needle in x for x in v), (needle, v)


def test_env_flags_parse_and_clamp() -> None:
    f = LoanFlags.from_env({
        "STRATA_PREFILL_ELASTIC_LOAN": "1", "STRATA_PREFILL_MTP_LOAN": "1",
        "STRATA_PREFILL_HEAD_LOAN": "0", "STRATA_PREFILL_RETAIN_STARTUP_CHUNK": "1",
        "STRATA_PREFILL_REPEAT_LOAN": "1", "STRATA_PREFILL_REPEAT_MIN_TOKENS": "50000",
    })
    assert (f.elastic_loan, f.mtp_loan, f.head_loan, f.retain_startup_chunk, f.repeat_loan) == (
        True, True, False, True, True)
    assert f.repeat_min_tokens == 50000 and not f.warnings
    assert LoanFlags.from_env({}).repeat_min_tokens == 1024  # the default
    low = LoanFlags.from_env({"STRATA_PREFILL_REPEAT_MIN_TOKENS": "100"})
    assert low.repeat_min_tokens == 256 and "clamped to 256" in low.warnings[0]


def test_env_errors_all_reported() -> None:
    with pytest.raises(FlagError) as e:
        LoanFlags.from_env({"STRATA_PREFILL_REPEAT_MIN_TOKENS": "lots",
                            "STRATA_PREFILL_ELASTIC_LOAN": "maybe"})
    assert len(e.value.violations) == 2
    assert "not an integer" in str(e.value) and "not a boolean" in str(e.value)


def test_cli_refuses_before_deferring(tmp_path: Path, tiny_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI exits with 2, lists every violation on one line, and builds no engine."""
    from engine.startup import runtime as startup

    monkeypatch.setenv("STRATA_PREFILL_ELASTIC_LOAN", "1")
    monkeypatch.setenv("STRATA_PREFILL_HEAD_LOAN", "1")
    built = []
    real_ledger = startup.Ledger

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(1)
        return real_ledger(*args, **kwargs)

    monkeypatch.setattr(startup, "Ledger", spy)
    rc = main(["run", "--model", str(tiny_path), "--prompt", "hi", "--batch-slots", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and not built
    assert err.count("\n") == 1 and "Traceback" not in err
    for needle in ("--serve", "--vram-elastic", "--batch-slots 2", "needs --mtp"):
        assert needle in err, err


def test_cli_bad_env_value(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                           tiny_path: Path) -> None:
    monkeypatch.setenv("STRATA_PREFILL_REPEAT_MIN_TOKENS", "1e4")
    assert main(["run", "--model", str(tiny_path), "--prompt", "hi"]) == 2
    assert "STRATA_PREFILL_REPEAT_MIN_TOKENS='1e4' is not an integer" in capsys.readouterr().err


def test_a_bad_flash_kernel_choice_is_refused_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_FLASH", "fa3")
    options = EngineOptions(model="x")
    assert validate(options, LoanFlags(), SIM, True, True) == []  # no flash kernel there
    (problem,) = validate(options, LoanFlags(), CUDA, True, True)
    assert problem == "STRATA_FLASH='fa3' is not a flash kernel choice; use fa2 or auto (or unset it)"
    for ok in ("fa2", "auto", ""):
        monkeypatch.setenv("STRATA_FLASH", ok)
        assert validate(options, LoanFlags(), CUDA, True, True) == []


@pytest.mark.parametrize(("capacity_gib", "default_mib"), [(2, 32), (1, 16)])
def test_the_default_cuda_segment_is_checked(capacity_gib: int, default_mib: int) -> None:
    """Without --vram-segment-mib a CUDA device of a few GiB gets segments below 64 MiB: the
    loan is refused with the default's size and what to pass (a pure check, no GPU)."""
    capacity = capacity_gib * GiB
    seg = segment_bytes(GOOD, capacity)
    assert seg == default_mib * MiB
    v = validate(GOOD, ALL, CUDA, True, True, segment_bytes=seg, capacity_bytes=capacity)
    assert (f"STRATA_PREFILL_ELASTIC_LOAN=1 needs segments >= 64 MiB on CUDA; the default "
            f"segment of this device is {default_mib}.0 MiB: pass --vram-segment-mib 64") in v
    assert validate(GOOD, LoanFlags(), CUDA, True, True, segment_bytes=seg,
                    capacity_bytes=capacity) == []  # no loan: no floor
    explicit = GOOD.with_changes(vram_segment_mib=64)
    assert validate(explicit, ALL, CUDA, True, True, segment_bytes=segment_bytes(
        explicit, capacity), capacity_bytes=capacity) == []
    # the simulated device has no floor; a large GPU's default is already >= 64 MiB
    assert validate(GOOD, ALL, SIM, True, True, segment_bytes=seg, capacity_bytes=capacity) == []
    big = 80 * GiB
    assert validate(GOOD, ALL, CUDA, True, True, segment_bytes=segment_bytes(GOOD, big),
                    capacity_bytes=big) == []


def test_a_segment_larger_than_the_device_says_so() -> None:
    options = EngineOptions(vram_segment_mib=64)
    (problem,) = validate(options, LoanFlags(), SIM, True, True, segment_bytes=64 * MiB,
                          capacity_bytes=44 * MiB)
    assert problem.startswith("--vram-segment-mib 64 is larger than the whole device (44.0 MiB)")
    assert "default segment here is 1.0 MiB" in problem and "--device sim:SIZE" in problem
    assert "budget is 0.0" not in problem
    limited = options.with_changes(vram_limit="48MiB")
    (problem,) = validate(limited, LoanFlags(), CUDA, True, True, segment_bytes=64 * MiB,
                          capacity_bytes=48 * MiB)
    assert "a larger --vram-limit" in problem


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_refuses_what_run_refuses(demo_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`strata plan` runs the same guards as `strata run`: the same one line, exit 2."""
    monkeypatch.setenv("STRATA_PREFILL_ELASTIC_LOAN", "1")
    monkeypatch.setenv("STRATA_PREFILL_HEAD_LOAN", "1")
    args = ["--model", str(demo_path), "--batch-slots", "2"]
    rc_plan, out, err_plan = _cli(capsys, "plan", *args)
    rc_run, _, err_run = _cli(capsys, "run", "--prompt", "hi", *args)
    assert rc_plan == rc_run == 2 and not out
    assert err_plan == err_run and err_plan.count("\n") == 1 and "Traceback" not in err_plan
    for needle in ("--serve", "--vram-elastic", "--batch-slots 2", "needs --mtp"):
        assert needle in err_plan, err_plan
    ok = ["--serve", "--vram-elastic", "--mtp", "--spec", "4"]
    rc, out, err = _cli(capsys, "plan", "--model", str(demo_path), *ok)
    assert rc == 0 and "deferred at startup: head.native, verifier" in out, err


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_segment_larger_than_the_demo_device(command: str, demo_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--prompt", "hi"] if command == "run" else []
    rc, _, err = _cli(capsys, command, "--model", str(demo_path), "--mtp", "--spec", "4",
                      "--vram-segment-mib", "64", *extra)
    assert rc == 2 and err.count("\n") == 1, err
    assert "--vram-segment-mib 64 is larger than the whole device" in err
    assert "budget is 0.0 MiB" not in err

def test_unknown_prefill_names_warn_with_the_closest_real_one() -> None:
    f = LoanFlags.from_env({"STRATA_PREFILL_ELASTIK_LOAN": "1", "STRATA_PREFILL_REPEAT_MIN": "9",
                            "STRATA_PREFILL_MTP_LOAN": "1", "STRATA_TRACE": "1"})
    assert f.mtp_loan and not f.elastic_loan  # the misspelled one does nothing
    ignored = "is not one of the six loan flags and is ignored; did you mean"
    assert f.warnings == (
        f"STRATA_PREFILL_ELASTIK_LOAN {ignored} STRATA_PREFILL_ELASTIC_LOAN?",
        f"STRATA_PREFILL_REPEAT_MIN {ignored} STRATA_PREFILL_REPEAT_MIN_TOKENS?",
    )


def test_cli_warns_once_per_unknown_name(monkeypatch: pytest.MonkeyPatch, tiny_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STRATA_PREFILL_HEAD_LAON", "1")
    monkeypatch.setenv("STRATA_PREFILL_RETAIN_STARTUP", "1")
    assert main(["run", "--model", str(tiny_path), "--prompt", "hi", "--max-new", "1"]) == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    ignored = "is not one of the six loan flags and is ignored; did you mean"
    chunk = "STRATA_PREFILL_RETAIN_STARTUP_CHUNK"
    assert warnings == [
        f"strata: warning: STRATA_PREFILL_HEAD_LAON {ignored} STRATA_PREFILL_HEAD_LOAN?",
        f"strata: warning: STRATA_PREFILL_RETAIN_STARTUP {ignored} {chunk}?",
    ]


@pytest.mark.parametrize("value", ["-1", " -4096 "])
def test_negative_repeat_threshold_is_clamped_with_a_warning(
        value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tiny_path: Path) -> None:
    """Seed 000: the threshold is clamped to a minimum of 256, a negative one included."""
    monkeypatch.setenv("STRATA_PREFILL_REPEAT_MIN_TOKENS", value)
    assert main(["run", "--model", str(tiny_path), "--prompt", "hi", "--max-new", "1"]) == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert warnings == [(f"strata: warning: STRATA_PREFILL_REPEAT_MIN_TOKENS={int(value)} is "
                        "below the minimum of 256 tokens; clamped to 256")]
    flags = LoanFlags().with_changes(repeat_min_tokens=-5)  # the runtime path
    assert flags.repeat_min_tokens == 256 and "=-5 is below the minimum" in flags.warnings[0]
    with pytest.raises(AssertionError):
        LoanFlags(repeat_min_tokens=-5)  # bypassing make is our bug, not a user's


@pytest.mark.parametrize(("value", "n"), [("0", 256), ("255", 256), ("256", 256), ("+300", 300),
                                          ("-" + "9" * 5000, 256), ("2147483647", 2**31 - 1)],
                         ids=["0", "255", "256", "+300", "-9x5000", "2**31-1"])
def test_small_repeat_threshold_is_still_clamped(value: str, n: int) -> None:
    f = LoanFlags.from_env({"STRATA_PREFILL_REPEAT_MIN_TOKENS": value})
    assert f.repeat_min_tokens == n
    assert bool(f.warnings) == (value.startswith("-") or int(value) < 256)
    assert all(len(w) < 200 for w in f.warnings)  # a long number is cut short: one line


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_threshold_is_unset(value: str) -> None:
    """As an empty boolean is off, an empty count is as if the variable were not set."""
    f = LoanFlags.from_env({"STRATA_PREFILL_REPEAT_MIN_TOKENS": value,
                            "STRATA_PREFILL_REPEAT_LOAN": ""})
    assert f == LoanFlags() and f.repeat_min_tokens == 1024 and not f.warnings


@pytest.mark.parametrize("value", ["2147483648", "1" + "0" * 30, "9" * 5000],
                         ids=["2**31", "10**30", "9x5000"])
def test_a_threshold_past_any_prompt_is_refused(value: str, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STRATA_PREFILL_REPEAT_MIN_TOKENS", value)
    assert main(["run", "--prompt", "hi"]) == 2  # refused before any model is read
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 200
    assert err.startswith("strata: error: STRATA_PREFILL_REPEAT_MIN_TOKENS=")
    assert "is larger than any prompt; give a token count up to 2,147,483,647" in err
    with pytest.raises(FlagError, match="larger than any prompt"):
        LoanFlags().with_changes(repeat_min_tokens=10**30)  # the runtime path


def test_a_threshold_above_the_context_is_a_warning() -> None:
    """Kept (the repeat loan never runs), said at startup and with every runtime change."""
    flags = LoanFlags.make(elastic_loan=True, repeat_loan=True, repeat_min_tokens=50_000)
    (w,) = flags.warnings_for(EngineOptions(ctx=4096))
    assert w == ("STRATA_PREFILL_REPEAT_MIN_TOKENS=50000 is above the context (--ctx 4096): no "
                 "message reaches it, so no repeat loan runs; lower it, or raise --ctx")
    assert flags.warnings_for(EngineOptions(ctx=65536)) == ()
    assert flags.with_changes(repeat_loan=False).warnings_for(EngineOptions(ctx=4096)) == ()


@pytest.mark.parametrize("value", ["1_000", "\u0661\u0660\u0662\u0664", "1e4", "0x400",
                                   "1024 tokens"])
def test_repeat_threshold_takes_ascii_digits_only(value: str) -> None:
    """int() would read '1_000' and Arabic-Indic digits; a C strtol would not."""
    with pytest.raises(FlagError, match="is not an integer"):
        LoanFlags.from_env({"STRATA_PREFILL_REPEAT_MIN_TOKENS": value})


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("Yes", True), (" ON ", True),
     ("0", False), ("FALSE", False), ("no", False), ("off", False), ("", False)],
)
def test_boolean_spellings(value: str, on: bool) -> None:
    assert LoanFlags.from_env({"STRATA_PREFILL_REPEAT_LOAN": value}).repeat_loan is on


@pytest.mark.parametrize("value", ["2", "y", "enabled", "-1", "tru"])
def test_other_boolean_spellings_are_refused_with_the_list(value: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    monkeypatch.setenv("STRATA_PREFILL_HEAD_LOAN", value)
    assert main(["run", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"strata: error: STRATA_PREFILL_HEAD_LOAN={value!r} is not a boolean; use 1, true, yes, "
        "on or 0, false, no, off (any case; empty is off)\n"
    )
