"""Reports as a user shares them: the JSON validates against its schema, the HTML page opens
offline in a real browser (no network request, the figures drawn), every user string is
escaped, and %report writes what the session measured."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def offline_page(path: Path):
    """Chromium with every request that is not for a file aborted: yields (page, requests
    that were attempted, dialogs that opened), the page loaded from `path`."""
    require_browser()
    from playwright.sync_api import sync_playwright

    requests, dialogs = [], []
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
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(path.as_uri())
        try:
            yield page, requests, dialogs
        finally:
            browser.close()


def test_report_opens_offline_in_a_browser(written):
    with offline_page(written["html"]) as (page, requests, dialogs):
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 2")  # roofline, latency
        roofline = page.evaluate("() => document.getElementById('fig-roofline').data[1].x.length")
        assert roofline == 1 + 4  # the generation and the four ablation rows, each a point
        assert HOSTILE in page.inner_text("h1")  # shown as text
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
    threads = __import__("torch").get_num_threads()
    model = sh.user_ns["wb_model"]  # its switches as this session left them (earlier tests may have moved them)
    kv = f"%kvcache {model.kv_cache}" + (f" --kernel {model.switches.kv_text.split('(')[1][:-1]}"
                                         if "(" in model.switches.kv_text else "")
    assert data["reproduce"] == [f"%load_ext workbench\n%load_model smollm2-135m\n%attention {model.attention}\n"
                                 f"{kv}\n%threads {threads}\n%generate -n 3 Hello"]
    report.clear()


def test_reproduce_commands_reproduce_the_switches(tmp_path, capsys):
    """After %attention flash and %kvcache int8 --kernel dot, a %generate's Reproduce commands, run as
    written, measure the same configuration (they used to set only the load and the
    generation, so they measured the defaults)."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "workbench")
    report.clear()
    for line in ("%load_model smollm2-135m", "%attention flash", "%kvcache int8 --kernel dot", "%generate -n 3 Hello"):
        assert sh.run_cell(line).error_in_exec is None
    first = report.recorded()[-1]
    (command,) = [e["command"] for e in report.recorded()]
    sh.run_cell("%attention slim")
    sh.run_cell("%kvcache fp32")  # the session moves on; the commands alone must set it back
    report.clear()
    for line in command.splitlines():
        assert sh.run_cell(line).error_in_exec is None, line
    again = report.recorded()[-1]
    keys = ("attention", "kv_cache", "kv_kernel", "step", "threads", "prompt_tokens", "new_tokens", "sampling",
            "gemm_engine", "prompt_sha256")
    assert {k: again["workload"][k] for k in keys} == {k: first["workload"][k] for k in keys}
    assert (first["workload"]["attention"], first["workload"]["kv_cache"], first["workload"]["kv_kernel"]) == \
        ("flash", "int8", "dot")
    report.clear()
    capsys.readouterr()


def _one_run_report(model, title: str, **kw) -> dict:
    report.clear()
    out = model.generate("The capital of France is", max_new_tokens=24, stop_at_eos=False, **kw)
    report.record(out, model, command="test")
    data = report.build(title=title)
    report.clear()
    return data


def test_compare_says_within_noise_for_overlapping_ranges_and_names_a_regression(tmp_path):
    import copy
    import subprocess
    import sys

    from workbench.report.compare import compare, format_compare

    model = wb.load_model("smollm2-135m")
    model.generate("warm up", max_new_tokens=4)
    a = _one_run_report(model, "A")

    def scaled(report: dict, factor: float) -> dict:
        """The same run with every decode step `factor` times as long (no second timing: what
        two real runs measure is a benchmark's business, not a test's)."""
        out = copy.deepcopy(report)
        s = out["entries"][0]["decode_step_ms"]
        s["samples"] = [factor * x for x in s["samples"]]
        for k in ("median", "min", "max", "p90"):
            s[k] *= factor
        return out

    steps = a["entries"][0]["decode_step_ms"]
    # slower by less than the run's own spread (min * f <= max): the ranges overlap
    b = scaled(a, (1 + steps["max"] / steps["min"]) / 2)
    decode = next(r for r in compare(a, b) if r["measurement"].endswith("decode ms per step"))
    assert decode["verdict"] == "within noise"
    slow = scaled(a, 2 * steps["max"] / steps["min"])  # every step slower than the slowest one of A
    rows = compare(a, slow)
    decode = next(r for r in rows if r["measurement"].endswith("decode ms per step"))
    assert decode["verdict"] == "regression" and decode["ratio_b_over_a"] == pytest.approx(2 * steps["max"] / steps["min"])
    assert "regressions: generation smollm2-135m slim/fp32" in format_compare(rows, a, slow)
    # the command, as a user runs it
    for name, data in (("a", a), ("b", b), ("slow", slow)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data, default=str))
    cli = [sys.executable, "-m", "workbench.cli", "compare"]
    ok = subprocess.run([*cli, str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--fail-on-regression"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "within noise" in ok.stdout, ok.stderr
    bad = subprocess.run([*cli, str(tmp_path / "a.json"), str(tmp_path / "slow.json"), "-o",
                          str(tmp_path / "diff.html"), "--fail-on-regression"], capture_output=True, text=True)
    assert bad.returncode == 1 and "regression" in bad.stdout
    assert "regression" in (tmp_path / "diff.html").read_text()
    junk = subprocess.run([*cli, str(tmp_path / "a.json"), str(tmp_path / "nope.json")], capture_output=True, text=True)
    assert junk.returncode == 2 and "not a readable report JSON" in junk.stderr and "Traceback" not in junk.stderr


def test_workbench_report_merges_earlier_results_without_rerunning(tmp_path, written):
    import subprocess
    import sys

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"command": "python bench/linear.py", "rows": [{"shape": "576x576", "gbps": 20.5}]}))
    out = tmp_path / "merged.html"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "report", str(written["json"]), str(bench), "-o",
                        str(out), "--title", "merged"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.with_suffix(".json").read_text())
    assert [e["kind"] for e in data["entries"]] == ["generation", "ablation", "benchmark"]
    assert data["entries"][2]["rows"] == [{"shape": "576x576", "gbps": 20.5}]
    assert "python bench/linear.py" in data["reproduce"]
    pytest.importorskip("jsonschema").validate(data, SCHEMA)


def test_report_holds_the_cost_model_per_part(written):
    gen = json.loads(written["json"].read_text())["entries"][0]
    parts = gen["predicted"]["parts"]
    assert {r["part"] for r in parts} >= {"attention", "mlp", "other", "head", "step"}
    assert all(set(r) >= {"predicted_ms", "measured_ms", "ratio", "bound", "why"} for r in parts)
    assert len(gen["predicted"]["per_layer_ms"]["decode"]) == 30
    page = written["html"].read_text()
    assert "Cost model: predicted vs measured per part" in page and "roofline prediction" in page


def test_the_demos_report_opens_offline_and_validates(tmp_path):
    """The README's main job: `workbench demo` writes a report; Chromium opens it from the file
    with every non-file request blocked, and the figures draw."""
    import subprocess
    import sys

    out = tmp_path / "demo.json"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "demo", "--short-tokens", "8", "--long-tokens", "32",
                        "--new-tokens", "4", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "demo-report.json").read_text())
    pytest.importorskip("jsonschema").validate(data, SCHEMA)
    assert [e["kind"] for e in data["entries"]] == ["ablation", "generation"]
    with offline_page(tmp_path / "demo-report.html") as (page, requests, _):
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 2")
        drawn = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].map(d => d.id)")
        points = page.evaluate("() => document.getElementById('fig-roofline').data[1].x.length")
    assert "fig-roofline" in drawn and "fig-latency-1" in drawn
    from workbench.model.kv_formats import KERNEL_FORMATS, kernel_configs

    caches = kernel_configs(KERNEL_FORMATS, "all")  # the demo reads int8 with each of its kernels
    assert points == 2 * 4 * len(caches) + 1  # every ablation row and the generation
    assert requests == []


def test_wb_report_is_callable_and_draws_bandwidth_per_step(tmp_path):
    model = wb.load_model("smollm2-135m")
    report.clear()
    report.record(model.generate("Hello", max_new_tokens=5, stop_at_eos=False), model, command="test")
    paths = wb.report(tmp_path / "call.html", title="called")  # wb.report(...) is wb.report.write(...)
    report.clear()
    page = paths["html"].read_text()
    assert paths["entries"] == 1 and "fig-bandwidth-0" in page and "bandwidth per decode step" in page


def test_machine_and_software_tables_read_as_text(written):
    """The Machine and Software sections show "name: value" pairs, not JSON dicts."""
    page = written["html"].read_text()
    machine = page.split("<h2>Machine</h2>", 1)[1].split("<h2>", 1)[0]
    software = page.split("<h2>Software</h2>", 1)[1].split("<h2>", 1)[0]
    for section in (machine, software):
        assert "{&quot;" not in section and '{"' not in section and "[&quot;" not in section, section[:400]
    assert "triad" in machine
