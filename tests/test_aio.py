"""run_coroutine (workbench.runtime.aio): a coroutine run to its end from synchronous code,
in a terminal (no loop running) and in a Jupyter kernel (its loop running in this thread);
an interrupt while it runs cancels it and reaches the caller."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from workbench.runtime.aio import run_coroutine


async def _answer(x):
    await asyncio.sleep(0.01)
    return x * 2


def test_without_a_running_loop():
    assert run_coroutine(_answer(21)) == 42


def test_inside_a_running_loop_as_a_kernel_runs_a_cell():
    async def cell():
        refused = _answer(1)
        with pytest.raises(RuntimeError, match="running event loop"):  # what asyncio.run says there
            asyncio.run(refused)
        refused.close()
        return run_coroutine(_answer(21))

    assert asyncio.run(cell()) == 42


def test_its_exception_reaches_the_caller_inside_a_running_loop():
    async def fails():
        raise ValueError("num_requests must be a positive integer, got 0")

    async def cell():
        return run_coroutine(fails())

    with pytest.raises(ValueError, match="num_requests"):
        asyncio.run(cell())


def test_an_interrupt_cancels_the_coroutine_and_reaches_the_caller():
    """The kernel's stop button is SIGINT in the main thread: the wait ends with
    KeyboardInterrupt, and the coroutine, on its worker thread, is cancelled (its cleanup runs)."""
    seen = {}
    started = threading.Event()

    async def slow():
        started.set()
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    async def cell():
        return run_coroutine(slow())

    # A loop of its own, as ipykernel's: asyncio.run would turn SIGINT into cancelling `cell`
    # instead of raising KeyboardInterrupt in the waiting thread, as the kernel does.
    # SIGINT as a kernel handles it (Python's own handler), whatever the test runner was started
    # with: a shell's background job (`cmd &`) starts with SIGINT ignored, and a Python started
    # so keeps it ignored, so no KeyboardInterrupt would ever come (the sleep ran its 600 s).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    loop = asyncio.new_event_loop()
    timer = threading.Thread(target=lambda: (started.wait(), os.kill(os.getpid(), signal.SIGINT)))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(cell())
    finally:
        timer.join()
        loop.close()
        signal.signal(signal.SIGINT, before)
    assert seen == {"cancelled": True}
