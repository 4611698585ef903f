"""What batching does to the bytes a mixture of experts' decode step reads, predicted and
measured: the cost model's expected distinct experts under the routing the model really does
(wb.expert_routing on real text), against the step records of decode steps of B different
real-text prompts decoded together, B = 1, 4, 16, 64.

For each B: the distinct experts a layer's step read (mean over steps and layers; from the
records' weight bytes), the step's bytes (weights read, KV cache, head) measured and predicted
(with the measured routing, and with uniform routing), the ratio, and the step's time and
tokens/s measured against the roofline's. The step records count exactly the experts each step
ran; the prediction knows only the routing's statistics, so the ratio is the cost model's error.
The figure (results/moe_batch.html, workbench.ui.plots.moe_bytes_spec) sets both side by side.

    python bench/moe_batch.py                       # Qwen3-30B-A3B shapes, 4 layers, Q4_K_M
    python bench/moe_batch.py --model path/to/moe.gguf --batches 1,4,16,64

The default model is the GGUF file with Qwen3-30B-A3B's layer shapes and random weights
(workbench.analysis.gguf_files), quantized by llama.cpp's quantizer when llama-cpp-python is
installed, else by the workbench's own (workbench.model.quantize, the same Q4_K_M mix). Each B
is --rounds rounds, interleaved in a fresh random order every round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, spread, write_results  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.analysis.costmodel import predict  # noqa: E402
from workbench.analysis.experts import ExpertRouting  # noqa: E402
from workbench.analysis.text import sample_prompts  # noqa: E402
from workbench.runtime.threads import set_threads  # noqa: E402


def default_model(layers: int) -> Path:
    from workbench.analysis.gguf_files import shaped_gguf

    try:
        import llama_cpp  # noqa: F401

        return shaped_gguf("qwen3-30b-a3b", layers=layers, kind="Q4_K_M")
    except ImportError:  # our own quantizer, the same mix
        from workbench.model.quantize import write_quantized

        f16 = shaped_gguf("qwen3-30b-a3b", layers=layers, kind="F16")
        out = f16.with_name(f16.name.replace("-F16", "-Q4_K_M-ours"))
        return out if out.is_file() else write_quantized(f16, out, "Q4_K_M")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a mixture-of-experts GGUF file or folder (default: the "
                                                      "Qwen3-30B-A3B-shaped Q4_K_M file)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the default shaped file")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--routing-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    set_threads(args.threads)
    path = args.model or str(default_model(args.layers))
    model = wb.load_model(path, max_batch=max(batches), max_seq_len=args.prompt_len + args.new_tokens + 8)
    cfg, llama = model.config, model.llama
    if not cfg.n_experts:
        parser.error(f"--model: {cfg.name} is not a mixture of experts")
    routing = wb.expert_routing(model, tokens=args.routing_tokens)
    print(routing)

    layers = llama.layers
    expert_bytes = statistics.fmean(a.nbytes + b.nbytes for layer in layers for a, b in layer.experts)
    measured = {b: {"bytes": [], "experts": [], "step_ms": []} for b in batches}
    order = list(batches)
    for _ in range(args.rounds):
        random.shuffle(order)
        for b in order:
            prompts = sample_prompts(model.tokenizer, args.prompt_len, b)
            out = model.generate(prompts, max_new_tokens=args.new_tokens, stop_at_eos=False)
            steps = out.timings.decode_steps[1:]  # the first pays the threads' wake-up
            m = measured[b]
            m["bytes"].append(statistics.fmean(sum(s.weight_bytes) + sum(s.kv_bytes) + s.head_bytes for s in steps))
            m["experts"].append(statistics.fmean(
                (w - layer._shared_bytes) / expert_bytes for s in steps for w, layer in zip(s.weight_bytes, layers)))
            m["step_ms"].append(1e3 * statistics.median(s.total_s for s in steps))

    rows = []
    for b in batches:
        kw = dict(batch=b, prompt_len=args.prompt_len, new_tokens=args.new_tokens, kv_cache=model.kv_cache)
        p, uniform = predict(model, routing=routing, **kw), predict(model, routing=ExpertRouting.uniform(cfg), **kw)
        m = measured[b]
        got = statistics.median(m["bytes"])
        rows.append({"B": b, "experts measured": spread(m["experts"]), "experts predicted": f"{p.experts['decode']:.1f}",
                     "experts uniform": f"{uniform.experts['decode']:.1f}",
                     "MB measured": f"{got / 1e6:.1f}", "MB predicted": f"{p.step_bytes('decode') / 1e6:.1f}",
                     "predicted / measured": f"{p.step_bytes('decode') / got:.3f}",
                     "uniform / measured": f"{uniform.step_bytes('decode') / got:.3f}",
                     "step ms": spread(m["step_ms"], 2), "roofline ms": f"{p.step_ms('decode'):.2f}",
                     "tok/s": f"{1e3 * b / statistics.median(m['step_ms']):.0f}",
                     "_raw": {"batch": b, "measured_bytes": m["bytes"], "measured_experts": m["experts"],
                              "step_ms": m["step_ms"], "predicted_bytes": p.step_bytes("decode"),
                              "uniform_bytes": uniform.step_bytes("decode"), "predicted_experts": p.experts["decode"],
                              "uniform_experts": uniform.experts["decode"], "roofline_ms": p.step_ms("decode")}})
    cols = ["B", "experts measured", "experts predicted", "experts uniform", "MB measured", "MB predicted",
            "predicted / measured", "uniform / measured", "step ms", "roofline ms", "tok/s"]
    print_table(rows, cols, title=f"{cfg.name}: {cfg.n_layers} layers, {cfg.n_experts} experts, top "
                                  f"{cfg.experts_per_token}; {args.threads} threads; decode steps of B real-text "
                                  f"prompts; median (min-max) over {args.rounds} rounds")
    raw = [r["_raw"] for r in rows]
    out = write_results("moe_batch", {"model": path, "description": model.description,
                                      "routing": {"source": routing.source, "rows": routing.rows()}, "rows": raw},
                        args.out)
    import plotly.graph_objects as go

    from workbench.ui.plots import moe_bytes_spec

    figure = out.with_suffix(".html")  # plotly.js inside: opens offline
    go.Figure(moe_bytes_spec(raw, title=f"{cfg.name}: a decode step's bytes and experts as the batch grows, "
                                        f"predicted and measured")).write_html(figure, include_plotlyjs=True)
    print(f"wrote {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
