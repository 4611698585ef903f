"""Decode attention (one new token per sequence) against KV caches of each dtype.

Llama-2-7B attention shapes (H=32, D=128) with Hkv=32, for batch B and context L, plus
B=1 with GQA (H=32, Hkv=8) where split-KV matters. Cases, interleaved in one run:

    int8 / fp16 / bf16 / fp32   workbench decode_attention on a cache of that dtype
    sdpa fp32                   torch scaled_dot_product_attention on the same fp32 cache
    triad                       the STREAM triad, re-measured between the cases, so the
                                bandwidth yardstick sees the same machine state

GB/s counts the bytes the kernel must read: K and V of every cached token (plus the
fp32 per-token scales of an int8 cache). % of triad divides by the triad measured here;
a cache that fits in the L3 (small B and L) can exceed 100%.

    python bench/decode_attention.py [--batch 1,16,64] [--length 1024,4096] [--quick]
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
from workbench.model.kv_formats import KERNEL_FORMATS, KV_FORMATS, KVCache  # noqa: E402
from workbench.model.loaders import available_memory_bytes  # noqa: E402

H, D = 32, 128
DTYPES = KERNEL_FORMATS
TRIAD_FLOATS = 1 << 25  # 3 x 128 MiB, far beyond the caches


def cache_bytes(B: int, Hkv: int, L: int, name: str) -> int:
    return KV_FORMATS[name].cache_bytes(1, Hkv, D, B, L)


def make_caches(B: int, Hkv: int, L: int, names: list[str]) -> dict:
    """The same random K and V in a one-layer cache of each format, as decode_attention's
    keyword arguments."""
    k = torch.randn(B, Hkv, L, D)
    v = torch.randn(B, Hkv, L, D)
    caches = {}
    for name in names:
        cache = KVCache(1, B, Hkv, L, D, name)
        cache.append(0, k, v, torch.zeros(B, dtype=torch.int64))
        caches[name] = dict(k_cache=cache.k[0], v_cache=cache.v[0], k_scale=cache.k_scale[0],
                            v_scale=cache.v_scale[0])
    return caches


def run_config(B: int, Hkv: int, L: int, repeats: int, splits: list[int | None], budget_bytes: int) -> dict:
    names = [n for n in DTYPES if n != "fp32"]
    total = sum(cache_bytes(B, Hkv, L, n) for n in DTYPES) + 2 * B * Hkv * L * D * 4
    skipped = []
    if total <= budget_bytes:
        names.append("fp32")
    else:
        skipped.append(f"fp32 and sdpa: {total / 2**30:.1f} GiB of caches exceed the memory budget")
    caches = make_caches(B, Hkv, L, names)
    q = torch.randn(B, H, D)
    lengths = torch.full((B,), L, dtype=torch.int64)
    a, b, c = torch.empty(TRIAD_FLOATS), torch.rand(TRIAD_FLOATS), torch.rand(TRIAD_FLOATS)

    cases = {}
    for name in names:
        for s in splits:
            label = name if s is None else f"{name} splits={s}"
            cases[label] = (lambda kw=caches[name], s=s: kernels.decode_attention(q, lengths=lengths, num_splits=s, **kw))
    if "fp32" in names:
        qs = q.unsqueeze(2)  # [B, H, 1, D]
        kc, vc = caches["fp32"]["k_cache"], caches["fp32"]["v_cache"]
        cases["sdpa fp32"] = lambda: F.scaled_dot_product_attention(qs, kc, vc, enable_gqa=Hkv != H)
    cases["triad"] = lambda: kernels.native.ext.triad(a, b, c, 3.0)

    stats = {name: summarize(s) for name, s in interleaved(cases, repeats).items()}
    triad_gbps = 12 * TRIAD_FLOATS / (stats["triad"]["median_ms"] / 1e3) / 1e9
    rows = []
    for label, st in stats.items():
        if label == "triad":
            continue
        dtype = label.split()[1] if label.startswith("sdpa") else label.split()[0]
        gbps = cache_bytes(B, Hkv, L, dtype) / (st["median_ms"] / 1e3) / 1e9
        st["gbps"] = gbps
        st["pct_triad"] = 100 * gbps / triad_gbps
        rows.append({"B": B, "Hkv": Hkv, "L": L, "case": label, "KV MiB": f"{cache_bytes(B, Hkv, L, dtype) / 2**20:.0f}",
                     "ms median (min-max)": fmt_ms(st), "GB/s": f"{gbps:.1f}", "% triad": f"{st['pct_triad']:.0f}"})
    med = {k: v["median_ms"] for k, v in stats.items()}
    ratios = {}
    if "fp16" in med:
        ratios["fp16_over_int8"] = med["fp16"] / med["int8"]
    if "fp32" in med:
        ratios["fp32_over_int8"] = med["fp32"] / med["int8"]
        ratios["sdpa_fp32_over_fp32"] = med["sdpa fp32"] / med["fp32"]
    default_splits = kernels.native.default_num_splits(B, Hkv, L)
    print(f"B={B} Hkv={Hkv} L={L}: triad {triad_gbps:.1f} GB/s; "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + f"; default splits {default_splits}", flush=True)
    return {"B": B, "H": H, "Hkv": Hkv, "L": L, "D": D, "stats": stats, "triad_gbps": triad_gbps,
            "ratios": ratios, "default_splits": default_splits, "skipped": skipped, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--length", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="B=1,16, L=1024, 3 repeats")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--memory-budget-gib", type=float, default=None,
                        help="skip the fp32 cases of configurations needing more (default: 60%% of free RAM)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [1, 16] if args.quick else [int(x) for x in args.batch.split(",")]
    lengths = [1024] if args.quick else [int(x) for x in args.length.split(",")]
    repeats = 3 if args.quick else args.repeats
    budget = int((args.memory_budget_gib * 2**30) if args.memory_budget_gib else 0.6 * available_memory_bytes())

    configs = []
    for L in lengths:
        for B in batches:
            configs.append(run_config(B, H, L, repeats, [None], budget))
    # GQA at batch 1: few (batch, KV head) tasks, where splitting the KV length matters.
    for L in lengths:
        configs.append(run_config(1, 8, L, repeats, [None, 1, 2, 4, 8], budget))

    rows = [r for c in configs for r in c.pop("rows")]
    print_table(rows, ["B", "Hkv", "L", "case", "KV MiB", "ms median (min-max)", "GB/s", "% triad"],
                title=f"Decode attention, H={H} D={D}, {torch.get_num_threads()} threads "
                      f"(a cache smaller than the L3 can beat the DRAM triad)")
    write_results("decode_attention", {"repeats": repeats, "configs": configs}, args.out)


if __name__ == "__main__":
    main()
