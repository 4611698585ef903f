"""bench/throughput.py (the paper's Table 4) run as a user runs it, at the smallest sizes:
it prints its table and writes rows whose numbers hang together (tokens/s = batch / step,
the 32-layer projection from the same steps, the cost model beside it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_bench_writes_a_row_per_batch_and_cache(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--model", "smollm2-135m",
                        "--batches", "1,3", "--layers", "1",
                        "--steps", "2", "--repeats", "1", "--kv", "int8,fp16", "--input", "20", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Table 4 here" in r.stdout and "30 layers: tokens/s projected" in r.stdout
    rows = json.loads((tmp_path / "throughput.json").read_text())["rows"]
    assert {(row["batch"], row["kv_cache"]) for row in rows} == {(1, "int8"), (1, "fp16"), (3, "int8"), (3, "fp16")}
    for row in rows:
        step = row["step_ms"]
        assert step["min"] <= step["median"] <= step["max"]
        assert abs(row["tokens_per_s"]["median"] - 1e3 * row["batch"] / step["median"]) < 1e-6
        # the head once, the one measured layer 30 times (the bundled model's layers)
        assert abs(row["projected_all_layers_ms"] - (row["head_ms"] + 30 * row["layers_ms"])) < 1e-6
        assert row["model_all_layers_ms"] > row["model_step_ms"] > 0
        assert row["paper_tokens_per_s"] is None  # the paper's rows are Llama-2-7B at batch 256 and 512
