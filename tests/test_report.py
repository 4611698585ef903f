"""Reports as a user shares them: the JSON validates against its schema, the HTML page opens
offline in a real browser (no network request, the figures drawn), every user string is
escaped, and %report writes what the session measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS, require_browser

import workbench as wb
from workbench import report
from workbench.analysis.ablation import run_ablation

HOSTILE = "<script>alert('pwned')</script>"
SCHEMA = json.loads((Path(report.__file__).parent / "schema.json").read_text())


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    model = wb.load_model("smollm2-135m")
    report.clear()
    prompt = f"The capital of France is {HOSTILE}"
    out = model.generate(prompt, max_new_tokens=6, stop_at_eos=False)
    report.record(out, model, command="workbench generate 'The capital of France is' --max-new-tokens 6", prompt=prompt)
    report.record(run_ablation(model, ["slim", "naive"], ["int8", "fp32"], prompt_lens=[16], new_tokens=3), model)
    paths = report.write(tmp_path_factory.mktemp("report") / "r.html", title=f"Report {HOSTILE}")
    report.clear()
    return paths


def test_json_validates_and_holds_the_measurements(written):
    jsonschema = pytest.importorskip("jsonschema")
    data = json.loads(written["json"].read_text())
    jsonschema.validate(data, SCHEMA)
    gen, abl = data["entries"]
    steps = gen["decode_step_ms"]
    assert len(steps["samples"]) == 5 and steps["min"] <= steps["median"] <= steps["p90"] <= steps["max"]
    assert gen["model"]["sha256"] and len(gen["model"]["sha256"]) == 64  # the bundled GGUF file, hashed
    assert len(gen["per_layer_ms"]["decode"]) == 30 and len(abl["rows"]) == 4
    assert data["machine"]["peaks"]["triad_gbps"] > 0 and data["software"]["git"]["commit"]
    assert data["reproduce"] == ["workbench generate 'The capital of France is' --max-new-tokens 6"]


def test_user_strings_are_escaped(written):
    page = written["html"].read_text()
    assert HOSTILE not in page and "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;" in page
    assert "<script src" not in page and "<link" not in page  # nothing fetched: plotly's JS is inline


def test_report_opens_offline_in_a_browser(written):
    require_browser()
    from playwright.sync_api import sync_playwright

    requests = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.set_default_timeout(0)

        def block(route):
            if not route.request.url.startswith("file://"):
                requests.append(route.request.url)
                route.abort()
            else:
                route.continue_()

        page.route("**/*", block)
        dialogs = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(written["html"].as_uri())
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 2")  # roofline, latency
        roofline = page.evaluate("() => document.getElementById('fig-roofline').data[1].x.length")
        assert roofline == 1 + 4  # the generation and the four ablation rows, each a point
        assert HOSTILE in page.inner_text("h1")  # shown as text
        browser.close()
    assert requests == [] and dialogs == []  # no network, and the hostile script never ran


def test_report_magic_writes_the_session(tmp_path, capsys):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "workbench")
    report.clear()
    r = sh.run_cell(f"%report -o {tmp_path / 'empty.html'}")
    assert isinstance(r.error_in_exec, UsageError) and "nothing measured yet" in str(r.error_in_exec)
    sh.run_cell("%load_model smollm2-135m")
    sh.run_cell("%generate -n 3 Hello")
    capsys.readouterr()
    r = sh.run_cell(f"%report --title Session -o {tmp_path / 'session.html'}")
    assert r.error_in_exec is None
    assert "1 measurements (1 generation)" in capsys.readouterr().out
    data = json.loads((tmp_path / "session.json").read_text())
    assert data["reproduce"] == ["%load_ext workbench\n%load_model smollm2-135m\n%generate -n 3 Hello"]
    report.clear()
