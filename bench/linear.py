"""Linear layers at Llama-2-7B shapes: our fp32 / bf16 / int8 kernels vs torch, interleaved.

Decode at batch 1 (M = 1): memory-bound, so GB/s counts the weight bytes read and is set
against the triad measured in the same run. Batched decode (M = 16, 32) and prefill
(M = 512, 1024): GFLOP/s against the peak of the unit the case ran on: the fp32 FMA peak,
or the AMX bf16 peak for our GEMM on the matrix engine (`ours bf16 amx`, x rounded to bf16
as torch's oneDNN bf16 path does), the AVX512-BF16 peak for `ours bf16 avx512`, and for torch
bf16 the peak of the best bf16 unit the CPU has (AMX, else AVX512-BF16). `ours bf16 fma`
is the same GEMM on fp32 FMAs (x kept in fp32); at M = 16 and 32 the matrix-vector kernel
forced on (`matvec only`) shows what the GEMM gains. `ours int8 ...`: weight-only int8 (one
scale per row) on each engine, converted to bf16 slice by slice on the bf16 engines; `ours
int8 w8a8` (where the CPU has AMX int8): the same weights times x quantized to int8 per
token on the AMX int8 tiles, against the AMX int8 peak (giga-ops). Peers: torch's F.linear on fp32
weights, and on bf16 weights with bf16 activations.

    python bench/linear.py [--repeats 7] [--m 16,512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt_ms, interleaved, print_table, summarize, write_results  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from workbench import kernels  # noqa: E402
from workbench.kernels.peaks import measured_peaks  # noqa: E402

SHAPES = {"q/k/v/o [4096, 4096]": (4096, 4096), "gate/up [11008, 4096]": (11008, 4096),
          "down [4096, 11008]": (4096, 11008)}
TRIAD_FLOATS = 1 << 25


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--m", default="1,16,32,512,1024", help="rows of x (tokens), comma-separated")
    args = parser.parse_args()
    peak = measured_peaks()
    bf16_engines = [e for e in ("amx_bf16", "avx512_bf16") if kernels.gemm_engines()[e][0]]
    w8a8 = kernels.gemm_engines()["amx_int8"][0]  # per-row int8 weights as W8A8 on the AMX int8 tiles

    def engine(name):  # run our bf16 GEMM on one engine (restored to auto at the end)
        def run(x, w, **kw):
            kernels.set_gemm_engine(name)
            return kernels.linear(x, w, **kw)
        return run

    a, b, c = torch.empty(TRIAD_FLOATS), torch.rand(TRIAD_FLOATS), torch.rand(TRIAD_FLOATS)
    rows, results = [], []
    for label, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k) * 0.02
        w16 = w32.bfloat16()
        q8, s8 = kernels.quantize_weight_int8(w32)  # weight-only int8, one scale per row
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k)
            cases = {"ours fp32": lambda: kernels.linear(x, w32), "torch fp32": lambda: F.linear(x, w32)}
            if m > 10 and bf16_engines:
                for e in bf16_engines:
                    cases[f"ours bf16 {e.split('_')[0]}"] = lambda e=e: engine(e)(x, w16)
                cases["ours bf16 fma"] = lambda: engine("fma")(x, w16)
                for e in bf16_engines:
                    cases[f"ours int8 {e.split('_')[0]}"] = lambda e=e: engine(e)(x, q8, scale=s8)
                cases["ours int8 fma"] = lambda: engine("fma")(x, q8, scale=s8)
                if w8a8:
                    cases["ours int8 w8a8"] = lambda: engine("amx_int8")(x, q8, scale=s8)
            else:
                cases["ours bf16"] = lambda: kernels.linear(x, w16)
                cases["ours int8"] = lambda: kernels.linear(x, q8, scale=s8)
            if 1 < m <= 32:
                cases["ours bf16, matvec only"] = lambda: kernels.linear(x, w16, matvec_max_rows=m)
            if m > 1:  # torch's bf16 path: far too slow at M=1 to repeat (0.3 GFLOP/s, see issue 3)
                cases["torch bf16"] = lambda: F.linear(x.bfloat16(), w16).float()
            cases["triad"] = lambda: kernels.native.ext.triad(a, b, c, 3.0)
            stats = {name: summarize(s) for name, s in interleaved(cases, args.repeats).items()}
            triad = 12 * TRIAD_FLOATS / (stats["triad"]["median_ms"] / 1e3) / 1e9
            for name, st in stats.items():
                if name == "triad":
                    continue
                secs = st["median_ms"] / 1e3
                wbytes = n * k * (1 if "int8" in name else 2 if "bf16" in name else 4)  # int8: scales aside
                st["gbps"] = wbytes / secs / 1e9
                st["gflops"] = 2 * m * n * k / secs / 1e9
                # torch bf16 runs oneDNN on the best bf16 unit the CPU has, as our auto engine does
                best_bf16 = bf16_engines[0] if bf16_engines else "fma"
                unit = ("amx_int8" if "w8a8" in name else "amx_bf16" if "amx" in name else "avx512_bf16" if "avx512" in name else
                        best_bf16 if name == "torch bf16" else "fma")
                st["peak_unit"], st["peak_gflops"] = unit, peak.compute_peak_gflops(unit)
                label_unit = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16", "amx_int8": "AMX int8"}.get(unit, "FMA")
                metric = (f"{st['gbps']:.1f} GB/s ({100 * st['gbps'] / triad:.0f}% triad)" if m == 1
                          else f"{st['gflops']:.0f} GFLOP/s ({100 * st['gflops'] / st['peak_gflops']:.0f}% {label_unit})")
                rows.append({"weights": label, "M": m, "case": name, "ms median (min-max)": fmt_ms(st),
                             "throughput": metric})
            kernels.set_gemm_engine("auto")
            ratios = {}
            for ours, theirs in (("ours bf16 amx", "torch bf16"), ("ours bf16 avx512", "torch bf16"),
                                 ("ours bf16 amx", "ours bf16 fma"),
                                 ("ours bf16 avx512", "ours bf16 fma"), ("ours int8 amx", "ours int8 fma"),
                                 ("ours int8 avx512", "ours int8 fma"), ("ours int8 amx", "torch bf16"),
                                 ("ours int8 avx512", "torch bf16"), ("ours int8 w8a8", "ours int8 amx"),
                                 ("ours int8 w8a8", "torch bf16"), ("ours fp32", "torch fp32")):
                if ours in stats and theirs in stats:
                    ratios[f"{ours} / {theirs}"] = stats[theirs]["median_ms"] / stats[ours]["median_ms"]
            results.append({"shape": [n, k], "M": m, "triad_gbps": triad, "stats": stats, "speedups": ratios})
            print(f"{label} M={m}: " + ", ".join(f"{nm} {s['median_ms']:.2f} ms" for nm, s in stats.items())
                  + "".join(f"; {r}: {v:.2f}x" for r, v in ratios.items()), flush=True)
    print_table(rows, ["weights", "M", "case", "ms median (min-max)", "throughput"],
                title=f"Linear layers, {torch.get_num_threads()} threads; peaks: FMA {peak.fma_gflops:.0f}, "
                      f"AVX512-BF16 {peak.avx512_bf16_gflops:.0f}, AMX bf16 {peak.amx_bf16_gflops:.0f} GFLOP/s, "
                      f"AMX int8 {peak.amx_int8_gops:.0f} GOP/s")
    write_results("linear", {"repeats": args.repeats, "results": results}, args.out)


if __name__ == "__main__":
    main()
