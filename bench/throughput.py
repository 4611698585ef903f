"""The paper's Table 4 on this machine: decode throughput "without first token" of Llama-2-7B's
exact shapes at batch 1 to 256, with the paper's int8 KV cache and with fp16, interleaved.

The paper: Llama-2-7B, input 148 tokens, output 198, int8 KV cache, batch 256 and 512 on one
Xeon 8563C socket: 796.9 and 853.6 tokens/s. Here:

  - random bf16 weights in Llama-2-7B's shapes, `--layers` of its 32 (default 4: a batch-256
    step over all 32 would take seconds and the whole model 13 GiB); decode runs on the fused
    C++ step, its GEMM on the bf16 engine the CPU has (`--info`);
  - every sequence's KV cache filled with random values to the paper's 148-token input instead
    of prefilled (the metric leaves the first token out, and what a decode step reads and
    computes does not depend on the values), then `--steps` decode steps are timed from there;
  - per batch and KV format, in rounds that interleave every case: the step's median ms with
    min-max, tokens/s = batch / step, the step's bytes (weights, KV, head) against this run's
    triad and its FLOPs against the peak of the unit the GEMM ran on;
  - projected to all the model's layers (32) from the same steps (the head once, the measured
    layers scaled by 32 / layers), beside the cost model's roofline for all of them
    (`wb.predict`) and for the layers that ran (so the projection's inputs can be checked
    against the model). `--model` runs another preset's shapes.

    python bench/throughput.py [--batches 1,16,64,256] [--layers 4] [--steps 6] [--repeats 3]
                               [--kv int8,fp16] [--input 148]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, summarize, write_results  # noqa: E402
import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench import kernels  # noqa: E402
from workbench.analysis.costmodel import predict  # noqa: E402
from workbench.hw.rounds import interleaved_rounds  # noqa: E402
from workbench.kernels.peaks import measure_triad_gbps, measured_peaks  # noqa: E402
from workbench.model.config import preset  # noqa: E402
from workbench.model.switches import Switches  # noqa: E402

PAPER = {256: 796.9, 512: 853.6}  # tokens/s, Table 4 (int8 KV cache, one socket)


def fill_randomly(cache, length: int) -> None:
    """Every sequence of the cache holds `length` tokens of random K / V (and scales)."""
    for tensors in (cache.k, cache.v):
        for t in tensors:
            if t.dtype == torch.int8:
                t.random_(-127, 128)
            else:
                t.normal_()
    for scales in (cache.k_scale, cache.v_scale):
        for s in scales:
            if s is not None:
                s.uniform_(0.005, 0.02)
    cache.lengths = torch.full_like(cache.lengths, length)


class Case:
    """One (batch, KV format): its cache, and a run of `steps` decode steps from `length`."""

    def __init__(self, llama, batch: int, kv: str, length: int, steps: int):
        self.llama, self.batch, self.kv, self.length, self.steps = llama, batch, kv, length, steps
        self.switches = Switches(attention="slim", kv_cache=kv, step="fused")
        self.cache = llama.new_cache(batch, length + steps + 1, kv)
        fill_randomly(self.cache, length)
        self.tokens = torch.randint(0, llama.cfg.vocab_size, (batch,))
        self.records: list = []

    def run(self) -> list:
        self.cache.lengths.fill_(self.length)
        records = []
        for _ in range(self.steps):
            _, rec = self.llama.decode(self.tokens, self.cache, self.switches, record=True)
            records.append(rec)
        return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="decode steps timed per round (default 6)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv", default="int8,fp16")
    parser.add_argument("--input", type=int, default=148, help="tokens in each sequence's cache (the paper's input)")
    parser.add_argument("--model", default="llama2-7b", help="the preset whose shapes run (default: the paper's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    kvs = args.kv.split(",")

    peaks = measured_peaks()
    engine = kernels.gemm_engine_for("bfloat16")
    compute_peak = peaks.compute_peak_gflops(engine)
    full_layers = preset(args.model).n_layers
    model = wb.load_model(args.model, random=True, dtype="bf16", layers=args.layers, max_batch=max(batches),
                          max_seq_len=args.input + args.steps + 1)
    llama = model.llama
    cases = {(b, kv): Case(llama, b, kv, args.input, args.steps) for b in batches for kv in kvs}
    steps: dict = {key: [] for key in cases}
    triads = []
    for round_, key in interleaved_rounds(cases, args.repeats, warmup=1):
        records = cases[key].run()
        if round_ >= 0:
            steps[key].extend(records)
            if len(triads) <= round_:
                triads.append(measure_triad_gbps())  # once per round, between cases
    triad = statistics.median(triads)

    rows, results = [], []
    for (b, kv), recs in steps.items():
        step = summarize([r.total_s for r in recs])
        med = step["median_ms"]
        ms = [step["min_ms"], step["max_ms"]]
        layers_ms = summarize([r.total_s - r.head_s for r in recs])["median_ms"]
        head_ms = med - layers_ms
        projected_ms = head_ms + layers_ms * full_layers / args.layers
        step_bytes = sum(r.bytes_read for r in recs) / len(recs)
        step_flops = sum(r.total_flops for r in recs) / len(recs)
        cfg_here = replace(preset(args.model), n_layers=args.layers)
        model_here = predict(cfg_here, batch=b, prompt_len=args.input, new_tokens=args.steps, kv_cache=kv,
                             weight_dtype="bf16").step_ms("decode")
        model_full = predict(args.model, batch=b, prompt_len=args.input, new_tokens=args.steps, kv_cache=kv,
                             weight_dtype="bf16").step_ms("decode")
        r = {"batch": b, "kv_cache": kv, "layers": args.layers, "step_ms": {"median": med, "min": ms[0], "max": ms[-1]},
             "tokens_per_s": {"median": 1e3 * b / med, "min": 1e3 * b / ms[-1], "max": 1e3 * b / ms[0]},
             "layers_ms": layers_ms, "head_ms": head_ms, "step_gb": step_bytes / 1e9, "step_gflop": step_flops / 1e9,
             "pct_of_triad": 100 * step_bytes / (triad * 1e9) / (med / 1e3),
             "pct_of_compute_peak": 100 * step_flops / (compute_peak * 1e9) / (med / 1e3),
             "model_step_ms": model_here, "projected_all_layers_ms": projected_ms,
             "projected_all_layers_tokens_per_s": 1e3 * b / projected_ms, "model_all_layers_ms": model_full,
             "model_all_layers_tokens_per_s": 1e3 * b / model_full,
             "paper_tokens_per_s": PAPER.get(b) if kv == "int8" and args.model == "llama2-7b" else None}
        results.append(r)
        rows.append({"batch": b, "KV": kv, f"step ms ({args.layers} layers)": f"{med:.1f} ({ms[0]:.1f}-{ms[-1]:.1f})",
                     "tokens/s": f"{r['tokens_per_s']['median']:.0f} ({r['tokens_per_s']['min']:.0f}-{r['tokens_per_s']['max']:.0f})",
                     "% triad": f"{r['pct_of_triad']:.0f}", f"% {engine}": f"{r['pct_of_compute_peak']:.0f}",
                     "model ms": f"{model_here:.1f}",
                     f"{full_layers} layers: tokens/s projected": f"{r['projected_all_layers_tokens_per_s']:.0f}",
                     f"{full_layers} layers: cost model": f"{r['model_all_layers_tokens_per_s']:.0f}",
                     "paper": "" if r["paper_tokens_per_s"] is None else f"{r['paper_tokens_per_s']:.1f}"})
    print_table(rows, list(rows[0]), title=(
        f"Table 4 here: {args.model} shapes (random bf16 weights, {args.layers} of {full_layers} layers), {args.input}-token caches, "
        f"{args.steps} decode steps x {args.repeats} rounds, interleaved; GEMM on {engine} (peak {compute_peak:.0f} "
        f"GFLOP/s), triad {triad:.1f} GB/s this run. Paper: one Xeon 8563C socket, 32 layers, int8 KV"))
    write_results("throughput", {"peaks": peaks.as_dict(), "triad_gbps": triad, "engine": engine,
                                                   "layers": args.layers, "input": args.input, "steps": args.steps,
                                                   "repeats": args.repeats, "rows": results}, args.out)


if __name__ == "__main__":
    main()
