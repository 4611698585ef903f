"""The `workbench` command, run as a user runs it: a real process."""

from __future__ import annotations

import json
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True)


def test_generate_streams_text_and_reports_timings():
    r = run("generate", "The capital of France is", "--max-new-tokens", "6", "--kv-cache", "int8")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tokens/s" in r.stdout and "kv_cache=int8" in r.stdout


def test_demo_writes_a_row_per_configuration(demo_run):
    r, folder = demo_run  # workbench demo --layers 6 --short-tokens 8 --long-tokens 40 --new-tokens 4 --repeats 2 (conftest)
    out = folder / "demo.json"
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    from workbench.model.kv_formats import KERNEL_FORMATS, kernel_configs

    caches = kernel_configs(KERNEL_FORMATS, "all")  # the kernel KV formats, int8 with each of its kernels
    assert len(rows) == 2 * 4 * len(caches)  # two prompt lengths x four backends x the caches
    assert {(r["kv_cache"], r["kv_kernel"]) for r in rows} == {(f, k or "widen") for f, k in caches}
    assert {r["prompt_len"] for r in rows} == {8, 40}
    assert {r["attention"] for r in rows} == {"slim", "flash", "sdpa", "naive"}
    assert all(0.0 <= r["top1_agreement"] <= 1.0 for r in rows)
    assert all({"prefill_ms", "decode_tokens_per_s", "decode_gbps", "decode_gflops"} <= r.keys() for r in rows)
    naive_fp32 = [r for r in rows if r["attention"] == "naive" and r["kv_cache"] == "fp32"]
    assert all(r["top1_agreement"] == 1.0 for r in naive_fp32)  # the reference agrees with itself
    assert "top1_agreement" in r.stdout
    assert (folder / "demo-report.html").is_file() and (folder / "demo-report.json").is_file()


def test_user_mistakes_exit_with_a_message():
    r = run("generate", "hi", "--model", "llama2-7b")
    assert r.returncode == 2 and "no local weights for llama2-7b" in r.stderr and "Traceback" not in r.stderr
    r = run("generate", "hi", "--attention", "warp")
    assert r.returncode == 2 and "invalid choice" in r.stderr
