import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

import background
from workbench.kernels import KernelSet, runnable_variants
from workbench.kernels._build import emulation_runs_here

# Hypothesis: no per-example deadline (the scalar build and the float64 references are
# slow by design); the example count is a profile so CI and a developer can differ.
settings.register_profile(
    "default",
    max_examples=int(os.environ.get("WORKBENCH_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")

# The processes the tests start (IPython, Jupyter kernels, engines) run this environment's
# Python, and IPython adds $VIRTUAL_ENV's packages to its path: a shell that had activated
# another checkout's environment gave them that checkout's workbench (its sources, built into
# this run's cache). They get this environment, whichever one the shell had activated.
if sys.prefix != sys.base_prefix:
    os.environ["VIRTUAL_ENV"] = sys.prefix
else:
    os.environ.pop("VIRTUAL_ENV", None)


def pytest_generate_tests(metafunc):
    """Tests of the kernel API (the `kernels` fixture) run on every distinct build this host
    can execute: native, avx2 (where it differs from native) and scalar. A module that sets
    ALSO_EMULATED = True (the kernels' tests) runs on the "emulated" build too, where the
    code an AMX host runs (the AVX-512 path, VNNI, the AMX and AVX512-BF16 engines) runs with
    those instructions written out in C++ (kernels/emulate_isa.h): on a CPU without them, the
    only way that code runs at all."""
    if "kernels" in metafunc.fixturenames:
        variants = runnable_variants()
        if getattr(metafunc.module, "ALSO_EMULATED", False) and emulation_runs_here():
            variants = [*variants, "emulated"]
        metafunc.parametrize("kernels", variants, indirect=True, scope="session")


@pytest.fixture(scope="session")
def kernels(request) -> KernelSet:
    """The kernel API on one build (pytest_generate_tests says which)."""
    ks = KernelSet(request.param)
    if request.param != "native":
        background.result(_build_variants)  # usually compiled by now, in the background
    ks.ext  # build (or load) now, outside any hypothesis example
    return ks


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """README's main job, `workbench demo`, run once at small sizes as a user runs it (a real
    process) for the tests that read what it prints and writes: (the finished process, its
    output folder holding demo.json, demo-report.json and demo-report.html)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("demo")
    # two measured runs per row (a median and a min-max, as with the default three), so the
    # fixture's real process costs a quarter less; the model's first 6 layers (its real
    # weights): what the tests read is the grid, the columns and the report, not the depth
    done = subprocess.run([sys.executable, "-m", "workbench.cli", "demo", "--layers", "6",
                           "--short-tokens", "8", "--long-tokens", "40",
                           "--new-tokens", "4", "--repeats", "2", "--out", str(out / "demo.json")],
                          capture_output=True, text=True)
    return done, out


@pytest.fixture
def magic(capsys):
    """A real IPython shell with the workbench extension: magic(line) runs a cell as a user
    types it and returns (what it printed, its error or None)."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "workbench")

    def run(line: str):
        r = sh.run_cell(line)
        return capsys.readouterr().out, r.error_in_exec or r.error_before_exec

    run.shell = sh
    return run


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- a real browser (Debian's chromium driven by Playwright), shared by the browser tests ----

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root, without a GPU, on a machine whose only network is the package registries.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def require_browser() -> None:
    """Skip without Chromium and Playwright, except in CI, which must provide them."""
    def need(cond: bool, why: str) -> None:
        if not cond:
            if os.environ.get("CI"):
                pytest.fail(f"CI must provide this: {why}")
            pytest.skip(why)

    need(Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        need(False, "playwright is not installed")


# The modules that start processes, clusters, kernels of Jupyter, a browser or a fresh
# environment: `pytest tests -m "not slow"` is the quick loop while working (README's test
# command and CI run everything).
SLOW_MODULES = {"test_distributed", "test_distributed_lifecycle", "test_distributed_netns", "test_notebooks", "test_browser", "test_install",
                "test_magics_in_a_kernel",
                "test_peers", "test_profile"}


@pytest.hookimpl(trylast=True)  # after pytest has grouped the items by their fixtures' parameters
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    # The tests on the avx2 and scalar builds go last (each build's tests still together):
    # those builds compile in the background meanwhile (below), so no test waits for them.
    other_builds = [item for item in items
                    if getattr(item, "callspec", None) and item.callspec.params.get("kernels", "native") != "native"]
    if other_builds:
        moved = set(map(id, other_builds))
        items[:] = [item for item in items if id(item) not in moved] + other_builds


# -- builds needed later, started in the background when collection ends (tests/background.py)

_variants_needed: list[str] = []


def _build_variants():
    background.build_variants(_variants_needed)


def pytest_collection_finish(session):
    params = [item.callspec.params for item in session.items if hasattr(item, "callspec")]
    _variants_needed[:] = sorted({p["kernels"] for p in params if p.get("kernels", "native") != "native"})
    # One job at a time, in the order the tests need them: the modules' preparations (in
    # the order the modules run), then the builds whose tests run last.
    modules = list(dict.fromkeys(item.module for item in session.items))
    for module in modules:
        prepare = getattr(module, "prepare_in_background", None)
        if prepare is not None:
            background.start(prepare)
    if _variants_needed:
        background.start(_build_variants)


# Every process a test starts inherits this mark, so the session can tell at its end whether
# any is still running: a process left behind (an engine's nanny once was, in CI) fails the run.
SESSION_MARK = "WORKBENCH_TEST_SESSION"
os.environ[SESSION_MARK] = str(os.getpid())
LEFTOVER_GRACE_S = 20.0  # for processes a test has just stopped to finish exiting


def _marked_processes() -> dict[int, str]:
    """pid -> command line of every live process (not this one) carrying this session's mark."""
    from workbench.distributed.watchdog import cmdline, marked_processes

    return {pid: cmdline(pid) for pid in marked_processes(str(os.getpid()), SESSION_MARK)}


# What was in /dev/shm before the suite ran: whatever is there at its end and was not, and
# is not a live process's of someone else, the suite left behind (each shm segment holds its
# size in RAM, and CI runs the suite again and again on the same machine).
SHM = Path("/dev/shm")
_shm_before = {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def _shm_owner(name: str) -> int | None:
    """The pid a /dev/shm name carries: ours (workbench-<pid>-...), libfabric's (<pid>:n:m)."""
    import re

    m = re.match(r"workbench-(\d+)-|(\d+):", name)
    return int(m.group(1) or m.group(2)) if m else None


def _shm_left() -> list[str]:
    from workbench.distributed.watchdog import alive

    def someone_elses(name: str) -> bool:  # a live process's that this session did not start
        owner = _shm_owner(name)
        return owner is not None and owner != os.getpid() and alive(owner) and owner not in _marked_processes()

    return sorted(p.name for p in SHM.iterdir() if p.name not in _shm_before and not someone_elses(p.name)) \
        if SHM.is_dir() else []


def pytest_sessionfinish(session, exitstatus):
    background.stop()
    if not sys.platform.startswith("linux"):
        return
    import signal
    import time

    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = _marked_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _marked_processes()
    if left:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        listing = "\n".join(f"  {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items()))
        sys.stderr.write(f"\nthe run fails: processes started by the tests were still running "
                         f"{LEFTOVER_GRACE_S:.0f} s after the last test (killed now):\n{listing}\n")
        session.exitstatus = 1
    left = _shm_left()
    if left:
        sizes = "\n".join(f"  {SHM / name}: {(SHM / name).stat().st_size / 2**20:.0f} MiB" for name in left
                          if (SHM / name).exists())
        sys.stderr.write(f"\nthe run fails: the tests left files in /dev/shm (removed now):\n{sizes}\n")
        for name in left:
            (SHM / name).unlink(missing_ok=True)
        session.exitstatus = 1
