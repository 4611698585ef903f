"""How busy the machine is besides us, recorded with every measurement: a run made while
another process compiled is not comparable with one made on a quiet machine, and the report
must say which it was.

    machine_load()   {"loadavg": [1, 5, 15 min], "cpus", "busy_elsewhere_cpus",
                      "busy_processes": [{"pid", "name", "cpu_percent"}, ...], "sample_s"}

The load average counts every runnable thread, this process's own included (a 2-thread
generation alone puts it near 2), so it is kept beside what it cannot tell apart: the CPUs
the other processes (neither this one nor its children, such as a cluster's engines) used
over a short sample, and the busiest of them by name.
"""

from __future__ import annotations

import os
import time

SAMPLE_S = 0.1  # long enough to see a process that keeps a core busy, short enough to add no wait worth noting
BUSY_PERCENT = 5.0  # a process using at least this much of one CPU over the sample is listed
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, user + system ticks, name) of every process readable now."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()
            found[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]), name)
    return found


def descendants(root: int, ticks: dict[int, tuple[int, int, str]]) -> set[int]:
    """root and its descendants, from a cpu_ticks() table."""
    found, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in ticks.items() if ppid in frontier} - found
        found |= frontier
    return found


def machine_load(sample_s: float = SAMPLE_S) -> dict:
    """The load averages and the CPU other processes use now (see the module docstring)."""
    try:
        with open("/proc/loadavg") as f:
            loadavg = [float(x) for x in f.read().split()[:3]]
    except OSError:
        loadavg = list(os.getloadavg())
    before, t0 = cpu_ticks(), time.monotonic()
    time.sleep(sample_s)
    after, elapsed = cpu_ticks(), time.monotonic() - t0
    ours = descendants(os.getpid(), after)
    busy = []
    for pid, (_, ticks, name) in after.items():
        if pid in ours or pid not in before:
            continue
        percent = 100.0 * (ticks - before[pid][1]) / TICKS / elapsed
        if percent > 0:
            busy.append({"pid": pid, "name": name, "cpu_percent": round(percent, 1)})
    busy.sort(key=lambda p: -p["cpu_percent"])
    return {"loadavg": loadavg, "cpus": os.cpu_count(), "sample_s": round(elapsed, 3),
            "busy_elsewhere_cpus": round(sum(p["cpu_percent"] for p in busy) / 100, 2),
            "busy_processes": [p for p in busy if p["cpu_percent"] >= BUSY_PERCENT][:5]}


def load_said(load: dict | None) -> str:
    """A recorded load in words: 'load average 1.95 (2 CPUs); other processes busy on 0.9 CPU
    (cc1plus 85%)'."""
    if not load:
        return "machine load not recorded"
    names = ", ".join(f"{p['name']} {p['cpu_percent']:.0f}%" for p in load.get("busy_processes", []))
    return (f"load average {load['loadavg'][0]:.2f} ({load['cpus']} CPUs); other processes busy on "
            f"{load['busy_elsewhere_cpus']:.1f} CPU" + (f" ({names})" if names else ""))
