"""Every weight format on one model, side by side: what it does to the predictions and what it
costs, measured in one run.

    rows = weight_study("smollm2-135m")                 # every format, the bundled model
    rows = weight_study(model, ["file", "q4_0", "int4-g32"])  # a loaded model's source, loaded again
    print(format_study(rows)); fig = study_figure(rows) # one table, one Pareto figure

In a notebook: %weight_quality (magics), whose rows join %report.

For each format (WEIGHT_FORMATS, and "file": the model's own file as it is):
  - quality against the model in fp32 on real text (workbench.analysis.quality.weight_quality:
    one forward pass of `context` tokens each; mean KL(p_fp32 || p_format), top-1 agreement,
    perplexity). For a quantized file "fp32" is its exact dequantization, so its own row reads
    0: the other rows are what requantizing its values costs;
  - bytes per token: what a batch-1 decode step reads of the weights (every layer, the LM head,
    one embedding row), with the format's fallbacks where a row is not whole blocks;
  - decode tokens/s at batch 1 and the prefill time of `prompt_len` tokens, in interleaved
    rounds (workbench.hw.rounds): median and min-max, decode also as GB/s and a fraction of the
    machine's measured triad.
"""

from __future__ import annotations

import statistics
import time

DEFAULT_FORMATS = ("fp32", "bf16", "int8", "int8-g32", "file", "q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k",
                   "q4_1", "q4_0", "int4-g32", "int4-g128")


def weight_study(source="smollm2-135m", formats=DEFAULT_FORMATS, context: int = 1024, text: str | None = None,
                 new_tokens: int = 32, prompt_len: int = 256, rounds: int = 3, progress=None) -> list[dict]:
    """One row per format (see the module docstring), in the order given. source: a preset
    name or path, or a loaded Model (its source is loaded again in each format, with the same
    load arguments; the model itself is left as it is). progress(done, total, label) after each
    step. A format that does not fit in the memory left is refused by load_model, with the
    numbers, before its load starts (ModelLoadError)."""
    import torch

    import workbench as wb
    from workbench.analysis.quality import weight_quality
    from workbench.hw.rounds import interleaved_rounds
    from workbench.kernels.peaks import measured_peaks
    from workbench.model.weights import AS_FILE, describe_formats, weight_format

    formats = list(dict.fromkeys(formats))
    if not formats:
        raise ValueError("formats: give at least one weight format")
    for f in formats:
        if f != AS_FILE:
            weight_format(f)  # ValueError naming the format and the accepted ones
    for arg, value, least in (("context", context, 2), ("new_tokens", new_tokens, 2), ("prompt_len", prompt_len, 1),
                              ("rounds", rounds, 1)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{arg} must be an integer of at least {least}, got {value!r}")
    if isinstance(source, str):
        load_args, name = {"name_or_path": source}, source
    else:
        load_args = {k: v for k, v in source.load_args.items() if k != "dtype"}
        name = str(load_args.get("name_or_path"))
        if source.load_args.get("parallel") or getattr(source, "cluster", None) is not None:
            raise ValueError("weight_study runs in this process: load the model without a cluster")
    total = len(formats) + 1 + rounds + 1
    done = 0

    def step(label):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    reference = wb.load_model(**load_args, dtype="fp32")
    step("fp32 reference")
    models = {}
    for f in formats:
        models[f] = wb.load_model(**load_args, dtype=None if f == AS_FILE else f)
        step(f"loaded {f}")
    rows = {}
    for f, model in models.items():
        llama = model.llama
        params = sum(layer.linear_params for layer in llama.layers) + llama.lm_head.params
        linear_bytes = sum(lin.nbytes for layer in llama.layers for lin in layer.linears.values()) + llama.lm_head.nbytes
        q = weight_quality(reference, model, context=context, text=text)
        rows[f] = {"format": f, "formats": describe_formats(llama.weight_formats),
                   "bits_per_weight": 8 * linear_bytes / params,
                   "bytes_per_token": sum(layer.weight_bytes for layer in llama.layers) + llama.head_bytes(1),
                   "kl_nats": q["kl_nats"], "kl_nats_max": q["kl_nats_max"], "top1_agreement": q["top1_agreement"],
                   "perplexity": q["perplexity"], "perplexity_fp32": q["perplexity_reference"], "context": q["context"],
                   "decode_s": [], "prefill_s": []}
    prompt = reference.tokenizer.encode(" ".join(["The licence grants every recipient the same rights."] * 64))
    prompt = (prompt * (prompt_len // max(1, len(prompt)) + 1))[:prompt_len]
    short = prompt[:16]
    last_round = None
    for round_, f in interleaved_rounds(formats, rounds, warmup=1):
        if last_round is not None and round_ != last_round:
            step(f"round {last_round + 1}" if last_round >= 0 else "warm-up")
        last_round = round_
        model = models[f]
        stamps: list[float] = []
        model.generate([short], max_new_tokens=new_tokens, stop_at_eos=False, record=False,
                       on_token=lambda step, ids: stamps.append(time.perf_counter()))
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.logits(prompt)
        prefill = time.perf_counter() - t0
        if round_ >= 0:
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            rows[f]["decode_s"].append(statistics.median(gaps))
            rows[f]["prefill_s"].append(prefill)
    step(f"round {last_round + 1}")
    triad = measured_peaks().triad_gbps
    out = []
    for f in formats:
        r = rows[f]
        dec, pre = r.pop("decode_s"), r.pop("prefill_s")
        r["decode_tok_s"] = {"median": 1 / statistics.median(dec), "min": 1 / max(dec), "max": 1 / min(dec)}
        r["prefill_ms"] = {"median": 1e3 * statistics.median(pre), "min": 1e3 * min(pre), "max": 1e3 * max(pre)}
        r["decode_gbps"] = r["bytes_per_token"] * r["decode_tok_s"]["median"] / 1e9
        r["decode_pct_of_triad"] = 100 * r["decode_gbps"] / triad
        r["prompt_len"], r["new_tokens"], r["rounds"], r["model"] = len(prompt), new_tokens, rounds, name
        out.append(r)
    return out


def pareto_front(rows: list[dict]) -> list[dict]:
    """The formats no other beats on both bytes per token and KL, fewest bytes first."""
    front = [r for r in rows if not any(o is not r and o["bytes_per_token"] <= r["bytes_per_token"]
                                        and o["kl_nats"] < r["kl_nats"] for o in rows)]
    return sorted(front, key=lambda r: r["bytes_per_token"])


def format_study(rows: list[dict]) -> str:
    from workbench.analysis.tables import format_table

    def spread(d, fmt):
        return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}-{fmt.format(d['max'])})"

    out = [{"format": r["format"], "bits/weight": f"{r['bits_per_weight']:.2f}",
            "MB/token": f"{r['bytes_per_token'] / 1e6:.1f}", "KL nats": f"{r['kl_nats']:.2e}",
            "top-1": f"{r['top1_agreement']:.3f}", "perplexity": f"{r['perplexity']:.3f}",
            "decode tok/s": spread(r["decode_tok_s"], "{:.1f}"), "% triad": f"{r['decode_pct_of_triad']:.0f}",
            "prefill ms": spread(r["prefill_ms"], "{:.0f}")} for r in rows]
    front = ", ".join(r["format"] for r in pareto_front(rows))
    return format_table(out, list(out[0])) + f"\nPareto front (no format reads fewer bytes with lower KL): {front}"


def study_figure(rows: list[dict]) -> dict:
    """Plotly spec: KL against bytes per token, a marker per format, the Pareto front joined."""
    front = pareto_front(rows)
    shown = [r for r in rows if r["kl_nats"] > 0]
    return {"data": [
        {"type": "scatter", "mode": "markers+text", "name": "formats",
         "x": [r["bytes_per_token"] / 1e6 for r in shown], "y": [r["kl_nats"] for r in shown],
         "text": [r["format"] for r in shown], "textposition": "top center",
         "hovertemplate": "%{text}: %{x:.1f} MB/token, KL %{y:.2e} nats<extra></extra>"},
        {"type": "scatter", "mode": "lines", "name": "Pareto front", "line": {"dash": "dot"},
         "x": [r["bytes_per_token"] / 1e6 for r in front if r["kl_nats"] > 0],
         "y": [r["kl_nats"] for r in front if r["kl_nats"] > 0]}],
        "layout": {"title": {"text": "Weight formats: KL to fp32 against the bytes a decode step reads"},
                   "height": 460, "xaxis": {"title": {"text": "MB read per token (batch 1)"}},
                   "yaxis": {"title": {"text": "mean KL to fp32, nats"}, "type": "log",
                             "exponentformat": "power"}}}
