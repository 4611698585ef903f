"""Work the suite needs later, started at the lowest CPU priority as soon as it is collected.

Two jobs need nothing from the tests before them and cost a minute or more of compiling:
the kernels' avx2 and scalar builds (the `kernels` fixture's later parameters) and the
project installed from a wheel into a fresh environment, where it compiles its kernels
again (tests/test_install.py). Started at the lowest priority (nice 19, in a session whose
scheduling group has the lowest weight) when collection ends, they compile while
earlier tests wait on Jupyter kernels, clusters, servers and a browser; whenever a test's
own processes want the CPU they get it. A test that needs a job's result waits for it
(`result`), and a job nobody started runs there and then, so a single test file run alone
behaves as before.

Nothing here changes what a test checks: the same builds happen, in the same folders, by
the same code; only when they happen moves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

NICE = ["nice", "-n", "19"]


def _lowest_group_priority(pid: int) -> None:
    """With autogroup scheduling (Linux's default on desktops and in many VMs) nice only ranks
    processes of one session: a test's Jupyter kernel or ipyparallel engine, started in a
    session of its own, shares the CPU half and half with the pytest session, nice 19 or not.
    So each job gets a session of its own and that session's group the lowest weight."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write("19")
    except OSError:
        pass  # no autogroup scheduling here: nice alone ranks the processes

_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background")  # one job at a time
_jobs: dict[Callable, Future] = {}
_procs: list[subprocess.Popen] = []
_paths: list[Path] = []
_lock = threading.Lock()
_stopping = False
_go = threading.Event()  # cleared while paused()
_go.set()


def run(cmd, **kw) -> subprocess.CompletedProcess:
    """Run a command at nice 19 (killed if the session ends first); fail with its output."""
    while True:
        _go.wait()  # not while paused()
        with _lock:  # the lock paused() takes its list of running commands under
            if _stopping:
                raise RuntimeError("the test session ended")
            if not _go.is_set():
                continue  # paused() began since: its list has no place for this one, wait again
            proc = subprocess.Popen(NICE + [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True, **kw)
            _lowest_group_priority(proc.pid)
            _procs.append(proc)
            break
    out, err = proc.communicate()
    with _lock:
        _procs.remove(proc)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@contextmanager
def paused():
    """The running commands stopped (SIGSTOP to their sessions) and none started for the
    block. For tests of gloo: its socket thread is a batch thread (workbench.distributed.comm),
    which a wake-up never schedules in over another process, nice 19 or not, so a background
    compile on a rank's core costs each message a scheduler tick. Never wait for a job's
    result inside the block."""
    _go.clear()
    with _lock:
        stopped = [p.pid for p in _procs if p.poll() is None]
    for pid in stopped:
        _signal_session(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in stopped:
            _signal_session(pid, signal.SIGCONT)
        _go.set()


def _signal_session(pid: int, sig: int) -> None:
    """`sig` to every process of the session `pid` leads (each command leads one of its own,
    start_new_session). Not to its process group alone: ninja starts each compiler in a
    group of its own, so a SIGSTOP to the group stopped ninja and left its compilers running
    beside gloo's ranks."""
    for member in _session_members(pid):
        try:
            os.kill(member, sig)
        except ProcessLookupError:
            pass


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == sid:
            members.append(int(entry))
    return members


def start(job: Callable) -> None:
    """Queue `job()` to run in the background (once)."""
    with _lock:
        if job not in _jobs and not _stopping:
            _jobs[job] = _pool.submit(job)


def result(job: Callable):
    """`job()`'s result: waited for if it was started, run now if it was not."""
    with _lock:
        future = _jobs.get(job)
    return future.result() if future is not None else job()


def remove_at_exit(path: Path) -> Path:
    _paths.append(path)
    return path


def stop() -> None:
    """The session is over: drop queued jobs, kill running commands, delete their folders."""
    global _stopping
    with _lock:
        _stopping = True
        _go.set()  # a run() waiting for paused() to end finds the session over
        for future in _jobs.values():
            future.cancel()
        for proc in _procs:
            proc.kill()
    _pool.shutdown(wait=True)
    for path in _paths:
        shutil.rmtree(path, ignore_errors=True)


def peer_files() -> None:
    """The files the peers read, written into the cache by the same functions a user's first
    peers run calls (converted_gguf, hf_directory): a minute of converting that needs nothing
    from the tests. tests/test_peers.py checks them; tests/test_runtime.py loads transformers
    from the Hugging Face directory (the GGUF's values, as transformers itself decodes them)
    instead of decoding the GGUF a second time. Both modules name this one job, so it runs
    once, and its readers wait for it: never two writers of one file."""
    run([sys.executable, "-c", "from workbench.analysis.peers import converted_gguf, hf_directory; "
                               "[converted_gguf(k) for k in ('F32', 'F16', 'Q8_0')]; hf_directory()"])


def build_variants(variants: list[str]) -> None:
    """Compile the kernel builds `variants` into the cache, as KernelSet(v).ext would."""
    for variant in variants:
        code = f"from workbench.kernels import KernelSet; KernelSet({variant!r}).ext"
        try:
            run([sys.executable, "-c", code])
        except AssertionError:
            pass  # the fixture builds it again in the test process and reports the error there
