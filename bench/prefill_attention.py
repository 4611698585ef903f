"""Prefill attention at Llama-2-7B shapes: SlimAttention vs our FlashAttention vs PyTorch.

One attention layer's prefill (B=1, H=Hkv=32, D=128, causal) for each prompt length N, the
cases interleaved in one run:

    slim        workbench SlimAttention, fp32 (default block_m from the L2 size)
    flash       workbench FlashAttention-2, fp32 (same micro-kernel and exp; default tiles)
    sdpa        torch.nn.functional.scaled_dot_product_attention(is_causal=True), fp32
    naive       softmax(Q K^T + mask) V in plain PyTorch fp32 (materialised scores)
    slim_full   SlimAttention without the causal mask (to check causal ~ half the work)
  and where the CPU has a bf16 engine (AMX, AVX512-BF16), on bf16 q / k / v:
    slim bf16 amx, flash bf16 amx (and avx512)   ours, Q K^T and P V on that engine
    sdpa bf16   PyTorch's SDPA on bf16 inputs (what a user of such a CPU would run)

GFLOP/s counts only the visible (causal) query-key pairs: 4 D flops per pair (Q.K and P.V),
against the peak of the unit the case ran on (FMA for fp32; AMX or AVX512-BF16 for ours on
that engine; the best bf16 unit for torch's bf16). Then a block-size sweep for SlimAttention
(and FlashAttention's tiles) at each N, on the fp32 kernels and on the first bf16 engine.

    python bench/prefill_attention.py [--n 256,1024] [--repeats 5] [--no-sweep] [--quick]
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

B, H, D = 1, 32, 128


def naive_attention(q, k, v):
    n = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    s.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def causal_flops(n: int) -> float:
    return 4.0 * D * B * H * n * (n + 1) / 2


def executed_flops(n: int, block_m: int, causal: bool) -> float:
    """The flops SlimAttention's kernel executes, following its panel structure
    (kernels/gemm.h): each MR-row panel computes Q.K^T over whole NR-wide column panels
    up to the last key its rows see, and P.V over exactly those keys."""
    mr, nr = kernels.native.ext.gemm_mr(), kernels.native.ext.gemm_nr()
    total = 0
    for i0 in range(0, n, block_m):
        m = min(block_m, n - i0)
        for p0 in range(0, m, mr):
            rows = min(mr, m - p0)
            visible = min(n, i0 + p0 + rows) if causal else n
            total += 2 * rows * D * (-(-visible // nr) * nr + visible)
    return float(total * B * H)


ENGINE_TAG = {"amx_bf16": "amx", "avx512_bf16": "avx512"}
UNIT_LABEL = {"fma": "FMA", "amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}


def on_engine(engine: str, fn):
    """fn() with our kernels on `engine` (the bf16 engine in force decides where bf16 inputs run)."""
    def call():
        kernels.set_gemm_engine(engine)
        return fn()
    return call


def run(ns: list[int], repeats: int, sweep: bool) -> dict:
    peaks = measured_peaks()
    engines = [e for e in ENGINE_TAG if kernels.gemm_engines()[e][0]]
    best_bf16 = engines[0] if engines else "fma"
    rows, results, sweeps = [], [], []
    for n in ns:
        q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
        qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
        fp32 = lambda fn: on_engine("fma", fn)  # noqa: E731 (fp32 inputs run the FMA kernels whatever the engine)
        cases = {
            "slim": fp32(lambda: kernels.slim_attention(q, k, v)),
            "flash": fp32(lambda: kernels.flash_attention(q, k, v)),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "naive": lambda: naive_attention(q, k, v),
            "slim_full": fp32(lambda: kernels.slim_attention(q, k, v, causal=False)),
        }
        unit = {name: "fma" for name in cases}
        for e in engines:
            cases[f"slim bf16 {ENGINE_TAG[e]}"] = on_engine(e, lambda: kernels.slim_attention(qb, kb, vb))
            cases[f"flash bf16 {ENGINE_TAG[e]}"] = on_engine(e, lambda: kernels.flash_attention(qb, kb, vb))
            unit[f"slim bf16 {ENGINE_TAG[e]}"] = unit[f"flash bf16 {ENGINE_TAG[e]}"] = e
        if engines:
            cases["sdpa bf16"] = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
            unit["sdpa bf16"] = best_bf16
        samples = interleaved(cases, repeats)
        kernels.set_gemm_engine("auto")
        stats = {name: summarize(s) for name, s in samples.items()}
        med = {name: s["median_ms"] for name, s in stats.items()}
        flops = causal_flops(n)
        for name in cases:
            if name == "slim_full":
                continue
            gflops = flops / (med[name] / 1e3) / 1e9
            peak = peaks.compute_peak_gflops(unit[name])
            stats[name].update(gflops=gflops, peak_unit=unit[name], peak_gflops=peak)
            base = "slim" if unit[name] == "fma" else f"slim bf16 {ENGINE_TAG[best_bf16]}"
            rows.append({"N": n, "case": name, "ms median (min-max)": fmt_ms(stats[name]),
                         "GFLOP/s": f"{gflops:.0f}",
                         "% of its unit's peak": f"{100 * gflops / peak:.0f}% {UNIT_LABEL[unit[name]]}",
                         "time / slim (same dtype)": f"{med[name] / med[base]:.2f}x"})
        block_m = kernels.native.default_block_m(n, n, D, B * H)
        executed_ratio = executed_flops(n, block_m, True) / executed_flops(n, block_m, False)
        results.append({
            "N": n, "stats": stats, "causal_flops": flops,
            "default_block_m": block_m,
            "executed_flops_causal_over_full": executed_ratio,
            "ratios": {
                "flash_over_slim": med["flash"] / med["slim"],
                "sdpa_over_slim": med["sdpa"] / med["slim"],
                "naive_over_slim": med["naive"] / med["slim"],
                "causal_over_full": med["slim"] / med["slim_full"],
                **{f"sdpa_bf16_over_{algo}_bf16_{ENGINE_TAG[e]}": med["sdpa bf16"] / med[f"{algo} bf16 {ENGINE_TAG[e]}"]
                   for e in engines for algo in ("slim", "flash")},
                **{f"slim_fp32_over_slim_bf16_{ENGINE_TAG[e]}": med["slim"] / med[f"slim bf16 {ENGINE_TAG[e]}"]
                   for e in engines},
            },
        })
        if engines:
            tag = ENGINE_TAG[best_bf16]
            print(f"N={n} bf16: slim on {tag} {med[f'slim bf16 {tag}']:.2f} ms, flash {med[f'flash bf16 {tag}']:.2f}, "
                  f"sdpa bf16 {med['sdpa bf16']:.2f}: sdpa bf16 / slim bf16 "
                  f"{med['sdpa bf16'] / med[f'slim bf16 {tag}']:.2f}x", flush=True)
        print(f"N={n}: slim {med['slim']:.2f} ms, flash/slim {med['flash'] / med['slim']:.2f}x, "
              f"sdpa/slim {med['sdpa'] / med['slim']:.2f}x, causal/full time {med['slim'] / med['slim_full']:.2f} "
              f"(flops executed {executed_ratio:.3f})",
              flush=True)

        if sweep:
            mr = kernels.native.ext.gemm_mr()
            blocks = sorted({mr * m for m in (2, 4, 8, 16, 32) if mr * m <= max(n, mr * 2)})
            sweep_cases = {f"slim bm={bm}": (lambda bm=bm: kernels.slim_attention(q, k, v, block_m=bm))
                           for bm in blocks}
            for bm, bn in ((96, 256), (192, 256), (192, 512)):
                sweep_cases[f"flash {bm}x{bn}"] = (
                    lambda bm=bm, bn=bn: kernels.flash_attention(q, k, v, block_m=bm, block_n=bn))
            if engines:  # the tiles take whole 32-row pairs and 32-key blocks
                e = best_bf16
                for bm in (64, 128, 256, 512):
                    sweep_cases[f"slim bf16 {ENGINE_TAG[e]} bm={bm}"] = on_engine(
                        e, lambda bm=bm: kernels.slim_attention(qb, kb, vb, block_m=bm))
                for bm, bn in ((128, 256), (192, 512), (256, 512), (512, 512)):
                    sweep_cases[f"flash bf16 {ENGINE_TAG[e]} {bm}x{bn}"] = on_engine(
                        e, lambda bm=bm, bn=bn: kernels.flash_attention(qb, kb, vb, block_m=bm, block_n=bn))
            sweep_stats = {name: summarize(s) for name, s in interleaved(sweep_cases, max(3, repeats // 2)).items()}
            kernels.set_gemm_engine("auto")
            sweeps.append({"N": n, "stats": sweep_stats})
            best = min(sweep_stats, key=lambda x: sweep_stats[x]["median_ms"])
            print("  sweep: " + ", ".join(f"{name} {s['median_ms']:.1f}" for name, s in sweep_stats.items())
                  + f"  (best: {best})", flush=True)
        del q, k, v

    print_table(rows, ["N", "case", "ms median (min-max)", "GFLOP/s", "% of its unit's peak", "time / slim (same dtype)"],
                title=f"Prefill attention, B={B} H=Hkv={H} D={D} causal, {torch.get_num_threads()} threads; peaks: "
                      f"FMA {peaks.fma_gflops:.0f}, AVX512-BF16 {peaks.avx512_bf16_gflops:.0f}, "
                      f"AMX bf16 {peaks.amx_bf16_gflops:.0f} GFLOP/s")
    return {"shape": {"B": B, "H": H, "Hkv": H, "D": D, "dtypes": ["float32"] + (["bfloat16"] if engines else []),
                      "causal": True},
            "bf16_engines": engines, "repeats": repeats, "results": results, "block_sweep": sweeps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", default="256,512,1024,2048,4096", help="prompt lengths, comma separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-sweep", action="store_true", help="skip the block-size sweep")
    parser.add_argument("--quick", action="store_true", help="N = 256,1024, 3 repeats, no sweep")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ns = [256, 1024] if args.quick else [int(x) for x in args.n.split(",")]
    repeats = 3 if args.quick else args.repeats
    payload = run(ns, repeats, sweep=not (args.no_sweep or args.quick))
    write_results("prefill_attention", payload, args.out)


if __name__ == "__main__":
    main()
