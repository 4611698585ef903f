"""No cluster outlives its client: a small process that watches the client and, when it dies
by any signal (a crashed or OOM-killed notebook kernel, a restart that timed out), stops
the controller, the engines and their nannies and removes the cluster's files (its
shared-memory segment, ipyparallel's connection files).

Cluster.start() launches it in its own session once the engines are up, with the pids and
files to clean; Cluster.stop() ends it first, so a clean stop leaves it nothing to do. It
exits on its own once every process it watches is gone. What it did goes to its log:

    python -m workbench.distributed.watchdog --client PID --pids 11,12,13 --files a,b --log F
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.5
GRACE_S = 3.0  # between SIGTERM and SIGKILL


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    """The process's command line, its arguments joined by spaces ("" if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks after boot, /proc/PID/stat field 22), None if it
    is gone: with its pid, what tells a process from a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(")")[-1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class ExitWatch:
    """Sleeps that end early when one of `pids` exits: wait(seconds) returns True then. On
    pidfds (Linux 5.3 and later), so a waiting client reads nothing in /proc and wakes the
    moment an engine dies; where there are none, a plain sleep followed by `alive` on each."""

    def __init__(self, pids: list[int]):
        self.pids, self.fds = list(pids), []
        try:
            for pid in self.pids:
                self.fds.append(os.pidfd_open(pid))
        except (AttributeError, OSError):  # no pidfd here, or a pid already gone
            self.close()
            self.fds = None

    def wait(self, seconds: float) -> bool:
        if self.fds is None:
            time.sleep(seconds)
            return not all(alive(pid) for pid in self.pids)
        return bool(select.select(self.fds, [], [], seconds)[0])  # with no fds: a sleep

    def close(self) -> None:
        for fd in self.fds or ():
            os.close(fd)
        self.fds = []

    def __enter__(self) -> ExitWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def clean(pids: list[int], files: list[Path], say) -> None:
    """SIGTERM every live pid, SIGKILL what is left after GRACE_S, then remove the files."""
    live = [p for p in pids if alive(p)]
    signal_all(live, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while any(alive(p) for p in live) and time.monotonic() < deadline:
        time.sleep(0.1)
    stubborn = [p for p in live if alive(p)]
    signal_all(stubborn, signal.SIGKILL)
    removed = []
    for f in files:
        try:
            f.unlink()
            removed.append(f.name)
        except FileNotFoundError:
            pass
    say(f"stopped {len(live)} process(es) ({len(stubborn)} needed SIGKILL): {' '.join(map(str, live))}; "
        f"removed {', '.join(removed) or 'no files'}")


def watch(client: int, pids: list[int], files: list[Path], say) -> None:
    say(f"watching client {client}: {len(pids)} cluster process(es), {len(files)} file(s)")
    while True:
        if not alive(client):
            say(f"client {client} is gone: stopping its cluster")
            clean(pids, files, say)
            return
        if not any(alive(p) for p in pids):
            say("every cluster process has exited: nothing left to watch")
            return
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client", type=int, required=True)
    parser.add_argument("--pids", default="")
    parser.add_argument("--files", default="")
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args(argv)
    log = open(args.log, "a", buffering=1) if args.log else sys.stderr

    def say(msg: str) -> None:
        log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} workbench watchdog {os.getpid()}: {msg}\n")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # Cluster.stop ends it this way
    watch(args.client, [int(p) for p in args.pids.split(",") if p],
          [Path(f) for f in args.files.split(",") if f], say)


if __name__ == "__main__":
    main()
