"""`workbench` command line: generate, demo (the main job), report, compare, peers, profile, serve, serve-bench, bench.

    workbench generate "The capital of France is" --max-new-tokens 32 --attention slim --kv-cache int8
    workbench demo                      # every attention x KV dtype on the bundled model, table + JSON + report
    workbench report [FILE.json ...] -o results/report.html   # a report from earlier results, or a fresh run
    workbench compare a.json b.json [-o diff.html]            # two reports side by side, noise-aware verdicts
    workbench peers                     # ours vs transformers and llama.cpp, interleaved, same tokens
    workbench profile [--native] -- generate "Hello"          # py-spy over a workbench command
    workbench serve --port 8000 --slots 8          # OpenAI-compatible server, prefix reuse on
    workbench serve-bench --url http://127.0.0.1:8000 --rate 1,2,4 --slo-ttft 1s --slo-tpot 100ms
    workbench quantize in.gguf out.gguf --type Q4_K_M            # our quantizer, llama.cpp's mixes
    workbench bench attention|generation|peaks [args...]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from workbench.cache import results_dir
from workbench.serving.process import DEFAULT_PORT
from workbench.serving.scheduler import DEFAULT_CHUNK
from workbench.options import (GENERATE_OPTIONS, LOAD_OPTIONS, SERVE_BENCH_OPTIONS, add_options, chat_prompt,
                               generate_kwargs)

ROOT = Path(__file__).resolve().parents[1]


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="preset name or path (default: the bundled model)")
    add_options(p, LOAD_OPTIONS)
    p.add_argument("--threads", type=int, default=None, help="threads for the kernels (default: torch's)")


def _load(args):
    import workbench as wb
    from workbench.runtime.threads import set_threads

    if args.threads is not None:
        set_threads(args.threads)
    return wb.load_model(args.model, random=args.random, layers=args.layers, dtype=args.dtype)


def cmd_generate(args) -> int:
    from workbench.runtime.streaming import TextStream

    model = _load(args)
    prompt = chat_prompt(model, args.prompt, args.chat)
    out = model.generate(prompt, **generate_kwargs(args), on_token=TextStream(model.tokenizer))
    print(f"\n\n[{len(out.token_ids)} tokens | {out.summary_line()}]")
    return 0


def cmd_demo(args) -> int:
    import torch

    from workbench.analysis.ablation import rows_as_dicts, spread_warnings
    from workbench.analysis.demo import format_table, run_demo
    from workbench.model.kv_formats import kv_label

    model = _load(args)
    print(f"{model!r}\nthreads {torch.get_num_threads()}; reference: naive attention with an fp32 KV cache\n",
          flush=True)

    def progress(done, total, row):
        print(f"  [{done}/{total}] {row.prompt_len:4d} tokens {row.attention:5s} {kv_label(row.kv_cache, row.kv_kernel):12s} "
              f"prefill {row.prefill_ms:.1f} ms, {row.decode_tokens_per_s:.1f} tok/s", flush=True)

    t0 = time.perf_counter()
    rows = run_demo(model, short_tokens=args.short_tokens, long_tokens=args.long_tokens,
                    new_tokens=args.new_tokens, progress=progress, repeats=args.repeats)
    print()
    print(format_table(rows))
    for warning in spread_warnings(rows):
        print(f"warning: {warning}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": model.description, "config": model.config.as_dict(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "seconds": time.perf_counter() - t0,
        "command": " ".join(sys.argv), "rows": rows_as_dicts(rows)}, indent=2))
    from workbench import report
    from workbench.analysis.text import sample_prompts

    command = " ".join(["workbench", *sys.argv[1:]])
    report.record(rows, model, command=command)
    # one plain generation too, for the report's per-layer figure and cost model
    prompt = sample_prompts(model.tokenizer, args.long_tokens, 1)
    result = model.generate(prompt, max_new_tokens=args.new_tokens, attention="slim", kv_cache="int8",
                            stop_at_eos=False)
    report.record(result, model, command=command, prompt=model.tokenizer.decode(prompt[0]))
    paths = report.write(out.with_name(out.stem + "-report.html"), title=f"workbench demo: {model.description}")
    print(f"\nwrote {out}, {paths['html']} (opens offline) and {paths['json']}")
    return 0


def _entries_from(path: Path) -> list[dict]:
    """A report JSON's entries, or a benchmark's JSON (bench/*.py, results/*.json) as one entry."""
    from workbench.report.compare import load

    data = json.loads(path.read_text())
    if isinstance(data, dict) and "schema_version" in data:
        entries = load(path)["entries"]
        for e in entries:
            e.setdefault("source", str(path))
        return entries
    rows = data.get("rows") if isinstance(data, dict) and isinstance(data.get("rows"), list) else None
    if rows is None:
        rows = [{"field": k, "value": json.dumps(v) if isinstance(v, (dict, list)) else v}
                for k, v in (data.items() if isinstance(data, dict) else enumerate(data))]
    return [{"kind": "benchmark", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": None, "source": str(path),
             "rows": rows, "command": data.get("command") if isinstance(data, dict) else None}]


def cmd_report(args) -> int:
    """With files: their measurements, re-rendered into one report (nothing re-run). Without:
    one generation of the given model measured now."""
    from workbench import report

    if args.files:
        entries = []
        for f in args.files:
            path = Path(f)
            if not path.is_file():
                print(f"error: {path}: no such file", file=sys.stderr)
                return 2
            try:
                entries += _entries_from(path)
            except ValueError as e:
                print(f"error: {path}: {e}", file=sys.stderr)
                return 2
    else:
        model = _load(args)
        prompt = args.prompt
        out = model.generate(prompt, max_new_tokens=args.max_new_tokens, stop_at_eos=False)
        report.record(out, model, command=" ".join(["workbench", *sys.argv[1:]]), prompt=prompt)
        entries = None
    paths = report.write(args.out, title=args.title, entries=entries)
    print(f"wrote {paths['html']} (opens offline) and {paths['json']}: {paths['entries']} measurement(s)")
    return 0


def cmd_compare(args) -> int:
    from workbench.report.compare import compare, format_compare, html_page, load

    a, b = load(args.a), load(args.b)
    rows = compare(a, b)
    print(format_compare(rows, a, b))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(html_page(rows, a, b))
        print(f"\nwrote {args.out}")
    return 1 if args.fail_on_regression and any(r["verdict"] == "regression" for r in rows) else 0


def cmd_peers(args) -> int:
    from workbench import report
    from workbench.analysis.peers import format_peers, run_peers

    rows = run_peers(engines=args.engines.split(",") if args.engines else None,
                     prompt_lens=[int(x) for x in args.prompt_lens.split(",")], new_tokens=args.new_tokens,
                     rounds=args.rounds, threads=args.threads, progress=lambda m: print("  " + m, flush=True),
                     model=args.model)
    print()
    print(format_peers(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["workbench", *sys.argv[1:]])
    out.write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    report.record(rows, None, command=command, kind="peers")
    paths = report.write(out.with_name(out.stem + "-report.html"), title="workbench peers")
    print(f"\nwrote {out}, {paths['html']} and {paths['json']}")
    return 0


def cmd_profile(args) -> int:
    """py-spy over `workbench <command ...>` in a child process."""
    from workbench.analysis.profile import profile_command, top_frames_text

    rest = [a for a in args.rest if a != "--"]
    if not rest:
        print("error: give the workbench command to profile, e.g. workbench profile -- generate 'Hello'",
              file=sys.stderr)
        return 2
    result = profile_command([sys.executable, "-m", "workbench.cli", *rest], native=args.native, rate=args.rate,
                             out=args.out)
    print(top_frames_text(result))
    print(f"\nspeedscope JSON: {result['speedscope']}")
    return result["returncode"]


def cmd_serve(args) -> int:
    from workbench.serving.server import serve

    model = _load(args)
    max_len = args.max_len or min(model.config.max_seq_len, 2048)
    serve(model, model_name=args.model, host=args.host, port=args.port, slots=args.slots, max_len=max_len,
          chunk=args.chunk, kv_cache=args.kv_cache, kv_kernel=args.kv_kernel,
          prefix_cache_tokens=args.prefix_cache_tokens, max_queue=args.max_queue)
    return 0


def cmd_serve_bench(args) -> int:
    from workbench import report
    from workbench.analysis.serve_bench import format_rows, serve_bench

    rows = serve_bench(args.url, rates=args.rate, concurrency=args.concurrency, num_requests=args.num_requests,
                       prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                       shared_prefix_tokens=args.shared_prefix_tokens, shared_fraction=args.shared_fraction,
                       burstiness=args.burstiness, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                       model=args.model, label=args.label, range_ratio=args.range_ratio,
                       prompts_file=args.prompts_file)
    print(format_rows(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["workbench", *sys.argv[1:]])
    out.write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    report.record(rows, None, command=command, kind="serve_bench")
    paths = report.write(out.with_name(out.stem + "-report.html"), title="workbench serve-bench")
    print(f"\nwrote {out}, {paths['html']} and {paths['json']} (`workbench compare` takes two such JSON)")
    return 0


def cmd_quantize(args) -> int:
    from workbench.model.loaders import BUNDLED_MODEL, bundled_gguf_path
    from workbench.model.quantize import write_quantized

    source = bundled_gguf_path() if args.source == BUNDLED_MODEL else Path(args.source)
    if not source.is_file():
        print(f"workbench quantize: {source} is not a file (a GGUF file, or {BUNDLED_MODEL})", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = write_quantized(source, Path(args.out), args.type)
    print(f"wrote {out.resolve()} ({out.stat().st_size / 2**20:.1f} MiB, {args.type}) in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_bench(args) -> int:
    script = ROOT / "bench" / {"attention": "all.py", "generation": "generation.py", "peaks": "peaks.py"}[args.which]
    if not script.is_file():
        print(f"error: {script} not found (the benchmarks live in the source tree)", file=sys.stderr)
        return 1
    return subprocess.run([sys.executable, str(script), *args.rest]).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    results = results_dir()  # where outputs go by default (the checkout's results/, else the cache's)

    g = sub.add_parser("generate", help="generate text, streaming it, then a timing summary")
    _model_args(g)
    g.add_argument("prompt")
    add_options(g, GENERATE_OPTIONS)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="every attention backend x KV dtype: a table and JSON")
    _model_args(d)
    d.add_argument("--short-tokens", type=int, default=16)
    d.add_argument("--long-tokens", type=int, default=512)
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--repeats", type=int, default=3, help="measured runs per configuration, interleaved, after a "
                   "warm-up round (rows: median and min-max)")
    d.add_argument("--out", default=str(results / "demo.json"), help="JSON file (default %(default)s)")
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("report", help="a report (JSON + offline HTML) from result files, or from a fresh run")
    _model_args(r)
    r.add_argument("files", nargs="*", help="report JSON or benchmark JSON files (default: measure a generation now)")
    r.add_argument("-o", "--out", default=str(results / "report.html"), help="HTML path; JSON beside it (default %(default)s)")
    r.add_argument("--title", default="Workbench report")
    r.add_argument("--prompt", default="The capital of France is")
    r.add_argument("--max-new-tokens", type=int, default=32)
    r.set_defaults(func=cmd_report)

    c = sub.add_parser("compare", help="two report JSONs side by side: ratio per row and a noise-aware verdict")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("-o", "--out", default=None, help="also write the comparison as an HTML page")
    c.add_argument("--fail-on-regression", action="store_true", help="exit 1 if any row is a regression")
    c.set_defaults(func=cmd_compare)

    pe = sub.add_parser("peers", help="ours vs transformers and llama.cpp: same tokens, interleaved rounds")
    pe.add_argument("--model", default="smollm2-135m",
                    help="the bundled default (its conversions: F32, Q8_0, ...), gemma3-270m or a .gguf path "
                         "(the file itself in every engine) (default %(default)s)")
    pe.add_argument("--engines", default=None, help="comma-separated engine names (default: all)")
    pe.add_argument("--prompt-lens", default="64,1024")
    pe.add_argument("--new-tokens", type=int, default=64)
    pe.add_argument("--rounds", type=int, default=3)
    pe.add_argument("--threads", type=int, default=None)
    pe.add_argument("--out", default=str(results / "peers.json"), help="JSON file (default %(default)s)")
    pe.set_defaults(func=cmd_peers)

    pr = sub.add_parser("profile", help="py-spy over a workbench command (flame graph data as speedscope JSON)")
    pr.add_argument("--native", action="store_true", help="include native frames (our C++ kernels by name)")
    pr.add_argument("--rate", type=int, default=250, help="samples per second")
    pr.add_argument("--out", default=str(results / "profile.speedscope.json"), help="speedscope file (default %(default)s)")
    pr.add_argument("rest", nargs=argparse.REMAINDER)
    pr.set_defaults(func=cmd_profile)

    sv = sub.add_parser("serve", help="an OpenAI-compatible server: continuous batching, prefix reuse")
    _model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (default %(default)s)")
    sv.add_argument("--slots", type=int, default=8, help="sequences decoded together at most (KV cache rows)")
    sv.add_argument("--max-len", type=int, default=None, help="tokens per sequence (default min(context, 2048))")
    sv.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                    help=f"prompt tokens prefilled per scheduler step, all prompts together (default {DEFAULT_CHUNK})")
    sv.add_argument("--kv-cache", default=None, help="KV cache format (default the model's switch)")
    sv.add_argument("--kv-kernel", default=None, help="how the cache is read (default the format's)")
    sv.add_argument("--prefix-cache-tokens", type=int, default=None,
                    help="prompt-prefix reuse budget in tokens (default: half the memory left after the model and "
                         "its slots; 0: off)")
    sv.add_argument("--max-queue", type=int, default=256, help="waiting requests at most; beyond, 429")
    sv.set_defaults(func=cmd_serve)

    sb = sub.add_parser("serve-bench", help="load an OpenAI-compatible server: TTFT / TPOT / ITL percentiles, goodput")
    sb.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="the server (default %(default)s)")
    add_options(sb, SERVE_BENCH_OPTIONS)
    sb.add_argument("--model", default="default", help="the model name sent in each request")
    sb.add_argument("--label", default="", help="a name for these rows (which server, which settings)")
    sb.add_argument("--out", default=str(results / "serve-bench.json"), help="JSON file (default %(default)s)")
    sb.set_defaults(func=cmd_serve_bench)

    from workbench.model.quantize import MIXES

    q = sub.add_parser("quantize", help="requantize a GGUF file with our quantizer (a llama.cpp file type's mix)")
    q.add_argument("source", help="a GGUF file (F32, F16 or quantized), or smollm2-135m for the bundled one")
    q.add_argument("out", help="the GGUF file to write")
    q.add_argument("--type", default="Q4_K_M", choices=list(MIXES), help="the file type (default Q4_K_M)")
    q.set_defaults(func=cmd_quantize)

    b = sub.add_parser("bench", help="run a benchmark script from bench/")
    b.add_argument("which", choices=["attention", "generation", "peaks"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    from workbench.model.loaders import ModelLoadError

    try:
        return args.func(args)
    except (ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
