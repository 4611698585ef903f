"""The quickstart in a real browser: JupyterLab on localhost, headless Chromium driven by
Playwright runs all cells, checks that the control panel and the live figures rendered,
switches the KV-cache toggle to int8, runs again, checks a figure changed, and saves
screenshots under results/screenshots/.

Needs Debian's chromium (/usr/bin/chromium) and the playwright and jupyterlab packages;
.ci/run installs them. Outside CI the test is skipped when they are missing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = ROOT / "results" / "screenshots"


def _require(cond: bool, why: str) -> None:
    if not cond:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide this: {why}")
        pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    pytest.importorskip("nbformat")
    _require(Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        import jupyterlab  # noqa: F401
        import playwright  # noqa: F401
    except ImportError as e:
        _require(False, f"{e.name} is not installed")
    import nbformat

    work = tmp_path_factory.mktemp("lab")
    nb = nbformat.read(ROOT / "notebooks" / "01-quickstart.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source = 'MODEL = "smollm2-135m"\nNEW_TOKENS = 6\nABLATE_PROMPT_LEN = "24"\nABLATE_NEW_TOKENS = 3'
    nbformat.write(nb, work / "quickstart.ipynb")
    port, token = _free_port(), "workbench-test"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--allow-root",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    # Wait for the server's own readiness line (its URL); if the process exits first, fail
    # with its output. Afterwards a thread keeps draining the pipe so the server never
    # blocks on a full one.
    log = []
    for line in proc.stdout:
        log.append(line)
        if f"127.0.0.1:{port}/" in line:
            break
    else:
        pytest.fail(f"JupyterLab did not start:\n{''.join(log)[-3000:]}")
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    while True:  # it prints that line just before its event loop starts taking connections
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited:\n{''.join(log)[-3000:]}")
            time.sleep(0.2)
    yield url, token
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _bandwidth_trace(page) -> str:
    # plotly keeps each figure's data on its div; the bandwidth figure is the second of three.
    return page.evaluate("""() => {
        const plots = document.querySelectorAll('.jp-OutputArea .js-plotly-plot');
        return plots.length >= 2 ? JSON.stringify(plots[1].data[0].y || []) : '';
    }""")


def test_quickstart_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    url, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        # Every wait below is for a condition, with no time limit: the test checks what the
        # page does, not how fast (a hang is CI's to stop).
        page.set_default_timeout(0)
        page.goto(f"{url}/lab/tree/quickstart.ipynb?token={token}")
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('notebook:run-all-cells')")
        page.wait_for_function("() => { const s = window.jupyterapp.shell.currentWidget?.sessionContext?.session;"
                               " return s?.kernel?.status === 'idle'; }")  # the kernel has started
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        # The last cell (%workbench) prints the measured peaks: wait for it.
        page.wait_for_function("() => document.body.innerText.includes('triad') && "
                               "document.body.innerText.includes('micro-kernel')")
        page.wait_for_function("() => document.querySelectorAll('.jp-OutputArea .js-plotly-plot').length >= 3")
        assert page.locator(".jp-OutputArea .widget-toggle-buttons").count() >= 2  # attention + KV toggles
        assert "Paris" in page.inner_text(".jp-Notebook")
        panel_button = page.locator(".jp-OutputArea button", has_text="Run").first
        panel_button.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "quickstart-after-run-all.png"), full_page=False)
        before = _bandwidth_trace(page)
        assert before not in ("", "[]")

        page.locator(".jp-OutputArea .widget-toggle-buttons button", has_text="int8").first.click()
        panel_button.click()
        # Done when the bandwidth figure holds a full new run: one point per decode step (5),
        # different from the fp32 run's.
        page.wait_for_function("(before) => { const plots = document.querySelectorAll('.jp-OutputArea .js-plotly-plot');"
                               " const y = plots.length >= 2 ? (plots[1].data[0].y || []) : [];"
                               " return y.length >= 5 && JSON.stringify(y) !== before; }",
                               arg=before)
        page.wait_for_function("() => document.body.innerText.includes('Idle')")
        page.screenshot(path=str(SHOTS / "quickstart-after-int8-run.png"), full_page=False)
        after = _bandwidth_trace(page)
        assert after != before
        json.loads(after)
        browser.close()
