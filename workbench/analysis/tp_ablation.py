"""The tensor-parallel ablation: ranks x backend x the paper's three switches, each setting
run on a real cluster (the all-reduce's own latency and fit are in
workbench.distributed.allreduce).

tp_ablation rows (decode phase, batch 1 unless given):
    ranks, backend, token_broadcast, lm_head, zero_copy
    decode_ms_per_token         median (with min / max) over the repeats, wall time per step
    comm_ms_per_token           the step's collectives (all-reduces and the head's), median
    pct_comm                    comm_ms_per_token / decode_ms_per_token
    comm_bytes_per_token        payload this rank sent per decode step
    same_tokens_as_tp1          the greedy tokens equal the single-process run's
    path                        which decode path ran ("fused": the C++ step, with the
                                all-reduces inside on the ranks; "reference": Python)
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

from workbench.analysis.text import sample_prompts
from workbench.distributed.cluster import Cluster
from workbench.hw.rounds import interleaved_rounds


def _row(out, batch: int) -> dict:
    steps = out.timings.decode_steps
    per_step_ms = [1e3 * s.total_s for s in steps]
    return {"decode_ms_per_token": 1e3 * out.timings.decode_s / max(1, out.timings.decode_tokens // batch),
            "comm_ms_per_token": statistics.mean(1e3 * s.comm_s for s in steps) if steps else 0.0,
            "comm_bytes_per_token": statistics.mean(s.comm_bytes for s in steps) if steps else 0.0,
            "step_ms": statistics.median(per_step_ms) if per_step_ms else 0.0,
            "path": "+".join(sorted({s.path for s in steps}))}


def _summarize(config: dict, samples: list[dict], same: bool) -> dict:
    ms = [s["decode_ms_per_token"] for s in samples]
    comm = [s["comm_ms_per_token"] for s in samples]
    med = statistics.median(ms)
    return {**config, "decode_ms_per_token": med, "decode_ms_min": min(ms), "decode_ms_max": max(ms),
            "comm_ms_per_token": statistics.median(comm), "pct_comm": 100 * statistics.median(comm) / med,
            "comm_bytes_per_token": statistics.median(s["comm_bytes_per_token"] for s in samples),
            "same_tokens_as_tp1": same, "repeats": len(samples),
            "path": "+".join(sorted({s["path"] for s in samples}))}


def tp_ablation(name: str = "smollm2-135m", load_kwargs: dict | None = None, ranks=(1, 2),
                backends=("gloo", "shm"), token_broadcast=("ids", "embeddings"), lm_head=("topk", "gather"),
                zero_copy=(True, False), prompt_len: int = 64, new_tokens: int = 32, repeats: int = 3,
                threads_per_rank: int = 1, batch: int = 1, seed: int = 0,
                progress: Callable[[str], None] | None = None) -> list[dict]:
    import workbench as wb
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
                for _, c in interleaved_rounds(combos, repeats, seed=order.randrange(2**31)):
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


