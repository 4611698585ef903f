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
    outcome: dict = {}

    async def main():
        running["loop"], running["task"] = asyncio.get_running_loop(), asyncio.current_task()
        started.set()
        return await coro

    done = threading.Event()  # waited on, not thread.join: an interrupted join can return early later

    def work():
        try:
            outcome["value"] = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=work, name="workbench-coroutine", daemon=True)
    try:
        # Inside the try from the start: an interrupt may arrive while the thread is starting
        # (its coroutine already running), and must still cancel it.
        thread.start()
        while not done.wait(WAKE_S):
            # A timed wait, again and again: a signal another thread received (SIGINT goes to
            # any thread of the process) runs its handler here only once this wakes.
            pass
    except KeyboardInterrupt:
        # A thread that started runs its coroutine: wait until it has, to cancel it. One that
        # never got its OS thread (the interrupt came before) has no ident after a grace period.
        waited = 0.0
        while not (started.wait(WAKE_S) or done.is_set()):
            waited += WAKE_S
            if thread.ident is None and waited >= 10 * WAKE_S:
                coro.close()  # it never ran
                raise
        if started.is_set():
            try:
                running["loop"].call_soon_threadsafe(running["task"].cancel)
            except RuntimeError:  # its loop has closed: the coroutine had just finished
                pass
        while not done.wait(WAKE_S):
            pass  # the coroutine's own cleanup (closing connections) runs first
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
