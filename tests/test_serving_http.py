"""`workbench serve` as a user runs it: a real server process on 127.0.0.1, driven over HTTP
with httpx. Completions are the model's greedy tokens, streaming sends the same text as
server-sent events, bad bodies get a 400 naming the problem, a full queue a 429, a client
that disconnects mid-stream frees its slot, and the metrics count it all."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import workbench as wb
from workbench.serving.process import ServerProcess, read_metrics as metrics

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    """The server's URL: `workbench serve` started as a user would (serving/process.py)."""
    process = ServerProcess(["--slots", "2", "--max-queue", "2", "--max-len", "512", "--prefix-cache-tokens", "256"])
    process.start(timeout_s=180)
    yield process.url
    assert process.stop() == 0  # SIGTERM ends the scheduler's loop and the HTTP thread cleanly


def test_a_completion_is_the_models_greedy_text_streamed_or_not(server):
    model = wb.load_model("smollm2-135m")
    want = model.generate(PROMPT, max_new_tokens=10, stop_at_eos=False).text
    r = httpx.post(server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == want and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(model.tokenizer.encode(PROMPT)), "completion_tokens": 10,
                             "total_tokens": len(model.tokenizer.encode(PROMPT)) + 10}
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 10, "ignore_eos": True, "stream": True}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    chat = httpx.post(server + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24})
    answer = chat.json()["choices"][0]
    assert "Paris" in answer["message"]["content"] and "<|im_end|>" not in answer["message"]["content"]


@pytest.mark.parametrize("body, message", [
    (b'{"prompt": ', "not valid JSON"),
    (b'\xff\xfe{}', "not UTF-8"),
    (b'[1, 2]', "must be a JSON object"),
    (b'{"prompt": "x", "max_tokens": 4, "frobnicate": 1}', "unknown field 'frobnicate'"),
    (b'{"prompt": "x", "max_tokens": -3}', "max_tokens must be an integer in 1..511, got -3"),
    (b'{"prompt": "x", "max_tokens": 100000000}', "max_tokens must be an integer in 1..511"),
    (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens must be an integer"),
    (b'{"prompt": "", "max_tokens": 4}', "prompt must be a non-empty string"),
    (b'{"prompt": "x", "temperature": -0.5}', "temperature must be a number in 0..100, got -0.5"),
    (b'{"prompt": "x", "temperature": 0.7, "top_p": 1.5}', "top_p must be a number in (0, 1], got 1.5"),
    (b'{"prompt": "x", "temperature": 0.7, "top_k": "ten"}', "top_k must be a non-negative integer"),
    (b'{"prompt": "x", "temperature": 0.7, "seed": -1}', "seed must be a non-negative integer, got -1"),
])
def test_bad_bodies_are_400_naming_the_problem(server, body, message):
    r = httpx.post(server + "/v1/completions", content=body, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_sampled_requests_follow_their_seed(server):
    """temperature / top_p / top_k / seed as a client sends them: the same seed gives the same
    text, top_k 1 is greedy whatever the temperature."""
    def ask(**kw):
        body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **kw}
        r = httpx.post(server + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert ask(temperature=1.0, top_p=0.95, seed=7) == ask(temperature=1.0, top_p=0.95, seed=7)
    assert ask(temperature=1.5, top_k=1, seed=3) == ask(temperature=0)
    assert ask(temperature=None) == ask()  # null is the default (greedy here)


def test_overload_is_429_a_disconnect_frees_its_slot_and_the_server_stays_up(server):
    before = metrics(server)

    def ask(_):
        return httpx.post(server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 48, "ignore_eos": True},
                          timeout=120).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(ask, range(8)))  # 2 slots + 2 waiting: the rest are refused
    assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 1, codes
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}) as s:
        next(line for line in s.iter_lines() if line.startswith("data: "))  # one token, then hang up
    deadline = time.monotonic() + 20  # a hang guard, not a timing assertion
    while metrics(server)["workbench_requests_running"] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    after = metrics(server)
    assert after["workbench_requests_running"] == 0 and after["workbench_requests_waiting"] == 0
    assert after["workbench_requests_rejected_total"] - before["workbench_requests_rejected_total"] == codes.count(429)
    # the abandoned stream stopped well before its 400 tokens
    made = after["workbench_generation_tokens_total"] - before["workbench_generation_tokens_total"]
    assert made < 48 * codes.count(200) + 300
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_serve_bench_loads_the_server_and_reports_percentiles(server, tmp_path):
    """`workbench serve-bench` against the real server: a fixed concurrency and a Poisson rate,
    every request served in full, percentiles ordered, goodput no larger than the rate served,
    rows written as JSON (what the SLOs and the overload flag make of given latencies is
    tests/test_serving.py's, on fixed numbers)."""
    out = tmp_path / "sb.json"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "serve-bench", "--url", server, "--rate", "max,20",
                        "--concurrency", "2", "--num-requests", "4", "--prompt-tokens", "12", "--max-tokens", "5",
                        "--shared-prefix-tokens", "40", "--shared-fraction", "1", "--slo-ttft", "10s",
                        "--slo-tpot", "1ms", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TTFT ms p50/p90/p99" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [row["rate"] for row in rows] == [None, 20.0] and rows[0]["concurrency"] == 2
    for row in rows:
        assert row["completed"] == 4 and row["statuses"] == {"200": 4} and row["output_tokens"] == 20
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            p = row[key]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"]
        assert row["goodput_requests_per_s"] <= row["requests_per_s"] and row["slo_tpot_s"] == 1e-3
    assert metrics(server)["workbench_prefix_reused_tokens_total"] > 0  # the shared 40 words hit the prefix cache
    # ... and each run says how much: its share of prompt tokens reused, and the K / V bytes not recomputed
    assert all(0 < row["prefix_hit_rate"] < 1 and row["prefix_reused_bytes"] > 0 for row in rows[1:])
    assert "prefix hit" in r.stdout
    # a report beside the rows, which `workbench compare` reads
    shared = tmp_path / "sb-report.json"
    assert json.loads(shared.read_text())["entries"][0]["kind"] == "serve_bench"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "compare", str(shared), str(shared)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "concurrency 2 prompt 12 max 5" in r.stdout and "TTFT p50 ms" in r.stdout


def test_serve_bench_takes_prompts_from_a_file_and_lengths_from_a_range(server, tmp_path):
    """`workbench serve-bench --prompts-file`: the file's prompts in order (repeated), each
    line's own max_tokens where it gives one; --range-ratio: prompt and output lengths drawn
    around the nominal ones, so the requests differ. Every request streams exactly the tokens
    it asked for (ignore_eos), which the server's usage counts."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The capital of France is", "max_tokens": 2}) + "\n\n"
                       + json.dumps({"prompt": "def fibonacci(n):"}) + "\n")
    out = tmp_path / "file.json"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "serve-bench", "--url", server, "--concurrency", "2",
                        "--num-requests", "5", "--max-tokens", "6", "--prompts-file", str(prompts), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["completed"] == 5 and row["prompts_file"] == str(prompts) and row["prompt_tokens"] is None
    assert row["output_tokens_asked"] == row["output_tokens"] == 2 + 6 + 2 + 6 + 2  # lines 1, 2, 1, 2, 1
    ranged = wb.serve_bench(server, concurrency=2, num_requests=6, prompt_tokens=12, max_tokens=6, range_ratio=0.5,
                            seed=3)[0]
    assert ranged["completed"] == 6 and ranged["range_ratio"] == 0.5
    assert ranged["output_tokens"] == ranged["output_tokens_asked"] != 6 * 6  # drawn in 3..9 each
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "serve-bench", "--url", server, "--prompts-file", str(bad),
                        "--num-requests", "1", "--out", str(tmp_path / "x.json")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "line 2" in r.stderr and '"prompt": a non-empty string' in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_taken_port_is_a_clear_error(server):
    port = server.rsplit(":", 1)[1]
    with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is in use"):
        ServerProcess(["--max-len", "256"], port=int(port)).start()
    # the command itself, past that check: uvicorn's reason and a failing exit code
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "serve", "--max-len", "256", "--port", port],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode != 0 and "address already in use" in r.stderr, r.stderr[-2000:]
    assert httpx.get(server + "/health", timeout=5).status_code == 200  # the first one is untouched


def test_serve_and_serve_bench_magics_in_a_real_shell(magic, tmp_path):
    from IPython.core.error import UsageError

    run, sh = magic, magic.shell
    assert isinstance(run("%serve_bench --num-requests 2")[1], UsageError)  # nothing to load yet
    run("%load_model smollm2-135m")
    out, err = run("%serve start --slots 2 --prefix-cache-tokens 128")
    assert err is None and "serving at http://127.0.0.1:" in out
    url = sh.user_ns["wb_server_url"]
    try:
        assert isinstance(run("%serve start")[1], UsageError)  # one at a time
        out, err = run("%serve_bench --concurrency 2 --num-requests 3 --prompt-tokens 8 --max-tokens 3 "
                       "--slo-ttft 30s -o sb")
        assert err is None and "TTFT ms p50/p90/p99" in out
        df = sh.user_ns["sb"]
        assert list(df.completed) == [3] and list(df.output_tokens) == [9] and list(df.slo_ttft_s) == [30.0]
        from workbench import report

        entry = report.recorded()[-1]  # in %report, with the commands that reproduce it
        assert entry["kind"] == "serve_bench" and entry["rows"][0]["completed"] == 3
        assert entry["command"].splitlines()[-3:] == [
            "%serve start --slots 2 --prefix-cache-tokens 128",
            "%serve_bench --concurrency 2 --num-requests 3 --prompt-tokens 8 --max-tokens 3 --slo-ttft 30s -o sb",
            "%serve stop"]
        assert isinstance(run("%serve_bench --slo-ttft soon")[1], UsageError)
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("The capital of France is\n")
        out, err = run(f"%serve_bench --concurrency 1 --num-requests 2 --max-tokens 4 --range-ratio 0.5 "
                       f"--prompts-file {prompts}")
        assert err is None and "TTFT ms p50/p90/p99" in out
        row = report.recorded()[-1]["rows"][0]
        assert row["completed"] == 2 and row["prompts_file"] == str(prompts) and row["range_ratio"] == 0.5
        assert isinstance(run(f"%serve_bench --prompts-file {tmp_path / 'none.txt'}")[1], UsageError)
        assert "serving at " + url in run("%serve status")[0]
    finally:
        out, err = run("%serve stop")
    assert err is None and "stopped" in out
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def test_serve_bench_runs_where_an_event_loop_is_running(server):
    """A Jupyter kernel runs every cell inside its event loop, where asyncio.run refuses
    ("cannot be called from a running event loop"): %serve_bench and the panel's Serve-bench
    button failed in JupyterLab and worked in a terminal. Called from inside a running loop,
    as a kernel calls it, the load still runs and every request is served."""
    import asyncio

    async def a_cell():
        return wb.serve_bench(server, concurrency=2, num_requests=2, prompt_tokens=8, max_tokens=3)

    (row,) = asyncio.run(a_cell())
    assert row["completed"] == 2 and row["statuses"] == {"200": 2}


def test_serve_takes_port_8000_where_it_is_free_and_says_when_it_is_not():
    import socket

    from workbench.serving.process import DEFAULT_PORT, default_port, port_is_free

    if port_is_free(DEFAULT_PORT):
        assert default_port() == (DEFAULT_PORT, None)
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", DEFAULT_PORT))
        except OSError:
            pass  # another process has it: the same case
        port, said = default_port()
    assert port != DEFAULT_PORT and said == f"port {DEFAULT_PORT} is in use on 127.0.0.1, so the server took {port}"
