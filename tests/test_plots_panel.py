"""Live plots and the control panel, driven as a user would (button clicks are the
handlers the buttons call), without a browser; tests/test_notebooks.py runs them in a
real kernel."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import workbench as wb  # noqa: E402
from workbench.ui.plots import LivePlots  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return wb.load_model("smollm2-135m")


@pytest.mark.parametrize("widget", [False, True])
def test_live_plots_follow_a_generation(model, widget):
    plots = LivePlots(widget=widget, peak_gbps=50.0, max_fps=1000)
    out = model.generate("The capital of France is", max_new_tokens=6, stop_at_eos=False, on_step=plots.on_step)
    plots.update(out.timings)
    n_layers = model.config.n_layers
    decode_attention = plots.latency.data[3]  # decode attention trace
    assert list(decode_attention.x) == list(range(n_layers)) and len(decode_attention.y) == n_layers
    assert all(y > 0 for y in decode_attention.y)
    assert len(plots.bandwidth.data[0].y) == 5 and all(y > 0 for y in plots.bandwidth.data[0].y)
    assert list(plots.bandwidth.data[1].y) == [50.0, 50.0]  # the peak line
    assert len(plots.throughput.data[0].y) == 5
    assert plots.updates >= 2  # refreshed during the run, not only at the end


def test_refresh_rate_is_bounded(model):
    plots = LivePlots(widget=False, peak_gbps=50.0, max_fps=0.001)  # at most one refresh per 1000 s
    model.generate("Hello", max_new_tokens=8, stop_at_eos=False, on_step=plots.on_step)
    assert plots.updates == 1


def test_panel_load_switch_run(model):
    p = wb.panel(model)
    p.attention.value, p.kv_cache.value = "flash", "int8"
    p.batch.value, p.prompt_len.value, p.new_tokens.value = 2, 32, 5
    p.run_button.click()
    assert p.result is not None and p.result.switches.kv_cache == "int8"
    assert p.progress.value == 5 and p.progress.description == "done"
    assert len(p.plots.latency.data[3].y) == model.config.n_layers
    assert any("tokens/s" in o.get("text", "") for o in p.output.outputs)


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

    rows = run_ablation(model, ["slim", "naive"], ["int8"], prompt_lens=[16], new_tokens=2)
    fig = ablation_figure(rows)
    assert len(fig.data) == 2 and len(fig.data[0].x) == 2
    assert all(0 <= y <= 1 for y in fig.data[1].y)
