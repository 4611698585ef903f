"""No cluster outlives its client: a small process that owns everything a cluster creates and
removes it when the cluster stops or its client dies by any means.

What a cluster creates, on this host:
    processes   the controller, the engines and the nannies ipyparallel starts beside each
                engine (in sessions of their own, out of reach of a signal to the client's
                process group), found by the mark ipyparallel gives every process it
                launches: IPP_CLUSTER_ID=<the cluster's id> in its environment
    files       ipyparallel's connection files and logs (named by the cluster's id), the shm
                backend's segment (/dev/shm/workbench-<client pid>-...), and the regions
                libfabric's shared-memory transport (oneCCL's between ranks of one host)
                keeps as /dev/shm/<pid>:<n>:<m> for each rank, which it removes itself only
                when the rank exits cleanly

Cluster.start() launches it first, in a session of its own, before it creates anything, with
the cluster's id and the file patterns; its stdin is a pipe from the client. The client
stops the cluster politely itself (Cluster.stop), then writes "stop" and waits while the
watchdog makes sure: it ends every process still carrying the mark (SIGTERM, SIGKILL after
GRACE_S) and removes every file. If the client dies instead (a SIGKILLed or OOM-killed kernel;
a restart that cut its atexit stop short), the pipe closes and the watchdog does the same at
once; it also polls the client's pid, in case a forked child holds the pipe open. What it did
goes to its log:

    python -m workbench.distributed.watchdog --client PID --cluster-id ID --files 'GLOB,GLOB' --log F
"""

from __future__ import annotations

import argparse
import glob
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5  # how often the client's pid is looked at (its pipe closing wakes the watchdog at once)
GRACE_S = 2.0  # between SIGTERM and SIGKILL: an engine's polite exit takes well under a second
MARK = "IPP_CLUSTER_ID"  # in the environment of every process ipyparallel launches
SHM_DIR = Path("/dev/shm")


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


def marked_processes(cluster_id: str, variable: str = MARK) -> list[int]:
    """Live processes (this one excepted) whose environment carries variable=cluster_id (the
    cluster's MARK, or another mark such as the test session's)."""
    mark = f"{variable}={cluster_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return [pid for pid in found if alive(pid)]


def rank_shm_files(pids) -> list[Path]:
    """libfabric's shared-memory regions of these processes, /dev/shm/<pid>:<n>:<m>."""
    return [path for pid in pids for path in SHM_DIR.glob(f"{pid}:*")]


def end_processes(pids: list[int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM each live pid, SIGKILL those still alive after grace_s, and wait (a few seconds
    at most) until they are gone; returns the pids that needed SIGKILL."""
    live = [p for p in pids if alive(p)]
    signal_all(live, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    stubborn = [p for p in live if alive(p)]
    signal_all(stubborn, signal.SIGKILL)
    deadline = time.monotonic() + 5  # SIGKILL is not instant
    while any(alive(p) for p in stubborn) and time.monotonic() < deadline:
        time.sleep(0.05)
    return stubborn


def clean(cluster_id: str, patterns: list[str], say) -> None:
    """End the cluster's processes and remove its files (see the module docstring)."""
    ended: list[int] = []
    for _ in range(3):  # a nanny may outlive its engine briefly; look again after each round
        pids = marked_processes(cluster_id)
        if not pids:
            break
        stubborn = end_processes(pids)
        ended += pids
        if stubborn:
            say(f"SIGKILL needed for {' '.join(map(str, stubborn))}")
    files = [Path(f) for pattern in patterns for f in glob.glob(pattern)] + rank_shm_files(ended)
    removed = []
    for f in files:
        try:
            f.unlink()
            removed.append(str(f))
        except FileNotFoundError:
            pass
    say(f"ended {len(ended)} process(es): {' '.join(map(str, ended)) or '-'}; removed {', '.join(removed) or 'no files'}")


def watch(client: int, cluster_id: str, patterns: list[str], commands, say) -> None:
    """Wait for "stop" on `commands` (the client's pipe), its end (the client is gone) or the
    client's pid to go; then clean."""
    say(f"watching client {client}: cluster {cluster_id}, files {' '.join(patterns)}")
    while True:
        ready, _, _ = select.select([commands], [], [], POLL_S)
        if ready:
            line = commands.readline()
            if line.strip() == "stop":
                say(f"client {client} stopped its cluster: making sure nothing is left")
                break
            if not line:
                say(f"client {client} is gone: stopping its cluster (its pipe closed)")
                break
        elif not alive(client):
            say(f"client {client} is gone: stopping its cluster (its pid has exited)")
            break
    clean(cluster_id, patterns, say)


class Watchdog:
    """The client's side: start() launches the watchdog process for a cluster; stop() (after
    the cluster's own polite stop) has it end what is left, remove the files, and waits for it.
    If this process dies, its end of the pipe closes and the watchdog cleans up by itself."""

    def __init__(self, cluster_id: str, patterns: list[str], log: Path):
        self.cluster_id, self.patterns, self.log = cluster_id, list(patterns), log
        self.proc: subprocess.Popen | None = None

    def start(self) -> Watchdog:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.distributed.watchdog", "--client", str(os.getpid()),
             "--cluster-id", self.cluster_id, "--files", ",".join(self.patterns), "--log", str(self.log)],
            start_new_session=True, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            text=True)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell it the cluster has stopped; return once it has made sure (or after timeout_s)."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
        except OSError:  # it died: nothing to tell
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client", type=int, required=True)
    parser.add_argument("--cluster-id", required=True)
    parser.add_argument("--files", default="", help="comma-separated glob patterns of the cluster's files")
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args(argv)
    log = open(args.log, "a", buffering=1) if args.log else sys.stderr

    def say(msg: str) -> None:
        log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} workbench watchdog {os.getpid()}: {msg}\n")

    # A signal to the client's process group does not reach this session; SIGTERM sent to the
    # watchdog itself (by someone else) still cleans up before it exits.
    signal.signal(signal.SIGTERM, lambda *_: (clean(args.cluster_id, patterns, say), sys.exit(0)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    patterns = [p for p in args.files.split(",") if p]
    watch(args.client, args.cluster_id, patterns, sys.stdin, say)


if __name__ == "__main__":
    main()
