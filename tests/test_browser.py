"""The quickstart in a real browser: JupyterLab on localhost, headless Chromium driven by
Playwright runs all cells and then uses the control panel as a person would:

- the panel shows the KV format `%kvcache int8` chose before it was opened;
- a panel run before it was displayed draws its peak line flat at the measured triad;
- `%kvcache fp16` typed after the panel moves its toggle, and Run then uses fp16;
- the figure's per-layer decode latency is exactly the run's, counted again from its raw step records;
- Export JSON writes the runs;
- after a page reload the figures still draw, and a new Run updates them;
- the panel's text box shows each run's text (it was empty after every other run);
- %kv_quality, %profile and a %serve_bench sweep draw their figures, and so does the panel's
  Serve-bench button;
- Run All and save leave `git status` clean (the notebook filter and the server's post-save
  hook, checkpoints ignored);
- the saved file holds the panel's static figures (the HTML fallback of its widget view);
- the panel's runs are in `%report`, and in a narrow (split) view its figures' titles do not collide.

Screenshots of each state land under results/screenshots/.

Needs Debian's chromium (/usr/bin/chromium) and the playwright and jupyterlab packages;
.ci/run installs them. Outside CI the test is skipped when they are missing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
import urllib.request
from pathlib import Path

import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS, require_browser

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "results" / "screenshots"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    pytest.importorskip("nbformat")
    require_browser()
    pytest.importorskip("jupyterlab")
    import nbformat

    work = tmp_path_factory.mktemp("lab")
    nb = nbformat.read(ROOT / "notebooks" / "01-quickstart.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source = 'MODEL = "smollm2-135m"\nNEW_TOKENS = 6\nABLATE_PROMPT_LEN = "24"\nABLATE_NEW_TOKENS = 3'
    # The magics that draw figures, as a user types them (each drew nothing in JupyterLab once).
    for source in ("%kv_quality --formats fp32,int8 --context 96 --steps 8",
                   "%profile --rate 100 wb_model.generate('The capital of France is', max_new_tokens=4)",
                   "%serve start --slots 2 --max-len 256",
                   "%serve_bench --rate 20,40 --num-requests 3 --prompt-tokens 8 --max-tokens 3",
                   "%serve stop"):
        nb.cells.append(nbformat.v4.new_code_cell(source))
    # A panel run before it is displayed (its figures must arrive whole, the peak flat).
    nb.cells.append(nbformat.v4.new_code_cell(
        "q = wb.panel()\nq.new_tokens.value, q.warmup.value = 4, False\nq.run()\nq"))
    nbformat.write(nb, work / "quickstart.ipynb")
    # A repository as a user's clone has it: the notebook committed through the project's
    # filter (scripts/bootstrap sets it up), the project's .gitignore.
    git = ["git", "-C", str(work), "-c", "user.name=test", "-c", "user.email=test@localhost"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "config", "filter.strip-notebook-outputs.clean",
                    f"{sys.executable} {ROOT / 'scripts' / 'strip_notebook_outputs.py'}"], check=True)
    for name in (".gitattributes", ".gitignore"):
        (work / name).write_text((ROOT / name).read_text())
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "the notebook as stored"], check=True)
    # JupyterLab 4 renders only the cells near the viewport (its windowing modes); the checks
    # below read outputs anywhere in the notebook, so every cell is rendered (a user setting
    # in a folder of the test's own).
    settings = tmp_path_factory.mktemp("lab-settings")
    (settings / "@jupyterlab" / "notebook-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), "workbench-test"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--allow-root",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings)})
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
    yield url, token, work
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


# The figures are plotly divs in output areas, three per panel; the quickstart's first panel
# owns plots 0-2 and the panel run before display (the last cell) the last three.
FIGURES = "document.querySelectorAll('.jp-OutputArea .js-plotly-plot')"


def _figure(page, index: int) -> dict:
    """data and layout of the index-th plotly figure on the page (negative: from the end)."""
    return page.evaluate(f"""(i) => {{ const p = Array.from({FIGURES}); const d = p[i < 0 ? p.length + i : i];
        return d ? {{data: d.data, shapes: (d.layout.shapes || [])}} : null; }}""", index)


def _kernel(page, code: str) -> str:
    """Run code in the notebook's kernel (as typing it in a cell would) and return its stdout."""
    return page.evaluate("""async (code) => {
        const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
        let out = '';
        const future = kernel.requestExecute({code});
        future.onIOPub = (msg) => { if (msg.header.msg_type === 'stream') out += msg.content.text; };
        await future.done;
        return out; }""", code)


# The cell whose code contains a text: its output's plotly figures and its text.
_CELL_JS = """(marker) => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell'))
    .find(c => (c.querySelector('.jp-InputArea-editor') || {}).innerText?.includes(marker))"""


def _cell_figures(page, marker: str) -> int:
    return page.evaluate(f"(m) => ({_CELL_JS})(m).querySelectorAll('.jp-OutputArea .js-plotly-plot').length", marker)


def _cell_output_text(page, marker: str) -> str:
    return page.evaluate(f"(m) => ({_CELL_JS})(m).querySelector('.jp-OutputArea').innerText", marker)


def _text_box(page) -> str:
    """What the first panel's text box (its bordered Output widget) shows."""
    return page.evaluate(f"""() => Array.from(({_CELL_JS})('p = wb.panel()')
        .querySelectorAll('.widget-output')).map(e => e.innerText).join('\\n')""")


def _run_panel(page) -> None:
    """Click the first panel's Run and wait until its bandwidth figure shows a new run."""
    before = json.dumps(_figure(page, 1)["data"])
    run_button = page.locator(".jp-OutputArea button", has_text="Run").first
    run_button.scroll_into_view_if_needed()
    run_button.click()
    page.wait_for_function(f"""(before) => {{ const d = {FIGURES}[1];
        return d && JSON.stringify(d.data) !== before; }}""", arg=before)


# Every widget model the notebook's outputs show, with the models they hold (a Box's children,
# an Output widget's displayed views), that the kernel no longer has.
_MISSING_MODELS = """
from ipywidgets.widgets.widget import _instances
import json
def _held(w):
    for c in getattr(w, "children", ()) or ():
        yield c.model_id
    for o in getattr(w, "outputs", ()) or ():
        v = o.get("data", {}).get("application/vnd.jupyter.widget-view+json")
        if v:
            yield v["model_id"]
seen, todo = set(), list(json.loads(%r))
while todo:
    m = todo.pop()
    if m not in seen:
        seen.add(m)
        todo.extend(_held(_instances[m]) if m in _instances else [])
print(json.dumps(sorted(m for m in seen if m not in _instances)))
"""
_SHOWN_MODELS_JS = """() => window.jupyterapp.shell.currentWidget.content.model.cells.toJSON()
    .flatMap(c => c.outputs || []).map(o => (o.data || {})['application/vnd.jupyter.widget-view+json'])
    .filter(v => v).map(v => v.model_id)"""


def _wait_for_figures(page, condition: str, what: str, errors: list[str], reopen=None) -> None:
    """Wait for `condition` on the figures after the notebook is reopened. A reopen draws them
    in seconds; if they have not come back after 3 minutes, fail with what the page holds (each
    figure's traces and points, how many widget views and Output widgets it drew and which
    failed, the browser console's errors, the kernel's status, a screenshot) rather than wait
    out the 10-minute hang guard with nothing to show for it.

    One case is the frontend's, not ours: views that say "model not found" while the kernel
    still holds every model the outputs show (and the models those hold). JupyterLab's widget
    manager then failed to fetch state the kernel has; reopening fetches it again, as a user
    would reload. `reopen` does that once, with a warning naming what happened; a model the
    kernel really lost fails at once, and so does a second miss."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(condition, timeout=180_000)
    except PlaywrightTimeout:
        shown = page.evaluate(_SHOWN_MODELS_JS)
        missing = json.loads(_kernel(page, _MISSING_MODELS % json.dumps(shown)))
        if reopen is not None and not missing and any("widget model not found" in e for e in errors):
            warnings.warn(f"{what}: the widget manager did not fetch {len(shown)} shown models' state the kernel "
                          f"holds ('widget model not found'); reopened once")
            reopen()
            return _wait_for_figures(page, condition, what + " (reopened)", errors)
        shot = SHOTS / f"timeout-{what.replace(' ', '-')}.png"
        page.screenshot(path=str(shot), full_page=True)
        figures = page.evaluate(f"() => Array.from({FIGURES}).map(d => (d.data || []).map(t => (t.y || []).length))")
        kernel = page.evaluate("() => window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status")
        views = page.evaluate("""() => ({views: document.querySelectorAll('.jp-OutputArea .jupyter-widgets').length,
            outputs: document.querySelectorAll('.jp-OutputArea .widget-output').length,
            failed: Array.from(document.querySelectorAll('.jp-OutputArea .jupyter-widgets'))
                .filter(e => e.innerText.includes('Error displaying widget')).length,
            placeholders: Array.from(document.querySelectorAll('.jp-OutputArea-output'))
                .filter(e => e.innerText.includes('Loading widget')).length})""")
        pytest.fail(f"{what}: the figures did not come back in 3 minutes; points per trace of each figure: "
                    f"{figures}; widget views {views}; kernel {kernel}; models shown that the kernel lost: "
                    f"{missing}; console errors {errors[-5:]}; screenshot {shot}")


_ACTIVE_KV_JS = """() => { const boxes = document.querySelectorAll('.jp-OutputArea .widget-dropdown');
    const kv = Array.from(boxes).find(g => g.innerText.includes('KV cache'));
    const s = kv && kv.querySelector('select'); return s ? s.value : ''; }"""


def _active_kv(page) -> str:
    """The selected format of the first panel's KV-cache dropdown."""
    return page.evaluate(_ACTIVE_KV_JS)


def save(page) -> None:
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty")


def test_quickstart_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    url, token, work = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        # Every wait below is for a condition; the limit is a hang guard far beyond any run
        # (a missed condition fails here instead of holding CI), not a timing assertion.
        page.set_default_timeout(600_000)

        def open_notebook():
            page.goto(f"{url}/lab/tree/quickstart.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('notebook:run-all-cells')")
            page.wait_for_function("() => { const s = window.jupyterapp.shell.currentWidget?.sessionContext?.session;"
                                   " return s?.kernel?.status === 'idle'; }")  # the kernel has started

        open_notebook()
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        # The panel run before display (the last cell) is done when its figures are drawn.
        page.wait_for_function(f"() => {FIGURES}.length >= 6 && document.body.innerText.includes('micro-kernel')")
        page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'")
        assert page.locator(".jp-OutputArea .widget-toggle-buttons").count() >= 2  # two panels' attention toggles
        assert "Paris" in page.inner_text(".jp-Notebook")
        assert _active_kv(page) == "int8 (tile)"  # %kvcache int8 ran before the panel was opened
        page.screenshot(path=str(SHOTS / "quickstart-after-run-all.png"), full_page=False)

        # The panel run before it was displayed: its peak line is flat at the measured triad.
        early = _figure(page, -2)
        (peak,) = early["shapes"]
        assert peak["y0"] == peak["y1"] > 0 and peak["x0"] == 0 and peak["x1"] == 1  # across the whole plot
        assert len(early["data"][-1]["y"]) == 3  # 4 new tokens: 3 decode steps, all drawn
        triad = float(_kernel(page, "from workbench.kernels.peaks import measured_peaks; print(measured_peaks().triad_gbps)"))
        assert abs(peak["y0"] - triad) < 1e-6 * triad

        # %kvcache typed after the panel moves its toggle; Run uses it.
        assert "kv_cache = fp16" in _kernel(page, "%kvcache fp16")
        page.wait_for_function("() => (" + _ACTIVE_KV_JS + ")() === 'fp16'")
        prompt = "The capital of France is"
        page.locator(".jp-OutputArea textarea").first.fill(prompt)  # the panel's prompt box
        _run_panel(page)
        page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'")
        assert _kernel(page, "print(p.result.switches.kv_cache, p.prompt.value)").split() == ["fp16", *prompt.split()]
        assert "fp16 KV" in page.inner_text(".jp-Notebook")  # the summary names what ran
        # The panel's second run (the first was p.run() in a cell): its own text is in the box,
        # and stays once the browser and the kernel have exchanged what they had to.
        shown = _kernel(page, "print(p.result.text[0].strip().splitlines()[0])").strip()
        page.wait_for_function(f"(t) => ({_CELL_JS})('p = wb.panel()').innerText.includes(t)", arg=shown)
        _kernel(page, "print('round trip')")
        assert shown in _text_box(page) and "sequence 0 continues" in _text_box(page)

        # The magics' figures, drawn by JupyterLab's plotly renderer.
        for marker in ("%kv_quality", "%profile", "%serve_bench"):
            assert _cell_figures(page, marker) == 1, (marker, _cell_output_text(page, marker)[-1500:])
        assert "best per byte" in _cell_output_text(page, "%kv_quality")
        page.screenshot(path=str(SHOTS / "quickstart-after-fp16-run.png"), full_page=False)

        # The figure's per-layer decode ms are exactly the run's, counted independently from
        # its raw step records (seconds per part and layer, the median over steps of each):
        # a unit or aggregation slip would be a factor of 1000 or of the layer count. One bar
        # per layer in every part, and the parts lie inside the steps (a structural bound,
        # not a timing).
        def decode_ms(expr: str) -> float:
            return float(_kernel(page, f"print(sum(sum(r.values()) - r['layer'] for r in {expr}.per_layer()))"))

        expected = decode_ms("p.result.timings")
        deadline = time.monotonic() + 20  # a hang guard: the figure's update reaches the browser on its own clock
        while True:
            bars = [t for t in _figure(page, 0)["data"] if t.get("xaxis") == "x2" and t["type"] == "bar"]
            figure_ms = sum(sum(t["y"]) for t in bars)
            if abs(figure_ms - expected) < 1e-6 * expected or time.monotonic() > deadline:
                break
            page.wait_for_timeout(250)
        assert abs(figure_ms - expected) < 1e-6 * expected, (figure_ms, expected)
        raw = _kernel(page, "import statistics; st = p.result.timings.decode_steps; "
                            "print(len(st), len(st[0].parts_s['mlp']), "
                            "1e3 * sum(statistics.median(s.parts_s[k][i] for s in st) for k in st[0].parts_s "
                            "for i in range(len(st[0].parts_s[k]))), "
                            "1e3 * sum(s.total_s for s in st))").split()
        n_layers, raw_ms, step_ms = int(raw[1]), float(raw[2]), float(raw[3])
        assert int(raw[0]) > 0 and all(len(t["y"]) == n_layers for t in bars)
        assert abs(figure_ms - raw_ms) < 1e-6 * figure_ms and figure_ms <= step_ms

        # Saved after Run All and a panel run: git sees no change (outputs, execution counts,
        # widget state and the metadata JupyterLab adds are filtered; checkpoints are ignored),
        # `git status` lists nothing (the server's post-save hook recorded the new size in the
        # index), and the file on disk holds the panel's static figures of its last run.
        save(page)
        assert (work / ".ipynb_checkpoints").is_dir()  # JupyterLab made one; .gitignore must cover it
        diff = subprocess.run(["git", "-C", str(work), "diff"], capture_output=True, text=True, check=True).stdout
        assert diff == "", diff[:3000]
        status = subprocess.run(["git", "-C", str(work), "status", "--porcelain"], capture_output=True, text=True,
                                check=True).stdout
        assert status == "", status
        saved = json.loads((work / "quickstart.ipynb").read_text())
        static = [o["data"]["text/html"] for c in saved["cells"] for o in c.get("outputs", [])
                  if "application/vnd.jupyter.widget-view+json" in o.get("data", {}) and "text/html" in o["data"]]
        static = ["".join(h) if isinstance(h, list) else h for h in static]
        assert any("fp16, batch 1" in h and h.count("<svg") == 4 for h in static), [h[:200] for h in static]
        (SHOTS / "quickstart-static-figures.html").write_text(next(h for h in static if "fp16, batch 1" in h))

        # The panel's runs are in the session's report, each with the command that reproduces it.
        _kernel(page, "%report -o results/browser-report.html")
        entries = json.loads((work / "results" / "browser-report.json").read_text())["entries"]
        panel_runs = [e for e in entries if "p = wb.panel(model)" in (e.get("command") or "")]
        assert panel_runs and panel_runs[-1]["workload"]["kv_cache"] == "fp16"

        # Export the runs.
        page.locator(".jp-OutputArea button", has_text="Export JSON").first.click()
        page.wait_for_function("() => document.body.innerText.includes('wrote ') && document.body.innerText.includes('.json')")
        from workbench.cache import results_dir

        exported = sorted(results_dir().glob("panel-*.json"), key=lambda p: p.stat().st_mtime)
        assert exported and json.loads(exported[-1].read_text())["runs"][-1]["kv_cache"] == "fp16"
        assert not (work / "notebooks").exists() and not list(work.glob("panel-*"))  # not the kernel's folder

        # The panel's Serve-bench button: a server on the panel's model, loaded at two rates,
        # its table and latency-throughput figure in the panel (it failed in the kernel's loop).
        _kernel(page, "p.serve_rates.value, p.serve_requests.value, p.serve_concurrency.value = '20,40', 3, 2\n"
                      "p.prompt_len.value, p.new_tokens.value = 8, 3")
        panel_figures = _cell_figures(page, "p = wb.panel()")
        serve_button = page.locator(".jp-OutputArea button", has_text="Serve-bench").first
        serve_button.scroll_into_view_if_needed()
        serve_button.click()
        page.wait_for_function(f"""(n) => ({_CELL_JS})('p = wb.panel()')
            .querySelectorAll('.jp-OutputArea .js-plotly-plot').length > n""", arg=panel_figures)
        assert "TTFT" in _cell_output_text(page, "p = wb.panel()")
        assert "error" not in _kernel(page, "print(p.serve_output.outputs[0]['data']['text/plain'][:300])").lower()

        # Reload: the figures come back drawn, and a new run updates them.
        save(page)
        open_notebook()
        _wait_for_figures(page, f"() => {FIGURES}.length >= 6 && ({FIGURES}[1].data || []).some(t => (t.y || []).length)",
                          "after reload", errors, reopen=open_notebook)
        page.screenshot(path=str(SHOTS / "quickstart-after-reload.png"), full_page=False)
        _run_panel(page)
        shown = _kernel(page, "print(p.result.text[0].strip().splitlines()[0])").strip()
        page.wait_for_function(f"(t) => ({_CELL_JS})('p = wb.panel()').innerText.includes(t)", arg=shown)
        page.screenshot(path=str(SHOTS / "quickstart-after-reload-run.png"), full_page=False)

        # A narrow view (half a laptop screen, as in a split), opened that way: the latency figure
        # fits its output area, and its titles and legend do not overlap.
        save(page)
        page.set_viewport_size({"width": 640, "height": 1800})
        open_notebook()
        _wait_for_figures(page, f"() => {FIGURES}.length >= 6 && ({FIGURES}[0].data || []).some(t => (t.y || []).length)",
                          "narrow view", errors, reopen=open_notebook)
        fits = page.evaluate(f"""() => {{ const d = {FIGURES}[0], svg = d.querySelector('svg.main-svg');
            const area = d.closest('.jp-OutputArea-output');
            return [svg.getBoundingClientRect().width, area.getBoundingClientRect().width]; }}""")
        assert fits[0] <= fits[1] + 1, fits
        boxes = page.evaluate(f"""() => Array.from({FIGURES}[0].querySelectorAll(
                '.annotation-text, .gtitle, .legendtext, .xtitle, .x2title, .ytitle, .y2title'))
            .map(e => {{ const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom, e.textContent]; }})""")
        assert len(boxes) >= 9, boxes
        for i in range(3):  # every figure's title inside its figure
            title, svg = page.evaluate(f"""(i) => {{ const d = {FIGURES}[i];
                const b = (e) => {{ const r = e.getBoundingClientRect(); return [r.left, r.right]; }};
                return [b(d.querySelector('.gtitle')), b(d.querySelector('svg.main-svg'))]; }}""", i)
            assert svg[0] - 1 <= title[0] and title[1] <= svg[1] + 1, (i, title, svg)
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                apart = a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
                assert apart, (a, b)
        page.locator(".jp-OutputArea .js-plotly-plot").first.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "quickstart-narrow.png"), full_page=False)
        browser.close()
    state_errors = [e for e in errors if "Error setting state" in e or "out of bounds" in e]
    assert not state_errors, state_errors[:3]
