"""bench/gguf_load.py run as a user runs it, on a small file it can make without llama.cpp (a
2-layer TinyLlama-shaped F16 file): each round a fresh process that loads the file and
generates, the peak growth set against the file's size, the JSON written; bad arguments
refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "gguf_load.py"


def run(*args):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, cwd=ROOT, timeout=900)


def test_each_round_loads_in_a_fresh_process_and_generates(tmp_path):
    r = run("--preset", "tinyllama-1.1b", "--layers", "2", "--kind", "F16", "--rounds", "2", "--new-tokens", "3",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tinyllama-1.1b, 2 layers, F16: load in a fresh process" in r.stdout
    result = json.loads((tmp_path / "gguf_load.json").read_text())
    assert result["layers"] == 2 and result["kind"] == "F16" and len(result["runs"]) == 2
    for run_ in result["runs"]:
        assert run_["load_s"] > 0 and run_["decode_tokens_per_s"] > 0
        # the model holds its weights (F16 matrices widened to fp32: about twice the file), and
        # the process grew by at least them (the bound on a Q4_K_M file's growth is
        # test_gguf_weights.py's; here the numbers are what the benchmark reports)
        assert run_["peak_growth_generate"] >= run_["peak_growth_load"] >= run_["weight_bytes"] > result["file_bytes"]


def test_bad_arguments_are_refused_by_name():
    r = run("--rounds", "0")
    assert r.returncode != 0 and "--rounds must be at least 1, got 0" in r.stderr
    r = run("--kind", "Q3_K_XS", "--layers", "1")
    assert r.returncode != 0 and "--kind must be one of F16, Q4_0" in r.stderr and "got 'Q3_K_XS'" in r.stderr
