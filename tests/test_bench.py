"""`strata bench`: the lower-bound column, the warm-up, and its flag errors (a real run on the
tiny model; the figures themselves are never asserted)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from engine.config import EngineOptions
from engine.memory.costs import Shapes, prefill_flops
from engine.model.loader import load_model
from engine.tools.bench import LOAN_ON, Config, Hardware, Row, Sample, markdown, run_bench
from tests.test_cli import run


def test_the_bound_is_the_slower_of_pcie_and_compute() -> None:
    hw = Hardware(h2d_bytes_per_s=50e9, peak_flops=1e15)
    assert hw.bound_s(100e9, 1e15) == 2.0  # PCIe-bound
    assert hw.bound_s(1e9, 3e15) == 3.0  # compute-bound


def test_markdown_adds_columns_only_when_there_is_data() -> None:
    plain = Row("off", [Sample("256 / 8", 100.0, 10.0, 1.0, 5.0, False)])
    assert "lower bound" not in markdown([plain], "t") and "Temporaries" not in markdown([plain], "t")
    rich = Row("on", [Sample("512 / 8", 200.0, 10.0, 0.5, 5.0, True, 300.0, 0.0, 4.0),
                      Sample("512 / 8", 180.0, 10.0, 0.6, 5.0, True, 310.0, 0.0, 5.0)])
    table = markdown([rich], "t")
    assert "| Prefill / lower bound |" in table and "| 4.5x (4.0x-5.0x) |" in table
    assert "| 305 (300-310) | 0 (0-0) |" in table
    assert "Decode cache hits" not in table
    hits = Row("on", [Sample("512 / 8", 200.0, 10.0, 0.5, 5.0, True, decode_hits=30, decode_misses=10)])
    assert "| Decode cache hits (%) |" in markdown([hits], "t") and "| 75 |" in markdown([hits], "t")
    assert "Drafted steps" not in markdown([hits], "t")
    spec = Row("on", [Sample("512 / 8", 200.0, 10.0, 0.5, 5.0, True, spec_steps=40, drafted_steps=10)])
    assert "| Drafted steps (%) |" in markdown([spec], "t") and "| 25 |" in markdown([spec], "t")


def test_the_first_measured_run_is_set_against_the_later_ones() -> None:
    """Issue 17: the first measured run within 5% of later ones; the table says how far."""
    def row(label: str, tgs: list[float]) -> Row:
        return Row(label, [Sample("512 / 8", 200.0, tg, 0.5, 5.0, True, generated=128) for tg in tgs])

    table = markdown([row("off", [36.0, 40.0, 41.0, 39.0]), row("on", [45.0])], "t")
    assert ("TG, the first measured run against the median of the later ones: "
            "off 36.0 against 40.0 (-10.0%).") in table
    assert "first measured run" not in markdown([row("on", [45.0])], "t")


def test_a_tg_that_is_not_at_depth_says_so() -> None:
    """TG at depth: at least 128 tokens, the median of at least 3 runs; a table short of
    either says what it had under the table."""
    def row(n_runs: int, generated: int) -> Row:
        return Row("on", [Sample("512 / 8", 200.0, 30.0, 0.5, 5.0, True, generated=generated)
                          for _ in range(n_runs)])

    assert "TG at depth" not in markdown([row(3, 128)], "t")
    assert "TG: 32 tokens, 3 runs per configuration" in markdown([row(3, 32)], "t")
    assert "TG: 200 tokens, 1 run per configuration" in markdown([row(1, 200)], "t")
    no_tg = Row("off", [Sample("512 / 8", 200.0, 0.0, 0.5, 5.0, False, generated=1)])
    assert "TG at depth" not in markdown([no_tg], "t")


def test_a_reply_counts_the_experts_its_decode_steps_read(tiny_nomtp_path: Path) -> None:
    """Every decode step routes each layer's row to k experts: each is a cache hit or a miss."""
    from engine.runtime.serve import ServeLoop

    opts = EngineOptions(model=str(tiny_nomtp_path), ctx=1024, prefill=128, expert_cache=6)
    loop = ServeLoop.create(opts)
    hp = loop.rt.model.hp
    t = loop.complete(loop.rt.model.tokenizer.encode("the river runs " * 20), max_new=6).timing
    assert t.decode_hits + t.decode_misses == (t.generated - 1) * hp.n_layer * hp.n_expert_used
    assert t.decode_hits > 0 and t.decode_misses > 0  # 6 of the cache's experts, not all


def test_a_run_reports_its_ratio_to_the_bound(tiny_path: Path) -> None:
    hw = Hardware(h2d_bytes_per_s=1e9, peak_flops=1e11)
    opts = EngineOptions(model=str(tiny_path), ctx=1024, serve=True, vram_elastic=True,
                         mtp=True, spec=2, prefill=128)
    rows = run_bench([Config("on", opts, LOAN_ON)], 300, 2, 1, hw=hw)
    s = rows[0].samples[0]
    flops = prefill_flops(Shapes.of(load_model(tiny_path, build=False)), 300)
    expected = s.prefill_s / hw.bound_s(s.mib_streamed * (1 << 20), flops)
    assert s.bound_ratio == pytest.approx(expected, rel=1e-6)
    assert "Prefill / lower bound" in markdown(rows, "t")


def test_the_bound_flags_go_together(capsys: pytest.CaptureFixture[str], tiny_path: Path) -> None:
    code, _, err = run(capsys, "bench", "--model", str(tiny_path), "--h2d-gbs", "50")
    assert code == 2 and "--h2d-gbs and --peak-tflops go together" in err
    code, _, err = run(capsys, "bench", "--model", str(tiny_path), "--h2d-gbs", "0",
                       "--peak-tflops", "1")
    assert code == 2 and "must be positive" in err


def test_a_traced_run_passes_on_its_prefill_phases(tiny_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("STRATA_TRACE", "1")
    lines: list[str] = []
    opts = EngineOptions(model=str(tiny_path), ctx=1024, prefill=128)
    run_bench([Config("off", opts)], 300, 2, 1, progress=lines.append, warmup=False)
    assert any(ln.startswith("prefill phases: ") for ln in lines), lines


def test_merge_pools_the_runs_of_several_json_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.tools.bench import as_json

    def sample(pp: float) -> Sample:
        return Sample("512 / 8", pp, 10.0, 1.0, 5.0, True)

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text('{"auto": ' + as_json([Row("on", [sample(100.0), sample(300.0)])]) + "}")
    b.write_text('{"auto": ' + as_json([Row("on", [sample(200.0)]), Row("off", [sample(50.0)])]) + "}")
    code, out, _ = run(capsys, "bench", "--merge", str(a), str(b))
    assert code == 0 and "### Automatic planner: 3 runs from 2 files" in out
    assert "| on | 512 / 8 | 200.0 (100.0-300.0) |" in out and "| off | 512 / 8 | 50.0 |" in out
    (tmp_path / "bad.json").write_text('{"auto": [{"label": "x"}]}')
    code, _, err = run(capsys, "bench", "--merge", str(a), str(tmp_path / "bad.json"))
    assert code == 2 and "bad.json: not a sample file written by `strata bench --json`" in err
    assert len(err.strip().splitlines()) == 1


def test_the_peak_column_names_its_source_and_marks_a_run_past_the_limit() -> None:
    from engine.backend.process_memory import DEVICE, PROCESS
    from engine.tools.bench import SIMULATED

    def run(peak: float, source: str = PROCESS, limit: float = 8192.0) -> Sample:
        return Sample("512 / 8", 100.0, 10.0, 1.0, 5.0, True, peak_mib=peak, peak_source=source,
                      limit_mib=limit)

    inside = Row("off", [run(7900.0), run(8000.0)])
    past = Row("on", [run(8100.0), run(8777.0), run(8345.0)])
    table = markdown([inside, past], "t")
    assert "| Streamed (MiB) | GPU peak (MiB) |" in table
    assert "| 7950 (7900-8000) |" in table and "| 8345 (8100-8777) * |" in table
    assert (
        "Marked *: on: the GPU peak passed --vram-limit 8,192 MiB in 2 of 3 runs (highest "
        "8,777 MiB, 585 MiB over; NVML, this process)") in table.splitlines()
    assert "Marked" not in markdown([inside], "t") and " * |" not in markdown([inside], "t")
    sim = markdown([Row("off", [run(40.0, SIMULATED, 0.0)])], "t")
    assert "| Sim device peak (MiB) |" in sim and "| 40 |" in sim and "Marked" not in sim
    assert "| GPU peak (MiB, device used - baseline) |" in markdown([Row("x", [run(1.0, DEVICE)])], "t")
    assert "peak (MiB)" not in markdown([Row("x", [Sample("1 / 1", 1.0, 1.0, 1.0, 1.0, False)])], "t")


def test_strata_run_says_the_peak_against_the_limit() -> None:
    from engine.backend.process_memory import PROCESS, MemoryReading
    from engine.cli.run import peak_line
    from engine.memory.sizes import GiB, MiB

    assert peak_line(MemoryReading(7912 * MiB, PROCESS), 8 * GiB) == (
        "strata run: GPU peak 7,912 MiB (NVML, this process) of --vram-limit 8,192 MiB")
    assert peak_line(MemoryReading(8345 * MiB, PROCESS), 8 * GiB) == (
        "strata run: GPU peak 8,345 MiB (NVML, this process), 153 MiB over --vram-limit 8,192 MiB")
    assert peak_line(MemoryReading(600 * MiB, PROCESS), None) == (
        "strata run: GPU peak 600 MiB (NVML, this process)")


def test_the_plain_scenario_decodes_without_the_mtp_block(tiny_path: Path) -> None:
    """`--scenario plain`: the automatic planner with no MTP block and no drafts (what `--mtp
    --spec` is held to), the same greedy reply as the MTP configurations give."""
    from engine.tools.bench import scenario

    base = EngineOptions(model=str(tiny_path), ctx=1024, mtp=True, spec=2)
    title, configs = scenario("plain", base, 300)
    assert title == "No MTP (plain decoding)" and len(configs) == 1
    assert not configs[0].options.mtp and configs[0].options.spec == 0
    _, spec_configs = scenario("auto", base, 300)
    plain, spec = (run_bench(c, 300, 8, 1, warmup=False)[0].samples[0] for c in (configs, spec_configs[:1]))
    assert plain.spec_steps == 0 and spec.spec_steps > 0 and plain.generated == spec.generated == 8
    assert plain.reply_crc == spec.reply_crc


def test_the_decode_table_samples_with_a_fixed_seed_beside_greedy(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--scenario decode` (in the default set): sampled rows (T 1.0, a fixed seed) and greedy
    rows, with and without MTP drafts. The seed fixes the sampled text, drafts or not; greedy
    text is another; the decode steps' link bytes per token are a column."""
    from engine.tools.bench import DEFAULT_SCENARIOS, SAMPLED, scenario

    assert "decode" in DEFAULT_SCENARIOS
    base = EngineOptions(model=str(tiny_path), ctx=1024, mtp=True, spec=2, expert_cache=6)
    title, configs = scenario("decode", base, 300)
    assert title == "Decode at depth, sampled and greedy"
    assert [c.label for c in configs] == [
        "sampled (T 1.0, top-k 40, top-p 0.95, seed 1), no MTP",
        "sampled (T 1.0, top-k 40, top-p 0.95, seed 1), --mtp --spec 2",
        "greedy, no MTP", "greedy, --mtp --spec 2"]
    assert [c.params for c in configs[:2]] == [SAMPLED] * 2 and configs[2].params.greedy
    rows = run_bench(configs, 300, 12, 1, warmup=False)
    crcs = [r.samples[0].reply_crc for r in rows]
    assert crcs[0] == crcs[1] and crcs[2] == crcs[3] and crcs[0] != crcs[2]
    assert [r.samples[0].spec_steps > 0 for r in rows] == [False, True, False, True]
    code, out, err = run(capsys, "bench", "--model", str(tiny_path), "--scenario", "decode",
                         "--runs", "1", "--max-new", "4", "--prompt-tokens", "64",
                         "--no-warmup", "--seed", "5")
    assert code == 0, err
    assert "### Decode at depth, sampled and greedy: 64 fresh tokens, 4-token cap, 1 runs" in out
    assert "| sampled (T 1.0, top-k 40, top-p 0.95, seed 5), no MTP |" in out
    code, _, err = run(capsys, "bench", "--model", str(tiny_path), "--temperature", "0")
    assert code == 2 and "--temperature 0 is greedy" in err


def test_decode_steps_count_the_bytes_their_misses_copy() -> None:
    hits = Row("on", [Sample("512 / 8", 200.0, 10.0, 0.5, 5.0, True, decode_hits=30,
                             decode_misses=10, generated=4, decode_mib=10.0)])
    assert "| Link / token (MiB) |" in markdown([hits], "t") and "| 2.5 |" in markdown([hits], "t")


def test_reply_crcs_says_whether_the_greedy_replies_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/reply_crcs.py (the H200 identity stages): every run's reply CRC from bench JSON
    files, exit 0 only when all agree."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("reply_crcs", Path(__file__).parent.parent / "scripts" / "reply_crcs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def sample(crc: str) -> dict:
        return {**asdict(Sample("256 / 8", 1.0, 1.0, 1.0, 1.0, False, generated=8)), "reply_crc": crc}

    same, other = tmp_path / "a.json", tmp_path / "b.json"
    same.write_text(json.dumps({"ab": [{"label": "off", "samples": [sample("aa"), sample("aa")]}]}))
    other.write_text(json.dumps({"auto": [{"label": "on", "samples": [sample("bb")]}]}))
    assert mod.main([str(same)]) == 0 and "replies: all equal" in capsys.readouterr().out
    assert mod.main([str(same), str(other)]) == 1 and "replies: 2 different" in capsys.readouterr().out
