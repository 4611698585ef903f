"""Live plots and the control panel, driven as a user would (button clicks are the
handlers the buttons call), without a browser; tests/test_notebooks.py runs them in a
real kernel."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import workbench as wb  # noqa: E402
from workbench.ui.plots import LivePlots  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return wb.load_model("smollm2-135m")


PLOTLY = "application/vnd.plotly.v1+json"


def drawn(plots, i):
    """The figure JSON the i-th Output widget holds (what the browser draws)."""
    (out,) = plots.outputs[i].outputs
    return out["data"][PLOTLY]


@pytest.mark.parametrize("widget", [False, True])
def test_live_plots_follow_a_generation(model, widget):
    plots = LivePlots(widget=widget, peak_gbps=50.0, max_fps=1000)
    out = model.generate("The capital of France is", max_new_tokens=6, stop_at_eos=False, on_step=plots.on_step)
    plots.finish(out.timings, "slim / fp32")
    n_layers = model.config.n_layers
    latency = plots.latency
    decode_attention = [t for t in latency.data if t.xaxis == "x2"][0]  # decode panel, first part (attention)
    assert list(decode_attention.x) == list(range(n_layers)) and len(decode_attention.y) == n_layers
    assert all(y > 0 for y in decode_attention.y)
    assert [r["attention_ms"] for r in out.timings.per_layer("decode")] == list(decode_attention.y)
    bandwidth = plots.bandwidth
    assert len(bandwidth.data[0].y) == 5 and all(y > 0 for y in bandwidth.data[0].y)
    assert list(bandwidth.data[0].y) == [s.gbps() for s in out.timings.decode_steps]
    (peak,) = bandwidth.layout.shapes  # the peak: a flat line at the measured triad
    assert peak.y0 == peak.y1 == 50.0
    assert len(plots.throughput.data[0].y) == 5
    assert plots.updates >= 3  # drawn during the run, not only at the end
    for fig in plots.figures:  # units in every axis title, y from 0
        assert all(ax.title.text for ax in (fig.layout.xaxis, fig.layout.yaxis))
        assert fig.layout.yaxis.rangemode == "tozero" or fig.layout.yaxis.range[0] == 0
    if widget:
        assert drawn(plots, 1)["layout"]["shapes"][0]["y0"] == 50.0
        assert list(drawn(plots, 1)["data"][0]["y"]) == list(bandwidth.data[0].y)
    # The next run draws the finished one as a faint trace.
    again = model.generate("Once upon a time", max_new_tokens=4, stop_at_eos=False)
    plots.finish(again.timings, "second")
    assert [t.name for t in plots.bandwidth.data] == ["earlier: run 1: slim / fp32", "this run"]


def test_earlier_runs_are_told_apart_with_one_legend_entry_each(model):
    """Runs of the same settings once drew as one grey dotted line per run, all alike, the
    legend repeating the same words: each earlier run now has its number, its own shade and
    dash (the same in every figure), and one legend entry."""
    plots = LivePlots(widget=False, peak_gbps=50.0)
    for _ in range(4):
        out = model.generate("Hello", max_new_tokens=3, stop_at_eos=False)
        plots.finish(out.timings, "slim / fp32")
    for fig in plots.figures:
        earlier = [t for t in fig.data if t.name.startswith("earlier")]
        legend = [t.name for t in earlier if t.showlegend is not False]
        assert legend == ["earlier: run 3: slim / fp32", "earlier: run 2: slim / fp32", "earlier: run 1: slim / fp32"]
        styles = {t.legendgroup: (t.line.color, t.line.dash) for t in earlier}
        assert len(set(styles.values())) == 3
    lines = [{t.name: (t.line.color, t.line.dash) for t in fig.data if t.name.startswith("earlier")}
             for fig in plots.figures]
    assert lines[0] == lines[1] == lines[2]  # a run looks the same in each figure


def test_figure_outputs_are_valid_notebook_outputs(model):
    """What the live plots put in their Output widgets, and what show_figure displays, is an
    output nbformat's schema accepts: the figure's MIME bundle as data, metadata apart. (The
    magics once displayed a whole output dict as if it were the data: JupyterLab drew nothing
    and refused to save the notebook as valid.)"""
    import nbformat
    from IPython.core.interactiveshell import InteractiveShell

    from workbench.ui.plots import figure_data, knee_spec, show_figure

    plots = LivePlots(widget=True, peak_gbps=50.0)
    plots.finish(model.generate("Hello", max_new_tokens=3, stop_at_eos=False).timings, "slim / fp32")
    outputs = [o for w in plots.outputs for o in w.outputs]
    assert len(outputs) == 3
    shell = InteractiveShell.instance()
    shown = []
    publisher = shell.display_pub.publish
    shell.display_pub.publish = lambda data, metadata=None, **kw: shown.append(
        nbformat.v4.new_output("display_data", data=data, metadata=metadata or {}))
    try:
        show_figure(plots.latency)  # a go.Figure
        show_figure({"data": [], "layout": {"title": {"text": "a spec"}}})
    finally:
        shell.display_pub.publish = publisher
    assert [set(o["data"]) for o in shown] == [{PLOTLY, "text/plain"}] * 2
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=outputs + shown)])
    nbformat.validate(nb)
    assert figure_data({"data": [], "layout": {}})["text/plain"] == "<figure>"  # untitled: still text


def test_refresh_rate_is_bounded(model):
    plots = LivePlots(widget=False, peak_gbps=50.0, max_fps=0.001)  # at most one refresh per 1000 s
    model.generate("Hello", max_new_tokens=8, stop_at_eos=False, on_step=plots.on_step)
    assert plots.updates == 2  # the empty figures at creation, then the first step
    quiet = LivePlots(widget=False, peak_gbps=50.0, live=False)  # draws only when told
    model.generate("Hello", max_new_tokens=8, stop_at_eos=False, on_step=quiet.on_step)
    assert quiet.updates == 1


def test_panel_load_switch_run_export(model, tmp_path):
    p = wb.panel(model)
    assert ("int8 (dot)", "int8:dot") in p.kv_cache.options  # every format with each of its kernels
    p.attention.value, p.kv_cache.value = "flash", "int8:tile"
    assert (model.attention, model.kv_cache, model.kv_kernel) == ("flash", "int8", "tile")  # the model's switches
    p.batch.value, p.prompt_len.value, p.new_tokens.value, p.repeats.value = 2, 32, 5, 2
    p.run_button.click()
    assert p.result is not None and p.result.switches.kv_cache == "int8"
    assert p.progress.value == 10 and p.progress.description == "done"
    assert len(p.runs) == 2 and all(r["kv_cache"] == "int8" for r in p.runs)
    assert "per sequence" in p.summary.value and "median (min-max) of 2 runs" in p.summary.value
    assert p.runs[0]["decode_tokens_per_s_per_sequence"] == pytest.approx(p.runs[0]["decode_tokens_per_s"] / 2)
    decode_attention = [t for t in p.plots.latency.data if t.xaxis == "x2"][0]
    assert len(decode_attention.y) == model.config.n_layers
    predicted = [t for t in p.plots.latency.data if t.name == "roofline prediction"]
    assert len(predicted) == 2 and all(len(t.y) == model.config.n_layers and min(t.y) > 0 for t in predicted)
    (shown,) = p.output.outputs  # the sequences' text, once: as HTML, and as text
    assert "sequence 1</b> continues" in shown["data"]["text/html"]
    assert shown["data"]["text/plain"].startswith("sequence 0 continues: ")
    js = json.loads(p.export(tmp_path / "run.json").read_text())
    assert len(js["runs"]) == 2 and len(js["per_layer_ms"]["decode"]) == model.config.n_layers
    rows = list(csv.DictReader(p.export(tmp_path / "run.csv").open()))
    assert [r["repeat"] for r in rows] == ["1", "2"] and rows[0]["kv_cache"] == "int8"
    with pytest.raises(ValueError, match="json or .csv"):
        p.export(tmp_path / "run.txt")
    model.attention, model.kv_cache = "slim", "fp32"  # the magics' way: the toggles follow
    assert (p.attention.value, p.kv_cache.value) == ("slim", "fp32")


def test_the_text_box_holds_each_runs_text(model):
    """The text box is emptied and filled in the kernel's state (Output.outputs), so every run
    shows its own text. Output.clear_output() sent a clear message instead, which the browser
    applied and wrote back as an empty state after the next run's text had arrived: the box was
    empty after every other run (and here, without a browser, it kept every run's text)."""
    p = wb.panel(model)
    p.new_tokens.value, p.repeats.value, p.warmup.value = 3, 1, False
    for prompt in ("The capital of France is", "Once upon a time", "The capital of Italy is"):
        p.prompt.value = prompt
        p.run()
        (shown,) = p.output.outputs
        (text,) = p.result.text  # one sequence (the panel generates a batch)
        assert shown["data"]["text/plain"] == f"sequence 0 continues: {text}"


def test_panel_follows_the_session_model(model):
    from workbench.runtime import session

    before = session.current.model
    try:
        session.current.model = None
        p = wb.panel()  # opened before anything is loaded
        p.run()
        assert any("no model loaded" in o.get("text", "") for o in p.output.outputs)
        model.kv_cache = "int8"
        session.current.model = model  # what %load_model does
        assert p.model is model and p.kv_cache.value == "int8:tile" and "smollm2" in p.status.value
        p.prompt.value, p.new_tokens.value, p.warmup.value = "The capital of France is", 4, False
        p.run()
        assert p.result.switches.kv_cache == "int8" and p.result.prompt_token_ids[0] == \
            model.tokenizer.encode("The capital of France is")
    finally:
        model.kv_cache = "fp32"
        session.current.model = before


def test_panel_runs_go_to_the_report_and_their_command_reproduces_them(model, capsys):
    """Each measured panel run is a report entry whose command, run as written in a fresh
    IPython shell (after the session's switches moved on), measures the same configuration."""
    from IPython.core.interactiveshell import InteractiveShell

    from workbench import report

    report.clear()
    p = wb.panel(model)
    p.attention.value, p.kv_cache.value = "flash", "int8:dot"
    p.prompt_len.value, p.new_tokens.value, p.repeats.value, p.warmup.value = 16, 3, 2, False
    p.run()
    entries = report.recorded()
    assert len(entries) == 2 and all(e["kind"] == "generation" for e in entries)
    first = entries[-1]
    assert (first["workload"]["attention"], first["workload"]["kv_cache"], first["workload"]["kv_kernel"]) == \
        ("flash", "int8", "dot")
    model.attention, model.kv_cache = "slim", "fp32"
    report.clear()
    sh = InteractiveShell.instance()
    assert sh.run_cell(first["command"]).error_in_exec is None, first["command"]
    again = report.recorded()[-1]
    keys = ("attention", "kv_cache", "kv_kernel", "step", "threads", "prompt_tokens", "batch", "new_tokens",
            "sampling", "prompt_sha256")
    assert {k: again["workload"][k] for k in keys} == {k: first["workload"][k] for k in keys}
    assert len(report.recorded()) == 2  # the command reruns the panel's two repeats
    report.clear()
    capsys.readouterr()


def test_panel_output_carries_a_static_copy_of_its_figures(model):
    """The panel's output: its widget view, with plain-SVG figures of the last run as the HTML
    fallback (what a saved notebook shows where widgets cannot be drawn), refreshed when a run
    ends; each decode bar's value is the run's median per-layer ms."""
    import re

    p = wb.panel(model)
    before = p._mimebundle()
    assert "application/vnd.jupyter.widget-view+json" in before and "no run yet" in before["text/html"]
    p.prompt.value, p.new_tokens.value, p.warmup.value = "The capital of France is", 4, False
    p.run()
    page = p._mimebundle()["text/html"]
    assert page.count("<svg") == 4 and "slim / fp32, batch 1" in page and "measured triad" in page
    decode_svg = page[page.index("<svg"):page.index("</svg>")]
    shown = {int(layer): ms for layer, ms in re.findall(r"layer (\d+) attention: ([\d.]+) ms", decode_svg)}
    rows = p.result.timings.per_layer("decode")
    assert len(shown) == len(rows) == model.config.n_layers
    # printed to 3 decimals: compared as printed (a difference of exactly half the last digit
    # is not always <= 5e-4 in floating point)
    assert {r["layer"]: f"{r['attention_ms']:.3f}" for r in rows} == shown


def test_panel_sets_a_run_against_the_previous_one(model):
    """Three repeats by default; the second run's summary compares it with the first: a ratio
    beyond both spreads, or a warning that the difference is within them."""
    p = wb.panel(model)
    assert p.repeats.value == 3
    p.prompt.value, p.new_tokens.value, p.warmup.value = "The capital of France is", 4, False
    p.run()
    assert "previous run" not in p.summary.value and "(min-max) of 3 runs" in p.summary.value
    p.kv_cache.value = "fp16"
    p.run()
    said = p.summary.value
    assert "previous run (slim / fp32, batch 1" in said
    assert ("within the run-to-run spread" in said) != ("beyond the spread of both" in said)
    p.repeats.value = 1
    p.run()
    assert "no spread to tell it from noise" in p.summary.value
    model.kv_cache = "fp32"


def test_panel_figures_before_a_run_and_rank_options(model):
    p = wb.panel(model)
    latency = p.plots.latency
    assert tuple(latency.layout.xaxis.range) == (-0.5, model.config.n_layers - 0.5)  # the model's layers
    assert any(a.text == "no run yet" for a in latency.layout.annotations)
    assert p.backend.layout.display == "none" and p.check_topk.layout.display == "none"  # one rank: no collectives
    if len(p.ranks.options) > 1:
        p.ranks.value = 2
        assert p.backend.layout.display is None and p.check_topk.layout.display is None


def test_layers_box_only_for_random_presets(model):
    p = wb.panel(model)
    assert p.layers.layout.display == "none"  # the bundled model is a trained model
    p.model_picker.value = "llama2-7b --random"
    assert p.layers.layout.display is None


def test_panel_shows_errors_and_keeps_the_model(model):
    p = wb.panel(model)
    p.model_picker.value = "llama2-70b --random"
    p.layers.value = 80
    p.load_button.click()  # needs far more memory than the machine has
    assert p.model is model
    assert any("error:" in o.get("text", "") for o in p.output.outputs)


def test_ablation_figure_has_a_bar_per_configuration(model):
    from workbench.analysis.ablation import run_ablation
    from workbench.ui.plots import ablation_figure

    rows = run_ablation(model, ["slim", "naive"], ["int8"], prompt_lens=[16], new_tokens=2, repeats=2)
    fig = ablation_figure(rows)
    assert len(fig.data) == 2 and len(fig.data[0].x) == 2
    assert all(0 <= y <= 1 for y in fig.data[1].y)
    assert fig.data[0].x[0] == "slim/int8 (tile) len 16 b1"  # the kernel that read the cache, named
    bars = fig.data[0]  # the error bars reach each row's min and max
    for r, y, up, down in zip(rows, bars.y, bars.error_y.array, bars.error_y.arrayminus):
        assert (y + up, y - down) == pytest.approx((r.decode_tokens_per_s_max, r.decode_tokens_per_s_min))


def test_panel_serve_bench_draws_the_knee_and_goes_to_the_report(model):
    """The panel's Serve-bench: a real `workbench serve` process on the panel's model, loaded
    at two rates, its rows and the latency-throughput figure in the panel, the rows in the
    session's report with the shell commands that reproduce them; bad rates a clear error."""
    from workbench import report
    from workbench.ui.panel import Panel

    p = Panel(model)
    p.prompt_len.value, p.new_tokens.value = 8, 3
    p.serve_rates.value, p.serve_concurrency.value, p.serve_requests.value = "oops", 2, 3
    assert p.serve_bench() is None
    (out,) = p.serve_output.outputs
    assert "rates must be numbers (requests/s) or max" in out["data"]["text/html"] and "'oops'" in out["data"]["text/plain"]

    p.serve_rates.value = "20, max"
    rows = p.serve_bench()
    assert [r["rate"] for r in rows] == [20.0, None] and all(r["completed"] == 3 for r in rows)
    assert all(r["output_tokens"] == 9 for r in rows)
    table, figure = p.serve_output.outputs
    assert "TTFT" in table["data"]["text/html"]
    spec = figure["data"][PLOTLY]
    assert spec["layout"]["title"]["text"].startswith("Latency against throughput")
    entry = report.recorded()[-1]
    assert entry["kind"] == "serve_bench" and entry["rows"] == rows
    first, bench, stop = entry["command"].splitlines()
    assert first.startswith("workbench serve --model smollm2-135m --dtype file --kv-cache ") and first.endswith(" &")
    assert bench.startswith("workbench serve-bench --url http://127.0.0.1:") and "--rate 20,max" in bench
    assert stop == "kill %1"
    assert not p.serve_button.disabled
