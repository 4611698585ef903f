"""The software-prefetch distance and hint the streaming kernels use, measured per host.

Two choices, each timed with the kernel it is for over data twice the last-level cache (at
least 256 MiB) on huge pages, and kept only if it beat no prefetch beyond the run-to-run
spread (`choose`: its slowest round faster than no prefetch's fastest),
cached per CPU and thread count like the peaks:
  - decode attention (the tiled int8 kernel, Llama-2-7B head shapes): bytes ahead and hint;
  - the matrix-vector kernel at small K (SmolLM2's four layer shapes, one row of x), for each
    weight type (fp32, bf16, int8): up to which row length to read a task's rows one after
    another rather than four side by side (kernels/linear.cpp, serial_dot), then, in that
    order, bytes ahead, hint, and up to which row-chunk length to prefetch at all.
The best distance and hint differ between hosts and between weight types (a hint that
helps one stream halves another), so nothing here is a constant; the figures measured on
each development host are in docs/measurements.md. No constant is right on every host.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from workbench.cache import cache_dir, cpu_key, write_json
from workbench.hw.rounds import interleaved_rounds

HINTS = {0: "prefetchnta", 1: "prefetcht2", 2: "prefetcht1", 3: "prefetcht0"}
# Decode attention's: (bytes ahead, hint, pipelined: the tiled kernel's prefetches running on
# past the end of a task's K and V into the next task's; kernels/decode_tiled.cpp).
CANDIDATES = ((0, 0, 0), (512, 3, 0), (1024, 3, 0), (2048, 3, 0), (3072, 3, 0), (4096, 2, 0), (8192, 2, 0),
              (4096, 0, 0), (1024, 3, 1), (2048, 3, 1), (3072, 2, 1), (8192, 2, 1))
# The matrix-vector kernel's prefetch: (bytes ahead, hint, longest row chunk prefetched); the
# first is off.
MATVEC_PREFETCH = ((0, 0, 0), (2048, 3, 3072), (4096, 3, 3072), (8192, 3, 3072), (16384, 3, 3072),
                   (8192, 3, 1 << 20), (8192, 2, 3072), (4096, 0, 3072))
# ... and the order it reads a task's rows in at one row of x: rows of at most this many
# values of K one after another (one ascending stream), longer rows four side by side (0:
# always side by side). The probe's shapes have K = 576 and 1536, so it can tell these apart
# and nothing longer: longer rows stay side by side. The order is chosen first, with no
# prefetch, then the prefetch in that order. It moves a decode step more than any prefetch
# choice has (the bundled model's fp32 step 1.15x on a Zen 1 VM), and a single pass over the
# probe's weights is short enough (tens of ms) for a VM's jitter to hide that, so each of its
# rounds passes over them ORDER_PASSES times, and it runs ORDER_REPEATS rounds.
MATVEC_ORDERS = ((0,), (1024,), (2048,))
ORDER_REPEATS = 5
ORDER_PASSES = 2
# ... chosen for each weight type the kernel streams (kernels/prefetch.h: MatvecWeights).
MATVEC_WEIGHTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
# Bumped whenever what is measured changes (2: the prefetch instructions are really emitted,
# see kernels/prefetch.h; the matrix-vector choice; 3: one matrix-vector choice per weight
# type; 4: decode attention's pipelined streams; 5: the tiled kernel's loops compiled per
# hint, which made its prefetches cheaper; 6: the tiled kernel reads K and V block by block,
# its pipelined prefetches run on into the next task; 7: a candidate must beat no prefetch in
# every round; 8: beyond the spread, its slowest round faster than no prefetch's fastest, see
# choose; 9: the matrix-vector kernel's row order; 10: chosen before the prefetch; 11: winners
# ranked by their median), so a cached choice is measured again.
VERSION = 11
MATVEC_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: qkv, o, gate/up, down


def _key(candidate: tuple[int, ...]) -> str:
    """A candidate's key in the measured tables: its numbers joined by ":"."""
    return ":".join(map(str, candidate))


def _seconds_by_round(candidates, apply, run, repeats: int) -> dict[str, list[float]]:
    """Each candidate's time for run() in each round, after apply(*candidate): one warm-up
    (page faults, thread pool), then `repeats` interleaved rounds over all candidates."""
    run()
    seconds: dict[str, list[float]] = {_key(c): [] for c in candidates}
    for _, cand in interleaved_rounds(candidates, repeats):
        apply(*cand)
        t0 = time.perf_counter()
        run()
        seconds[_key(cand)].append(time.perf_counter() - t0)
    return seconds


def choose(seconds: dict[str, list[float]], off: str) -> str:
    """The candidate to use: the fastest (by its median round) of those faster than `off`, no
    software prefetch, beyond the run-to-run spread: its slowest round faster than off's
    fastest; `off` where none was. (By the best round, two winners a few percent apart at the
    median had tied on one lucky round each, and the slower was kept.) A prefetch costs instructions and cache space, and pays
    only where the stream outruns the hardware prefetcher: a candidate that only ties with
    off here is not kept, since a tie in this measurement was a loss elsewhere (two
    tensor-parallel ranks streaming at once, docs/distributed.md). Winning each round is not
    enough: on a noisy VM one slow round of off, beside two ties, let a candidate through that
    then measured 4-13% slower than none (the int8 matrix-vector kernel, docs/measurements.md)."""
    fastest_off = min(seconds[off])
    winners = [k for k, times in seconds.items() if k != off and max(times) < fastest_off]
    return min(winners, key=lambda k: statistics.median(seconds[k])) if winners else off


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
        ext.decode_attention(q, k, v, lengths, k_scale=ks, v_scale=vs, scale=None, num_splits=None,
                             int8_kernel="tile")

    try:
        seconds = _seconds_by_round(CANDIDATES, lambda b, h, p: ext.set_prefetch(b, h, bool(p)), run, repeats)
    finally:
        ext.set_prefetch(*before)
    b, h, p = (int(x) for x in choose(seconds, _key(CANDIDATES[0])).split(":"))
    return {"bytes": b, "hint": h, "pipeline": bool(p), "hint_name": HINTS[h], **_rates(seconds, B * per_seq),
            "cache_bytes": B * per_seq, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _rates(seconds: dict[str, list[float]], nbytes: int) -> dict:
    """GB/s of each candidate: its best round ("gbps") and every round ("rounds_gbps")."""
    return {"gbps": {k: nbytes / min(t) / 1e9 for k, t in seconds.items()},
            "rounds_gbps": {k: [nbytes / x / 1e9 for x in t] for k, t in seconds.items()}}


def measure_matvec(ext, repeats: int = 3) -> dict:
    """For each weight type of MATVEC_WEIGHTS, on `ext`: one row of x against SmolLM2's layer
    shapes, the weights rotated over at least twice the last-level cache (256 MiB or more,
    int8 with its scale per 32 weights) on huge pages; first every MATVEC_ORDERS entry, then
    every MATVEC_PREFETCH entry in the order kept (`repeats` rounds). Returns, per weight type,
    the choices `choose` keeps and every candidate's GB/s ("order", "prefetch"): the choice
    differs with the type (the arithmetic per byte differs, so does how far ahead pays)."""
    from workbench.hw import memory
    from workbench.hw.machine import machine_info

    total = max(256 << 20, 2 * (machine_info().cache_bytes(3) or 0))  # bytes of weights per type
    xs = {k: torch.randn(1, k) for _, k in MATVEC_SHAPES}
    group = ext.constants()["weight_group"]  # int8 measured with the grouped format's scales
    before = {name: ext.get_matvec_prefetch(name) for name in MATVEC_WEIGHTS}
    found = {}
    try:
        for name, dtype in MATVEC_WEIGHTS.items():
            # Laid out as the model's weights are (workbench.hw.memory.Arena): matrix after
            # matrix, each int8 matrix followed by its scales; filled with normal numbers
            # (uninitialised memory may hold denormals, which are slow).
            int8 = dtype == torch.int8
            set_bytes = sum(memory.Arena.padded(n * k * dtype.itemsize)
                            + (memory.Arena.padded(4 * n * k // group) if int8 else 0) for n, k in MATVEC_SHAPES)
            arena = memory.Arena(max(2, -(-total // set_bytes)) * set_bytes)
            weights = []
            while arena.free >= set_bytes:
                for n, k in MATVEC_SHAPES:
                    w = arena.alloc((n, k), dtype).fill_(1 if int8 else 0.01)
                    scale = arena.alloc((n, k // group)).fill_(0.01) if int8 else None
                    weights.append((w, scale))
            nbytes = sum(t.nbytes for pair in weights for t in pair if t is not None)

            def run(weights=weights, passes=1):  # bound now: `weights` is deleted below
                for _ in range(passes):
                    for w, scale in weights:
                        ext.linear(xs[w.shape[1]], w, 10, None, scale)

            size = dtype.itemsize  # the candidates count serial rows in values of K, the kernel in bytes
            order = _seconds_by_round(MATVEC_ORDERS, lambda k: ext.set_matvec_prefetch(name, 0, 0, 0, k * size),
                                      lambda: run(passes=ORDER_PASSES), ORDER_REPEATS)
            serial = int(choose(order, _key(MATVEC_ORDERS[0]))) * size
            ahead = _seconds_by_round(MATVEC_PREFETCH, lambda b, h, c: ext.set_matvec_prefetch(name, b, h, c, serial),
                                      run, repeats)
            b, h, c = (int(x) for x in choose(ahead, _key(MATVEC_PREFETCH[0])).split(":"))
            found[name] = {"bytes": b, "hint": h, "max_chunk_bytes": c, "serial_max_chunk_bytes": serial,
                           "hint_name": HINTS[h], "order": _rates(order, ORDER_PASSES * nbytes),
                           "prefetch": _rates(ahead, nbytes)}
            del run, weights, arena  # freed before the next type's arena is filled
    finally:
        for name, setting in before.items():
            ext.set_matvec_prefetch(name, *setting)
    return found


def _complete(found: dict) -> bool:
    """A cached measurement of both choices over today's candidates (else measure again)."""
    try:
        orders, ahead = {_key(c) for c in MATVEC_ORDERS}, {_key(c) for c in MATVEC_PREFETCH}
        return (found.get("version") == VERSION and set(found["gbps"]) == {_key(c) for c in CANDIDATES}
                and set(found["matvec"]) == set(MATVEC_WEIGHTS)
                and all(set(mv["order"]["gbps"]) == orders and set(mv["prefetch"]["gbps"]) == ahead
                        for mv in found["matvec"].values()))
    except (KeyError, TypeError):
        return False


def cached() -> dict | None:
    """The choices measured for this machine and thread count, or None if there are none
    (never measured, unreadable, or from an older VERSION)."""
    try:
        found = json.loads(_path().read_text())
    except (OSError, ValueError):
        return None
    return found if _complete(found) else None


def tuned(ext, refresh: bool = False) -> dict:
    """The cached choices for this machine, measuring them (a few seconds) if needed."""
    found = None if refresh else cached()
    if found is not None:
        return found
    path = _path()
    found = measure(ext)
    found["matvec"] = measure_matvec(ext)
    found["version"] = VERSION
    write_json(path, found)  # the ranks of a TP run may both measure and write it
    return found


def apply(ext, measure_if_missing: bool = True) -> dict | None:
    """Set the tuned prefetch in a freshly loaded kernel module (workbench.kernels does this
    for the native build; the avx2 and scalar test builds take the native build's choice if
    there is one, and keep the default otherwise, rather than being timed themselves)."""
    found = tuned(ext) if measure_if_missing else cached()
    if found is None:
        return None
    ext.set_prefetch(found["bytes"], found["hint"], found["pipeline"])
    for name, mv in found["matvec"].items():
        ext.set_matvec_prefetch(name, mv["bytes"], mv["hint"], mv["max_chunk_bytes"], mv["serial_max_chunk_bytes"])
    return found
