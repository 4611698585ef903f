"""Live plots of a generation: per-layer latency, achieved bandwidth, tokens/s.

    plots = LivePlots(widget=True)          # plotly FigureWidgets in Jupyter / JupyterLab
    display(plots.box())                     # or plots.figures for static figures
    model.generate(..., on_step=plots.on_step)

Three figures, created once and then updated in place inside `batch_update()` (one
message per refresh), at most `max_fps` times a second so plotting never dominates a run:

    latency     per layer, stacked attention / MLP / other, for prefill and the mean decode step
    bandwidth   achieved GB/s of each decode step, with the machine's measured peak as a line
    throughput  tokens/s over the run (all sequences, decode steps)

With widget=False the same figures are plain plotly Figures (for IPython, nbconvert, or
export into a report); `update(timings)` works on both.
"""

from __future__ import annotations

import time

import plotly.graph_objects as go

from workbench.runtime.timing import PARTS, Timings

PHASES = ("prefill", "decode")


class LivePlots:
    def __init__(self, widget: bool = True, peak_gbps: float | None = None, max_fps: float = 4.0):
        make = go.FigureWidget if widget else go.Figure
        self.widget = widget
        self.max_fps = max_fps
        self._last = float("-inf")  # the first step always draws (perf_counter may start near 0)
        self.updates = 0
        if peak_gbps is None:
            from workbench.hw.peaks import measured_peaks

            peak_gbps = measured_peaks().triad_gbps
        self.peak_gbps = peak_gbps

        self.latency = make(layout=dict(title="Per-layer latency (ms)", barmode="stack", height=320,
                                        xaxis_title="layer", yaxis_title="ms per step",
                                        margin=dict(l=50, r=20, t=40, b=40)))
        for phase in PHASES:
            for part in PARTS:
                self.latency.add_bar(name=f"{phase} {part.name}", x=[], y=[], offsetgroup=phase,
                                     marker_color=part.color, opacity=1.0 if phase == "decode" else 0.45,
                                     legendgroup=phase)
        self.bandwidth = make(layout=dict(title="Achieved bandwidth per decode step", height=280,
                                          xaxis_title="decode step", yaxis_title="GB/s",
                                          margin=dict(l=50, r=20, t=40, b=40)))
        self.bandwidth.add_scatter(name="achieved", x=[], y=[], mode="lines+markers")
        self.bandwidth.add_scatter(name=f"measured peak (triad {peak_gbps:.0f} GB/s)", x=[0, 1],
                                   y=[peak_gbps, peak_gbps], mode="lines", line=dict(dash="dash", color="gray"))
        self.throughput = make(layout=dict(title="Tokens/s over the run", height=280, xaxis_title="decode step",
                                           yaxis_title="tokens/s", margin=dict(l=50, r=20, t=40, b=40)))
        self.throughput.add_scatter(name="tokens/s", x=[], y=[], mode="lines+markers")

    @property
    def figures(self) -> list:
        return [self.latency, self.bandwidth, self.throughput]

    def box(self):
        """The three figures in one ipywidgets VBox (widget mode)."""
        import ipywidgets

        return ipywidgets.VBox(self.figures)

    def on_step(self, record, timings: Timings) -> None:
        """generate(on_step=...) hook: refresh, unless the last refresh was under 1/max_fps ago."""
        now = time.perf_counter()
        if now - self._last >= 1.0 / self.max_fps:
            self.update(timings)
            self._last = time.perf_counter()

    def update(self, timings: Timings) -> None:
        decode = timings.decode_steps
        with self.latency.batch_update():
            for k, phase in enumerate(PHASES):
                layers = timings.per_layer(phase)
                for j, part in enumerate(PARTS):
                    trace = self.latency.data[len(PARTS) * k + j]
                    trace.x = [r["layer"] for r in layers]
                    trace.y = [r[f"{part.name}_ms"] for r in layers]
        steps = list(range(1, len(decode) + 1))
        with self.bandwidth.batch_update():
            self.bandwidth.data[0].x = steps
            self.bandwidth.data[0].y = [s.gbps() for s in decode]
            self.bandwidth.data[1].x = [0, max(1, len(decode))]
        with self.throughput.batch_update():
            self.throughput.data[0].x = steps
            self.throughput.data[0].y = [s.tokens / s.total_s if s.total_s else 0.0 for s in decode]
        self.updates += 1


def ablation_figure(rows) -> go.Figure:
    """One bar per configuration: decode tokens/s (left) and top-1 agreement (right), for
    the rows of workbench.analysis.ablation.run_ablation (AblationRow objects or their dicts)."""
    from plotly.subplots import make_subplots

    rows = [r if isinstance(r, dict) else r.__dict__ for r in rows]
    labels = [f"{r['attention']}/{r['kv_cache']} len {r['prompt_len']} b{r['batch']}" for r in rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("decode tokens/s", "top-1 agreement with the reference"))
    fig.add_bar(x=labels, y=[r["decode_tokens_per_s"] for r in rows], row=1, col=1, name="tokens/s")
    fig.add_bar(x=labels, y=[r["top1_agreement"] for r in rows], row=1, col=2, name="agreement")
    fig.update_yaxes(range=[0, 1.05], row=1, col=2)
    fig.update_layout(height=380, showlegend=False, margin=dict(l=50, r=20, t=40, b=120))
    return fig
