"""This checkout against an earlier commit on the same machine, interleaved in one run: time
to first token and batch-1 decode on the bundled model, per weight format, and the linear
kernel alone (GFLOP/s, in each weight format asked for: fp32, bf16, int8 and int8-g32 weights
of random values) at the bundled model's shapes, one row (decode), 4 and 8 rows on the
matrix-vector kernel (small-batch decode), 64 rows (a short prompt, or batched decode) and
256 (prefill), and with --llama-shapes at Llama-2-7B's
(q/k/v/o, gate/up, down) with 16 and 64 rows (batched decode) and 512 (prefill).

"No slower than before" is a claim about two builds of the kernels, so it is measured as one:
the earlier commit is checked out into a git worktree (kept under .cache/revisions/, its
kernels built there on first use), and every round runs each (revision, weight format) once
in its own process, in a fresh random order. Each process loads the model, warms up with one
short generation, then generates --new-tokens after a prompt of --prompt-words words; the
ratio is this checkout's figure over the earlier one's within each round (> 1: this checkout
is faster), median and min-max over rounds. The linear kernel's rows (kernels.linear, which
both commits have) take the median of 15 calls per process.

    python bench/revisions.py --base f77e44c [--dtypes fp32,bf16,int8] [--repeats 3] [--llama-shapes]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, print_table, ratio_text, spread, write_results  # noqa: E402
from workbench.hw.rounds import interleaved_rounds, ratio_by_round  # noqa: E402

# Runs inside either checkout, so it uses only what both have: load_model, generate, the
# timings' summary, KernelSet.linear and quantize_weight_int8.
WORKER = """
import json, sys
import workbench as wb
dtype, words, new, llama = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
model = wb.load_model("smollm2-135m", dtype=dtype)
prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * (words // 9 + 1)).split()[:words]
model.generate(" ".join(prompt[:16]), max_new_tokens=4, stop_at_eos=False)
s = model.generate(" ".join(prompt), max_new_tokens=new, stop_at_eos=False).timings.summary()
out = {"ttft_ms": s["time_to_first_token_ms"], "decode_tokens_per_s": s["decode_tokens_per_s"]}
if dtype in ("fp32", "bf16", "int8", "int8-g32"):  # the linear kernel alone, on weights of the model's shapes
    import statistics, time, torch
    from workbench.kernels import KernelSet, quantize_weight_int8
    ks, cfg = KernelSet("native"), model.config
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    cases = [(n, k, rows) for n, k in ((qkv, cfg.dim), (2 * cfg.ffn_dim, cfg.dim), (cfg.dim, cfg.ffn_dim))
             for rows in (1, 4, 8, 64, 256)]
    if llama:
        cases += [(n, k, rows) for n, k in ((4096, 4096), (11008, 4096), (4096, 11008)) for rows in (16, 64, 512)]
    for n, k, rows in cases:
        w, scale = torch.randn(n, k) * 0.02, None
        if dtype.startswith("int8"):  # weight-only int8: a scale per row, or per 32 weights of a row
            w, scale = quantize_weight_int8(w, 32 if dtype == "int8-g32" else None)
        else:
            w = w.to(torch.float32 if dtype == "fp32" else torch.bfloat16)
        x, times = torch.randn(rows, k), []
        for i in range(18):
            t = time.perf_counter()
            ks.linear(x, w, matvec_max_rows=10 if rows <= 8 else 0, scale=scale)  # up to 8: matrix-vector
            times.append(time.perf_counter() - t)
        out[f"linear M={rows} {n}x{k}"] = 2 * rows * n * k / statistics.median(times[3:]) / 1e9
print(json.dumps(out))
"""


def worktree(commit: str) -> Path:
    """A checkout of `commit` under .cache/revisions/ (made once)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True)
    if sha.returncode != 0:
        raise SystemExit(f"--base: {commit!r} is not a commit of this repository ({sha.stderr.strip()})")
    path = ROOT / ".cache" / "revisions" / sha.stdout.strip()[:12]
    if not (path / "workbench").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), sha.stdout.strip()], cwd=ROOT,
                       check=True, capture_output=True)
    return path


def run_once(checkout: Path, dtype: str, words: int, new_tokens: int, llama: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), WORKBENCH_CACHE_DIR=str(checkout / ".cache" / "workbench"))
    args = [dtype, str(words), str(new_tokens), str(int(llama))]
    done = subprocess.run([sys.executable, "-c", WORKER, *args], cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{checkout} ({dtype}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--dtypes", default="fp32,bf16,int8", help="weight formats, comma-separated")
    ap.add_argument("--prompt-words", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-shapes", action="store_true",
                    help="also time the GEMM at Llama-2-7B's linear shapes with 16, 64 and 512 rows")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default results/)")
    args = ap.parse_args()
    checkouts = {"this": ROOT, "base": worktree(args.base)}
    dtypes = [d for d in args.dtypes.split(",") if d]
    # the base's kernels are built before anything is timed
    for rev in checkouts:
        run_once(checkouts[rev], dtypes[0], 16, 2)
    runs: dict[tuple[str, str], dict[int, dict]] = {(r, d): {} for r in checkouts for d in dtypes}
    for round_, case in interleaved_rounds(list(runs), args.repeats, seed=1):
        runs[case][round_] = run_once(checkouts[case[0]], case[1], args.prompt_words, args.new_tokens,
                                      args.llama_shapes)
        print(f"round {round_} {case[0]:>4} {case[1]:>5}: {runs[case][round_]}", flush=True)
    def compare(dtype: str, key: str, label: str, lower_is_better: bool = False) -> dict:
        """The two revisions' median (min-max) of `key`, and this one's speed over the base's
        round by round (> 1: this is faster)."""
        this, base = ({k: s[key] for k, s in runs[(rev, dtype)].items()} for rev in ("this", "base"))
        speed = ratio_by_round(base, this) if lower_is_better else ratio_by_round(this, base)
        return {f"{label} this": spread(list(this.values())), f"{label} base": spread(list(base.values())),
                f"{label.split()[0]} speed this/base": ratio_text(speed)}

    rows = [{"weights": d, **compare(d, "ttft_ms", "TTFT ms", lower_is_better=True),
             **compare(d, "decode_tokens_per_s", "decode tok/s")} for d in dtypes]
    gemm_rows = [{"weights": d, "shape": key.removeprefix("linear "), **compare(d, key, "GFLOP/s")}
                 for d in dtypes for key in sorted(next(iter(runs[("this", d)].values())))
                 if key.startswith("linear")]
    columns = ["weights", "TTFT ms this", "TTFT ms base", "TTFT speed this/base", "decode tok/s this",
               "decode tok/s base", "decode speed this/base"]
    print_table(rows, columns, title=f"this checkout against {args.base}: bundled model, {args.prompt_words}-word "
                                     f"prompt, {args.new_tokens} new tokens, batch 1 (this/base > 1: this is faster)")
    if gemm_rows:
        print_table(gemm_rows, ["weights", "shape", "GFLOP/s this", "GFLOP/s base", "GFLOP/s speed this/base"],
                    title=f"the linear kernel alone (kernels.linear), this checkout against {args.base}: "
                          f"up to M=8 the matrix-vector kernel, more rows the GEMM")
    write_results("revisions", {"base": args.base, "prompt_words": args.prompt_words, "new_tokens": args.new_tokens,
                                "runs": [{"revision": r, "weights": d, "round": k, **v}
                                         for (r, d), by_round in runs.items() for k, v in by_round.items()]},
                  args.out)


if __name__ == "__main__":
    main()
