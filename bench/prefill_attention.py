"""Prefill attention at Llama-2-7B shapes: SlimAttention vs our FlashAttention vs PyTorch.

One attention layer's prefill (B=1, H=Hkv=32, D=128, fp32, causal) for each prompt length
N, the cases interleaved in one run:

    slim        workbench SlimAttention (default block_m from the L2 size)
    flash       workbench FlashAttention-2 (same micro-kernel and exp; default tiles)
    sdpa        torch.nn.functional.scaled_dot_product_attention(is_causal=True)
    naive       softmax(Q K^T + mask) V in plain PyTorch fp32 (materialised scores)
    slim_full   SlimAttention without the causal mask (to check causal ~ half the work)

GFLOP/s counts only the visible (causal) query-key pairs: 4 D flops per pair (Q.K and P.V).
Then a block-size sweep for SlimAttention (and FlashAttention's tiles) at each N.

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


def run(ns: list[int], repeats: int, sweep: bool) -> dict:
    peak = measured_peaks().fma_gflops
    rows, results, sweeps = [], [], []
    for n in ns:
        q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
        cases = {
            "slim": lambda: kernels.slim_attention(q, k, v),
            "flash": lambda: kernels.flash_attention(q, k, v),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "naive": lambda: naive_attention(q, k, v),
            "slim_full": lambda: kernels.slim_attention(q, k, v, causal=False),
        }
        samples = interleaved(cases, repeats)
        stats = {name: summarize(s) for name, s in samples.items()}
        med = {name: s["median_ms"] for name, s in stats.items()}
        flops = causal_flops(n)
        for name in ("slim", "flash", "sdpa", "naive"):
            gflops = flops / (med[name] / 1e3) / 1e9
            rows.append({"N": n, "algorithm": name, "ms median (min-max)": fmt_ms(stats[name]),
                         "GFLOP/s": f"{gflops:.0f}", "% FMA peak": f"{100 * gflops / peak:.0f}",
                         "vs slim": f"{med[name] / med['slim']:.2f}x"})
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
            },
        })
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
            sweep_stats = {name: summarize(s) for name, s in interleaved(sweep_cases, max(3, repeats // 2)).items()}
            sweeps.append({"N": n, "stats": sweep_stats})
            best = min(sweep_stats, key=lambda x: sweep_stats[x]["median_ms"])
            print("  sweep: " + ", ".join(f"{name} {s['median_ms']:.1f}" for name, s in sweep_stats.items())
                  + f"  (best: {best})", flush=True)
        del q, k, v

    print_table(rows, ["N", "algorithm", "ms median (min-max)", "GFLOP/s", "% FMA peak", "vs slim"],
                title=f"Prefill attention, B={B} H=Hkv={H} D={D} fp32 causal, {torch.get_num_threads()} threads, "
                      f"FMA peak {peak:.0f} GFLOP/s")
    return {"shape": {"B": B, "H": H, "Hkv": H, "D": D, "dtype": "float32", "causal": True},
            "repeats": repeats, "results": results, "block_sweep": sweeps}


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
