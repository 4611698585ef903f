"""The tensor-parallel ablation: ranks x backend x the paper's three switches, each setting
run on a real cluster (the all-reduce's own latency and fit are in
workbench.distributed.allreduce).

tp_ablation rows (decode phase, batch 1 unless given):
    experts                     a mixture's split over the ranks ("expert": whole experts per
                                rank; "tensor": each expert's FFN split; "-" for a dense model or
                                one process): each setting is its own load of the cluster
    busiest_rank_share          a mixture's: the share of the routed tokens the busiest rank's
                                experts took in the single process's run (expert parallel; 1 /
                                ranks under the tensor split, where every rank runs every token)
    ranks, backend, token_broadcast, lm_head, zero_copy ("n/a" where the backend's fused
                                step has no buffer to write into, gloo and ccl: both settings
                                would decode on the same code, so one runs; switch_settings),
                                kv_handoff (ours: "n/a" where the backend cannot hand a KV
                                head over, or the split shares none)
    decode_ms_per_token         median (with min / max) over the repeats, wall time per step
    vs_tp1                      ranks > 1: decode time over the single process's in the same
                                round, median and min / max over the rounds ({median, min,
                                max}); the single process runs in every round of every
                                cluster (tp1_interleaved), unless the host has no room for
                                it beside the cluster: then it runs first, before any cluster,
                                and vs_tp1 pairs the worst and best rounds instead
    comm_ms_per_token           rank 0's collectives in a step (all-reduces and the head's), median
    pct_comm                    comm_ms_per_token / decode_ms_per_token
    comm_wait_ms_per_token      of comm_ms_per_token, rank 0's waits for the other ranks to arrive
                                (their imbalance, not the collectives' cost), median; None where
                                the backend cannot tell (gloo, ccl) and at ranks 1
    pct_comm_own                (comm - wait) / decode_ms_per_token: the collectives' own share
                                of the step; None where the wait is not known
    comm_ms_by_rank             the same for every rank ([] at ranks 1): a rank whose part of a
                                layer is smaller (uneven head splits) waits at the all-reduce
                                that ends it, and the wait counts as its communication
    comm_wait_ms_by_rank        comm_wait_ms_per_token for every rank ([] at ranks 1), None
                                where the backend cannot tell
    comm_bytes_per_token        payload this rank sent per decode step
    roofline_vs_tp1             ranks > 1: the cost model's decode step on the ranks over one
                                process's (costmodel.tp_roofline_ratio: each rank on 1 / ranks
                                of the measured triad, the busiest rank's share of the weights
                                with the row's KV handoff, the backend's all-reduce fit), what
                                vs_tp1 would be at the
                                roofs (a prediction, not a bound)
    allreduce_fit               ranks > 1: the fit it used, {alpha_us, beta_gbps, source}: the one
                                given (`comm`: bench/distributed.py's, from the same run's
                                latency part), else measured on the cluster itself after its
                                rounds: the fused step's own all-reduce at batch x dim and 8
                                times that, each call after every rank has swept 4 MiB
                                (distributed.allreduce.step_fit); where that measurement fails,
                                roofline_vs_tp1 is None and source says why
    same_tokens_as_tp1          the greedy tokens equal the single-process run's
    decode_ms_by_round          decode_ms_per_token in each round, round 0 first (the rounds pair
                                the settings of one cluster: workbench.analysis.tp_savings)
    allreduce_bytes_per_token   ranks > 1: the layers' all-reduce payload in a decode step (what
                                zero copy spares a copy of)
    path                        which decode path ran ("fused": the C++ step, with the
                                all-reduces inside on the ranks; "reference": Python)
Within one cluster the switch settings and the single process are interleaved (shuffled
every round); clusters of different backends run one after another (starting one takes
seconds). ranks = 1 is the single-process model on the same cores (threads = the largest
ranks x threads_per_rank), in this process: while it decodes the engines wait, and while
they decode it waits. Each switch's saving, from these rows: workbench.analysis.tp_savings.
"""

from __future__ import annotations

import itertools
import random
import statistics
from types import SimpleNamespace
from typing import Callable

import torch

from workbench.analysis.text import sample_prompts
from workbench.distributed.cluster import Cluster
from workbench.hw.rounds import interleaved_rounds, ratio_by_round, ratio_of_runs


def _mean_ms(seconds: list[float | None]) -> float | None:
    """The mean in ms, or None where any value is unknown (or there are none)."""
    return statistics.mean(1e3 * s for s in seconds) if seconds and None not in seconds else None


def _median(values: list[float | None]) -> float | None:
    return statistics.median(values) if values and None not in values else None


def _row(out, batch: int) -> dict:
    steps = out.timings.decode_steps
    per_step_ms = [1e3 * s.total_s for s in steps]
    ranks = len(steps[0].rank_comm_s) if steps else 0
    waits = [s.comm_wait_s for s in steps]
    return {"decode_ms_per_token": 1e3 * out.timings.decode_s / max(1, out.timings.decode_tokens // batch),
            "comm_ms_per_token": statistics.mean(1e3 * s.comm_s for s in steps) if steps else 0.0,
            "comm_wait_ms_per_token": _mean_ms(waits),
            "comm_ms_by_rank": [statistics.mean(1e3 * s.rank_comm_s[r] for s in steps) for r in range(ranks)],
            "comm_wait_ms_by_rank": [_mean_ms([s.rank_comm_wait_s[r] for s in steps]) for r in range(ranks)],
            "comm_bytes_per_token": statistics.mean(s.comm_bytes for s in steps) if steps else 0.0,
            "step_ms": statistics.median(per_step_ms) if per_step_ms else 0.0,
            "path": "+".join(sorted({s.path for s in steps}))}


def _summarize(config: dict, samples: list[dict], same: bool) -> dict:
    ms = [s["decode_ms_per_token"] for s in samples]
    comm = [s["comm_ms_per_token"] for s in samples]
    waits = [s["comm_wait_ms_per_token"] for s in samples]
    wait = _median(waits)
    own = [c - w for c, w in zip(comm, waits)] if wait is not None else None
    med = statistics.median(ms)
    return {**config, "decode_ms_per_token": med, "decode_ms_min": min(ms), "decode_ms_max": max(ms),
            "decode_ms_by_round": ms,
            "comm_ms_per_token": statistics.median(comm), "pct_comm": 100 * statistics.median(comm) / med,
            "comm_wait_ms_per_token": wait,
            "pct_comm_own": 100 * statistics.median(own) / med if own is not None else None,
            "comm_ms_by_rank": [statistics.median(s["comm_ms_by_rank"][r] for s in samples)
                                for r in range(len(samples[0]["comm_ms_by_rank"]))],
            "comm_wait_ms_by_rank": [_median([s["comm_wait_ms_by_rank"][r] for s in samples])
                                     for r in range(len(samples[0]["comm_wait_ms_by_rank"]))],
            "comm_bytes_per_token": statistics.median(s["comm_bytes_per_token"] for s in samples),
            "same_tokens_as_tp1": same, "repeats": len(samples),
            "path": "+".join(sorted({s["path"] for s in samples}))}


ONE_RANK = "1 rank"  # the single process, as a case of the interleaved rounds


def switch_settings(backend: str, token_broadcast, lm_head, zero_copy, kv_handoff=(True,),
                    shares_kv_head: bool = True) -> list[tuple[str, str, bool, str, bool, str]]:
    """(token_broadcast, lm_head, zero_copy, its label, kv_handoff, its label) for every setting
    the ablation runs on `backend`: all combinations, except that zero copy is one setting
    labelled "n/a" where the fused step cannot write into the backend's buffer
    (Backend.fused_zero_copy), and the KV handoff where the backend cannot hand off
    (Backend.fused_kv_handoff) or the split shares no KV head (shares_kv_head), since there
    "on" and "off" run the same code and a difference between them would be noise."""
    from workbench.distributed.backends import backend as backend_record

    record = backend_record(backend)

    def labelled(values, applies):
        return [(v, "on" if v else "off") for v in values] if applies else [(True, "n/a")]

    return [(tb, lm, z, z_label, kv, kv_label) for tb, lm, (z, z_label), (kv, kv_label) in itertools.product(
        token_broadcast, lm_head, labelled(zero_copy, record.fused_zero_copy),
        labelled(kv_handoff, record.fused_kv_handoff and shares_kv_head))]


STEP_FIT_SOURCE = ("the step's own all-reduce, each call after a cache sweep, measured on the cluster after its "
                   "rounds")


def tp_ablation(name: str = "smollm2-135m", load_kwargs: dict | None = None, ranks=(1, 2),
                backends=("gloo", "shm"), token_broadcast=("ids", "embeddings"), lm_head=("topk", "gather"),
                zero_copy=(True, False), kv_handoff=(True,), experts=("expert",), prompt_len: int = 64,
                new_tokens: int = 32, repeats: int = 3,
                threads_per_rank: int = 1, batch: int = 1, seed: int = 0,
                comm: dict[str, tuple[float, float]] | None = None,
                progress: Callable[[str], None] | None = None) -> list[dict]:
    """The rows above. comm: {backend: (alpha_us, beta_gbps)} all-reduce fits for the
    roofline column (bench/distributed.py passes the ones it just measured); a backend
    without one has its fit measured on its cluster after the timed rounds."""
    import workbench as wb
    from workbench.analysis.costmodel import tp_roofline_ratio
    from workbench.distributed.allreduce import step_fit
    from workbench.distributed.tp import TPOptions
    from workbench.distributed.shard import shares_kv_head
    from workbench.model.loaders import available_memory_bytes
    from workbench.runtime.threads import set_threads

    load_kwargs = dict(load_kwargs or {})
    say = progress or (lambda msg: None)
    before = torch.get_num_threads()
    one_threads = max(ranks) * threads_per_rank
    set_threads(one_threads)
    single = wb.load_model(name, **load_kwargs)
    prompts = sample_prompts(single.tokenizer, prompt_len, batch)
    run = dict(max_new_tokens=new_tokens, stop_at_eos=False)
    ref = single.generate(prompts, **run)  # also the warm-up
    set_threads(before)
    cfg, weight_dtype, kv_cache = single.config, single.weight_dtype, single.switches.kv_cache
    routing = None
    if cfg.n_experts:  # where the single process's run sent its tokens: each rank's load under each split
        from workbench.analysis.experts import ExpertRouting
        from workbench.distributed.tp import EXPERT_SPLITS

        if not experts or any(e not in EXPERT_SPLITS for e in experts):
            raise ValueError(f"experts must be some of {', '.join(EXPERT_SPLITS)}, got {list(experts)!r}")
        routing = ExpertRouting.of_model(single)
    splits = list(experts) if cfg.n_experts else ["-"]
    # what the cost model needs of the weights (a file's own formats: their bytes per weight), kept
    # apart from the model, which may be freed before the clusters start
    weights = SimpleNamespace(config=cfg, weight_dtype=weight_dtype, bytes_per_weight=single.llama.bytes_per_weight())
    comm = dict(comm or {})

    def allreduce_fit(cluster: Cluster) -> dict:
        """The all-reduce fit the roofline column uses: the one given, else measured on the
        cluster now (its rounds are done); a measurement that fails leaves the column empty
        and says why, not the rows lost."""
        fit = comm.get(cluster.backend)
        if fit is not None:
            return {"alpha_us": fit[0], "beta_gbps": fit[1],
                    "source": "given (comm=; bench/distributed.py: the step's all-reduce in its latency part)"}
        try:
            measured = step_fit(cluster, batch * cfg.dim)
        except RuntimeError as e:  # DistributedError, CommError: an engine or its collective failed
            return {"source": f"measurement failed: {e}"}
        return {"alpha_us": measured["alpha_us"], "beta_gbps": measured["beta_gbps"], "source": STEP_FIT_SOURCE}

    def roofline(ranks_: int, fit: dict, handoff: bool, split: str) -> float | None:
        """The cost model's vs_tp1 for these ranks, all-reduce fit, KV handoff and expert split."""
        if "alpha_us" not in fit:
            return None
        return tp_roofline_ratio(weights, ranks_, comm=(fit["alpha_us"], fit["beta_gbps"]), batch=batch,
                                 prompt_len=prompt_len, new_tokens=new_tokens, kv_cache=kv_cache,
                                 weight_dtype=weight_dtype, kv_handoff=handoff,
                                 expert_split=split if split != "-" else "expert", routing=routing)

    def one_rank() -> dict:
        set_threads(one_threads)
        try:
            return _row(single.generate(prompts, **run), batch)
        finally:
            set_threads(before)

    multi = [r for r in ranks if r > 1]
    # The cluster's ranks hold the weights once more between them: interleave the single
    # process with them only where both fit.
    interleave = 1 in ranks and bool(multi) and 2 * single.llama.weight_bytes < available_memory_bytes()
    one_samples: list[dict] = []
    if 1 in ranks and not interleave:
        one_samples = [one_rank() for _ in range(repeats)]
        del single
    one_config = {"ranks": 1, "backend": "-", "experts": "-", "token_broadcast": "-", "lm_head": "-", "zero_copy": "-",
                  "kv_handoff": "-", "threads": one_threads}
    rows = []
    order = random.Random(seed)
    for r, backend, split in itertools.product(multi, backends, splits):
        combos = switch_settings(backend, token_broadcast, lm_head, zero_copy, kv_handoff, shares_kv_head(cfg, r))
        cluster = Cluster(r, backend=backend, threads_per_rank=threads_per_rank, pin=True).start()
        try:
            options = TPOptions(experts=split) if split != "-" else None
            model = cluster.load_model(name, options=options, **load_kwargs)
            model.generate(prompts, **run)  # warm-up
            samples = {c: [] for c in combos}
            same = {c: True for c in combos}
            one_here: dict[int, dict] = {}
            cases = combos + ([ONE_RANK] if interleave else [])
            for round_, c in interleaved_rounds(cases, repeats, seed=order.randrange(2**31)):
                if c == ONE_RANK:
                    one_here[round_] = one_rank()
                    continue
                model.set_options(token_broadcast=c[0], lm_head=c[1], zero_copy=c[2], kv_handoff=c[4])
                out = model.generate(prompts, **run)
                samples[c].append((round_, _row(out, batch)))
                same[c] = same[c] and out.token_ids == ref.token_ids
            one_samples.extend(one_here.values())
            one_ms = {round_: s["decode_ms_per_token"] for round_, s in one_here.items()}
            fit = allreduce_fit(cluster)  # one per cluster: the switches do not enter it
            for c in combos:
                config = {"ranks": r, "backend": backend, "experts": split, "token_broadcast": c[0],
                          "lm_head": c[1], "zero_copy": c[3], "kv_handoff": c[5], "threads": threads_per_rank}
                row = _summarize(config, [s for _, s in samples[c]], same[c])  # in round order, as they ran
                row["roofline_vs_tp1"] = roofline(r, fit, c[5] == "on", split)
                if routing is not None:
                    row["busiest_rank_share"] = (statistics.fmean(routing.busiest_rank(r)) if split == "expert"
                                                 else 1 / r)
                row["allreduce_fit"] = fit
                row["allreduce_bytes_per_token"] = 2 * cfg.n_layers * cfg.dim * 4 * batch  # fp32 residual rows
                if 1 in ranks:
                    ms = {round_: s["decode_ms_per_token"] for round_, s in samples[c]}
                    row["vs_tp1"] = ratio_by_round(ms, one_ms) if interleave else ratio_of_runs(
                        list(ms.values()), [s["decode_ms_per_token"] for s in one_samples])
                    row["tp1_interleaved"] = interleave
                rows.append(row)
                say(f"ranks {r} {backend}{'' if split == '-' else f' {split} split'} {c[0]} / {c[1]} / zero copy "
                    f"{c[3]} / KV handoff {c[5]}: "
                    f"{row['decode_ms_per_token']:.2f} ms/token, "
                    f"comm {row['comm_ms_per_token']:.2f}"
                    + (f", {row['vs_tp1']['median']:.2f}x one process" if "vs_tp1" in row else ""))
        finally:
            cluster.stop()
    if 1 in ranks:
        rows.insert(0, _summarize(one_config, one_samples, True))
        say(f"ranks 1: {rows[0]['decode_ms_per_token']:.2f} ms/token")
    return rows
