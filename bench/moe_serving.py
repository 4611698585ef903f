"""Serving a mixture of experts against a dense model of the same active size, as the batch
grows: our server (`workbench serve`) running each model under the same load from our load
generator (`workbench serve-bench`), the two servers' runs interleaved.

The mixture is the GGUF file with Qwen3-30B-A3B's layer shapes (128 experts of FFN 768, 8 a
token; random weights, the bundled tokenizer; Q4_K_M by llama.cpp's quantizer when
llama-cpp-python is installed, else by the workbench's own); its dense twin
(workbench.model.arch.dense_twin) has the same attention and one MLP of 8 x 768: every token
reads as many parameters in both. At one request at a time the two read about the same bytes
a step; as more requests decode together, the dense model still reads its one MLP while the
mixture reads every distinct expert its tokens chose (bench/moe_batch.py measures that), so
its output tokens/s grows less with the batch.

For each concurrency: output tokens/s and goodput (requests meeting --slo-ttft and
--slo-tpot) of each server, median (min-max) over --rounds rounds, the mixture over the dense
model round by round, and the cost model's decode-step bytes of each at that batch.

    python bench/moe_serving.py [--concurrency 1,4,16] [--rounds 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, spread, write_results  # noqa: E402

from workbench.analysis.serve_bench import serve_bench  # noqa: E402
from workbench.hw.rounds import interleaved_rounds  # noqa: E402
from workbench.serving.process import ServerProcess  # noqa: E402


def shaped(layers: int, dense_twin: bool) -> Path:
    from workbench.analysis.gguf_files import shaped_gguf

    try:
        import llama_cpp  # noqa: F401

        return shaped_gguf("qwen3-30b-a3b", layers=layers, kind="Q4_K_M", dense_twin=dense_twin)
    except ImportError:  # our own quantizer, the same mix
        from workbench.model.quantize import write_quantized

        f16 = shaped_gguf("qwen3-30b-a3b", layers=layers, kind="F16", dense_twin=dense_twin)
        out = f16.with_name(f16.name.replace("-F16", "-Q4_K_M-ours"))
        return out if out.is_file() else write_quantized(f16, out, "Q4_K_M")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput's time-to-first-token SLO, s")
    parser.add_argument("--slo-tpot", type=float, default=0.2, help="goodput's time-per-output-token SLO, s")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    loads = [int(c) for c in args.concurrency.split(",")]
    files = {"mixture": shaped(args.layers, False), "dense twin": shaped(args.layers, True)}
    slots = str(max(loads))
    servers = {name: ServerProcess(["--model", str(path), "--slots", slots, "--max-len", "512"])
               for name, path in files.items()}
    found = {(name, c): {"tps": [], "goodput": []} for name in servers for c in loads}
    try:
        for server in servers.values():
            server.start()
        cases = {(name, c): (name, c) for name in servers for c in loads}
        for round_, case in interleaved_rounds(cases, args.rounds, warmup=1):
            name, c = case
            row = serve_bench(servers[name].url, rates=[None], concurrency=c, num_requests=max(4, 2 * c),
                              prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                              slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, seed=1000 * (round_ + 2) + c)[0]
            if round_ >= 0:
                found[case]["tps"].append(row["output_tokens_per_s"])
                found[case]["goodput"].append(row["goodput_requests_per_s"])
    finally:
        for server in servers.values():
            server.stop()

    import workbench as wb

    rows, raw = [], []
    for c in loads:
        moe, dense = found[("mixture", c)], found[("dense twin", c)]
        ratios = [a / b for a, b in zip(moe["tps"], dense["tps"])]
        step_mb = {name: wb.predict(_config(path), batch=c, prompt_len=args.prompt_tokens, new_tokens=args.max_tokens,
                                    weight_dtype="q4_k").step_bytes("decode") / 1e6 for name, path in files.items()}
        rows.append({"concurrency": c, "mixture tok/s": spread(moe["tps"]), "dense tok/s": spread(dense["tps"]),
                     "mixture / dense": spread(ratios, 2, "x"), "mixture goodput req/s": spread(moe["goodput"], 2),
                     "dense goodput req/s": spread(dense["goodput"], 2),
                     "step MB mixture": f"{step_mb['mixture']:.0f}", "step MB dense": f"{step_mb['dense twin']:.0f}"})
        raw.append({"concurrency": c, "mixture": moe, "dense": dense, "ratio": ratios, "step_mb": step_mb})
    print_table(rows, list(rows[0]), title=(
        f"Qwen3-30B-A3B shapes ({args.layers} layers, Q4_K_M) against its dense twin: {args.prompt_tokens}-token "
        f"prompts, {args.max_tokens} output tokens, 2 x concurrency requests a run, {args.rounds} rounds interleaved; "
        f"goodput SLOs TTFT {args.slo_ttft} s, TPOT {args.slo_tpot} s; step MB: the cost model's, all q4_k, uniform routing"))
    write_results("moe_serving", {"files": {k: str(v) for k, v in files.items()},
                                  "servers": {k: s.shell_command for k, s in servers.items()}, "rows": raw}, args.out)
    return 0


def _config(path: Path):
    """The ModelConfig of a GGUF file, without its weights."""
    from workbench.model.gguf_file import read_gguf
    from workbench.model.loaders import _gguf_config

    f = read_gguf(path)
    return _gguf_config(f.fields, f.tensors, path.stem)


if __name__ == "__main__":
    sys.exit(main())
