"""Shared benchmark machinery: interleaved timing, summaries, tables, JSON results.

Machines here are shared and noisy, so every comparison is measured in one run with the
cases interleaved (every round runs each case once, in a fresh random order, so no case
always follows the same neighbour, e.g. one that flushes the caches) and reported as
medians with min-max; ratios are taken between medians of the same run.
"""

from __future__ import annotations

import os

# numpy (imported by torch) bundles OpenBLAS, whose idle worker threads were seen spinning
# in profiles of these benchmarks; on a 2-core machine that steals a core. The workbench
# never calls numpy's BLAS, so keep its pool to one thread. Must precede `import torch`.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from workbench.analysis.experiments import interleaved, summarize  # noqa: F401  (re-exported for the scripts)
from workbench.analysis.tables import format_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "results"


def spread(xs, digits: int = 1, unit: str = "") -> str:
    """Median (min-max) of one case's rounds, as every table prints it."""
    return f"{statistics.median(xs):.{digits}f}{unit} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def ratio_text(r: dict) -> str:
    """A ratio {median, min, max} (workbench.hw.rounds) as '1.05x (0.98-1.12)'."""
    return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def fmt_ms(s: dict) -> str:
    return f"{s['median_ms']:.2f} ({s['min_ms']:.2f}-{s['max_ms']:.2f})"


# Every table a script prints is also written into its results JSON ("tables": the cells as
# printed), so docs/measurements.md can be generated from the JSON (bench/measurements.py).
_PRINTED: list[dict] = []


def print_table(rows: list[dict], columns: list[str], title: str | None = None) -> None:
    print(("\n" if title else "") + format_table(rows, columns, title=title))
    _PRINTED.append({"title": title or "", "columns": list(columns),
                     "rows": [[str(r.get(c, "")) for c in columns] for r in rows]})


def command_line() -> str:
    """How this run was started, as a reader would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])


def environment() -> dict:
    from workbench.kernels import build_info
    from workbench.hw.machine import machine_info
    from workbench.kernels.peaks import measured_peaks

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        commit, dirty = "", False
    return {
        "command": command_line(),
        "git_commit": commit,
        "git_dirty": dirty,  # the tree had changes that commit does not hold
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": machine_info().as_dict(),
        "kernels": build_info(),
        "peaks": measured_peaks().as_dict(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_results(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), "tables": _PRINTED, **payload}, indent=2))
    print(f"\nwrote {path}")
    return path
