"""`python -m workbench.kernels --info`: build the kernels if needed and print what was built."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from workbench.kernels._build import KernelBuildError, build_info, load_extension, process_build, runnable_variants
from workbench.hw.machine import machine_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.kernels", description=__doc__)
    parser.add_argument("--info", action="store_true", help="print ISA path, compiler, flags, caches")
    parser.add_argument("--variant", default=None,
                        help="native, avx2, scalar or emulated (default: the process's, $WORKBENCH_KERNELS_BUILD or native)")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output while building")
    parser.add_argument("--json", action="store_true", help="print the info as JSON")
    args = parser.parse_args(argv)
    try:
        variant = args.variant or process_build()
        load_extension(variant, verbose=args.verbose)  # a ValueError naming the variants if it is none
        info = build_info(variant)
    except (KernelBuildError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    m = machine_info()
    info["cpu"] = m.cpu_model
    info["host_isa"] = "avx512" if m.has_avx512 else "avx2" if m.has_avx2 else "baseline"
    info["caches"] = {f"L{c.level} {c.kind}": f"{c.size_bytes // 1024} KiB" for c in m.caches}
    info["threads"] = torch.get_num_threads()
    info["runnable_variants"] = runnable_variants()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
