"""Loading a big GGUF file as users download it: a preset's full shapes (default Llama-2-7B,
all 32 layers) quantized by llama.cpp's own quantizer (Q4_K_M by default), loaded in a fresh
process each round, then a few greedy tokens generated.

    .venv/bin/python bench/gguf_load.py                       # llama2-7b, 32 layers, Q4_K_M, 3 rounds
    .venv/bin/python bench/gguf_load.py --kind Q4_0 --rounds 5

For each round: seconds from load_model's call to a model ready to generate, the process's peak
resident growth over the load (ru_maxrss, after the kernels are built and imported) against the
file's size, the model's own weight bytes, and decode tokens/s of the first tokens (the file's
pages come from the page cache after the first round: the first round's time is the one a cold
start has, the later ones a warm cache's; both are shown). The file is made once (F16 written
here from seeded random weights, then quantized by llama-cpp-python's llama_model_quantize;
needs the peers extra) and kept under the workbench cache; --keep-f16 keeps the F16 source too
(13.5 GB at 7B).

Writes results/gguf_load.json (or into --out, a folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_results  # noqa: E402

from workbench.analysis.gguf_files import FTYPES, shaped_gguf  # noqa: E402
from workbench.cache import cache_dir  # noqa: E402

CHILD = r"""
import json, resource, sys, time
import workbench as wb
from workbench import kernels
from workbench.runtime.threads import set_threads
set_threads({threads})
kernels.native.ext
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
m = wb.load_model({path!r})
load_s = time.perf_counter() - t0
after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = m.generate("The capital of France is", max_new_tokens={new_tokens}, stop_at_eos=False)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"load_s": load_s, "peak_growth_load": (after_load - before) * 1024,
                   "peak_growth_generate": (after - before) * 1024, "weight_bytes": m.llama.weight_bytes,
                   "formats": m.llama.weight_formats, "decode_tokens_per_s": out.timings.decode_tokens_per_s,
                   "text": out.text}}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--layers", type=int, default=None, help="default: the preset's own count")
    parser.add_argument("--kind", default="Q4_K_M", help="a llama.cpp file type (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file the quantized one is made from")
    parser.add_argument("--out", type=Path, default=None, help="folder of the JSON (default: results/)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.kind not in FTYPES:
        parser.error(f"--kind must be one of {', '.join(FTYPES)}, got {args.kind!r}")

    from workbench.model.config import preset

    layers = args.layers or preset(args.preset).n_layers
    path = shaped_gguf(args.preset, layers=layers, kind=args.kind)
    f16 = cache_dir() / "models" / f"{args.preset}-{layers}L-seed0-F16.gguf"
    if not args.keep_f16 and args.kind != "F16":
        f16.unlink(missing_ok=True)  # made again if asked for: disk, not time, is what it costs
    size = path.stat().st_size
    code = CHILD.format(path=str(path), threads=args.threads, new_tokens=args.new_tokens)
    runs = []
    for r in range(args.rounds):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}: load {runs[-1]['load_s']:.1f} s, peak growth "
              f"{runs[-1]['peak_growth_generate'] / 2**30:.2f} GiB, decode {runs[-1]['decode_tokens_per_s']:.2f} tok/s",
              flush=True)

    def spread(key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
        xs = [r[key] / scale for r in runs]
        return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"

    gib = 2**30
    table = [{"file": path.name, "file GiB": f"{size / gib:.2f}", "load s (cold, first)": f"{runs[0]['load_s']:.1f}",
              "load s (all rounds)": spread("load_s", fmt="{:.1f}"),
              "peak growth GiB": spread("peak_growth_generate", gib),
              "over the file GiB": f"{(max(r['peak_growth_generate'] for r in runs) - size) / gib:+.2f}",
              "weights GiB": f"{runs[0]['weight_bytes'] / gib:.2f}",
              "decode tok/s": spread("decode_tokens_per_s")}]
    print_table(table, list(table[0]), title=f"{args.preset}, {layers} layers, {args.kind}: load in a fresh process "
                                            f"(median (min-max) of {args.rounds}), {args.threads} threads")
    write_results("gguf_load", {"preset": args.preset, "layers": layers, "kind": args.kind, "file_bytes": size,
                                "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
