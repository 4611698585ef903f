"""bench/weight_quality.py run as a user runs it, at a short context: a row per format and
engine, the engine each format ran on named, an engine this build may not run listed with its
reason instead of run, numbers that hang together, and bad arguments refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "weight_quality.py"


def run(*args, out=None):
    extra = ["--out", str(out)] if out else []
    return subprocess.run([sys.executable, str(BENCH), *args, *extra], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def test_a_row_per_format_and_engine(tmp_path):
    from workbench import kernels

    r = run("--formats", "bf16,int8", "--engines", "fma,amx_int8", "--context", "48", out=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Weight formats against fp32" in r.stdout
    rows = json.loads((tmp_path / "weight_quality.json").read_text())["rows"]
    assert [(row["format"], row["engine"]) for row in rows] == [("bf16", "fma"), ("bf16", "amx_int8"),
                                                                ("int8", "fma"), ("int8", "amx_int8")]
    may_w8a8, why = kernels.gemm_engines()["amx_int8"]
    for row in rows:
        if row["engine"] == "amx_int8" and not may_w8a8:
            assert not row["ran"] and row["reason"] == why
            continue
        assert row["ran"] and row["context"] == 48
        assert row["ran_on"] == {("bf16", "fma"): "fma", ("int8", "fma"): "fma", ("bf16", "amx_int8"): "amx_bf16",
                                 ("int8", "amx_int8"): "amx_int8"}[row["format"], row["engine"]]
        assert 0 <= row["kl_nats"] <= row["kl_nats_max"] and 0.8 <= row["top1_agreement"] <= 1
        assert row["perplexity_reference"] > 1 and row["perplexity"] > 1


def test_bad_arguments_are_refused_by_name():
    for args, message in ((["--formats", "q4"], "--formats: dtype must be one of fp32, bf16, int8, int8-g32, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, int4-g32, int4-g128, got 'q4'"),
                          (["--engines", "tiles"], "--engines: 'tiles' is not one of auto, fma, amx_bf16"),
                          (["--context", "1"], "--context must be at least 2 tokens, got 1")):
        r = run(*args)
        assert r.returncode != 0 and message in r.stderr, (args, r.stderr[-500:])
