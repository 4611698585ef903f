"""End-to-end generation benchmarks, each comparison interleaved in one run.

    peer        the bundled SmolLM2-135M, batch 1, a 128-token prompt, 128 new tokens, greedy:
                ours (slim attention, fp32 cache, fp32 weights) vs Hugging Face transformers on
                the same GGUF (fp32, its sdpa attention). Decode tokens/s excludes the first
                token (ours: from the per-step timings; theirs: t(128 new) - t(1 new)).
    kv          batch 16 with a 1024-token context (--kv-batch, --kv-context, --kv-weights):
                the int8 cache read by each kernel (widen, dot, tile) vs fp16, interleaved, decode tokens/s, set against
                the ceilings the same run's triad and FMA peak allow.
    record      the cost of per-layer recording: record=True vs record=False.
    plots       the cost of live plots (FigureWidgets updated during the run) vs none.
    llama2-7b   the exact Llama-2-7B shapes with random bf16 weights, all 32 layers: load it,
                generate, and set decode time per token against weight bytes / measured triad.

    python bench/generation.py [--only peer,kv,record,plots,llama2-7b] [--repeats 3]
                               [--kv-batch 16] [--kv-context 1024]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_results  # noqa: E402
import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.analysis.text import sample_text  # noqa: E402
from workbench.hw.rounds import interleaved_rounds  # noqa: E402
from workbench.model.loaders import bundled_gguf_path  # noqa: E402
from workbench.kernels.peaks import measure_fma_gflops, measure_triad_gbps  # noqa: E402


def med(xs):
    return statistics.median(xs)


def bench_peer(repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = wb.load_model("smollm2-135m")
    path = bundled_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    prompt = model.tokenizer.encode(sample_text())[:128]
    ids = torch.tensor([prompt])

    def ours():
        out = model.generate(prompt, max_new_tokens=128, attention="slim", kv_cache="fp32", stop_at_eos=False,
                             record=False)
        return out.timings.time_to_first_token_s, out.timings.decode_tokens_per_s

    def theirs(n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    ours()
    theirs(2)
    o_ttft, o_tps, h_t1, h_t128 = [], [], [], []
    for _ in range(repeats):
        a, b = ours()
        o_ttft.append(a)
        o_tps.append(b)
        h_t1.append(theirs(1))
        h_t128.append(theirs(128))
    h_tps = 127 / (med(h_t128) - med(h_t1))
    r = {"ours_prefill_ms": 1e3 * med(o_ttft), "ours_decode_tokens_per_s": med(o_tps),
         "hf_prefill_ms": 1e3 * med(h_t1), "hf_decode_tokens_per_s": h_tps,
         "decode_speedup": med(o_tps) / h_tps, "prefill_speedup": med(h_t1) / med(o_ttft),
         "samples": {"ours_ttft_s": o_ttft, "ours_tps": o_tps, "hf_t1_s": h_t1, "hf_t128_s": h_t128}}
    print(f"peer: ours prefill {r['ours_prefill_ms']:.1f} ms, decode {r['ours_decode_tokens_per_s']:.1f} tok/s; "
          f"HF prefill {r['hf_prefill_ms']:.1f} ms, decode {h_tps:.1f} tok/s -> decode {r['decode_speedup']:.2f}x, "
          f"prefill {r['prefill_speedup']:.2f}x", flush=True)
    return r


# The int8 cache read by each of its kernels (the paper's first), and the fp16 cache.
KV_CASES = {"int8_widen": ("int8", "widen"), "int8_dot": ("int8", "dot"), "int8_tile": ("int8", "tile"),
            "fp16": ("fp16", None)}
INT8_KERNELS = ("int8_widen", "int8_dot", "int8_tile")


def bench_kv(repeats: int, batch: int = 16, context: int = 1024, new_tokens: int = 16,
             weights=("fp32", "bf16")) -> dict:
    """int8 vs fp16 KV decode, and the ratio the two would show if both ran at the machine's
    limits (the same run's triad and FMA peak). A decode step reads every weight once and each
    sequence's cache once, and does the step's recorded floating-point operations (linear
    layers, attention, LM head). fp16 step over int8 step, each at its floor:
      bytes      (weights + fp16 KV) / (weights + int8 KV + scales): arithmetic free;
      serial     flops / FMA peak + bytes / triad: arithmetic at the FMA peak, not overlapped
                 with memory traffic;
      overlapped max(flops / FMA peak, bytes / triad): both at their peaks, fully overlapped.
    Measured steps are slower than their floors, so the measured ratio is not capped by
    these; they say what int8 can gain over fp16 once both kernels are as fast as the machine."""
    results = {}
    text_ids = None
    for dtype in weights:
        model = wb.load_model("smollm2-135m", dtype=dtype, max_batch=batch)
        if text_ids is None:
            text_ids = model.tokenizer.encode(sample_text() * max(4, context // 256))
        prompts = [text_ids[i * 7:i * 7 + context] for i in range(batch)]
        tps = {kv: [] for kv in KV_CASES}
        step_bytes, step_flops = {}, {}
        model.generate(prompts, max_new_tokens=2, kv_cache="int8")  # warm-up
        for _, kv in interleaved_rounds(KV_CASES, repeats):
            fmt, kernel = KV_CASES[kv]
            out = model.generate(prompts, max_new_tokens=new_tokens, kv_cache=fmt, kv_kernel=kernel,
                                 stop_at_eos=False)
            tps[kv].append(out.timings.decode_tokens_per_s)
            steps = out.timings.decode_steps
            step_bytes[kv] = sum(s.bytes_read for s in steps) / len(steps)
            step_flops[kv] = sum(s.total_flops for s in steps) / len(steps)
        triad = measure_triad_gbps()
        fma = measure_fma_gflops(torch.get_num_threads())
        mem_s = {kv: b / (triad * 1e9) for kv, b in step_bytes.items()}
        compute_s = {kv: f / (fma * 1e9) for kv, f in step_flops.items()}
        step_s = {kv: batch / med(t) for kv, t in tps.items()}
        bound = step_bytes["fp16"] / step_bytes["int8_widen"]
        serial = (compute_s["fp16"] + mem_s["fp16"]) / (compute_s["int8_widen"] + mem_s["int8_widen"])
        overlap = max(compute_s["fp16"], mem_s["fp16"]) / max(compute_s["int8_widen"], mem_s["int8_widen"])
        results[dtype] = {"batch": batch, "context": context, "fp16_tokens_per_s": med(tps["fp16"]),
                          **{f"{kv}_tokens_per_s": med(tps[kv]) for kv in INT8_KERNELS},
                          **{f"{kv}_over_fp16": med(tps[kv]) / med(tps["fp16"]) for kv in INT8_KERNELS},
                          "kv_share_of_step_bytes_fp16": kv_bytes(model, prompts, new_tokens, "fp16") / step_bytes["fp16"],
                          "floors_ratio_bytes": bound, "floors_ratio_serial": serial,
                          "floors_ratio_overlapped": overlap, "triad_gbps": triad, "fma_gflops": fma,
                          "step_mb": {kv: b / 1e6 for kv, b in step_bytes.items()},
                          "step_gflop": {kv: f / 1e9 for kv, f in step_flops.items()},
                          "step_ms": {kv: 1e3 * v for kv, v in step_s.items()},
                          "memory_floor_ms": {kv: 1e3 * v for kv, v in mem_s.items()},
                          "compute_floor_ms": {kv: 1e3 * v for kv, v in compute_s.items()},
                          "samples": tps}
        print(f"kv (weights {dtype}, batch {batch}, context {context}): fp16 {med(tps['fp16']):.1f} tok/s "
              f"({min(tps['fp16']):.1f}-{max(tps['fp16']):.1f}); "
              + "; ".join(f"{kv} {med(tps[kv]):.1f} ({min(tps[kv]):.1f}-{max(tps[kv]):.1f}) = "
                          f"{med(tps[kv]) / med(tps['fp16']):.2f}x" for kv in INT8_KERNELS)
              + f"; the KV cache is {100 * results[dtype]['kv_share_of_step_bytes_fp16']:.0f}% of an fp16 step's bytes",
              flush=True)
        for kv in ("int8_widen", "fp16"):
            print(f"  {kv}: step {1e3 * step_s[kv]:.1f} ms; {step_bytes[kv] / 1e6:.0f} MB / triad {triad:.0f} GB/s "
                  f"= {1e3 * mem_s[kv]:.1f} ms; {step_flops[kv] / 1e9:.2f} GFLOP / FMA peak {fma:.0f} GFLOP/s "
                  f"= {1e3 * compute_s[kv]:.1f} ms", flush=True)
        print(f"  int8 / fp16 with both at the machine's limits: {bound:.2f}x with arithmetic free, {serial:.2f}x "
              f"at the FMA peak not overlapped, {overlap:.2f}x at both peaks overlapped", flush=True)
        del model
        gc.collect()
    return results


def kv_bytes(model, prompts, new_tokens: int, kv: str) -> float:
    """The KV-cache bytes of a mean decode step (all layers), as the step records count them."""
    from workbench.model.kv_formats import kv_format

    cfg = model.config
    mean_len = sum(len(p) for p in prompts) / len(prompts) + new_tokens / 2
    return cfg.n_layers * 2 * len(prompts) * mean_len * cfg.n_kv_heads * kv_format(kv).bytes_per_vector(cfg.head_dim)


def bench_record(repeats: int) -> dict:
    model = wb.load_model("smollm2-135m")
    prompt = model.tokenizer.encode(sample_text())[:64]
    times = {True: [], False: []}
    model.generate(prompt, max_new_tokens=8)
    for _ in range(repeats * 2):
        for rec in (True, False):
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=48, stop_at_eos=False, record=rec)
            times[rec].append(time.perf_counter() - t0)
    overhead = med(times[True]) / med(times[False]) - 1
    print(f"record: with {1e3 * med(times[True]):.1f} ms, without {1e3 * med(times[False]):.1f} ms "
          f"-> overhead {100 * overhead:.1f}%", flush=True)
    return {"with_ms": 1e3 * med(times[True]), "without_ms": 1e3 * med(times[False]), "overhead": overhead}


def bench_plots(repeats: int) -> dict:
    """Live-plot cost: generate with LivePlots(widget=True) hooked in (default refresh cap,
    and uncapped: every step redraws) vs without, interleaved."""
    from workbench.ui.plots import LivePlots

    model = wb.load_model("smollm2-135m")
    prompt = model.tokenizer.encode(sample_text())[:64]
    capped, uncapped = LivePlots(widget=True), LivePlots(widget=True, max_fps=1e9)
    cases = {"none": None, "capped": capped.on_step, "every step": uncapped.on_step}
    times = {k: [] for k in cases}
    model.generate(prompt, max_new_tokens=8)
    for _ in range(repeats * 2):
        for name, hook in cases.items():
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=48, stop_at_eos=False, on_step=hook)
            times[name].append(time.perf_counter() - t0)
    base = med(times["none"])
    r = {name: {"ms": 1e3 * med(t), "overhead": med(t) / base - 1} for name, t in times.items()}
    print("plots: " + ", ".join(f"{n} {v['ms']:.0f} ms ({100 * v['overhead']:+.1f}%)" for n, v in r.items()),
          flush=True)
    return r


def bench_llama2_7b(new_tokens: int = 8) -> dict:
    t0 = time.perf_counter()
    model = wb.load_model("llama2-7b", random=True, dtype="bf16", max_seq_len=256)
    load_s = time.perf_counter() - t0
    out = model.generate("The workbench measures", max_new_tokens=new_tokens, stop_at_eos=False)
    per_token_s = 1 / out.timings.decode_tokens_per_s
    steps = out.timings.decode_steps
    step_bytes = sum(s.bytes_read for s in steps) / len(steps)  # weights, LM head, KV cache
    triad = measure_triad_gbps()  # this run's: the host's bandwidth varies between runs
    bound_s = step_bytes / (triad * 1e9)
    r = {"load_s": load_s, "weight_gib": model.llama.weight_bytes / 2**30, "step_gb": step_bytes / 1e9, "decode_ms_per_token": 1e3 * per_token_s,
         "bandwidth_bound_ms": 1e3 * bound_s, "fraction_of_bound": bound_s / per_token_s,
         "prefill_ms": out.timings.summary()["prefill_ms"]}
    print(f"llama2-7b random bf16: loaded {r['weight_gib']:.1f} GiB in {load_s:.0f} s; decode "
          f"{r['decode_ms_per_token']:.0f} ms/token vs {r['bandwidth_bound_ms']:.0f} ms bound "
          f"(step bytes / triad {triad:.0f} GB/s) = {100 * r['fraction_of_bound']:.0f}% of the bound", flush=True)
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="peer,kv,record,plots,llama2-7b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-batch", type=int, default=16, help="kv: sequences per batch (default 16)")
    parser.add_argument("--kv-context", type=int, default=1024, help="kv: prompt tokens per sequence (default 1024)")
    parser.add_argument("--kv-weights", default="fp32,bf16", help="kv: weight dtypes to run (default fp32,bf16)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    parts = args.only.split(",")
    payload = {}
    if "peer" in parts:
        payload["peer"] = bench_peer(args.repeats)
    if "kv" in parts:
        payload["kv"] = bench_kv(args.repeats, batch=args.kv_batch, context=args.kv_context,
                                 weights=args.kv_weights.split(","))
    if "record" in parts:
        payload["record"] = bench_record(args.repeats)
    if "plots" in parts:
        payload["plots"] = bench_plots(args.repeats)
    if "llama2-7b" in parts:
        payload["llama2_7b"] = bench_llama2_7b()
    rows = []
    if "peer" in payload:
        p = payload["peer"]
        rows.append({"benchmark": "decode tok/s, ours vs HF", "value": f"{p['ours_decode_tokens_per_s']:.1f} vs "
                     f"{p['hf_decode_tokens_per_s']:.1f}", "ratio": f"{p['decode_speedup']:.2f}x"})
        rows.append({"benchmark": "prefill ms (128 tok), ours vs HF", "value": f"{p['ours_prefill_ms']:.1f} vs "
                     f"{p['hf_prefill_ms']:.1f}", "ratio": f"{p['prefill_speedup']:.2f}x"})
    for dtype, k in payload.get("kv", {}).items():
        rows.append({"benchmark": f"B={k['batch']} ctx {k['context']} decode, int8 (widen) vs fp16 KV ({dtype} weights)",
                     "value": f"{k['int8_widen_tokens_per_s']:.1f} vs {k['fp16_tokens_per_s']:.1f}",
                     "ratio": f"{k['int8_widen_over_fp16']:.2f}x (at the floors {k['floors_ratio_bytes']:.2f}x bytes only, "
                              f"{k['floors_ratio_serial']:.2f}x serial, {k['floors_ratio_overlapped']:.2f}x overlapped)"})
        for kv in INT8_KERNELS[1:]:
            rows.append({"benchmark": f"B={k['batch']} ctx {k['context']} decode, {kv} vs fp16 KV ({dtype} weights)",
                         "value": f"{k[f'{kv}_tokens_per_s']:.1f} vs {k['fp16_tokens_per_s']:.1f}",
                         "ratio": f"{k[f'{kv}_over_fp16']:.2f}x (KV {100 * k['kv_share_of_step_bytes_fp16']:.0f}% of "
                                  f"an fp16 step's bytes)"})
    if "record" in payload:
        rows.append({"benchmark": "recording overhead", "value": f"{payload['record']['with_ms']:.0f} vs "
                     f"{payload['record']['without_ms']:.0f} ms", "ratio": f"{100 * payload['record']['overhead']:.1f}%"})
    if "plots" in payload:
        for name in ("capped", "every step"):
            rows.append({"benchmark": f"live plots cost ({name})",
                         "value": f"{payload['plots'][name]['ms']:.0f} vs {payload['plots']['none']['ms']:.0f} ms",
                         "ratio": f"{100 * payload['plots'][name]['overhead']:+.1f}%"})
    if "llama2_7b" in payload:
        q = payload["llama2_7b"]
        rows.append({"benchmark": "llama2-7b bf16 decode ms/token vs bound", "value":
                     f"{q['decode_ms_per_token']:.0f} vs {q['bandwidth_bound_ms']:.0f}",
                     "ratio": f"{100 * q['fraction_of_bound']:.0f}%"})
    print_table(rows, ["benchmark", "value", "ratio"], title=f"Generation, {torch.get_num_threads()} threads")
    # A partial run (--only) gets its own file, so it does not replace a full run's results.
    default_only = parser.get_default("only")
    name = "generation" if args.only == default_only else "generation-" + args.only.replace(",", "-")
    write_results(name, payload, args.out)


if __name__ == "__main__":
    main()
