"""Ablations of a tensor-parallel run: ranks x backend x the paper's three switches, and the
all-reduce latency of each backend with its alpha-beta fit.

tp_ablation rows (decode phase, batch 1 unless given):
    ranks, backend, token_broadcast, lm_head, zero_copy
    decode_ms_per_token         median (with min / max) over the repeats, wall time per step
    comm_ms_per_token           the step's collectives (all-reduces and the head's), median
    pct_comm                    comm_ms_per_token / decode_ms_per_token
    comm_bytes_per_token        payload this rank sent per decode step
    same_tokens_as_tp1          the greedy tokens equal the single-process run's
Within one cluster the switch settings are interleaved (shuffled every round); clusters
of different backends run one after another (starting one takes seconds). ranks = 1 is the
single-process model on the same cores (threads = the largest ranks x threads_per_rank).
"""

from __future__ import annotations

import itertools
import random
import statistics
from typing import Callable

import torch

from workbench.distributed.cluster import Cluster


def _row(out, batch: int) -> dict:
    steps = out.timings.decode_steps
    per_step_ms = [1e3 * s.total_s for s in steps]
    return {"decode_ms_per_token": 1e3 * out.timings.decode_s / max(1, out.timings.decode_tokens // batch),
            "comm_ms_per_token": statistics.mean(1e3 * s.comm_s for s in steps) if steps else 0.0,
            "comm_bytes_per_token": statistics.mean(s.comm_bytes for s in steps) if steps else 0.0,
            "step_ms": statistics.median(per_step_ms) if per_step_ms else 0.0}


def _summarize(config: dict, samples: list[dict], same: bool) -> dict:
    ms = [s["decode_ms_per_token"] for s in samples]
    comm = [s["comm_ms_per_token"] for s in samples]
    med = statistics.median(ms)
    return {**config, "decode_ms_per_token": med, "decode_ms_min": min(ms), "decode_ms_max": max(ms),
            "comm_ms_per_token": statistics.median(comm), "pct_comm": 100 * statistics.median(comm) / med,
            "comm_bytes_per_token": statistics.median(s["comm_bytes_per_token"] for s in samples),
            "same_tokens_as_tp1": same, "repeats": len(samples)}


def tp_ablation(name: str = "smollm2-135m", load_kwargs: dict | None = None, ranks=(1, 2),
                backends=("gloo", "shm"), token_broadcast=("ids", "embeddings"), lm_head=("topk", "gather"),
                zero_copy=(True, False), prompt_len: int = 64, new_tokens: int = 32, repeats: int = 3,
                threads_per_rank: int = 1, batch: int = 1, seed: int = 0,
                progress: Callable[[str], None] | None = None) -> list[dict]:
    import workbench as wb
    from workbench.analysis.text import sample_prompts
    from workbench.runtime.threads import set_threads

    load_kwargs = dict(load_kwargs or {})
    say = progress or (lambda msg: None)
    before = torch.get_num_threads()
    set_threads(max(ranks) * threads_per_rank)
    single = wb.load_model(name, **load_kwargs)
    prompts = sample_prompts(single.tokenizer, prompt_len, batch)
    run = dict(max_new_tokens=new_tokens, stop_at_eos=False)
    ref = single.generate(prompts, **run)  # also the warm-up
    rows = []
    if 1 in ranks:
        samples = [_row(single.generate(prompts, **run), batch) for _ in range(repeats)]
        rows.append(_summarize({"ranks": 1, "backend": "-", "token_broadcast": "-", "lm_head": "-",
                                "zero_copy": "-", "threads": torch.get_num_threads()}, samples, True))
        say(f"ranks 1: {rows[-1]['decode_ms_per_token']:.2f} ms/token")
    del single
    set_threads(before)
    combos = list(itertools.product(token_broadcast, lm_head, zero_copy))
    order = random.Random(seed)
    for r in (r for r in ranks if r > 1):
        for backend in backends:
            cluster = Cluster(r, backend=backend, threads_per_rank=threads_per_rank, pin=True).start()
            try:
                model = cluster.load_model(name, **load_kwargs)
                model.generate(prompts, **run)  # warm-up
                samples = {c: [] for c in combos}
                same = {c: True for c in combos}
                for _ in range(repeats):
                    for c in order.sample(combos, len(combos)):
                        model.set_options(token_broadcast=c[0], lm_head=c[1], zero_copy=c[2])
                        out = model.generate(prompts, **run)
                        samples[c].append(_row(out, batch))
                        same[c] = same[c] and out.token_ids == ref.token_ids
                for c in combos:
                    config = {"ranks": r, "backend": backend, "token_broadcast": c[0], "lm_head": c[1],
                              "zero_copy": "on" if c[2] else "off", "threads": threads_per_rank}
                    rows.append(_summarize(config, samples[c], same[c]))
                    say(f"ranks {r} {backend} {c}: {rows[-1]['decode_ms_per_token']:.2f} ms/token, "
                        f"comm {rows[-1]['comm_ms_per_token']:.2f}")
            finally:
                cluster.stop()
    return rows


def allreduce_latency(backends=("gloo", "shm"), sizes=None, repeats: int = 20, ranks: int = 2) -> dict:
    """Median all-reduce seconds per payload size (1 KB to 16 MB by default) for each backend,
    and the alpha-beta fit t = alpha + bytes / beta (least squares on the medians)."""
    sizes = sizes or [256 * 4 ** i for i in range(8)]  # 256 floats (1 KB) .. 4M floats (16 MB)
    out = {}
    for backend in backends:
        cluster = Cluster(ranks, backend=backend, pin=True).start()
        try:
            rows = cluster.comm_latency(sizes, repeats)
        finally:
            cluster.stop()
        for row in rows:
            s = row.pop("seconds")
            row.update(median_us=1e6 * statistics.median(s), min_us=1e6 * min(s), max_us=1e6 * max(s))
        out[backend] = {"sizes": rows, **fit_alpha_beta([r["bytes"] for r in rows], [r["median_us"] / 1e6 for r in rows])}
    return out


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


def comm_fit(backend: str, ranks: int = 2, refresh: bool = False, cluster=None) -> dict:
    """This machine's alpha-beta fit of `backend`'s all-reduce between `ranks` pinned
    processes: measured once and cached per CPU like the peaks (on `cluster` if given, a
    running Cluster of that backend and size; else on a new one, about 10 s).
    {"alpha_us", "beta_gbps", "measured_at", "backend", "ranks", "sizes"}."""
    import json
    import time

    from workbench.cache import cache_dir, cpu_key
    from workbench.distributed.comm import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    path = cache_dir() / f"allreduce-{cpu_key()}-{backend}-{ranks}ranks.json"
    if not refresh and path.is_file():
        try:
            fit = json.loads(path.read_text())
            if {"alpha_us", "beta_gbps", "measured_at"} <= set(fit):
                return fit
        except ValueError:
            pass  # damaged: measure again
    if cluster is not None:
        sizes = [256 * 4 ** i for i in range(8)]
        rows = cluster.comm_latency(sizes, 10)
        for row in rows:
            row["median_us"] = 1e6 * statistics.median(row.pop("seconds"))
        measured = {"sizes": rows, **fit_alpha_beta([r["bytes"] for r in rows], [r["median_us"] / 1e6 for r in rows])}
    else:
        measured = allreduce_latency((backend,), ranks=ranks)[backend]
    fit = {"backend": backend, "ranks": ranks, "alpha_us": measured["alpha_us"], "beta_gbps": measured["beta_gbps"],
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sizes": measured["sizes"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fit, indent=2))
    return fit
