"""A sampling profiler over the running process: py-spy attached to ourselves while a
statement runs (and to a cluster's engines in a distributed run), saved as speedscope JSON,
summarised as the hottest frames and drawn as a flame graph (a plotly icicle: the root at
the top, each frame's width its share of the samples).

    result = profile(lambda: model.generate("Hello", max_new_tokens=32), native=True)
    result["top_frames"]       # [{"frame", "self %", "total %"}...]
    result["speedscope"]       # the file (open it at speedscope.app, offline: it is a JSON file)

py-spy needs ptrace permission on the process. Where it is missing (Yama's ptrace_scope
>= 1 without CAP_SYS_PTRACE, a container without SYS_PTRACE), ProfilerUnavailable says what
to change; nothing waits on a py-spy that cannot attach (every wait has a timeout).
`WORKBENCH_PY_SPY` names the py-spy command to use (default: the one beside this Python).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 60.0


class ProfilerUnavailable(RuntimeError):
    """py-spy is missing or may not attach; the message says what to do."""


def py_spy_command() -> list[str]:
    env = os.environ.get("WORKBENCH_PY_SPY")
    if env:
        return shlex.split(env)
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.is_file() else shutil.which("py-spy")
    if not found:
        raise ProfilerUnavailable("py-spy is not installed: pip install 'py-spy>=0.4.1' (or pip install -e "
                                  "'.[profile]'); 0.4.1 or newer is needed for native frames on Python 3.11")
    return [found]


def _ptrace_advice() -> str:
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    value = scope.read_text().strip() if scope.is_file() else None
    advice = ("py-spy may not attach to this process (ptrace is not permitted). "
              + (f"kernel.yama.ptrace_scope is {value}; " if value is not None else "")
              + "either allow it: `sudo sysctl kernel.yama.ptrace_scope=0`, or give the process the capability: "
                "in Docker `--cap-add SYS_PTRACE`, in Kubernetes securityContext.capabilities.add: [SYS_PTRACE], "
                "or run Jupyter as a user allowed to ptrace it.")
    return advice


DENIED_WORDS = ("permission denied", "not permitted", "eperm", "ptrace")  # py-spy's ways of saying no


class _Recorder:
    """One `py-spy record` attached to pid, writing speedscope JSON to `out`."""

    def __init__(self, pid: int, out: Path, native: bool, rate: int, duration: float | None):
        cmd = [*py_spy_command(), "record", "--pid", str(pid), "--rate", str(rate), "--format", "speedscope",
               "--output", str(out)]
        if native:
            cmd.append("--native")
        if duration:
            cmd += ["--duration", str(max(1, int(round(duration))))]
        self.out, self.pid = out, pid
        # An earlier profile's file at the same path (the default one is shared) must not pass
        # for this one's when py-spy writes none: stop() takes a missing file as its failure.
        if out.is_file():
            out.unlink()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._started = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if "Sampling process" in line:
                self._started.set()
        self._started.set()  # exited: wait_started looks at why

    def wait_started(self) -> None:
        if not self._started.wait(START_TIMEOUT_S):
            self.proc.kill()
            raise ProfilerUnavailable(f"py-spy did not start sampling pid {self.pid} within {START_TIMEOUT_S:.0f} s "
                                      f"(output: {' | '.join(self.lines[-3:]) or 'none'})")
        if self.proc.poll() is not None:
            self.proc.wait()
            time.sleep(0.05)  # the reader thread's last lines
            said, denied = self._said()
            if denied:
                raise ProfilerUnavailable(f"{_ptrace_advice()} (py-spy said: {denied[0]})")
            raise ProfilerUnavailable(f"py-spy exited at start (code {self.proc.returncode}): "
                                      f"{' | '.join(said[:3]) or 'no output'}")

    def _said(self) -> tuple[list[str], list[str]]:
        """py-spy's non-empty output lines, and those of them that say it may not attach."""
        said = [line.strip() for line in self.lines if line.strip()]
        return said, [line for line in said if any(w in line.lower() for w in DENIED_WORDS)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise ProfilerUnavailable(f"py-spy did not finish writing {self.out} within {STOP_TIMEOUT_S:.0f} s")
        if not self.out.is_file():  # it said it was sampling, then failed (a denied attach can show up late)
            said, denied = self._said()
            raise ProfilerUnavailable(f"py-spy wrote no profile of pid {self.pid} (exit code {self.proc.returncode}"
                                      f"; it said: {' | '.join(said[-3:]) or 'nothing'})"
                                      + (f". {_ptrace_advice()}" if denied else ""))


def summarize(speedscope: Path, top: int = 15, thread: str | None = "MainThread") -> dict:
    """Self and total share of each frame over the samples of `thread` (the one that ran
    the statement; all threads if None or if none is called that), the hottest frames by
    self time first, and the aggregated stacks (for the flame graph)."""
    data = json.loads(Path(speedscope).read_text())
    frames = data["shared"]["frames"]
    profiles = data["profiles"]
    if thread:
        profiles = [p for p in profiles if thread in str(p.get("name", ""))] or profiles

    def label(f: dict) -> str:
        where = Path(f.get("file") or "").name
        short = _without_template_args(f["name"])
        return f"{short} ({where}:{f.get('line')})" if where else short

    names = [label(f) for f in frames]  # once per frame, not once per sample

    self_count, total_count, stacks = Counter(), Counter(), Counter()
    n, count = 0, 0  # total weight (py-spy weights samples by seconds) and number of samples
    for prof in profiles:
        for stack, weight in zip(prof["samples"], prof.get("weights") or [1] * len(prof["samples"])):
            if not stack:
                continue
            n += weight
            count += 1
            self_count[stack[-1]] += weight
            for i in set(stack):
                total_count[i] += weight
            stacks[tuple(stack)] += weight
    rows = [{"frame": names[i], "self %": 100 * self_count[i] / n, "total %": 100 * total_count[i] / n}
            for i, _ in self_count.most_common(top)] if n else []
    return {"samples": count, "top_frames": rows, "stacks": {tuple(names[i] for i in s): c for s, c in stacks.items()}}


def _without_template_args(name: str) -> str:
    """'matvec<float>(float const*, ...)' stays readable; nested template arguments
    (parallel_for<lambda<...>>) collapse to <...> beyond the first level."""
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
            out.append("<" if depth == 1 else "..." if depth == 2 else "")
        elif ch == ">":
            out.append(">" if depth == 1 else "")
            depth = max(0, depth - 1)
        elif depth <= 1:
            out.append(ch)
    text = "".join(out)
    return text if len(text) <= 160 else text[:157] + "..."


def flame_spec(stacks: dict[tuple[str, ...], int], title: str = "Flame graph", min_share: float = 0.005) -> dict:
    """A plotly icicle of the aggregated stacks; frames under min_share of the samples are cut."""
    total = sum(stacks.values()) or 1
    value: Counter = Counter()
    for stack, c in stacks.items():
        for depth in range(1, len(stack) + 1):
            value[stack[:depth]] += c
    keep = [path for path, v in value.items() if v / total >= min_share]
    ids = ["all"] + [" / ".join(p) for p in keep]
    labels = ["all samples"] + [p[-1] for p in keep]
    parents = [""] + [" / ".join(p[:-1]) if len(p) > 1 else "all" for p in keep]
    values = [total] + [value[p] for p in keep]
    return {"data": [{"type": "icicle", "ids": ids, "labels": labels, "parents": parents, "values": values,
                      "branchvalues": "total", "tiling": {"orientation": "v"}, "maxdepth": 12,
                      "hovertemplate": "%{label}<br>%{value} samples (%{percentRoot:.1%})<extra></extra>"}],
            "layout": {"title": {"text": title}, "height": 560, "margin": {"l": 10, "r": 10, "t": 40, "b": 10}}}


def default_out() -> Path:
    """The speedscope file when none is named: profile.speedscope.json in results_dir()."""
    from workbench.cache import results_dir

    return results_dir() / "profile.speedscope.json"


def _out_path(out: str | Path | None) -> Path:
    return (default_out() if out is None else Path(out).expanduser()).resolve()


def profile(fn: Callable[[], object], native: bool = False, rate: int = 250, duration: float | None = None,
            out: str | Path | None = None, engine_pids: dict[int, int] | None = None) -> dict:
    """Run fn() under py-spy attached to this process (and to engine_pids {rank: pid});
    returns {"speedscope", "samples", "top_frames", "stacks", "value", "engines": {rank: summary}}.
    out: the speedscope file (default: default_out())."""
    if not isinstance(rate, int) or not 1 <= rate <= 10_000:
        raise ValueError(f"rate must be an integer number of samples per second in [1, 10000], got {rate!r}")
    if duration is not None and not duration > 0:
        raise ValueError(f"duration must be a positive number of seconds, got {duration!r}")
    out = _out_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recorders = [_Recorder(os.getpid(), out, native, rate, duration)]
    for rank, pid in (engine_pids or {}).items():
        recorders.append(_Recorder(pid, out.with_name(f"{out.stem}.rank{rank}{out.suffix}"), native, rate, duration))
    try:
        for r in recorders:
            r.wait_started()
    except ProfilerUnavailable:
        for r in recorders:
            if r.proc.poll() is None:
                r.proc.kill()
        raise
    t0 = time.perf_counter()
    try:
        value = fn()
    finally:
        elapsed = time.perf_counter() - t0
        for r in recorders:
            r.stop()
    result = {"speedscope": str(out), "native": native, "rate": rate, "seconds": elapsed, "value": value,
              **summarize(out)}
    result["engines"] = {rank: {"speedscope": str(r.out), **summarize(r.out)}
                         for rank, r in zip((engine_pids or {}), recorders[1:])}
    return result


def profile_command(cmd: list[str], native: bool = False, rate: int = 250,
                    out: str | Path | None = None) -> dict:
    """py-spy running a command from its start (`workbench profile`)."""
    out = _out_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file():
        out.unlink()  # as _Recorder: only this run's file may be read below
    args = [*py_spy_command(), "record", "--rate", str(rate), "--format", "speedscope", "--output", str(out),
            *(["--native"] if native else []), "--", *cmd]
    proc = subprocess.run(args)
    if not out.is_file():
        raise ProfilerUnavailable(f"py-spy wrote no profile (exit code {proc.returncode}). {_ptrace_advice()}")
    return {"speedscope": str(out), "returncode": proc.returncode, **summarize(out)}


def top_frames_text(result: dict) -> str:
    from workbench.analysis.tables import format_table

    return format_table(result["top_frames"], ["frame", "self %", "total %"], {"self %": "{:.1f}", "total %": "{:.1f}"},
                        title=f"{result['samples']} samples of the thread that ran it; the hottest frames by "
                              f"self time (total: with what they call)")


def report_entry(result: dict, statement: str) -> dict:
    """The profile as a report entry (workbench.report): where the speedscope file is and the top frames."""
    return {"kind": "profile", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": None, "statement": statement,
            "speedscope": result["speedscope"], "native": result["native"], "rate": result["rate"],
            "samples": result["samples"], "top_frames": result["top_frames"],
            "py_spy": _py_spy_version(), "command": f"%profile{' --native' if result['native'] else ''} "
                                                    f"--rate {result['rate']} {statement}"}


def _py_spy_version() -> str | None:
    try:
        return subprocess.run([*py_spy_command(), "--version"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired, ProfilerUnavailable):
        return None
