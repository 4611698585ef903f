"""Timed comparisons the notebooks and benchmarks share.

Cases are interleaved: every round runs each case once, in a fresh random order, so no
case always follows the same neighbour (one that flushes the caches, say), and results are
medians with min-max over the rounds. Ratios should be taken within one call.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from workbench.model.attention import attention_backend
from workbench.hw.rounds import interleaved_rounds
from workbench.model.kv_formats import KERNEL_FORMATS, KVCache, kernel_configs, kv_label


def interleaved(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                seed: int = 0) -> dict[str, list[float]]:
    """Seconds per case over `repeats` interleaved rounds (after `warmup` untimed ones;
    workbench.hw.rounds)."""
    samples: dict[str, list[float]] = {n: [] for n in cases}
    for round_, name in interleaved_rounds(cases, repeats, warmup=warmup, seed=seed):
        t0 = time.perf_counter()
        cases[name]()
        if round_ >= 0:
            samples[name].append(time.perf_counter() - t0)
    return samples


def summarize(seconds: list[float]) -> dict:
    return {"median_ms": statistics.median(seconds) * 1e3, "min_ms": min(seconds) * 1e3,
            "max_ms": max(seconds) * 1e3, "repeats": len(seconds)}


def prefill_comparison(ns=(256, 512, 1024), heads: int = 32, kv_heads: int = 32, head_dim: int = 128,
                       repeats: int = 3, algorithms=("slim", "flash", "sdpa")) -> list[dict]:
    """One causal attention layer's prefill (fp32, batch 1) per prompt length and algorithm:
    median / min / max ms and GFLOP/s over the visible query-key pairs. `algorithms` are
    names of workbench.model.attention.ATTENTION_BACKENDS."""
    run = {a: attention_backend(a).prefill for a in algorithms}
    rows = []
    for n in ns:
        q = torch.randn(1, heads, n, head_dim)
        k, v = torch.randn(1, kv_heads, n, head_dim), torch.randn(1, kv_heads, n, head_dim)
        samples = interleaved({a: (lambda a=a: run[a](q, k, v)) for a in algorithms}, repeats)
        flops = 4.0 * head_dim * heads * n * (n + 1) / 2
        for a, s in samples.items():
            st = summarize(s)
            rows.append({"N": n, "algorithm": a, **st, "gflops": flops / (st["median_ms"] / 1e3) / 1e9})
    return rows


def kv_dtype_comparison(batch: int = 16, heads: int = 32, kv_heads: int = 32, length: int = 1024,
                        head_dim: int = 128, repeats: int = 5, dtypes=KERNEL_FORMATS) -> list[dict]:
    """Decode attention over a cache of each format (workbench.model.kv_formats) with each
    kernel that reads it ("int8:dot" names one), filled with the same random K and V: median
    ms and the GB/s of the bytes read."""
    k, v = torch.randn(batch, kv_heads, length, head_dim), torch.randn(batch, kv_heads, length, head_dim)
    q = torch.randn(batch, heads, head_dim)
    lengths = torch.full((batch,), length)
    caches, nbytes = {}, {}
    start = torch.zeros(batch, dtype=torch.int64)
    for d in kernel_configs(dtypes, "all"):
        caches[d] = KVCache(1, batch, kv_heads, length, head_dim, *d)
        caches[d].append(0, k, v, start)
        nbytes[d] = caches[d].nbytes
    samples = interleaved({d: (lambda d=d: caches[d].attend(0, q, lengths)) for d in caches}, repeats)
    rows = []
    for d, s in samples.items():
        st = summarize(s)
        rows.append({"cache": kv_label(d[0], caches[d].kernel), "kv_cache": d[0], "kv_kernel": caches[d].kernel, **st,
                     "gbps": nbytes[d] / (st["median_ms"] / 1e3) / 1e9, "bytes": nbytes[d]})
    return rows
