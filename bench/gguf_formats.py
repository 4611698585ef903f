"""The files users download, in both engines: GGUF files with a preset's layer shapes (random
weights, the bundled tokenizer; workbench.analysis.gguf_files), quantized by llama.cpp's own
quantizer to Q4_K_M, Q4_0, ... and run as they are by the workbench (dtype "file": each matrix
in the file's own blocks) and by llama.cpp (llama-cpp-python), each in its own process, the two
interleaved in a new random order every round:

  - decode: tokens/s at batch 1 after a 16-token prompt (the median gap between tokens), as
    GB/s of the bytes a step reads (every matrix, one embedding row, the KV cache; the
    workbench's step records count them) and as a share of the measured triad;
  - prefill: time to first token of a --prompt-len prompt;
  - batched decode: tokens/s with --batch sequences decoded together (llama.cpp: as many
    parallel sequences of one context, its batched llama_decode).

--activation-bits 16,8 runs the workbench twice, its decode's integer products with int16
activations (the default) and with int8 ones (as llama.cpp's: faster, less exact; see
kernels.set_block_activation_bits), each engine in the same interleaved rounds.

Each ratio (ours over llama.cpp, > 1: ours faster) is taken round by round. Every figure is
median (min-max) over --rounds rounds after one warm-up round.

    python bench/gguf_formats.py [--preset llama2-7b] [--layers 8] [--kinds Q4_K_M,Q4_0]
                                 [--rounds 3] [--new-tokens 48] [--prompt-len 512] [--batch 16]
    python bench/gguf_formats.py --model gemma3-270m      # a real file: a bundled model or a path
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, ratio_text, write_results  # noqa: E402

from workbench.analysis.gguf_files import shaped_gguf  # noqa: E402
from workbench.analysis.peers import Engine, _Worker  # noqa: E402
from workbench.hw.rounds import interleaved_rounds, ratio_by_round  # noqa: E402
from workbench.kernels.peaks import measured_peaks  # noqa: E402


def _spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kinds", default="Q4_K_M,Q4_0", help="llama.cpp file types, comma-separated")
    parser.add_argument("--model", default=None, help="a real GGUF file instead of the shaped ones: a bundled "
                                                      "model's name (gemma3-270m) or a path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="sequences of the batched decode (0: skip it)")
    parser.add_argument("--activation-bits", default="16",
                        help="the workbench's decode activations, comma-separated: 16 (int16), 8 (int8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    try:
        bits_list = [int(b) for b in args.activation_bits.split(",")]
    except ValueError:
        parser.error(f"--activation-bits must be 16, 8 or both (16,8), got {args.activation_bits!r}")
    if not bits_list or any(b not in (8, 16) for b in bits_list):
        parser.error(f"--activation-bits must be 16, 8 or both (16,8), got {args.activation_bits!r}")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp is not installed: pip install -e '.[peers]' (compiles llama.cpp: minutes on 2 cores)")
        write_results("gguf_formats", {"rows": [], "skipped": "llama-cpp-python is not installed"}, args.out)
        return 0

    triad = measured_peaks().triad_gbps
    n_ctx = max(args.prompt_len, 16) + args.new_tokens + 16
    short = list(range(100, 116))
    long_prompt = [100 + (i * 37) % 20000 for i in range(args.prompt_len)]
    rows, table = [], []
    if args.model:
        from workbench.model.loaders import BUNDLED_MODELS, bundled_gguf_path

        path = bundled_gguf_path(args.model) if args.model in BUNDLED_MODELS else Path(args.model)
        files = [(args.model, path)]
        title = f"{args.model} ({path.name}), {args.threads} threads"
    else:
        files = [(kind, None) for kind in args.kinds.split(",")]
        title = f"{args.preset} shapes, {args.layers} layers, {args.threads} threads"
    for kind, path in files:
        path = path or shaped_gguf(args.preset, args.layers, kind)
        size = path.stat().st_size
        engines = {}
        for bits in bits_list:
            name = "workbench" if bits == 16 else "workbench int8 acts"
            engines[name] = Engine(name, {"engine": "workbench", "model": str(path), "dtype": "file", "kv_cache": "fp16",
                                          "max_batch": max(1, args.batch), "activation_bits": bits}, None, "")
        engines["llama.cpp"] = Engine("llama.cpp", {"engine": "llama.cpp", "path": str(path), "kv": "f16"}, "llama_cpp", "")
        ours = [name for name in engines if name != "llama.cpp"]
        workers = {name: _Worker(e, args.threads, n_ctx) for name, e in engines.items()}
        runs = {name: {"decode": {}, "prefill": {}, "batch": {}, "bytes": None} for name in workers}
        try:
            for round_, name in interleaved_rounds(list(workers), args.rounds, warmup=1):
                w, r = workers[name], runs[name]
                dec = w.run(short, args.new_tokens)
                pre = w.run(long_prompt, 2)
                bat = w.run(short, max(8, args.new_tokens // 3), args.batch) if args.batch > 1 else None
                if round_ < 0:
                    continue
                r["decode"][round_] = 1e3 / statistics.median(dec["decode_ms"])
                r["prefill"][round_] = pre["prefill_ms"]
                if bat:
                    r["batch"][round_] = 1e3 * args.batch / statistics.median(bat["decode_ms"])
                r["bytes"] = dec.get("decode_bytes_per_step", r["bytes"])
                r.setdefault("tokens", dec["tokens"])
        finally:
            for w in workers.values():
                w.close()
        step_bytes = runs[ours[0]]["bytes"]  # the same file: both read these bytes a step
        for name in workers:
            r = runs[name]
            dec = list(r["decode"].values())
            gbps = [step_bytes * t / 1e9 for t in dec]
            row = {"file": kind, "engine": name, "description": workers[name].description, "file_bytes": size,
                   "step_bytes": step_bytes, "decode_tok_s": dec, "decode_gbps": gbps,
                   "decode_pct_of_triad": [100 * g / triad for g in gbps], "prefill_ms": list(r["prefill"].values()),
                   "batch": args.batch, "batch_tok_s": list(r["batch"].values())}
            if name != "llama.cpp":
                other = runs["llama.cpp"]
                same = sum(1 for _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(r["tokens"], other["tokens"])))
                row["decode_ratio"] = ratio_by_round(r["decode"], other["decode"])
                row["prefill_ratio"] = ratio_by_round(other["prefill"], r["prefill"])  # theirs / ours: > 1 ours faster
                row["batch_ratio"] = ratio_by_round(r["batch"], other["batch"]) if r["batch"] else None
                row["same_greedy_tokens"] = same
            rows.append(row)
            table.append({"file": kind, "engine": name, "decode tok/s": _spread(dec),
                          "GB/s": _spread(gbps), "% triad": _spread(row["decode_pct_of_triad"], "{:.0f}"),
                          "ours/llama.cpp": ratio_text(row["decode_ratio"]) if "decode_ratio" in row else "",
                          f"TTFT {args.prompt_len} ms": _spread(row["prefill_ms"], "{:.0f}"),
                          "TTFT llama.cpp/ours": ratio_text(row["prefill_ratio"]) if "prefill_ratio" in row else "",
                          f"batch {args.batch} tok/s": _spread(row["batch_tok_s"]) if row["batch_tok_s"] else "-",
                          "batch ours/llama.cpp": ratio_text(row["batch_ratio"]) if row.get("batch_ratio") else ""})
    print_table(table, list(table[0]), title=f"{title}: the same files in both engines (triad {triad:.1f} GB/s)")
    write_results("gguf_formats", {"rows": rows, "triad_gbps": triad}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
