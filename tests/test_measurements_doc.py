"""docs/measurements.md is generated from the results JSON in docs/results/ (bench/measurements.py):
the committed page is exactly what the JSON renders to, and the render carries each run's
machine, peaks, command and tables."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("bench_measurements", ROOT / "bench" / "measurements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_page_is_the_render_of_the_committed_results():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "measurements.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_committed_result_names_its_command_machine_and_peaks():
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        env = json.loads(path.read_text())["environment"]
        assert env["command"].startswith("python bench/"), (path.name, env["command"])
        assert env["machine"]["flags"] and env["peaks"]["triad_gbps"] > 0, path.name
        assert len(env["git_commit"]) == 40, path.name


def _result(time: str, flags: list[str], title: str, rows: list[list[str]]) -> dict:
    return {
        "environment": {
            "command": "python bench/linear.py --m 32", "git_commit": "0123456789" * 4, "python": "3.11.7",
            "torch": "2.13.0+cpu", "threads": 2, "time": time, "kernels": {"isa": "avx512"},
            "machine": {"cpu_model": "Some CPU", "logical_cpus": 2, "flags": flags,
                        "caches": [{"level": 1, "kind": "Data", "size_bytes": 49152},
                                   {"level": 1, "kind": "Instruction", "size_bytes": 32768},
                                   {"level": 2, "kind": "Unified", "size_bytes": 2 << 20}]},
            "peaks": {"threads": 2, "triad_gbps": 28.94, "triad_gbps_1t": 15.8, "fma_gflops": 428.4,
                      "avx512_bf16_gflops": 221.0, "amx_bf16_gflops": 6256.0, "amx_int8_gops": 0.0,
                      "measured_at": "2026-12-02T10:00:00"},
        },
        "tables": [{"title": title, "columns": ["case", "ms median (min-max)"], "rows": rows}],
    }


def test_render_groups_by_host_and_day_and_keeps_every_cell(tmp_path):
    gen = _generator()
    amx = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    runs = [("linear", _result("2026-12-01T09:00:00+0000", amx, "Linear", [["ours | bf16", "1.00 (0.90-1.10)"]])),
            ("peaks", _result("2026-12-02T09:00:00+0000", ["avx2", "fma"], "", [["triad", "28.9 GB/s"]]))]
    page = gen.render(runs)
    newer, older = page.index("## 2026-12-02"), page.index("## 2026-12-01")
    assert newer < older  # newest first
    assert "AVX-512, AVX512-BF16, AMX; 48 KiB L1d, 2 MiB L2" in page
    assert "AVX2, no AMX" in page
    assert "triad 28.9 GB/s (15.8 on one thread), fp32 FMA 428 GFLOP/s, AVX512-BF16 221 GFLOP/s, AMX bf16 6256" in page
    assert "### linear\n" in page and "`python bench/linear.py --m 32` at commit 0123456789," in page
    assert "| ours \\| bf16 | 1.00 (0.90-1.10) |" in page  # a cell's pipe cannot split the row
    assert "**Linear**" in page


def test_a_result_without_tables_is_refused(tmp_path):
    gen = _generator()
    (tmp_path / "old.json").write_text(json.dumps({"environment": {"time": "2026-12-01"}}))
    try:
        gen.load(tmp_path)
    except SystemExit as e:
        assert "old.json" in str(e) and "tables" in str(e)
    else:
        raise AssertionError("a result without tables was accepted")


def test_a_run_whose_peaks_differ_from_its_sections_says_its_own():
    """Results of one day and host share a section headed by the first run's peaks; a later
    run that measured its own (a refreshed cache) prints them under its command."""
    gen = _generator()
    first = _result("2026-12-01T09:00:00+0000", ["avx2"], "A", [["a", "1"]])
    same = _result("2026-12-01T10:00:00+0000", ["avx2"], "B", [["b", "2"]])
    own = _result("2026-12-01T11:00:00+0000", ["avx2"], "C", [["c", "3"]])
    own["environment"]["peaks"] = {**own["environment"]["peaks"], "triad_gbps": 36.7, "measured_at": "2026-12-01T10:30"}
    page = gen.render([("a", first), ("b", same), ("c", own)])
    assert page.count("triad 28.9 GB/s") == 1 and page.count("triad 36.7 GB/s") == 1
    assert page.index("triad 36.7 GB/s") > page.index("**B**")  # under the run that measured them


def test_adding_a_second_run_of_a_benchmark_on_one_day_keeps_both(tmp_path, monkeypatch):
    gen = _generator()
    monkeypatch.setattr(gen, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    for time, folder in (("2026-12-01T09:00:00+0000", "a"), ("2026-12-01T15:31:00+0000", "b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "distributed.json").write_text(json.dumps(_result(time, ["avx2"], folder, [[folder, "1"]])))
        gen.add([tmp_path / folder / "distributed.json"])
    gen.add([tmp_path / "b" / "distributed.json"])  # the same run again: replaces its own copy only
    names = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert names == ["2026-12-01-some-cpu-avx512-l1d-48k-distributed-1531.json",
                     "2026-12-01-some-cpu-avx512-l1d-48k-distributed.json"]


def test_peer_summary_keeps_the_latest_run_of_each_comparison_per_host_class():
    gen = _generator()
    avx2, avx512 = ["avx2", "fma"], ["avx2", "avx512f", "avx512_vnni"]

    def gguf_run(time: str, flags: list[str], ratio: float) -> dict:
        run = _result(time, flags, "t", [["x", "1"]])
        run["environment"]["command"] = "python bench/gguf_formats.py --model gemma3-270m"
        run["tables"][0]["columns"] = ["file", "TTFT 512 ms"]
        run["rows"] = [{"file": "gemma3-270m", "engine": "workbench", "batch": 16,
                        "decode_ratio": {"median": ratio, "min": ratio - 0.1, "max": ratio + 0.1},
                        "prefill_ratio": {"median": 1.5, "min": 1.4, "max": 1.6}, "batch_ratio": None},
                       {"file": "gemma3-270m", "engine": "llama.cpp", "batch": 16}]
        return run

    runs = [("gguf_formats", gguf_run("2026-12-07T10:00:00+0000", avx2, 0.8)),
            ("gguf_formats", gguf_run("2026-12-07T12:00:00+0000", avx2, 0.97)),  # the later run wins
            ("gguf_formats", gguf_run("2026-12-06T12:00:00+0000", avx512, 1.2))]
    page = gen.render(runs)
    summary = page[page.index("## Where the workbench stands"):page.index("Below, every run")]
    assert "0.97x (0.87-1.07)" in summary and "0.80x" not in summary and "1.20x (1.10-1.30)" in summary
    assert summary.count("### Some CPU, 2 logical CPUs: ") == 2  # one table per host class
    assert "gemma3-270m: TTFT 512 tokens" in summary and "batch 16" not in summary  # no batch ratio measured
    assert "`python bench/gguf_formats.py --model gemma3-270m`" in summary and "2026-12-07" in summary
