"""The attention benchmark suite: machine peaks, prefill attention, decode attention.

    python bench/all.py [--quick]

Each part prints its table and writes JSON under results/.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about a minute)")
    args = parser.parse_args()
    quick = ["--quick"] if args.quick else []
    for script, extra in (("peaks.py", []), ("prefill_attention.py", quick), ("decode_attention.py", quick)):
        status = subprocess.run([sys.executable, str(HERE / script), *extra]).returncode
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
