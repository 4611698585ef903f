"""Figures of a generation: per-layer latency, achieved bandwidth, tokens/s.

    latency_figure(timings)               per-layer ms of each timing part: the prefill (per
                                          prompt) and a decode step (per token) side by side
    bandwidth_figure(timings, peak_gbps)  GB/s of each decode step, the measured triad as a
                                          flat line
    throughput_figure(timings, batch)     tokens/s of each decode step, all sequences and
                                          per sequence

Each takes earlier runs as `previous` (label, Timings) pairs, drawn as faint traces so two
settings can be compared by eye. The figures are plain plotly Figures, rebuilt from the
Timings: nothing is patched in place, so a figure can never hold half an update.

LivePlots shows the three in a notebook while a generation runs:

    plots = LivePlots()
    display(plots.box())
    out = model.generate(..., on_step=plots.on_step)    # redraws, at most max_fps a second
    plots.finish(out.timings, "slim / int8")            # the final state; kept as a faint trace

Each figure sits in an ipywidgets Output whose content is replaced whole at every redraw
(plotly's own mime type, drawn by JupyterLab's plotly renderer). Widget state is the
figure itself, so a reloaded page draws the last figure again; FigureWidget's incremental
updates did not survive a reload.
"""

from __future__ import annotations

import time

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.runtime.timing import PARTS, Timings

PLOTLY_MIME = "application/vnd.plotly.v1+json"
FAINT = "rgba(120, 120, 120, 0.45)"
MARGIN = dict(l=60, r=20, t=50, b=45)


def latency_figure(timings: Timings, previous=()) -> go.Figure:
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08,
                        subplot_titles=("prefill: ms per prompt, per layer", "decode: ms per token, per layer"))
    for col, phase in ((1, "prefill"), (2, "decode")):
        layers = timings.per_layer(phase)
        for part in PARTS:
            fig.add_bar(name=part.label.split(" (")[0], legendgroup=part.name, showlegend=col == 1,
                        x=[r["layer"] for r in layers], y=[r[f"{part.name}_ms"] for r in layers],
                        marker_color=part.color, row=1, col=col,
                        hovertemplate=f"{part.label}<br>layer %{{x}}: %{{y:.3f}} ms<extra></extra>")
        for label, earlier in previous:
            rows = earlier.per_layer(phase)
            fig.add_scatter(name=f"earlier: {label}", legendgroup=f"earlier {label}", showlegend=col == 1,
                            x=[r["layer"] for r in rows], y=[sum(r[f"{p.name}_ms"] for p in PARTS) for r in rows],
                            mode="lines", line=dict(color=FAINT, dash="dot"), row=1, col=col)
    fig.update_layout(barmode="stack", height=330, margin=MARGIN, legend=dict(orientation="h", y=-0.25),
                      title="Per-layer latency")
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(title_text="ms per prompt", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="ms per token", rangemode="tozero", row=1, col=2)
    return fig


def bandwidth_figure(timings: Timings, peak_gbps: float, previous=()) -> go.Figure:
    fig = go.Figure(layout=dict(title="Achieved memory bandwidth per decode step", height=300, margin=MARGIN,
                                xaxis_title="decode step", yaxis=dict(title="GB/s (bytes read / step time)",
                                                                      rangemode="tozero")))
    for label, earlier in previous:
        steps = earlier.decode_steps
        fig.add_scatter(name=f"earlier: {label}", x=list(range(1, len(steps) + 1)), y=[s.gbps() for s in steps],
                        mode="lines", line=dict(color=FAINT, dash="dot"))
    decode = timings.decode_steps
    fig.add_scatter(name="this run", x=list(range(1, len(decode) + 1)), y=[s.gbps() for s in decode],
                    mode="lines+markers")
    # The peak is a shape across the whole plot, not a trace: it cannot be drawn with half its points.
    fig.add_hline(y=peak_gbps, line=dict(dash="dash", color="gray"),
                  annotation_text=f"measured peak: triad {peak_gbps:.1f} GB/s", annotation_position="top left")
    fig.update_yaxes(range=[0, 1.15 * max([peak_gbps, *(s.gbps() for s in decode)])])
    return fig


def throughput_figure(timings: Timings, batch: int, previous=()) -> go.Figure:
    fig = go.Figure(layout=dict(title=f"Decode throughput per step (batch {batch})", height=300, margin=MARGIN,
                                xaxis_title="decode step", yaxis=dict(title="tokens/s", rangemode="tozero")))
    for label, earlier in previous:
        steps = earlier.decode_steps
        fig.add_scatter(name=f"earlier: {label}", x=list(range(1, len(steps) + 1)),
                        y=[s.tokens / s.total_s for s in steps], mode="lines", line=dict(color=FAINT, dash="dot"))
    decode = timings.decode_steps
    x = list(range(1, len(decode) + 1))
    fig.add_scatter(name=f"all {batch} sequences" if batch > 1 else "tokens/s", x=x,
                    y=[s.tokens / s.total_s for s in decode], mode="lines+markers")
    if batch > 1:
        fig.add_scatter(name="per sequence", x=x, y=[s.tokens / s.total_s / batch for s in decode],
                        mode="lines+markers", line=dict(dash="dash"))
    return fig


def mime_bundle(fig: go.Figure) -> dict:
    """The figure as a display_data output: plotly's JSON for JupyterLab, text elsewhere."""
    return {"output_type": "display_data", "metadata": {},
            "data": {PLOTLY_MIME: fig.to_plotly_json(), "text/plain": f"<{fig.layout.title.text}>"}}


class LivePlots:
    """The three figures of a run, redrawn while it runs (see the module docstring).

    widget: show them in ipywidgets Outputs (else only `figures`, for scripts and reports).
    max_fps: at most this many redraws a second while a run is in progress.
    live: redraw during the run (on_step); with live=False only finish() draws, so a
      browser repainting figures cannot compete with the run for the CPU (the panel's
      default on machines with few cores)."""

    def __init__(self, widget: bool = True, peak_gbps: float | None = None, max_fps: float = 4.0,
                 live: bool = True, keep_previous: int = 3):
        if peak_gbps is None:
            from workbench.hw.peaks import measured_peaks

            peak_gbps = measured_peaks().triad_gbps
        self.peak_gbps = peak_gbps
        self.max_fps = max_fps
        self.live = live
        self.keep_previous = keep_previous
        self.previous: list[tuple[str, Timings]] = []  # earlier finished runs, newest first
        self._finished: tuple[str, Timings] | None = None  # the last finished run (drawn, not faint)
        self.timings = Timings()
        self.batch = 1
        self.updates = 0
        self._last = float("-inf")  # the first step always draws (perf_counter may start near 0)
        self.outputs = None
        if widget:
            import ipywidgets

            self.outputs = [ipywidgets.Output(layout=ipywidgets.Layout(width="100%")) for _ in range(3)]
        self._draw()

    @property
    def figures(self) -> list[go.Figure]:
        """[latency, bandwidth, throughput] for the latest timings."""
        return [self.latency, self.bandwidth, self.throughput]

    @property
    def latency(self) -> go.Figure:
        return latency_figure(self.timings, self.previous)

    @property
    def bandwidth(self) -> go.Figure:
        return bandwidth_figure(self.timings, self.peak_gbps, self.previous)

    @property
    def throughput(self) -> go.Figure:
        return throughput_figure(self.timings, self.batch, self.previous)

    def box(self):
        """The three figures in one ipywidgets VBox (widget mode)."""
        import ipywidgets

        return ipywidgets.VBox(self.outputs, layout=ipywidgets.Layout(width="100%"))

    def on_step(self, record, timings: Timings) -> None:
        """generate(on_step=...) hook: redraw, unless live is off or the last redraw was under
        1/max_fps ago."""
        if not self.live:
            return
        now = time.perf_counter()
        if now - self._last >= 1.0 / self.max_fps:
            self.update(timings)
            self._last = time.perf_counter()

    def update(self, timings: Timings, batch: int | None = None) -> None:
        self.timings = timings
        if batch is not None:
            self.batch = batch
        self._draw()

    def finish(self, timings: Timings, label: str, batch: int | None = None) -> None:
        """Draw the run's final state; the run finished before it becomes a faint trace."""
        if self._finished is not None:
            self.previous = ([self._finished] + self.previous)[:self.keep_previous]
        self._finished = (label, timings)
        self.update(timings, batch)

    def _draw(self) -> None:
        self.updates += 1
        if self.outputs is None:
            return
        for out, fig in zip(self.outputs, self.figures):
            out.outputs = (mime_bundle(fig),)  # one message per figure, replacing what was there


def ablation_figure(rows) -> go.Figure:
    """One bar per configuration: decode tokens/s (left) and top-1 agreement with the naive /
    fp32-cache reference (right), for the rows of workbench.analysis.ablation.run_ablation
    (AblationRow objects or their dicts)."""
    rows = [r if isinstance(r, dict) else r.__dict__ for r in rows]
    labels = [f"{r['attention']}/{r['kv_cache']} len {r['prompt_len']} b{r['batch']}" for r in rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("decode tokens/s (all sequences)",
                                                        "top-1 agreement with naive attention + fp32 cache"))
    fig.add_bar(x=labels, y=[r["decode_tokens_per_s"] for r in rows], row=1, col=1, name="tokens/s")
    fig.add_bar(x=labels, y=[r["top1_agreement"] for r in rows], row=1, col=2, name="agreement")
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="fraction of positions", range=[0, 1.05], row=1, col=2)
    fig.update_layout(height=380, showlegend=False, margin=dict(l=60, r=20, t=40, b=120))
    return fig
