"""Shareable performance reports: one JSON file (with a schema version) and one
self-contained HTML page that opens offline (plotly's JavaScript inlined once).

    import workbench as wb
    wb.report.record(result)                          # or: %generate / %ablate record themselves
    paths = wb.report.write(title="SmolLM2 on my laptop")     # results_dir()/report.html; or a path
    paths = wb.report(title="SmolLM2 on my laptop")           # the same

What a report holds (workbench/report/schema.json is the contract):
    machine     CPU model, sockets, cores and threads used, ISA flags, caches, NUMA nodes,
                RAM, the measured triad and FMA peaks (when measured, how)
    software    Python, torch, compiler and flags, the kernels' ISA path, package versions,
                the project's git commit and whether the tree was dirty
    entries     every recorded measurement: generations (model identity with its file's
                sha256, workload, switches, raw per-step samples with median / min / max /
                p90, prefill and decode apart, per-layer milliseconds, bytes and FLOPs, the
                cost model's prediction per part with the ratio and why), ablation grids and
                tensor-parallel ablations (their rows), peers (workbench.analysis.peers),
                profiles (py-spy: the speedscope file and the hottest frames) and benchmark
                JSON files (`workbench report FILE.json`), each with the command that
                reproduces it

    workbench compare a.json b.json   (workbench.report.compare) sets two reports side by side
    peak_rss    the process's peak resident memory

The session's log (`recorded()`) is what %report writes without re-running anything.
"""

import sys
import types

from workbench.report.collect import SCHEMA_VERSION, add_entry, build, clear, record, recorded
from workbench.report.render import write

__all__ = ["SCHEMA_VERSION", "add_entry", "build", "clear", "record", "recorded", "write"]


class _CallableModule(types.ModuleType):
    """`wb.report(path, title=...)` is `wb.report.write(path, title=...)`."""

    def __call__(self, path=None, title: str = "Workbench report", entries=None) -> dict:
        return write(path, title=title, entries=entries)


sys.modules[__name__].__class__ = _CallableModule
