"""Up to how many rows of x a linear layer runs the matrix-vector kernel, measured per host.

A linear layer of M rows (M sequences in a decode step, M tokens of a prompt) runs either the
matrix-vector kernel, which streams each weight once and does the arithmetic of every row on
fp32 FMAs, or the GEMM, which packs x and runs a register-blocked micro-kernel on the engine
in force (AVX512-BF16 or AMX for bf16 and int8 weights, fp32 FMAs for fp32). Where they cross
depends on the weight dtype (the bytes per weight), the engine (its peak against the FMA
peak) and the machine's bandwidth: measured on one host, bf16 weights on AVX512-BF16 crossed
at 3-4 rows while fp32 weights on FMAs had not crossed at 16. So the crossover is timed here,
for each weight kernel, with weights of twice the last-level cache (as decode streams them),
cached per CPU, thread count and kernel sources, and set in the extension when it loads
(`matvec_max_rows`); batch-1 decode always stays on the matrix-vector kernel.
"""

from __future__ import annotations

import json
import time

import torch

from workbench.cache import cache_dir, cpu_key, write_json

ROWS = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # candidate row counts, ascending
K = 4096  # a Llama-2-7B layer's input width
VERSION = 4  # 2: the crossover that makes the measured counts fastest together; 3: best of 5; 4: block kernels


def _path(sources_key: str):
    return cache_dir() / f"crossover-{cpu_key()}-{sources_key}-{torch.get_num_threads()}threads.json"


def _weights(ext, kernel: str, min_bytes: int):
    """(w, scale) of `kernel`'s storage, N x K with at least min_bytes of weights, normal values
    (block kernels: 64 rows quantized by our quantizer, repeated; scale None)."""
    group = ext.constants()["weight_group"]
    if kernel in ext.constants()["weight_blocks"]:
        sample = torch.empty(64, K)
        ext.fill_normal_(sample, 0, 0, 0.02)
        rows = ext.repack_blocks(ext.quantize_blocks(sample, kernel, False), kernel, K, True)
        n = -(-min_bytes // rows.shape[1] // 64) * 64
        return rows.repeat(n // 64, 1), None
    itemsize = {"float32": 4, "bfloat16": 2}.get(kernel, 1)
    n = -(-min_bytes // (K * itemsize) // 64) * 64
    if kernel in ("float32", "bfloat16"):
        w = torch.empty(n, K, dtype=torch.float32 if kernel == "float32" else torch.bfloat16)
        ext.fill_normal_(w, 0, 0, 0.02)
        return w, None
    w = torch.randint(-127, 128, (n, K), dtype=torch.int8)
    scale = torch.full((n, -(-K // group)) if kernel == "int8_group" else (n,), 0.0002)
    return w, scale


def decide(ms: dict[int, dict[str, float]]) -> tuple[int, bool]:
    """From both kernels' times at the row counts measured so far: (the crossover, whether to
    stop measuring). Stop once the GEMM has been faster at the two largest counts. The
    crossover is the count c (1, batch-1 decode's, or a measured one) that makes the measured
    counts fastest together, each weighed by its time over the faster kernel's there:
    matrix-vector up to c, GEMM beyond. One noisy count does not move it the way a rule on
    the last win would."""
    counts = sorted(ms)

    def cost(c: int) -> float:
        return sum(ms[m]["matvec" if m <= c else "gemm"] / min(ms[m].values()) for m in counts)

    rows = min([1, *counts], key=lambda c: (cost(c), c))
    done = len(counts) >= 2 and all(ms[m]["gemm"] < ms[m]["matvec"] for m in counts[-2:])
    return rows, done


def measure(ext, repeats: int = 5) -> dict:
    """For each weight kernel: the best of `repeats` interleaved times of both kernels at each
    candidate row count, ascending, until `decide` says stop; its crossover."""
    from workbench.hw.machine import machine_info

    min_bytes = max(64 << 20, 2 * (machine_info().cache_bytes(3) or 0))
    found = {}
    blocks = ext.constants()["weight_blocks"]
    for kernel in ext.constants()["weight_kernels"]:
        w, scale = _weights(ext, kernel, min_bytes)
        named = kernel if kernel in blocks else ""  # block rows name their kernel
        times: dict[int, dict[str, float]] = {}
        for m in ROWS:
            x = torch.randn(m, K)
            best = {"matvec": float("inf"), "gemm": float("inf")}
            ext.linear(x, w, 0, None, scale, named)  # warm: the GEMM's scratch, the thread pool
            for _ in range(repeats):
                for name, limit in (("matvec", m), ("gemm", 0)):
                    t0 = time.perf_counter()
                    ext.linear(x, w, limit, None, scale, named)
                    best[name] = min(best[name], time.perf_counter() - t0)
            times[m] = {name: 1e3 * sec for name, sec in best.items()}
            rows, done = decide(times)
            if done:
                break
        found[kernel] = {"rows": rows, "engine": ext.gemm_engine_for(kernel), "ms": times}
        del w, scale
    return found


def tuned(ext, sources_key: str, refresh: bool = False) -> dict:
    """The cached crossovers for this machine and these kernels, measuring them if needed."""
    path = _path(sources_key)
    if not refresh and path.is_file():
        try:
            found = json.loads(path.read_text())
            if found.get("version") == VERSION and set(found["kernels"]) == set(ext.constants()["weight_kernels"]):
                return found
        except (ValueError, KeyError, TypeError):
            pass
    found = {"version": VERSION, "kernels": measure(ext), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(path, found)  # whole or not at all: another process may be reading it
    return found


def apply(ext, sources_key: str, measure_if_missing: bool = True) -> dict | None:
    """Set the measured crossovers in a freshly loaded kernel module (the native build measures
    them once per host; the avx2 and scalar test builds keep the default rather than being
    timed themselves)."""
    if not measure_if_missing:
        return None
    found = tuned(ext, sources_key)
    for kernel, choice in found["kernels"].items():
        ext.set_matvec_max_rows(kernel, choice["rows"])
    return found
