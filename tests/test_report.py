"""Reports as a user shares them: the JSON validates against its schema, the HTML page opens
offline in a real browser (no network request, the figures drawn), every user string is
escaped, the page leads with what was found in words that respect the spread, its tables
speak labels rather than JSON keys, and %report writes what the session measured."""

from __future__ import annotations

import contextlib
import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import CHROMIUM, CHROMIUM_ARGS, require_browser

import workbench as wb
from workbench import report
from workbench.analysis.ablation import run_ablation
from workbench.analysis.tp_savings import switch_savings

HOSTILE = "<script>alert('pwned')</script>"
SCHEMA = json.loads((Path(report.__file__).parent / "schema.json").read_text())
# a prompt long enough to be folded on the page (the demo's is a thousand tokens)
LONG = ("Paris is the capital and largest city of France. It lies on the Seine, in the north of the country, "
        "at the heart of the Ile-de-France region. The city has been a centre of finance, diplomacy, commerce, "
        "fashion and science for centuries. The capital of France is")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    model = wb.load_model("smollm2-135m")
    report.clear()
    prompt = f"The capital of France is {HOSTILE}. {LONG}"
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
        # the roofline, the latency, and a figure per switch the ablation varies
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 4")
        roofline = page.evaluate("() => document.getElementById('fig-roofline').data[1].x.length")
        assert roofline == 1 + 4  # the generation and the four ablation rows, each a point
        legend = page.evaluate("() => document.getElementById('fig-ablation-1-attention').data"
                               ".filter(t => t.showlegend).map(t => t.name)")
        assert legend == ["slim", "naive"]
        assert HOSTILE in page.inner_text("h1")  # shown as text
        assert page.inner_text("details summary").startswith("The capital of France is <script>")  # the prompt, folded
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


def test_an_ablations_reproduce_commands_reproduce_its_grid(capsys):
    """%ablate's recorded commands, run as written in a session whose switches and threads have
    moved on, measure the same grid: every row's configuration and the repeats per row."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "workbench")
    report.clear()
    for line in ("%load_model smollm2-135m", "%threads 1",
                 "%ablate --attention flash,slim --kvcache int8:dot,fp16 --prompt-len 12 --new-tokens 3 --repeats 2"):
        assert sh.run_cell(line).error_in_exec is None, line
    first = report.recorded()[-1]
    sh.run_cell("%threads 2")
    report.clear()
    for line in first["command"].splitlines():
        assert sh.run_cell(line).error_in_exec is None, line
    again = report.recorded()[-1]

    def grid(entry):
        return [{k: r[k] for k in ("attention", "kv_cache", "kv_kernel", "prompt_len", "batch", "new_tokens", "repeats")}
                for r in entry["rows"]]

    assert grid(again) == grid(first) and len(grid(first)) == 4
    assert ("int8", "dot") in {(r["kv_cache"], r["kv_kernel"]) for r in first["rows"]}
    assert "%threads 1" in first["command"]
    sh.run_cell("%threads 2")
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
    diff = (tmp_path / "diff.html").read_text()  # the verdict first, then the rows in labels and rounded figures
    assert diff.index("<h2>Verdict</h2>") < diff.index("<h2>Every measurement</h2>")
    verdict = _section(diff, "Verdict")
    assert "<b>1 regression</b>" in verdict and "decode ms per step of generation smollm2-135m" in verdict
    headers = [c[2] for t in _tables(diff) for r in t for c in r if c[0] == "th"]
    assert "B/A" in headers and not [h for h in headers if "_" in h]
    figures = [c[2] for t in _tables(diff) for r in t for c in r if c[1] == "num"]
    assert figures and not [f for f in figures if re.search(r"\.\d{3,}", f)], figures
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


def test_the_demos_report_opens_offline_and_validates(demo_run):
    """The README's main job: `workbench demo` writes a report (the run is conftest's, shared
    with test_cli); Chromium opens it from the file with every non-file request blocked, and
    the figures draw."""
    r, folder = demo_run
    assert r.returncode == 0, r.stderr
    data = json.loads((folder / "demo-report.json").read_text())
    pytest.importorskip("jsonschema").validate(data, SCHEMA)
    assert [e["kind"] for e in data["entries"]] == ["ablation", "generation"]
    with offline_page(folder / "demo-report.html") as (page, requests, _):
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 2")
        drawn = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].map(d => d.id)")
        points = page.evaluate("() => document.getElementById('fig-roofline').data[1].x.length")
    assert "fig-roofline" in drawn and "fig-latency-1" in drawn
    # the demo varies attention, the KV cache and the prompt length: a figure for each
    assert {"fig-ablation-0-attention", "fig-ablation-0-kv-cache", "fig-ablation-0-prompt-length"} <= set(drawn)
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


# -- the page as a reader meets it -------------------------------------------------------------


class _Tables(HTMLParser):
    """Every <table> of a page as rows of (tag, class, text) cells; nested tables apart."""

    def __init__(self):
        super().__init__()
        self.tables, self._stack, self._cell = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._stack.append([])
        elif tag == "tr" and self._stack:
            self._stack[-1].append([])
        elif tag in ("td", "th") and self._stack:
            self._cell = [tag, dict(attrs).get("class"), ""]

    def handle_endtag(self, tag):
        if tag == "table":
            self.tables.append(self._stack.pop())
        elif tag in ("td", "th") and self._cell and self._stack:
            self._stack[-1][-1].append(tuple(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[2] += data


def _tables(page: str) -> list[list[list[tuple]]]:
    parser = _Tables()
    parser.feed(page)
    return parser.tables


def _section(page: str, heading: str) -> str:
    return page.split(f"<h2>{heading}</h2>", 1)[1].split("<h2>", 1)[0]


def _significant(number: str) -> int:
    digits = number.replace(",", "").replace(".", "").lstrip("0")
    return len(digits)


def _figure_spec(page: str, fid: str) -> tuple[list, dict]:
    """A figure's data and layout as the page hands them to Plotly.newPlot."""
    call = f"Plotly.newPlot({json.dumps(fid)}, "
    start = page.index(call) + len(call)
    decoder = json.JSONDecoder()
    data, end = decoder.raw_decode(page, start)
    layout, _ = decoder.raw_decode(page, end + 2)
    return data, layout


def _grid_row(attention: str, kv: str, decode: float, prefill: float, spread: float = 0.05,
              repeats: int = 3) -> dict:
    """An ablation row as workbench.analysis.ablation makes it, min and max `spread` either side."""
    return {"attention": attention, "kv_cache": kv, "kv_kernel": "widen", "prompt_len": 16, "batch": 1,
            "new_tokens": 4, "prefill_ms": prefill, "decode_tokens_per_s": decode, "decode_gbps": 0.3 * decode,
            "pct_peak_bandwidth": 0.75 * decode, "decode_gflops": 0.15 * decode, "pct_peak_fma": 0.075 * decode,
            "top1_agreement": 1.0, "repeats": repeats, "prefill_ms_min": prefill * (1 - spread),
            "prefill_ms_max": prefill * (1 + spread), "decode_tokens_per_s_min": decode * (1 - spread),
            "decode_tokens_per_s_max": decode * (1 + spread)}


def _page_of(rows: list[dict], kind: str = "ablation") -> str:
    from workbench.report.render import html_page

    entry = {"kind": kind, "time": "now", "model": {"name": "m"}, "rows": rows, "command": None}
    return html_page({"schema_version": 1, "title": "t", "created": "now", "entries": [entry], "peak_rss_bytes": 0,
                      "machine": {"cpu_model": "a CPU", "threads_used": 1,
                                  "peaks": {"triad_gbps": 40.0, "fma_gflops": 200.0, "measured_at": "now", "how": "-"}},
                      "software": {}, "reproduce": []})


def _finding(page: str, switch: str) -> str:
    """The findings table's row for one switch, as text."""
    rows = [r for t in _tables(_section(page, "What was found")) for r in t if r and r[0][2] == switch]
    assert len(rows) == 1, switch
    return " ".join(c[2] for c in rows[0])


def test_findings_call_a_setting_faster_only_beyond_the_spread():
    """slim decodes twice as fast as naive, far beyond a 5% spread; fp16 and fp32 differ by 2%,
    inside it: the page names slim fastest with its ratio, and calls neither cache faster."""
    rows = [_grid_row("slim", "fp16", 100, 10), _grid_row("slim", "fp32", 98, 10.2),
            _grid_row("naive", "fp16", 50, 20), _grid_row("naive", "fp32", 49, 20.4)]
    page = _page_of(rows)
    assert page.index("<h2>What was found</h2>") < page.index("<h2>Measurements</h2>")
    attention, kv = _finding(page, "Attention"), _finding(page, "KV cache")
    # 100/50 in both matched pairs; the range: 95/52.5 to 105/47.5
    assert "slim is fastest" in attention and "2.00x as fast as naive (1.81–2.21)" in attention
    assert "faster beyond the run-to-run spread in all 2 matched pairs" in attention
    assert "is fastest" not in kv and "1.02x as fast as fp32" in kv and "within the run-to-run spread" in kv
    assert "fp16</b> has the fastest medians, but is not faster" in _section(page, "What was found")
    findings = _section(page, "What was found")
    assert "median (min–max) over 3 repeats" in findings
    assert "75% of the measured triad" in findings  # 0.3 x 100 GB/s against 40
    single = _page_of([_grid_row(a, "fp16", d, p, spread=0, repeats=1) for a, d, p in
                       (("slim", 100, 10), ("naive", 50, 20))])
    assert "is fastest" not in _finding(single, "Attention") and "no spread to judge" in _finding(single, "Attention")


def test_tensor_parallel_findings_give_the_ratio_to_one_process_from_its_rounds():
    """The fastest setting's time against the single process's is the per-round ratio the
    ablation recorded (vs_tp1), said with how it was paired, not recomputed from medians."""
    def tp_row(ranks, ms, vs=None, interleaved=True):
        row = {"ranks": ranks, "backend": "shm" if ranks > 1 else "-", "token_broadcast": "ids", "lm_head": "topk",
               "zero_copy": "on", "decode_ms_per_token": ms, "decode_ms_min": ms * 0.9, "decode_ms_max": ms * 1.1,
               "comm_ms_per_token": 0.5 if ranks > 1 else 0.0, "pct_comm": 4.0 if ranks > 1 else 0.0,
               "comm_bytes_per_token": 1000, "same_tokens_as_tp1": True, "repeats": 5}
        if vs:
            row.update(vs_tp1={"median": vs[0], "min": vs[1], "max": vs[2]}, tp1_interleaved=interleaved)
        return row

    findings = _section(_page_of([tp_row(1, 20.0), tp_row(2, 19.0, (0.93, 0.81, 1.07))], "tp_ablation"),
                        "What was found")
    assert "0.93x the single process's (0.81–1.07, in the same rounds)" in findings
    apart = _section(_page_of([tp_row(1, 20.0), tp_row(2, 19.0, (0.95, 0.78, 1.16), False)], "tp_ablation"),
                     "What was found")
    assert "0.95x the single process's (0.78–1.16, in runs apart" in apart


def test_tensor_parallel_findings_give_each_switch_its_saving_round_by_round():
    """Each switch's saving is the matched rows' difference round by round, with its spread and
    whether the rounds agree on its sign; a backend whose zero copy is n/a gets no zero-copy
    saving, and the page shows the savings as a table too."""
    def row(backend, tb, zc, by_round, sent):
        return {"ranks": 2, "backend": backend, "token_broadcast": tb, "lm_head": "topk", "zero_copy": zc,
                "decode_ms_per_token": sorted(by_round)[1], "decode_ms_min": min(by_round),
                "decode_ms_max": max(by_round), "decode_ms_by_round": by_round, "comm_ms_per_token": 0.5,
                "pct_comm": 4.0, "comm_bytes_per_token": sent, "allreduce_bytes_per_token": 138240,
                "same_tokens_as_tp1": True, "repeats": 3}

    rows = [{"ranks": 1, "backend": "-", "token_broadcast": "-", "lm_head": "-", "zero_copy": "-",
             "decode_ms_per_token": 20.0, "decode_ms_min": 19.0, "decode_ms_max": 21.0, "comm_ms_per_token": 0.0,
             "pct_comm": 0.0, "comm_bytes_per_token": 0, "same_tokens_as_tp1": True, "repeats": 3},
            # shm: zero copy on / off, token ids / embeddings (2 x 2 rows; embeddings send 2,304 bytes more)
            row("shm", "ids", "on", [20.0, 21.0, 22.0], 138_000),
            row("shm", "ids", "off", [20.5, 20.8, 22.6], 138_000),
            row("shm", "embeddings", "on", [21.0, 22.0, 23.0], 140_304),
            row("shm", "embeddings", "off", [21.5, 21.8, 23.6], 140_304),
            # gloo: zero copy n/a, so only the token broadcast pairs
            row("gloo", "ids", "n/a", [30.0, 30.0, 30.0], 138_000),
            row("gloo", "embeddings", "n/a", [31.0, 32.0, 33.0], 140_304)]
    savings = {(s["backend"], s["switch"]): s for s in switch_savings(rows)}
    assert set(savings) == {("shm", "token_broadcast"), ("shm", "zero_copy"), ("gloo", "token_broadcast")}
    zc = savings["shm", "zero_copy"]  # on against off, rounds paired: 0.5, -0.2, 0.6 in both pairs
    assert (zc["setting"], zc["against"], zc["pairs"]) == ("on", "off", 2)
    assert zc["sent_bytes_saved_per_token"] == 0 and zc["copied_bytes_saved_per_token"] == 138240
    assert zc["ms_saved_per_token"] == pytest.approx({"median": 0.5, "min": -0.2, "max": 0.6})
    assert zc["pct_saved"] == pytest.approx(100 * 0.5 / ((20.8 + 21.8) / 2))
    tb = savings["gloo", "token_broadcast"]
    assert tb["pairs"] == 1 and tb["sent_bytes_saved_per_token"] == 2304
    assert tb["ms_saved_per_token"] == pytest.approx({"median": 2.0, "min": 1.0, "max": 3.0})
    assert savings["shm", "token_broadcast"]["ms_saved_per_token"] == pytest.approx({"median": 1.0, "min": 1.0, "max": 1.0})

    page = _page_of(rows, "tp_ablation")
    findings = _section(page, "What was found")
    assert ("zero copy (the kernels write into the collective&#x27;s buffer) instead of a copy (2 ranks over shm, "
            "2 matched pairs): 135 KiB per token not copied, the same sent; 0.50 (-0.20–0.60) ms per token saved") in findings
    assert "(its 6 paired rounds disagree on the sign)" in findings and "faster in all 6 paired rounds" in findings
    assert ("2 ranks over gloo, 1 matched pair): 2.25 KiB less sent per token; 2.00 (1.00–3.00) ms per token "
            "saved (6.2% of the time without it): faster in all 3 paired rounds") in findings
    assert "copied per token, saved" in page and "ms per token saved" in page


def test_a_figure_per_ablated_switch_with_medians_and_min_max(written):
    page = written["html"].read_text()
    rows = json.loads(written["json"].read_text())["entries"][1]["rows"]  # attention x KV cache, one prompt
    assert "fig-ablation-1-kv-cache" in page and "fig-ablation-1-prompt-length" not in page  # one length: no figure
    data, layout = _figure_spec(page, "fig-ablation-1-attention")
    decode = [t for t in data if t["yaxis"] == "y"]  # the top row; prefill ms below
    assert [t["name"] for t in decode] == ["slim", "naive"] and layout["barmode"] == "group"
    for trace in decode:  # a bar at each median, its error bar from the min to the max over the repeats
        mine = [(r["decode_tokens_per_s"], r["decode_tokens_per_s_min"], r["decode_tokens_per_s_max"])
                for r in rows if r["attention"] == trace["name"]]
        assert trace["y"] == [m for m, _, _ in mine]
        assert trace["error_y"]["array"] == [hi - m for m, _, hi in mine]
        assert trace["error_y"]["arrayminus"] == [m - lo for m, lo, _ in mine]
    assert "prefill ms" in layout["yaxis2"]["title"]["text"]


def test_findings_of_a_real_run_name_a_setting_and_a_ratio(written):
    findings = _section(written["html"].read_text(), "What was found")
    for switch in ("Attention", "KV cache"):
        row = _finding(written["html"].read_text(), switch)
        # ratios in meaningful digits: 2.01, and 23.3 once a noisy pairing passes 10
        assert re.search(r"\d+(?:\.\d+)?x as fast as .+? \(\d+(?:\.\d+)?–\d+(?:\.\d+)?\)", row), row
        assert "is fastest" in row or "within the run-to-run spread" in row or "within it in" in row, row
    assert "median (min–max) over 3 repeats" in findings and "% of the measured triad" in findings


def test_tables_speak_labels_and_meaningful_digits(written):
    page = written["html"].read_text()
    visible = re.sub(r"<script>.*?</script>", "", page, flags=re.S)
    for key in ("pct_peak_bandwidth", "decode_gflops", "decode_tokens_per_s", "prefill_ms", "top1_agreement"):
        assert key not in visible, key  # raw keys stay in the JSON
    headers = [c[2] for t in _tables(visible) for r in t for c in r if c[0] == "th"]
    assert not [h for h in headers if "_" in h], headers
    ablation = next(t for t in _tables(_section(page, "Measurements")) if "KV cache" in [c[2] for c in t[0]])
    head = [c[2].split("median (min–max)")[0] for c in ablation[0]]  # a median's header says so beneath the label
    assert {"decode tokens/s", "% of triad", "prefill ms", "KV cache"} <= set(head)
    for row in ablation[1:]:
        for h, (_, cls, text) in zip(head, row):
            for number in re.findall(r"\d[\d,]*\.?\d*", text) if cls == "num" else []:
                if h.startswith("prefill ms"):
                    assert len(number.partition(".")[2]) <= 2, (h, text)  # ms: one or two decimals
                elif h == "% of triad":  # whole percent; one decimal below 10%
                    decimals = number.partition(".")[2]
                    assert not decimals or (float(number) < 10 and len(decimals) == 1), (h, text)
                else:
                    assert _significant(number) <= 3, (h, text)


def test_long_prompt_and_text_are_folded_and_escaped(written):
    page = written["html"].read_text()
    prompt = json.loads(written["json"].read_text())["entries"][0]["workload"]["prompt"]
    folds = re.findall(r"<details><summary>(.*?)</summary><pre>(.*?)</pre></details>", page, flags=re.S)
    summary = next(s for s, f in folds if f == html.escape(prompt))
    assert summary.startswith(html.escape(" ".join(prompt[:200].split()))) and len(summary) < 400
    assert page.count(html.escape(prompt)) == 1  # the whole prompt once, inside the fold


def test_compare_reads_an_ablation_rows_spread():
    from workbench.report.compare import compare

    def run(decode: float) -> dict:
        row = _grid_row("slim", "fp16", decode, 10)  # 5% either side, 3 repeats
        return {"entries": [{"kind": "ablation", "model": {"name": "m"}, "rows": [row]}]}

    same = {r["measurement"].split(" | ")[1]: r["verdict"] for r in compare(run(100), run(101))}
    slower = {r["measurement"].split(" | ")[1]: r["verdict"] for r in compare(run(100), run(50))}
    assert same == {"decode tokens/s": "within noise", "prefill ms": "within noise"}
    assert slower["decode tokens/s"] == "regression"


def test_prefill_findings_say_fastest_not_highest():
    """Under prefill time the best median is the lowest: the finding said "slim has the highest
    medians" for the fastest setting."""
    rows = [_grid_row("slim", "fp16", 100, 10), _grid_row("slim", "fp32", 98, 10.2),
            _grid_row("flash", "fp16", 99, 10.1), _grid_row("flash", "fp32", 97, 10.3)]
    findings = _section(_page_of(rows), "What was found")
    assert "highest" not in findings
    assert "slim</b> has the fastest medians" in findings


def test_the_roofline_labels_its_log_axes_at_decades():
    """Plotly's own log ticks read "2 3 4 ... 9 1 2": a point at 0.5 FLOP/byte read as 5.
    Every power of ten the points span is a tick, labelled in full, and nothing else is."""
    from workbench.analysis.axes import decade_label

    rows = [_grid_row("slim", "fp16", 100, 10), _grid_row("naive", "fp16", 50, 20)]
    _, layout = _figure_spec(_page_of(rows), "fig-roofline")
    for axis, values in (("xaxis", [0.5]), ("yaxis", [7.5, 15.0])):  # decode_gflops / decode_gbps; decode_gflops
        a = layout[axis]
        assert a["type"] == "log" and a["tickmode"] == "array"
        powers = [round(__import__("math").log10(v)) for v in a["tickvals"]]
        assert a["tickvals"] == [10.0 ** k for k in powers] and powers == list(range(powers[0], powers[-1] + 1))
        assert a["range"] == [powers[0], powers[-1]]
        assert all(10.0 ** powers[0] <= v <= 10.0 ** powers[-1] for v in values)
        assert a["ticktext"] == [decade_label(k) for k in powers]
    assert layout["xaxis"]["ticktext"][:3] == ["0.1", "1", "10"]


def test_decade_labels():
    from workbench.analysis.axes import decade_axis, decade_label

    assert [decade_label(k) for k in range(-5, 6)] == ["10⁻⁵", "10⁻⁴", "0.001", "0.01", "0.1", "1", "10", "100",
                                                      "1000", "10000", "10⁵"]
    axis = decade_axis("KL", [3e-5, 0.02])
    assert axis["ticktext"] == ["10⁻⁵", "10⁻⁴", "0.001", "0.01", "0.1"] and axis["range"] == [-5, -1]
    assert decade_axis("x", [5.0])["tickvals"] == [1.0, 10.0]  # one value: the decade around it
    with pytest.raises(ValueError, match="positive"):
        decade_axis("x", [0.0])


def test_every_report_records_the_machines_load_and_frontend(written):
    """Each measurement and the report itself carry the machine's load then: load averages,
    the CPUs other processes kept busy, the busiest by name; and what ran it."""
    data = json.loads(written["json"].read_text())
    for load in [data["machine"]["load"], *(e["load"] for e in data["entries"])]:
        assert len(load["loadavg"]) == 3 and load["cpus"] >= 1 and load["busy_elsewhere_cpus"] >= 0
        assert all({"pid", "name", "cpu_percent"} <= set(p) for p in load["busy_processes"])
    # pytest: plain Python, or an IPython shell if an earlier test of the session made one
    said = data["software"]["frontend"]
    assert said in ("plain Python", "an IPython shell (InteractiveShell)")
    page = written["html"].read_text()
    assert f"Measured in {said}" in page and "load average" in page


def test_machine_load_counts_other_processes_and_not_ours():
    """A process busy elsewhere is named with its share of a CPU; this process's own children
    (a cluster's engines, a server) are the run's, not load from elsewhere."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from workbench.hw.load import load_said, machine_load

    spin = f"{sys.executable} -c 'while True: pass'"
    child = subprocess.Popen(["sh", "-c", f"exec {spin}"])
    # started by a shell that exits at once: re-parented away from this process
    other = int(subprocess.run(["sh", "-c", f"{spin} >/dev/null 2>&1 & echo $!"], capture_output=True,
                               text=True, check=True).stdout)
    try:
        time.sleep(0.2)
        load = machine_load(sample_s=0.5)
    finally:
        os.kill(other, signal.SIGKILL)
        child.kill()
        child.wait()
    busy = {p["pid"]: p for p in load["busy_processes"]}
    assert other in busy and child.pid not in busy
    # the total is rounded to 0.01 CPU
    assert busy[other]["name"].startswith("python") and load["busy_elsewhere_cpus"] >= busy[other]["cpu_percent"] / 100 - 0.005
    assert f"python" in load_said(load) and load_said(None) == "machine load not recorded"


def test_compare_warns_when_the_two_runs_loads_or_frontends_differ(written, tmp_path):
    """A notebook's report made at 1.9 tokens/s under load was "reproduced" at 56 in a shell,
    and compare called that an improvement. Now it says first that the loads differed."""
    import copy
    import subprocess
    import sys

    from workbench.report.compare import compare, format_compare, html_page, load_warnings

    a = json.loads(written["json"].read_text())
    quiet = copy.deepcopy(a)
    quiet["software"]["frontend"] = "an IPython terminal"
    for load in [quiet["machine"]["load"], *(e["load"] for e in quiet["entries"])]:
        load.update(loadavg=[0.1, 0.1, 0.1], busy_elsewhere_cpus=0.0, busy_processes=[])
    busy = copy.deepcopy(quiet)
    busy["entries"][0]["load"].update(loadavg=[3.9, 2.0, 1.0], busy_elsewhere_cpus=1.8,
                                      busy_processes=[{"pid": 1, "name": "cc1plus", "cpu_percent": 95.0}])
    assert load_warnings(quiet, copy.deepcopy(quiet)) == []
    (said,) = load_warnings(quiet, busy)
    assert said.startswith("the machine's load differed") and "cc1plus 95%" in said and "1.8 CPU" in said
    text = format_compare(compare(quiet, busy), quiet, busy)
    assert text.startswith("warning: the machine's load differed")
    assert "<b>warning:</b> the machine&#x27;s load differed" in html_page(compare(quiet, busy), quiet, busy)
    kernel = copy.deepcopy(quiet)
    kernel["software"]["frontend"] = "a Jupyter kernel (ipykernel)"
    assert load_warnings(quiet, kernel) == ["A ran in an IPython terminal, B in a Jupyter kernel (ipykernel)"]
    old = copy.deepcopy(quiet)
    del old["machine"]["load"]
    for e in old["entries"]:
        del e["load"]
    assert "A recorded no machine load" in load_warnings(old, quiet)[0]
    for name, data in (("quiet", quiet), ("busy", busy)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "compare", str(tmp_path / "quiet.json"),
                        str(tmp_path / "busy.json")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("warning: the machine's load differed"), r.stderr
