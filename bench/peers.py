"""Time to first token and decode speed against the peers, as `workbench peers` measures them,
written as a benchmark result so docs/measurements.md can show it (bench/measurements.py).

Each engine runs in its own process on the same prompt tokens, the engines interleaved in a new
random order every round (workbench.analysis.peers). The table: prefill ms (time to first
token) and decode tokens/s with their spread over the rounds, and each peer's ratios to the
workbench row of matching precision (ours/peer > 1: ours faster). Engines that could not run
are a second table with the reason.

    python bench/peers.py [--engines "workbench bf16,transformers bf16,OpenVINO GenAI F16"]
                          [--prompt-lens 64,1024] [--new-tokens 16] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_results  # noqa: E402

from workbench.analysis.peers import peers_table, run_peers  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="workbench fp32,workbench bf16,transformers fp32,transformers bf16,"
                                              "OpenVINO GenAI F16",
                        help="comma-separated engine names (workbench.analysis.peers.ENGINES)")
    parser.add_argument("--prompt-lens", default="64,1024")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="folder for peers.json (default: results/)")
    args = parser.parse_args()
    rows = run_peers(engines=args.engines.split(","), prompt_lens=[int(n) for n in args.prompt_lens.split(",")],
                     new_tokens=args.new_tokens, rounds=args.rounds, progress=lambda m: print("  " + m, flush=True))
    print_table(*peers_table(rows))
    absent = [{"engine": r["engine"], "why": r["status"]} for r in rows if r["status"] != "ok"]
    if absent:
        print_table(absent, ["engine", "why"], title="not run")
    write_results("peers", {"rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
