"""The software-prefetch distance and hint the streaming kernels use, measured per host.

Decode attention itself (the tiled int8 kernel, Llama-2-7B head shapes) is timed with each
candidate over a cache twice the last-level cache (at least 256 MiB) on huge pages, and the
fastest is kept, cached per CPU and thread count like the peaks. Measured on host C (Xeon, 2 threads): no prefetch 25.4 GB/s, prefetchnta 4 KB
ahead 16.4, prefetcht1 4 KB ahead 27.0, prefetcht0 1 KB ahead 28.6; on the AMD hosts the
kernels were tuned with prefetchnta 4 KB ahead. No constant is right on both.
"""

from __future__ import annotations

import json
import time

import torch

from workbench.cache import cache_dir, cpu_key

HINTS = {0: "prefetchnta", 1: "prefetcht2", 2: "prefetcht1", 3: "prefetcht0"}
CANDIDATES = ((0, 0), (512, 3), (1024, 3), (2048, 3), (4096, 2), (8192, 2), (4096, 0))  # (bytes ahead, hint)


def _path():
    return cache_dir() / f"prefetch-{cpu_key()}-{torch.get_num_threads()}threads.json"


def measure(ext, repeats: int = 3) -> dict:
    """Time every candidate on `ext` (a built kernel module): int8 decode attention at
    Llama-2-7B head shapes over a cache of at least twice the last-level cache (256 MiB or
    more) on huge pages; returns the choice and every candidate's GB/s."""
    from workbench.hw import memory
    from workbench.hw.machine import machine_info

    H = Hkv = 32
    L, D = 1024, 128
    per_seq = 2 * Hkv * L * (D + 4)
    B = max(1, -(-max(256 << 20, 2 * (machine_info().cache_bytes(3) or 0)) // per_seq))
    k = memory.empty((B, Hkv, L, D), torch.int8).random_(-127, 128)
    v = memory.empty((B, Hkv, L, D), torch.int8).random_(-127, 128)
    ks = torch.full((B, Hkv, L), 0.01)
    vs = torch.full((B, Hkv, L), 0.01)
    q = torch.randn(B, H, D)
    lengths = torch.full((B,), L)
    before = ext.get_prefetch()

    def run():
        ext.decode_attention(q, k, v, lengths, k_scale=ks, v_scale=vs, scale=None, num_splits=None, int8_query=True,
                             tiled=True)

    gbps = {}
    try:
        run()  # warm-up: page faults, thread pool
        for _ in range(repeats):
            for bytes_ahead, hint in CANDIDATES:  # interleaved rounds, the best of each
                ext.set_prefetch(bytes_ahead, hint)
                t0 = time.perf_counter()
                run()
                rate = B * per_seq / (time.perf_counter() - t0) / 1e9
                key = f"{bytes_ahead}:{hint}"
                gbps[key] = max(gbps.get(key, 0.0), rate)
    finally:
        ext.set_prefetch(*before)
    best = max(gbps, key=gbps.get)
    b, h = (int(x) for x in best.split(":"))
    return {"bytes": b, "hint": h, "hint_name": HINTS[h], "gbps": gbps, "cache_bytes": B * per_seq,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def tuned(ext, refresh: bool = False) -> dict:
    """The cached choice for this machine, measuring it (a few seconds) if needed."""
    path = _path()
    if not refresh and path.is_file():
        try:
            found = json.loads(path.read_text())
            if {"bytes", "hint"} <= set(found):
                return found
        except ValueError:
            pass
    found = measure(ext)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found, indent=2))
    return found


def apply(ext, measure_if_missing: bool = True) -> dict | None:
    """Set the tuned prefetch in a freshly loaded kernel module (workbench.kernels does this
    for the native build; the avx2 and scalar test builds take the native build's choice if
    there is one, and keep the default otherwise, rather than being timed themselves)."""
    if not measure_if_missing and not _path().is_file():
        return None
    found = tuned(ext)
    ext.set_prefetch(found["bytes"], found["hint"])
    return found
