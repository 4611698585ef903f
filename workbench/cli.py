"""`workbench` command line: generate, demo (the main job), bench.

    workbench generate "The capital of France is" --max-new-tokens 32 --attention slim --kv-cache int8
    workbench demo                      # every attention x KV dtype on the bundled model, table + JSON
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

from workbench.options import GENERATE_OPTIONS, LOAD_OPTIONS, add_options, chat_prompt, generate_kwargs

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

    from workbench.analysis.ablation import rows_as_dicts
    from workbench.analysis.demo import format_table, run_demo

    model = _load(args)
    print(f"{model!r}\nthreads {torch.get_num_threads()}; reference: naive attention with an fp32 KV cache\n",
          flush=True)

    def progress(done, total, row):
        print(f"  [{done}/{total}] {row.prompt_len:4d} tokens {row.attention:5s} {row.kv_cache:4s} "
              f"prefill {row.prefill_ms:.1f} ms, {row.decode_tokens_per_s:.1f} tok/s", flush=True)

    t0 = time.perf_counter()
    rows = run_demo(model, short_tokens=args.short_tokens, long_tokens=args.long_tokens,
                    new_tokens=args.new_tokens, progress=progress)
    print()
    print(format_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": model.description, "config": model.config.as_dict(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "seconds": time.perf_counter() - t0,
        "command": " ".join(sys.argv), "rows": rows_as_dicts(rows)}, indent=2))
    from workbench import report

    report.record(rows, model, command=" ".join(["workbench", *sys.argv[1:]]))
    paths = report.write(out.with_name(out.stem + "-report.html"), title=f"workbench demo: {model.description}")
    print(f"\nwrote {out}, {paths['html']} (opens offline) and {paths['json']}")
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
    d.add_argument("--out", default=str(Path("results") / "demo.json"), help="JSON file (default results/demo.json)")
    d.set_defaults(func=cmd_demo)

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
