"""The all-reduce's cost on this machine: latency per payload size for each backend, and its
alpha-beta fit t = alpha + bytes / beta, measured on engines of a new cluster (or a running
one) and cached per CPU like the peaks. Measuring is always an explicit call
(`measure_allreduce`, `bench/distributed.py`); `cached_fit` only reads what was measured, so
the cost model never starts a process."""

from __future__ import annotations

import json
import statistics
import time

from workbench.cache import cache_dir, cpu_key, write_json
from workbench.distributed.backends import backend as backend_record

# What every rank reads of its own memory before each call when the step's all-reduce is
# timed after a cache sweep (allreduce_latency's "step" rows, step_fit).
STEP_SWEEP_BYTES = 4 << 20


def allreduce_latency(backends=("gloo", "shm"), sizes=None, repeats: int = 20, ranks: int = 2,
                      step_sizes=(576, 4096), step_calls: int = 1000, step_stream_bytes=(0, STEP_SWEEP_BYTES)) -> dict:
    """Median all-reduce seconds per payload size (1 KB to 16 MB by default) for each backend,
    from Python with a barrier before each call, and the alpha-beta fit t = alpha + bytes /
    beta (least squares on the medians); and under "step", the fused decode step's own
    all-reduce called natively `step_calls` times per round at each of step_sizes (floats: the
    bundled model's and Llama-2-7B's hidden sizes), `repeats` rounds, with each of
    step_stream_bytes read by every rank before each call: 0, the calls in a row, what one of
    a step's all-reduces costs at least; 4 MiB, each call after the caches have been swept as
    the step's matrix-vector kernels sweep them between two all-reduces, and "step_fit" the
    alpha-beta fit of those (the one tp_ablation's roofline takes)."""
    sizes = sizes or [256 * 4 ** i for i in range(8)]  # 256 floats (1 KB) .. 4M floats (16 MB)
    from workbench.distributed.cluster import Cluster  # here: cached_fit needs no ipyparallel

    out = {}
    for backend in backends:
        cluster = Cluster(ranks, backend=backend, pin=True).start()
        try:
            rows = cluster.comm_latency(sizes, repeats)
            step = [row for stream in (step_stream_bytes if step_sizes else ())
                    for row in cluster.step_collective_latency(list(step_sizes), step_calls, repeats, stream)]
        finally:
            cluster.stop()
        swept = [r for r in _summarized(step) if r["stream_bytes"]]
        out[backend] = {"sizes": _summarized(rows), "step": step, **_fit(rows),
                        "step_fit": _fit(swept) if len(swept) >= 2 else None}
    return out


def _summarized(rows: list[dict]) -> list[dict]:
    """rows with each one's "seconds" (its rounds) replaced by median_us, min_us and max_us."""
    for row in rows:
        s = row.pop("seconds")
        row.update(median_us=1e6 * statistics.median(s), min_us=1e6 * min(s), max_us=1e6 * max(s))
    return rows


def _fit(rows: list[dict]) -> dict:
    """fit_alpha_beta over summarized rows' bytes and median times."""
    return fit_alpha_beta([r["bytes"] for r in rows], [r["median_us"] / 1e6 for r in rows])


def step_fit(cluster, floats: int, calls: int = 300, repeats: int = 3) -> dict:
    """The alpha-beta fit of the fused decode step's own all-reduce on a running cluster: its
    StepCollective called natively at `floats` and 8 x `floats` values, each call after every
    rank has swept STEP_SWEEP_BYTES of its own memory (as the step's kernels sweep the caches
    between two all-reduces). What a decode step's all-reduces cost, where measure_allreduce's
    fit (from Python, a barrier before each call) also counts Python's own overhead and a
    loop's warm caches. {"alpha_us", "beta_gbps", "sizes"}; not cached."""
    rows = _summarized(cluster.step_collective_latency([floats, 8 * floats], calls, repeats, STEP_SWEEP_BYTES))
    return {"sizes": rows, **_fit(rows)}


def fit_alpha_beta(nbytes: list[int], seconds: list[float]) -> dict:
    """t = alpha + bytes / beta, least squares on relative errors (weights 1 / t^2), so the
    small sizes that set alpha count as much as the large ones that set beta: alpha in
    microseconds, beta in GB/s."""
    w = [1 / (t * t) for t in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, nbytes)) / sw
    my = sum(wi * t for wi, t in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, nbytes))
    slope = sum(wi * (x - mx) * (t - my) for wi, x, t in zip(w, nbytes, seconds)) / sxx if sxx else 0.0
    alpha = my - slope * mx
    return {"alpha_us": 1e6 * alpha, "beta_gbps": (1 / slope / 1e9) if slope > 0 else float("inf")}


def _fit_path(backend: str, ranks: int):
    return cache_dir() / f"allreduce-{cpu_key()}-{backend}-{ranks}ranks.json"


def _check_backend(backend: str) -> None:
    backend_record(backend)  # a ValueError naming the backends


def cached_fit(backend: str, ranks: int = 2) -> dict | None:
    """The alpha-beta fit of `backend`'s all-reduce between `ranks` processes last measured on
    this machine (measure_allreduce), or None when none is cached. Never measures."""
    _check_backend(backend)
    path = _fit_path(backend, ranks)
    try:
        fit = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none yet, or damaged: measure again
    return fit if {"alpha_us", "beta_gbps", "measured_at"} <= set(fit) else None


def measure_allreduce(backend: str, ranks: int = 2, cluster=None, repeats: int = 10) -> dict:
    """Measure this machine's alpha-beta fit of `backend`'s all-reduce between `ranks` pinned
    processes and cache it (read back by cached_fit and the cost model): on `cluster` if
    given (a running Cluster of that backend and size), else on a new one started and stopped
    here (about 10 s). {"alpha_us", "beta_gbps", "measured_at", "backend", "ranks", "sizes"}."""
    _check_backend(backend)
    if cluster is not None:
        if (cluster.backend, cluster.n) != (backend, ranks):
            raise ValueError(f"cluster runs {cluster.backend} on {cluster.n} ranks, not {backend} on {ranks}")
        sizes = [256 * 4 ** i for i in range(8)]
        rows = _summarized(cluster.comm_latency(sizes, repeats))
        measured = {"sizes": rows, **_fit(rows)}
    else:  # the Python sweep alone: the step's own all-reduce is not what this fit caches
        measured = allreduce_latency((backend,), ranks=ranks, repeats=repeats, step_sizes=())[backend]
    fit = {"backend": backend, "ranks": ranks, "alpha_us": measured["alpha_us"], "beta_gbps": measured["beta_gbps"],
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sizes": measured["sizes"]}
    path = _fit_path(backend, ranks)
    write_json(path, fit)
    return fit
