"""Tensor-parallel benchmarks (2 ranks on this host, one thread each, pinned):

    latency   all-reduce latency of each backend from 1 KB to 16 MB (median, min-max over
              repeats, a barrier before each call) and its alpha-beta fit
              t = alpha + bytes / beta, which the cost model and reports reuse; and the
              fused step's own all-reduce (called natively, as the step does) 1,000 times
              at the bundled model's and Llama-2-7B's hidden sizes, in a row (the least each
              of a decode step's all-reduces costs) and each after the ranks have read 4 MiB
              (the caches swept, as the step's kernels sweep them between all-reduces), whose
              alpha-beta fit is the tp part's roofline
    tp        ranks 1 and 2 x backends x the three switches (token broadcast, LM head,
              zero copy; and our KV handoff with --kv-handoff on,off) on the bundled model and on llama2-7b --random --layers 4 --dtype bf16:
              decode ms/token, time over one process's and what the cost model predicts for
              it (roofline / 1 rank, with the latency part's fit of the step's all-reduce,
              or without it each cluster's own, measured after its rounds), comm ms/token,
              % comm (rank 0's, and every rank's: a rank with less to do waits at the
              all-reduce), of each rank's comm the wait for the other rank to arrive and
              rank 0's collectives' own share without it (shm only: the backend that can tell),
              bytes per token; switch settings and the one process (2 threads, in this
              process) interleaved within a cluster; then each switch's saving in bytes and
              in ms (rows matched on the other switches, paired round by round)
    prefetch  the ranks' software prefetch for fp32 / bf16 weights (workbench/kernels/
              prefetch.py): the host's tuned choice against none and two fixed distances,
              on 2 ranks over shm with the default switches, interleaved with the one
              process round by round

    python bench/distributed.py [--only latency,tp,prefetch] [--repeats 3] [--models smollm2-135m,llama2-7b]
                                [--backends gloo,shm] [--switches all|default] [--kv-handoff on|on,off]
                                [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_results  # noqa: E402

from workbench.analysis.tp_ablation import tp_ablation  # noqa: E402
from workbench.analysis.tp_savings import switch_savings  # noqa: E402
from workbench.distributed.allreduce import allreduce_latency  # noqa: E402

MODELS = {
    "smollm2-135m": ("smollm2-135m", {}),
    "llama2-7b": ("llama2-7b", {"random": True, "layers": 4, "dtype": "bf16", "max_seq_len": 512}),
}


def _ms(row: dict) -> str:
    return f"{row['decode_ms_per_token']:.2f} ({row['decode_ms_min']:.2f}-{row['decode_ms_max']:.2f})"


def _vs_one(row: dict) -> str:
    q = row.get("vs_tp1")
    return f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f})" if q else "-"


# The ranks' matrix-vector prefetch settings compared (bytes ahead, hint, longest row chunk
# prefetched; workbench/kernels/prefetch.py): none, and two candidates the per-host tuning
# once kept on a tie with none.
PREFETCH_SETTINGS = {"off": (0, 0, 0), "8192 B prefetcht1": (8192, 2, 3072), "16384 B prefetcht0": (16384, 3, 3072)}


def _apply_prefetch(setting) -> str:
    """On an engine: fp32 and bf16 weights' matrix-vector prefetch set to `setting` (the row
    order kept as tuned), or to this host's tuned choice (None); returns what is in force,
    in words."""
    from workbench.kernels import native, prefetch

    prefetch.apply(native.ext)
    if setting is not None:
        for name in ("float32", "bfloat16"):
            serial = native.ext.get_matvec_prefetch(name)[3]
            native.ext.set_matvec_prefetch(name, *setting, serial)

    def said(name):
        ahead, hint, _, _ = native.ext.get_matvec_prefetch(name)
        return f"{ahead} B {prefetch.HINTS[hint]}" if ahead else "off"

    return f"fp32 {said('float32')}, bf16 {said('bfloat16')}"


def prefetch_ab(name: str, kwargs: dict, repeats: int, new_tokens: int) -> list[dict]:
    """Rows: the one process (its own tuned choice), and TP=2 (shm, 1 thread per rank,
    pinned, default switches) with the ranks' tuned choice and with each PREFETCH_SETTINGS."""
    import statistics

    import torch

    import workbench as wb
    from workbench.analysis.text import sample_prompts
    from workbench.distributed.cluster import Cluster
    from workbench.hw.rounds import interleaved_rounds, ratio_by_round
    from workbench.runtime.threads import set_threads

    before = torch.get_num_threads()
    set_threads(2)
    single = wb.load_model(name, **kwargs)
    prompts = sample_prompts(single.tokenizer, 64, 1)
    run = dict(max_new_tokens=new_tokens, stop_at_eos=False)
    single.generate(prompts, **run)  # warm-up
    cluster = Cluster(2, backend="shm", threads_per_rank=1, pin=True).start()
    settings = {"tuned": None, **PREFETCH_SETTINGS}
    ms: dict = {"one process": {}, **{case: {} for case in settings}}
    try:
        model = cluster.load_model(name, **kwargs)
        said = {case: cluster.run(_apply_prefetch, setting, what="setting the prefetch")[0][0]
                for case, setting in settings.items()}
        model.generate(prompts, **run)  # warm-up
        for round_, case in interleaved_rounds(list(ms), repeats):
            if case == "one process":
                set_threads(2)
                out = single.generate(prompts, **run)
            else:
                cluster.run(_apply_prefetch, settings[case], what="setting the prefetch")
                out = model.generate(prompts, **run)
            ms[case][round_] = 1e3 * out.timings.decode_s / out.timings.decode_tokens
    finally:
        cluster.stop()
        set_threads(before)
    rows = []
    for case, by_round in ms.items():
        v = list(by_round.values())
        row = {"ranks": 1 if case == "one process" else 2, "setting": case,
               "matrix-vector prefetch": "its own tuned choice" if case == "one process" else said[case],
               "decode_ms_per_token": statistics.median(v), "decode_ms_min": min(v), "decode_ms_max": max(v),
               "repeats": len(v)}
        if case != "one process":
            row["vs_tp1"] = ratio_by_round(by_round, ms["one process"])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="latency,tp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="smollm2-135m,llama2-7b")
    parser.add_argument("--backends", default="gloo,shm")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--switches", choices=("all", "default"), default="all",
                        help="tp: every setting of the three switches, or only the default one (token ids, "
                             "top-k head, zero copy on), for more rounds in the same time")
    parser.add_argument("--kv-handoff", default="on", choices=("on", "on,off", "off,on", "off"),
                        help="tp: the shared KV head handed over (on), computed on both ranks (off), or both "
                             "settings interleaved (where the backend hands off and the split shares a head)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    parts, backends = args.only.split(","), tuple(args.backends.split(","))
    payload = {}
    if "latency" in parts:
        lat = allreduce_latency(backends, repeats=max(20, 10 * args.repeats))
        payload["allreduce_latency"] = lat
        rows = [{"backend": b, "bytes": r["bytes"], "median us (min-max)":
                 f"{r['median_us']:.1f} ({r['min_us']:.1f}-{r['max_us']:.1f})"} for b, v in lat.items() for r in v["sizes"]]
        print_table(rows, ["backend", "bytes", "median us (min-max)"], title="All-reduce latency, 2 ranks")
        print_table([{"backend": b, "alpha us": f"{v['alpha_us']:.1f}", "beta GB/s": f"{v['beta_gbps']:.2f}"}
                     for b, v in lat.items()], ["backend", "alpha us", "beta GB/s"],
                    title="alpha-beta fit (from Python, a barrier before each call)")
        rows = [{"backend": b, "floats": r["floats"], "bytes": r["bytes"],
                 "between calls": "nothing" if not r["stream_bytes"] else f"each rank reads {r['stream_bytes'] >> 20} MiB",
                 "us per call, median (min-max)": f"{r['median_us']:.1f} ({r['min_us']:.1f}-{r['max_us']:.1f})"}
                for b, v in lat.items() for r in v["step"]]
        print_table(rows, ["backend", "floats", "bytes", "between calls", "us per call, median (min-max)"],
                    title="The fused step's all-reduce, called natively 1,000 times per round (no barrier; each "
                          "round's 10th-percentile call: the ranks arriving together): with nothing between, its "
                          "least cost; after a sweep of the caches, what a step's call pays")
        print_table([{"backend": b, "alpha us": f"{v['step_fit']['alpha_us']:.1f}",
                      "beta GB/s": f"{v['step_fit']['beta_gbps']:.2f}"} for b, v in lat.items() if v["step_fit"]],
                    ["backend", "alpha us", "beta GB/s"],
                    title="alpha-beta fit of the step's own all-reduce after a cache sweep (the tp part's roofline)")
    # the tp part's roofline: the step's own all-reduce, as the step pays for it
    fits = {b: (v["step_fit"]["alpha_us"], v["step_fit"]["beta_gbps"])
            for b, v in payload.get("allreduce_latency", {}).items() if v.get("step_fit")}
    if "tp" in parts:
        payload["tp"] = {}
        for key in args.models.split(","):
            name, kwargs = MODELS[key]
            switches = {} if args.switches == "all" else dict(token_broadcast=("ids",), lm_head=("topk",),
                                                                   zero_copy=(True,))
            handoff = tuple(v == "on" for v in args.kv_handoff.split(","))
            rows = tp_ablation(name, kwargs, backends=backends, repeats=args.repeats, new_tokens=args.new_tokens,
                               comm=fits, progress=lambda msg: print("  " + msg, flush=True), kv_handoff=handoff,
                               **switches)
            payload["tp"][key] = rows
            table = [{**r, "decode ms/token (min-max)": _ms(r), "comm ms": f"{r['comm_ms_per_token']:.2f}",
                      "% comm": f"{r['pct_comm']:.0f}",
                      "wait ms by rank": " / ".join("-" if w is None else f"{w:.2f}"
                                                    for w in r.get("comm_wait_ms_by_rank", [])) or "-",
                      "% comm, waits excluded": "-" if r.get("pct_comm_own") is None else f"{r['pct_comm_own']:.1f}",
                      "% comm by rank": " / ".join(f"{100 * c / r['decode_ms_per_token']:.0f}"
                                                   for c in r.get("comm_ms_by_rank", [])) or "-", "comm KB/token": f"{r['comm_bytes_per_token'] / 1e3:.1f}",
                      "time / 1 rank (min-max)": _vs_one(r),
                      "roofline / 1 rank": "-" if r.get("roofline_vs_tp1") is None else f"{r['roofline_vs_tp1']:.3f}"}
                     for r in rows]
            paired = all(r.get("tp1_interleaved", True) for r in rows)
            print_table(table, ["ranks", "backend", "token_broadcast", "lm_head", "zero_copy", "kv_handoff",
                                "decode ms/token (min-max)", "time / 1 rank (min-max)", "roofline / 1 rank", "comm ms",
                                "% comm", "wait ms by rank", "% comm, waits excluded", "% comm by rank",
                                "comm KB/token", "same_tokens_as_tp1"],
                        title=f"Tensor parallel decode, {key}; time / 1 rank: "
                              + ("per round, the single process in the same rounds" if paired else
                                 "medians' ratio, worst and best pairing (the single process ran apart)"))
            savings = switch_savings(rows)
            payload.setdefault("tp_savings", {})[key] = savings
            if savings:  # none with --switches default: nothing to match a setting against
                print_table([{**s, "sent bytes saved": f"{s['sent_bytes_saved_per_token']:.0f}",
                              "copied bytes saved": f"{s['copied_bytes_saved_per_token']:.0f}",
                              "ms saved (min-max)": "-" if s["ms_saved_per_token"] is None else
                              "{median:.2f} ({min:.2f}-{max:.2f})".format(**s["ms_saved_per_token"]),
                              "% saved": "-" if s["pct_saved"] is None else f"{s['pct_saved']:.1f}"} for s in savings],
                            ["ranks", "backend", "switch", "setting", "against", "pairs", "sent bytes saved",
                             "copied bytes saved", "ms saved (min-max)", "% saved"],
                            title=f"Each switch's saving per decode token, {key}: rows matched on the other switches, "
                                  "ms paired round by round")
    if "prefetch" in parts:
        payload["prefetch"] = {}
        for key in args.models.split(","):
            name, kwargs = MODELS[key]
            rows = prefetch_ab(name, kwargs, args.repeats, args.new_tokens)
            payload["prefetch"][key] = rows
            table = [{**r, "decode ms/token (min-max)": _ms(r), "time / 1 rank (min-max)": _vs_one(r)} for r in rows]
            print_table(table, ["ranks", "setting", "matrix-vector prefetch", "decode ms/token (min-max)",
                                "time / 1 rank (min-max)"],
                        title=f"The ranks' prefetch choice, {key}, shm, ids / topk / zero copy on; time / 1 rank: "
                              "per round, the single process in the same rounds")
    write_results("distributed", payload, args.out)


if __name__ == "__main__":
    main()
