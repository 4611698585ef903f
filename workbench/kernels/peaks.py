"""The machine's measured peaks: memory bandwidth and fp32 FMA throughput.

Every benchmark divides its result by one of these, which makes numbers comparable
across machines. They are measured once with the kernels' own probes (kernels/peaks.cpp)
and cached per CPU and thread count under the workbench cache directory.

    triad_gbps        a[i] = b[i] + s * c[i] over arrays far larger than the caches,
                      counting 12 bytes per element (STREAM's convention: no write-allocate),
                      on huge pages where the OS allows (workbench.hw.memory), as the KV
                      caches and weights are
    triad_gbps_1t     the same on one thread
    read_gbps         a sum over one such array (4 bytes per element): the pattern of decode
    fma_gflops        independent FMA chains in registers, all threads
    fma_gflops_1t     the same on one thread
    amx_bf16_gflops   the matrix engine: independent tdpbf16ps on tiles already loaded, all
                      threads (0 where AMX may not run; amx_reason says why)
    avx512_bf16_gflops  independent vdpbf16ps chains in registers, all threads (0 where the CPU
                      has no AVX512-BF16)
    amx_int8_gops     the matrix engine on int8: independent tdpbssd on loaded tiles, all threads,
                      in integer ops (0 where AMX int8 may not run; amx_int8_reason says why)

A kernel's result is set against the peak of the unit it ran on: `compute_peak_gflops(engine)`
for the GEMM engine in force ("fma", "amx_bf16" or "avx512_bf16", workbench.kernels.gemm_engine()),
or "amx_int8" for an int8 product on the tiles.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch

from workbench.cache import cache_dir, measured_key, write_json


@dataclass(frozen=True)
class Peaks:
    threads: int
    triad_gbps: float
    triad_gbps_1t: float
    read_gbps: float
    fma_gflops: float
    fma_gflops_1t: float
    measured_at: str
    amx_bf16_gflops: float = 0.0
    amx_reason: str = ""
    avx512_bf16_gflops: float = 0.0
    amx_int8_gops: float = 0.0
    amx_int8_reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    def compute_peak_gflops(self, engine: str = "fma") -> float:
        """The compute roof of `engine`: "fma" (fp32 FMA units), "amx_bf16" (the tiles),
        "avx512_bf16" (vdpbf16ps) or "amx_int8" (the tiles on int8, giga-ops)."""
        if engine == "amx_bf16":
            return self.amx_bf16_gflops
        if engine == "amx_int8":
            return self.amx_int8_gops
        if engine == "avx512_bf16":
            return self.avx512_bf16_gflops
        if engine == "fma":
            return self.fma_gflops
        raise ValueError(f"engine must be 'fma', 'amx_bf16', 'avx512_bf16' or 'amx_int8', got {engine!r}")


def probe_kernels():
    """The build whose probes measure the machine's bandwidth and FMA peaks: the process's
    (workbench.kernels.native), except on the test build "emulated", whose vector
    instructions are C++ (kernels/emulate_isa.h) and whose speed is no peak of anything:
    there, the native build's. The matrix engines' peaks stay the process build's (0 on
    "emulated", whose engines are emulations too)."""
    from workbench.kernels import KernelSet, native

    return KernelSet("native") if native.variant == "emulated" else native


def _best(fn, repeats: int) -> float:
    fn()  # warm up: page faults, thread pool start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_triad_gbps(n_floats: int = 1 << 26, repeats: int = 5, threads: int | None = None) -> float:
    """Triad bandwidth over three arrays of n_floats fp32 (default 3 x 256 MiB)."""
    from workbench.hw import memory

    probe = probe_kernels()

    # on huge pages, like the KV caches and weights the kernels stream
    a, b, c = memory.empty(n_floats), memory.empty(n_floats).uniform_(), memory.empty(n_floats).uniform_()
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return 12 * n_floats / _best(lambda: probe.ext.triad(a, b, c, 3.0), repeats) / 1e9
    finally:
        torch.set_num_threads(before)


def measure_read_gbps(n_floats: int = 1 << 26, repeats: int = 5) -> float:
    from workbench.hw import memory

    probe = probe_kernels()
    x = memory.empty(n_floats).uniform_()
    return 4 * n_floats / _best(lambda: probe.ext.read_sum(x), repeats) / 1e9


def _loop_gflops(loop, threads: int, iterations: int, repeats: int) -> float:
    """GFLOP/s of one of the extension's probe loops (fma_loop, amx_bf16_loop,
    avx512_bf16_loop: each returns the FLOPs it executed) on `threads` threads, best of
    `repeats` (_best warms up)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = loop(1) * iterations
        return flops / _best(lambda: loop(iterations), repeats) / 1e9
    finally:
        torch.set_num_threads(before)


def measure_fma_gflops(threads: int, iterations: int = 20_000_000, repeats: int = 5) -> float:
    """The best of `repeats` runs, like the bandwidths: a peak is what the machine can do, and
    anything else running on a shared host only lowers a run (one median-of-3 measurement on
    a 2-vCPU cloud host once came out at half the peak)."""
    return _loop_gflops(probe_kernels().ext.fma_loop, threads, iterations, repeats)


def measure_amx_bf16_gflops(threads: int, iterations: int = 2_000_000, repeats: int = 5) -> tuple[float, str]:
    """The AMX bf16 peak (best of `repeats`) and why it is 0 where the tiles may not run."""
    from workbench.kernels import native

    available, reason = native.ext.gemm_engines()["amx_bf16"]
    return (_loop_gflops(native.ext.amx_bf16_loop, threads, iterations, repeats) if available else 0.0), reason


def measure_avx512_bf16_gflops(threads: int, iterations: int = 5_000_000, repeats: int = 5) -> float:
    from workbench.kernels import native

    if not native.ext.gemm_engines()["avx512_bf16"][0]:
        return 0.0
    return _loop_gflops(native.ext.avx512_bf16_loop, threads, iterations, repeats)


def measure_amx_int8_gops(threads: int, iterations: int = 2_000_000, repeats: int = 5) -> tuple[float, str]:
    """The AMX int8 peak in giga-ops (best of `repeats`) and why it is 0 where it may not run."""
    from workbench.kernels import native

    available, reason = native.ext.amx_int8_status()
    return (_loop_gflops(native.ext.amx_int8_loop, threads, iterations, repeats) if available else 0.0), reason


def _cache_path():
    # v2: measured on huge pages (workbench.hw.memory), as the kernels' big buffers are;
    # v3: the AMX bf16 peak; v4: the AVX512-BF16 peak; v5: the AMX int8 peak
    return cache_dir() / f"peaks-v5-{measured_key()}-{torch.get_num_threads()}threads.json"


def measured_peaks(refresh: bool = False) -> Peaks:
    """The cached peaks for this machine and thread count, measuring them if needed (~10 s)."""
    path = _cache_path()
    if not refresh and path.is_file():
        try:
            return Peaks(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # an old or damaged cache file: measure again
    threads = torch.get_num_threads()
    amx, amx_reason = measure_amx_bf16_gflops(threads)
    amx_int8, amx_int8_reason = measure_amx_int8_gops(threads)
    peaks = Peaks(
        threads=threads,
        triad_gbps=measure_triad_gbps(),
        triad_gbps_1t=measure_triad_gbps(threads=1),
        read_gbps=measure_read_gbps(),
        fma_gflops=measure_fma_gflops(threads),
        fma_gflops_1t=measure_fma_gflops(1),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        amx_bf16_gflops=amx,
        amx_reason=amx_reason,
        avx512_bf16_gflops=measure_avx512_bf16_gflops(threads),
        amx_int8_gops=amx_int8,
        amx_int8_reason=amx_int8_reason,
    )
    write_json(path, peaks.as_dict())
    return peaks
