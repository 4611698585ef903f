"""oneCCL's settings against the least cost of the fused step's all-reduce.

Two processes (one pinned core each, as the ranks of a TP=2 run) connect through our oneCCL
binding with the workbench's environment (workbench/distributed/ccl.py) plus one setting
under test, and call the step's own all-reduce (its StepCollective, natively, oneCCL's
operation cached) `--calls` times in a row with nothing between, at each of `--floats`. The
settings run interleaved, round by round, each round in two new processes; the table gives
microseconds per call (each round's median call), median (min-max) over the rounds, and each setting over the
workbench's own in the same rounds. This is the floor bench/distributed.py --only latency
reports for the ccl backend, swept over what oneCCL and libfabric let one change.

    python bench/ccl_settings.py [--rounds 3] [--calls 2000] [--floats 576,4096]
                                 [--settings '{"name": {"CCL_X": "v"}, ...}']
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_results  # noqa: E402
from workbench.distributed.watchdog import rank_shm_files  # noqa: E402

# Each is added to the workbench's environment; "workbench" is that environment alone.
SETTINGS = {
    "workbench": {},
    "CCL_YIELD=pause": {"CCL_YIELD": "pause"},
    "CCL_YIELD=none": {"CCL_YIELD": "none"},
    "CCL_SPIN_COUNT=100000": {"CCL_SPIN_COUNT": "100000"},
    "CCL_ALLREDUCE=recursive_doubling": {"CCL_ALLREDUCE": "recursive_doubling"},
    "CCL_ALLREDUCE=ring": {"CCL_ALLREDUCE": "ring"},
    "CCL_ENABLE_OMP_ALLREDUCE=1": {"CCL_ENABLE_OMP_ALLREDUCE": "1"},
    "CCL_ATL_SYNC_COLL=1": {"CCL_ATL_SYNC_COLL": "1"},
    "CCL_OP_SYNC=1": {"CCL_OP_SYNC": "1"},
    "CCL_PRIORITY=none": {"CCL_PRIORITY": "none"},
    "FI_PROVIDER=shm": {"FI_PROVIDER": "shm"},
    "CCL_ATL_SHM=0 (tcp only)": {"CCL_ATL_SHM": "0"},
}


def rank(rank: int, address_file: str, floats: list[int], calls: int) -> None:
    """One rank: the environment comes from the parent; prints [seconds per call per size]."""
    import torch

    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    from workbench.distributed import ccl
    from workbench.kernels import native

    ext = ccl.extension()
    path = Path(address_file)
    if rank == 0:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(ext.main_kvs_address())
        tmp.replace(path)
    else:
        deadline = time.monotonic() + 60
        while not path.exists():
            if time.monotonic() > deadline:
                raise SystemExit("rank 1: rank 0 published no oneCCL address within 60 s")
            time.sleep(0.01)
    ext.connect(rank, 2, path.read_bytes())
    collective = native.ext.ForeignCollective(ext.step_collective())
    native.ext.time_collective(collective, floats[0], 200)  # warm-up: the cached operation built
    print(json.dumps([statistics.median(native.ext.time_collective(collective, n, calls)) for n in floats]), flush=True)
    ext.disconnect()


def one_round(extra: dict, floats: list[int], calls: int) -> list[float] | str:
    """Seconds per call at each size with `extra` added to the workbench's environment, or
    the reason the setting failed (oneCCL refuses some combinations)."""
    from workbench.distributed import ccl

    with tempfile.TemporaryDirectory() as tmp:
        address = str(Path(tmp) / "kvs-address")
        procs = []
        for r in range(2):
            env = {**os.environ, **ccl.environment(r, 2, "lo"), **extra}
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--address", address,
                                           "--floats", ",".join(map(str, floats)), "--calls", str(calls)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        try:
            outs = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            # A rank that oneCCL aborts (a refused setting ends in SIGABRT) or that is killed leaves
            # libfabric's shared-memory region, /dev/shm/<pid>:0:0 (64 MiB of RAM each): its own.
            for path in rank_shm_files(p.pid for p in procs):
                path.unlink(missing_ok=True)
    if procs[0].returncode != 0 or procs[1].returncode != 0:
        errors = [line for _, err in outs for line in err.splitlines() if "ERROR" in line or "Error" in line]
        return (errors or ["exit codes " + str([p.returncode for p in procs])])[0][-160:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--floats", default="576,4096")
    parser.add_argument("--settings", default=None, help="JSON {name: {variable: value}}; default: the built-in list")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    floats = [int(n) for n in args.floats.split(",")]
    if args.rank is not None:
        return rank(args.rank, args.address, floats, args.calls)
    from workbench.distributed import ccl

    if not ccl.available():
        raise SystemExit(ccl.INSTALL_HINT)
    settings = json.loads(args.settings) if args.settings else SETTINGS
    settings = {"workbench": {}, **settings}  # the reference, in every round
    found: dict[str, list] = {name: [] for name in settings}
    for r in range(args.rounds):
        for name, extra in settings.items():
            found[name].append(one_round(extra, floats, args.calls))
            print(f"  round {r + 1}/{args.rounds}: {name}", flush=True)
    rows = []
    for name, rounds in found.items():
        row = {"setting": name, "environment": settings[name]}
        failed = next((x for x in rounds if isinstance(x, str)), None)
        if failed is not None:
            row["failed"] = failed
        else:
            for i, n in enumerate(floats):
                us = [1e6 * x[i] for x in rounds]
                ref = [1e6 * x[i] for x in found["workbench"] if not isinstance(x, str)]
                ratio = [a / b for a, b in zip(us, ref)]
                row[f"{n}"] = {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us),
                               "vs_workbench": {"median": statistics.median(ratio), "min": min(ratio),
                                                "max": max(ratio)} if ratio else None}
        rows.append(row)
    columns = ["setting"]
    table = []
    for row in rows:
        cells = {"setting": row["setting"]}
        for n in floats:
            c = row.get(f"{n}")
            cells[f"{n} floats: us per call"] = ("failed: " + row["failed"]) if c is None else \
                f"{c['median_us']:.1f} ({c['min_us']:.1f}-{c['max_us']:.1f})"
            cells[f"{n} floats: / workbench"] = "-" if c is None or c["vs_workbench"] is None else \
                "{median:.2f} ({min:.2f}-{max:.2f})".format(**c["vs_workbench"])
        table.append(cells)
    for n in floats:
        columns += [f"{n} floats: us per call", f"{n} floats: / workbench"]
    print_table(table, columns, title=f"oneCCL's step all-reduce, 2 ranks, {args.calls} calls in a row per round, "
                                      f"{args.rounds} rounds interleaved; / workbench: per round")
    write_results("ccl_settings", {"calls": args.calls, "floats": floats, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
