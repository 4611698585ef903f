"""Running a coroutine to its end from synchronous code, with or without an event loop
already running in this thread.

    rows = run_coroutine(load_the_server())

In a terminal (IPython, a script) nothing runs a loop, and this is asyncio.run. A Jupyter
kernel (ipykernel) runs its own loop in the main thread and executes every cell, and every
widget callback, inside it: asyncio.run refuses there ("cannot be called from a running event
loop"), and the running loop cannot be waited on from inside one of its own callbacks
without returning to it. So there the coroutine runs on a loop of its own in a worker
thread while the caller waits, as it would for any blocking call; an interrupt (the
kernel's stop button, Ctrl-C) cancels the coroutine and is raised in the caller once the
coroutine has cleaned up.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Coroutine

WAKE_S = 0.2  # how soon the waiting thread sees an interrupt


def run_coroutine(coro: Coroutine[Any, Any, Any]) -> Any:
    """The coroutine's result (or its exception), run to completion here or on a worker thread
    (see the module docstring)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    started = threading.Event()
    running: dict = {}

    async def main():
        running["loop"], running["task"] = asyncio.get_running_loop(), asyncio.current_task()
        started.set()
        return await coro

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="workbench-coroutine") as pool:
        future = pool.submit(asyncio.run, main())
        try:
            while True:
                try:
                    # A timed wait, again and again: a signal another thread received (SIGINT goes
                    # to any thread of the process) runs its handler here only once this wakes.
                    return future.result(timeout=WAKE_S)
                except FutureTimeout:
                    continue
        except KeyboardInterrupt:
            started.wait()
            try:
                running["loop"].call_soon_threadsafe(running["task"].cancel)
            except RuntimeError:  # its loop has closed: the coroutine had just finished
                pass
            try:
                future.result()  # the coroutine's own cleanup (closing connections) runs first
            except BaseException:  # its CancelledError, or whatever the cleanup raised
                pass
            raise
