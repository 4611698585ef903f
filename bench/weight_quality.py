"""Each weight format's effect on the bundled model's predictions, against its fp32 weights, on
real text (workbench.analysis.quality.weight_quality): mean KL(p_fp32 || p_format) and its
largest value, top-1 agreement, and both perplexities over every position of --context tokens
of the license texts, one forward pass each (a prefill: more rows than the matrix-vector
kernel takes, so the linear layers run the GEMM). With --engines, each format runs on each
GEMM engine named: "fma", "amx_bf16", "avx512_bf16", or "amx_int8", which runs per-row int8
weights as W8A8 (x quantized to int8 per token) and the rest as amx_bf16; the row says which
engine ran the format (kernels.gemm_engine_for). An engine this build may not run gets a row
with the reason. Deterministic, so no repeats. WORKBENCH_KERNELS_BUILD=emulated runs the AMX
engines' code on any AVX2 host (the same numbers, far slower).

    python bench/weight_quality.py [--formats bf16,int8,int8-g32] [--engines auto,amx_int8] [--context 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_results  # noqa: E402

import workbench as wb  # noqa: E402
from workbench import kernels  # noqa: E402
from workbench.analysis.quality import weight_quality  # noqa: E402
from workbench.model.weights import WEIGHT_FORMATS, weight_format  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="bf16,int8,int8-g32", help="weight formats against fp32, comma-separated")
    parser.add_argument("--engines", default="auto", help="GEMM engines, comma-separated (kernels.set_gemm_engine)")
    parser.add_argument("--context", type=int, default=1024, help="tokens of text scored")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/)")
    args = parser.parse_args()
    try:
        formats = [weight_format(f).name for f in args.formats.split(",")]
    except ValueError as e:
        raise SystemExit(f"--formats: {e}") from None
    engines = args.engines.split(",")
    for e in engines:
        if e not in kernels.native.GEMM_ENGINES:
            raise SystemExit(f"--engines: {e!r} is not one of {', '.join(kernels.native.GEMM_ENGINES)}")
    if args.context < 2:
        raise SystemExit(f"--context must be at least 2 tokens, got {args.context}")

    reference = wb.load_model("smollm2-135m", dtype="fp32")
    status = kernels.gemm_engines()
    rows, table = [], []
    for name in formats:
        model = wb.load_model("smollm2-135m", dtype=name)
        for engine in engines:
            if engine != "auto" and not status[engine][0]:
                rows.append({"format": name, "engine": engine, "ran": False, "reason": status[engine][1]})
                table.append({"format": name, "engine": engine, "KL nats (max)": "-", "top-1": "-",
                              "perplexity": f"not run: {status[engine][1]}"})
                continue
            kernels.set_gemm_engine(engine)
            try:
                q = weight_quality(reference, model, context=args.context)
                ran_on = kernels.gemm_engine_for(WEIGHT_FORMATS[name].kernel)
            finally:
                kernels.set_gemm_engine("auto")
            rows.append({"format": name, "engine": engine, "ran": True, "ran_on": ran_on, **q})
            table.append({"format": name, "engine": f"{engine} ({ran_on})" if engine == "auto" else ran_on,
                          "KL nats (max)": f"{q['kl_nats']:.2e} ({q['kl_nats_max']:.2f})",
                          "top-1": f"{q['top1_agreement']:.3f}",
                          "perplexity": f"{q['perplexity']:.2f} (fp32 {q['perplexity_reference']:.2f})"})
    print_table(table, ["format", "engine", "KL nats (max)", "top-1", "perplexity"],
                title=f"Weight formats against fp32, bundled model, {args.context} tokens of the license texts, "
                      f"kernels build {kernels.native.variant}")
    write_results("weight_quality", {"context": args.context, "build": kernels.native.variant, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
