"""Decode attention (one new token per sequence) against KV caches of each kernel format,
read by each kernel the format has.

Shapes: Llama-2-7B attention (H=32, Hkv=32, D=128) and, with --shapes smollm2, the bundled
model's (H=9, Hkv=3, D=64: GQA 3:1), for batch B and context L; plus B=1 with GQA (H=32,
Hkv=8) where split-KV matters. Cases, interleaved in one run:

    int8 (widen)  the paper's kernel: int8 K and V widened to fp32 in registers
    int8 (dot)    the same cache, the query quantized to int8, scores by integer dot products
    int8 (tile)   the same values and scales in the tiled layout: integer dot products for
                  the scores and for P.V (the format's default kernel)
    fp16 / bf16 / fp32   a cache of that dtype
    sdpa fp32 torch scaled_dot_product_attention on the same fp32 cache
    triad     the STREAM triad, re-measured between the cases (same machine state)
    read      a plain read of one large array per thread (the fastest any reader streams
              here: the ceiling a decode kernel, which only reads, can approach)

Every timed call attends over `layers` separate caches, as a decode step does over its
layers, with layers chosen so that even the int8 caches together exceed twice the
last-level cache: the data comes from DRAM, as in a model (a one-layer cache smaller than
the L3 would be read from cache; this host's L3 is reported as 504 MiB). GB/s counts the
bytes the kernel must read: K and V of every cached token plus the int8 scales. Ratios are
between medians of the same run; the bytes ratio fp16 / int8 is the ceiling of the int8
speed-up if both were bandwidth-bound.

    python bench/decode_attention.py [--shapes 7b,smollm2] [--batch 1,16,64] [--length 1024,4096] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt_ms, interleaved, print_table, summarize, write_results  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from workbench.hw import memory  # noqa: E402
from workbench.hw.machine import machine_info  # noqa: E402
from workbench.model.kv_formats import KERNEL_FORMATS, KV_FORMATS, KVCache, kernel_configs, kv_label  # noqa: E402
from workbench.model.loaders import available_memory_bytes  # noqa: E402

SHAPES = {"7b": (32, 32, 128), "smollm2": (9, 3, 64)}  # H, Hkv, D
CACHES = {kv_label(f, k): (f, k) for f, k in kernel_configs(KERNEL_FORMATS, "all")}  # label -> (format, kernel)
TRIAD_FLOATS = 1 << 25  # 3 x 128 MiB, far beyond the caches


def cache_bytes(B: int, Hkv: int, L: int, D: int, name: str) -> int:
    return KV_FORMATS[name].cache_bytes(1, Hkv, D, B, L)


def layers_for(B: int, Hkv: int, L: int, D: int) -> int:
    """Enough layers that the int8 caches together exceed twice the last-level cache."""
    llc = machine_info().cache_bytes(3) or (32 << 20)
    return max(1, math.ceil(2 * llc / cache_bytes(B, Hkv, L, D, "int8")))


def make_caches(B: int, Hkv: int, L: int, D: int, labels: list[str], layers: int) -> dict:
    """Random K and V in `layers` one-layer caches for each case; kernels that read the same
    layout (int8 widen and dot) share one set of caches."""
    stored: dict[tuple, list] = {}
    caches = {}
    for label in labels:
        fmt, kernel = CACHES[label]
        layout = (fmt, kernel == "tile")
        if layout not in stored:
            stored[layout] = []
            for _ in range(layers):
                k, v = torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
                cache = KVCache(1, B, Hkv, L, D, fmt, "tile" if kernel == "tile" else "widen")
                cache.append(0, k, v, torch.zeros(B, dtype=torch.int64))
                stored[layout].append(cache)
        caches[label] = stored[layout]
    return caches


def run_config(B: int, H: int, Hkv: int, D: int, L: int, repeats: int, splits: list[int | None],
               budget_bytes: int) -> dict:
    layers = layers_for(B, Hkv, L, D)
    names = [n for n in CACHES if n != "fp32"]
    layouts = {(f, k == "tile") for f, k in CACHES.values()}
    per_layer = sum(cache_bytes(B, Hkv, L, D, f) for f, _ in layouts) + 2 * B * Hkv * L * D * 4
    skipped = []
    if layers * per_layer <= budget_bytes:
        names.append("fp32")
    else:
        skipped.append(f"fp32 and sdpa: {layers * per_layer / 2**30:.1f} GiB of caches exceed the memory budget")
    caches = make_caches(B, Hkv, L, D, names, layers)
    q = torch.randn(B, H, D)
    lengths = torch.full((B,), L, dtype=torch.int64)
    a, b, c = torch.empty(TRIAD_FLOATS), torch.rand(TRIAD_FLOATS), torch.rand(TRIAD_FLOATS)
    r = memory.empty((3 * TRIAD_FLOATS,)).fill_(1.0)
    from workbench import kernels

    def step(name, s):
        """One timed call: this case's kernel over every layer's cache (splits s, None: default)."""
        fmt, kernel = CACHES[name]
        return lambda: [KV_FORMATS[fmt].decode(q, c.k[0], c.v[0], c.k_scale[0], c.v_scale[0], lengths, num_splits=s,
                                               int8_kernel=kernel) for c in caches[name]]

    cases = {}
    for name in names:
        for s in splits:
            cases[name if s is None else f"{name} splits={s}"] = step(name, s)
    if "fp32" in names:
        qs = q.unsqueeze(2)  # [B, H, 1, D]
        cases["sdpa fp32"] = lambda: [F.scaled_dot_product_attention(qs, cache.k[0], cache.v[0],
                                                                     enable_gqa=Hkv != H) for cache in caches["fp32"]]
    cases["triad"] = lambda: kernels.native.ext.triad(a, b, c, 3.0)
    cases["read"] = lambda: kernels.native.ext.read_sum(r)

    stats = {name: summarize(s) for name, s in interleaved(cases, repeats).items()}
    triad_gbps = 12 * TRIAD_FLOATS / (stats["triad"]["median_ms"] / 1e3) / 1e9
    read_gbps = 12 * TRIAD_FLOATS / (stats["read"]["median_ms"] / 1e3) / 1e9
    rows = []
    for label, st in stats.items():
        if label in ("triad", "read"):
            continue
        dtype = label.split()[1] if label.startswith("sdpa") else label.split()[0]  # the format: its bytes
        nbytes = layers * cache_bytes(B, Hkv, L, D, dtype)
        gbps = nbytes / (st["median_ms"] / 1e3) / 1e9
        st["gbps"] = gbps
        st["pct_triad"] = 100 * gbps / triad_gbps
        st["pct_read"] = 100 * gbps / read_gbps
        st["ms_per_layer"] = st["median_ms"] / layers
        rows.append({"H/Hkv/D": f"{H}/{Hkv}/{D}", "B": B, "L": L, "layers": layers, "case": label,
                     "KV MiB": f"{nbytes / 2**20:.0f}", "ms median (min-max)": fmt_ms(st),
                     "ms/layer": f"{st['ms_per_layer']:.3f}", "GB/s": f"{gbps:.1f}", "% triad": f"{st['pct_triad']:.0f}",
                     "% read": f"{st['pct_read']:.0f}"})
    med = {k: v["median_ms"] for k, v in stats.items()}
    ratios = {}
    if "fp16" in med:
        for kernel in KV_FORMATS["int8"].kernels:
            ratios[f"fp16_over_int8_{kernel}"] = med["fp16"] / med[f"int8 ({kernel})"]
        ratios["int8_widen_over_int8_dot"] = med["int8 (widen)"] / med["int8 (dot)"]
        ratios["bytes_ceiling_fp16_over_int8"] = cache_bytes(B, Hkv, L, D, "fp16") / cache_bytes(B, Hkv, L, D, "int8")
    if "fp32" in med:
        ratios["fp32_over_int8_widen"] = med["fp32"] / med["int8 (widen)"]
        ratios["sdpa_fp32_over_fp32"] = med["sdpa fp32"] / med["fp32"]
    default_splits = kernels.native.default_num_splits(B, Hkv, L)
    print(f"H/Hkv/D {H}/{Hkv}/{D} B={B} L={L} ({layers} layers): triad {triad_gbps:.1f} GB/s, read {read_gbps:.1f}; "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + f"; default splits {default_splits}", flush=True)
    return {"B": B, "H": H, "Hkv": Hkv, "L": L, "D": D, "layers": layers, "stats": stats, "triad_gbps": triad_gbps,
            "read_gbps": read_gbps,
            "ratios": ratios, "default_splits": default_splits, "skipped": skipped, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="7b,smollm2", help="7b (H32 Hkv32 D128), smollm2 (H9 Hkv3 D64)")
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
    for shape in args.shapes.split(","):
        H, Hkv, D = SHAPES[shape]
        for L in lengths:
            for B in batches:
                configs.append(run_config(B, H, Hkv, D, L, repeats, [None], budget))
    if "7b" in args.shapes.split(","):  # GQA at batch 1: few (batch, KV head) tasks, where splitting matters
        for L in lengths:
            configs.append(run_config(1, 32, 8, 128, L, repeats, [None, 1, 2, 4, 8], budget))

    rows = [r for c in configs for r in c.pop("rows")]
    print_table(rows, ["H/Hkv/D", "B", "L", "layers", "case", "KV MiB", "ms median (min-max)", "ms/layer", "GB/s",
                       "% triad"],
                title=f"Decode attention, {torch.get_num_threads()} threads, caches rotated past the last-level cache")
    write_results("decode_attention", {"repeats": repeats, "configs": configs}, args.out)


if __name__ == "__main__":
    main()
