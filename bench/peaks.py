"""Measure (or re-measure) the machine's peaks: triad / read bandwidth and FMA throughput.

    python bench/peaks.py [--refresh] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_results  # noqa: E402
import torch  # noqa: E402

from workbench.kernels.peaks import measured_peaks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refresh", action="store_true", help="measure again instead of using the cache")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    p = measured_peaks(refresh=args.refresh)
    rows = [
        {"peak": "triad bandwidth", "value": f"{p.triad_gbps:.1f} GB/s", "threads": p.threads},
        {"peak": "triad bandwidth", "value": f"{p.triad_gbps_1t:.1f} GB/s", "threads": 1},
        {"peak": "read bandwidth", "value": f"{p.read_gbps:.1f} GB/s", "threads": p.threads},
        {"peak": "fp32 FMA", "value": f"{p.fma_gflops:.0f} GFLOP/s", "threads": p.threads},
        {"peak": "fp32 FMA", "value": f"{p.fma_gflops_1t:.0f} GFLOP/s", "threads": 1},
        {"peak": "AVX512-BF16 (vdpbf16ps)", "value": f"{p.avx512_bf16_gflops:.0f} GFLOP/s" if p.avx512_bf16_gflops
         else "not on this CPU", "threads": p.threads},
        {"peak": "AMX bf16 tiles", "value": f"{p.amx_bf16_gflops:.0f} GFLOP/s" if p.amx_bf16_gflops
         else f"not here: {p.amx_reason}", "threads": p.threads},
        {"peak": "AMX int8 tiles", "value": f"{p.amx_int8_gops:.0f} GOP/s" if p.amx_int8_gops
         else f"not here: {p.amx_int8_reason}", "threads": p.threads},
    ]
    print_table(rows, ["peak", "value", "threads"], title=f"Machine peaks (measured {p.measured_at})")
    write_results("peaks", {"peaks": p.as_dict()})


if __name__ == "__main__":
    main()
