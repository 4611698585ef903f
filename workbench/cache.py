"""Where the workbench keeps what it builds or measures once per machine: the compiled
kernels, the measured peaks, named models' weights.

    cache_dir()     $WORKBENCH_CACHE_DIR, default ~/.cache/workbench
    cpu_key()       a short hash of the CPU model and its flags: code compiled with
                    -march=native, or a peak measured on one CPU, is only valid on the same
                    kind, so a home directory shared by different machines stays correct
    measured_key()  cpu_key(), and the kernels' build where a process runs another than
                    the native one ($WORKBENCH_KERNELS_BUILD): the peaks measured through
                    one build are not the other's (prefetch and crossovers are only ever
                    measured on the native build, and keyed by cpu_key())
    write_json()    store a measurement whole or not at all: the ranks of a tensor-parallel
                    run may measure and write the same file at once, and a reader must never
                    see half of one
    results_dir()   where reports, profiles and exports go unless a path is given
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE_DIR", Path.home() / ".cache" / "workbench"))


RESULTS_DIR_ENV = "WORKBENCH_RESULTS_DIR"


def results_dir() -> Path:
    """Where %report, %profile, the panel's exports and the CLI write unless given a path, as an
    absolute path: $WORKBENCH_RESULTS_DIR; else, in a checkout of this repository, its
    results/ folder (which .gitignore covers), wherever the process runs; else results/ under
    cache_dir(). Never the working folder: a notebook's kernel runs in the notebook's folder,
    inside the source tree (or a user's own repository), where a new folder dirties `git
    status`."""
    if os.environ.get(RESULTS_DIR_ENV):
        return Path(os.environ[RESULTS_DIR_ENV]).expanduser().resolve()
    root = Path(__file__).resolve().parents[1]  # the checkout, when the package runs from one
    if (root / "pyproject.toml").is_file() and (root / ".git").exists() and (root / "workbench").is_dir():
        return root / "results"
    return (cache_dir() / "results").resolve()


def cpu_key() -> str:
    from workbench.hw.machine import machine_info  # here, not at the top: workbench.hw imports this module

    info = machine_info()
    return hashlib.sha1(f"{info.cpu_model}|{sorted(info.flags)}".encode()).hexdigest()[:10]


# Which build of the kernels a process runs (validated by workbench.kernels._build.process_build).
KERNELS_BUILD_ENV = "WORKBENCH_KERNELS_BUILD"


def measured_key() -> str:
    build = os.environ.get(KERNELS_BUILD_ENV, "native")
    return cpu_key() if build == "native" else f"{cpu_key()}-{build}"


def write_json(path: Path, data) -> None:
    """Write data to path as indented JSON through a file of this process's own, renamed over
    path (a rename is atomic): concurrent writers leave one whole version, never a mixture."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
