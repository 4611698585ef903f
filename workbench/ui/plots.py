"""Figures of a generation: per-layer latency, achieved bandwidth, tokens/s.

    latency_figure(timings)               per-layer ms of each timing part: the prefill (per
                                          prompt) and a decode step (per token) side by side
    bandwidth_figure(timings, peak_gbps)  GB/s of each decode step, the measured triad as a
                                          flat line
    throughput_figure(timings, batch)     tokens/s of each decode step, all sequences and
                                          per sequence

Each takes earlier runs as `previous` (label, Timings) pairs, newest first, drawn as faint
lines (a shade and a dash per run, EARLIER_LINES) so settings can be compared by eye. The figures are plain plotly Figures, rebuilt from the
Timings: nothing is patched in place, so a figure can never hold half an update.

    expert_load_spec(timings.expert_load())   a mixture of experts: tokens per expert per layer

LivePlots shows the three in a notebook while a generation runs (and, where they apply, the
tensor-parallel figures and a mixture's expert load):

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

import json
import math
import statistics
import time

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.model.timing import PARTS, Timings

PHASES = ("prefill", "decode")
PLOTLY_MIME = "application/vnd.plotly.v1+json"
# Earlier runs, newest first: a shade and a dash each, the same run alike in every figure, so
# two earlier runs are told apart (the newest is the darkest).
EARLIER_LINES = ({"color": "rgba(60, 60, 60, 0.8)", "dash": "dot"}, {"color": "rgba(110, 110, 110, 0.65)", "dash": "dash"},
                 {"color": "rgba(150, 150, 150, 0.55)", "dash": "dashdot"}, {"color": "rgba(180, 180, 180, 0.5)",
                                                                              "dash": "longdash"})
MARGIN = dict(l=60, r=20, t=50, b=45)
BELOW = {"orientation": "h", "y": -0.38, "yanchor": "top"}  # legends under the plot: it keeps its width when narrow


def _axis(title: str, **kw) -> dict:
    return {"title": {"text": title}, **kw}


def _earlier(age: int, name: str, x, y, **kw) -> dict:
    """An earlier run's trace (age 0: the newest), one legend entry per run."""
    return {"type": "scatter", "name": f"earlier: {name}", "x": list(x), "y": list(y), "mode": "lines",
            "line": {**EARLIER_LINES[age % len(EARLIER_LINES)], "width": 1.5}, "legendgroup": f"earlier {age}", **kw}


# The figures are written as plotly JSON (dicts) rather than built through graph_objects:
# validating a Figure costs about 25 ms, which a live redraw four times a second would take
# from the run it is drawing (bench/generation.py --only plots). go.Figure(spec) validates
# once, for users who want Figure objects.

def latency_spec(timings: Timings, previous=(), title: str = "Per-layer latency", predicted=None,
                 n_layers: int | None = None) -> dict:
    """Per-layer ms of each part, prefill (per prompt) above decode (per token); earlier runs
    as faint totals; the cost model's prediction (Prediction.per_layer rows per phase) as a
    dashed line. n_layers: the model's, so a figure with no run yet spans its layers."""
    earlier = [(label, {phase: t.per_layer(phase) for phase in PHASES}) for label, t in previous]
    return per_layer_spec({phase: timings.per_layer(phase) for phase in PHASES}, earlier, title, predicted, n_layers)


def per_layer_spec(layers: dict[str, list[dict]], earlier=(), title: str = "Per-layer latency",
                   predicted: dict[str, list[dict]] | None = None, n_layers: int | None = None) -> dict:
    """latency_spec from Timings.per_layer rows ({"prefill": [...], "decode": [...]}), which is
    also what a report's JSON keeps; `predicted` has the same shape (the cost model's rows).
    The two phases are stacked (not side by side), so their titles never collide in a narrow
    view."""
    data = []
    for axis, phase in (("", "prefill"), ("2", "decode")):
        rows = layers[phase]
        for part in PARTS:
            data.append({"type": "bar", "name": part.label.split(" (")[0], "legendgroup": part.name,
                         "showlegend": axis == "", "x": [r["layer"] for r in rows],
                         "y": [r[f"{part.name}_ms"] for r in rows], "marker": {"color": part.color},
                         "xaxis": f"x{axis}", "yaxis": f"y{axis}",
                         "hovertemplate": f"{part.label}<br>layer %{{x}}: %{{y:.3f}} ms<extra></extra>"})
        for age, (label, old) in enumerate(earlier):
            rows = old[phase]
            data.append(_earlier(age, label, (r["layer"] for r in rows),
                                 (sum(r[f"{p.name}_ms"] for p in PARTS) for r in rows), showlegend=axis == "",
                                 xaxis=f"x{axis}", yaxis=f"y{axis}"))
        if predicted and predicted.get(phase):
            rows = predicted[phase]
            parts = ", ".join(f"{p.name} {rows[0][p.name + '_ms']:.3f}" for p in PARTS)
            data.append({"type": "scatter", "mode": "lines", "name": "roofline prediction", "legendgroup": "predicted",
                         "showlegend": axis == "", "x": [r["layer"] for r in rows],
                         "y": [sum(r[f"{p.name}_ms"] for p in PARTS) for r in rows],
                         "line": {"color": "black", "dash": "dash", "width": 1.5}, "xaxis": f"x{axis}",
                         "yaxis": f"y{axis}",
                         "hovertemplate": f"predicted (roofline) layer %{{x}}: %{{y:.3f}} ms<br>{parts} ms<extra></extra>"})
    note = {"xref": "paper", "yref": "paper", "x": 0, "xanchor": "left", "yanchor": "bottom", "showarrow": False}
    span = {"range": [-0.5, n_layers - 0.5]} if n_layers and not layers["decode"] and not layers["prefill"] else {}
    layout = {"title": {"text": title}, "barmode": "stack", "height": 580, "margin": {**MARGIN, "b": 90},
              "legend": {"orientation": "h", "y": -0.2, "yanchor": "top"},
              "xaxis": _axis("layer", anchor="y", **span), "xaxis2": _axis("layer", anchor="y2", matches="x"),
              "yaxis": _axis("ms per prompt", rangemode="tozero", domain=[0.66, 1]),
              "yaxis2": _axis("ms per token", rangemode="tozero", domain=[0, 0.36], anchor="x2"),
              "annotations": [{**note, "y": 1.0, "text": "prefill, per prompt"},
                              {**note, "y": 0.36, "text": "decode, per token (median of steps)"}]}
    if not layers["decode"] and not layers["prefill"]:
        layout["annotations"].append(_no_run_yet())
    return {"data": data, "layout": layout}


def _no_run_yet() -> dict:
    return {"xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "showarrow": False, "text": "no run yet",
            "font": {"color": "gray", "size": 14}}


def bandwidth_spec(timings: Timings, peak_gbps: float, previous=()) -> dict:
    data = []
    for age, (label, earlier) in enumerate(previous):
        steps = earlier.decode_steps
        data.append(_earlier(age, label, range(1, len(steps) + 1), (s.gbps() for s in steps)))
    decode = timings.decode_steps
    data.append({"type": "scatter", "name": "this run", "x": list(range(1, len(decode) + 1)),
                 "y": [s.gbps() for s in decode], "mode": "lines+markers"})
    top = 1.15 * max([peak_gbps, *(s.gbps() for s in decode)])
    # The peak is a shape across the whole plot, not a trace: it cannot be drawn with half its points.
    layout = {"title": {"text": "Bandwidth per decode step"}, "height": 340, "margin": MARGIN, "legend": BELOW,
              "xaxis": _axis("decode step"), "yaxis": _axis("GB/s (bytes read / step time)", range=[0, top]),
              "shapes": [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": peak_gbps,
                          "y1": peak_gbps, "line": {"dash": "dash", "color": "gray"}}],
              "annotations": [{"xref": "paper", "x": 0, "xanchor": "left", "yref": "y", "y": peak_gbps,
                               "yanchor": "bottom", "showarrow": False,
                               "text": f"measured peak: triad {peak_gbps:.1f} GB/s"}]}
    if not decode:
        layout["annotations"].append(_no_run_yet())
        layout["xaxis"]["range"] = [1, 2]
    return {"data": data, "layout": layout}


def throughput_spec(timings: Timings, batch: int, previous=()) -> dict:
    data = []
    for age, (label, earlier) in enumerate(previous):
        steps = earlier.decode_steps
        data.append(_earlier(age, label, range(1, len(steps) + 1), (s.tokens / s.total_s for s in steps)))
    decode = timings.decode_steps
    x = list(range(1, len(decode) + 1))
    data.append({"type": "scatter", "name": f"all {batch} sequences" if batch > 1 else "tokens/s", "x": x,
                 "y": [s.tokens / s.total_s for s in decode], "mode": "lines+markers"})
    if batch > 1:
        data.append({"type": "scatter", "name": "per sequence", "x": x, "mode": "lines+markers",
                     "y": [s.tokens / s.total_s / batch for s in decode], "line": {"dash": "dash"}})
    layout = {"title": {"text": f"Tokens/s per decode step (batch {batch})"}, "height": 340, "margin": MARGIN,
              "legend": BELOW,
              "xaxis": _axis("decode step"), "yaxis": _axis("tokens/s", rangemode="tozero")}
    if not decode:
        layout["annotations"] = [_no_run_yet()]
        layout["xaxis"]["range"], layout["yaxis"]["range"] = [1, 2], [0, 1]
    return {"data": data, "layout": layout}


def _waits_said(decode) -> str:
    """Of a step's communication, each rank's wait for the others (median of steps), where the
    backend measures it (shm): the ranks' imbalance, not the collectives' cost."""
    waits = [s.rank_comm_wait_s for s in decode]
    if not waits or not waits[0] or any(None in w or len(w) != len(waits[0]) for w in waits):
        return ""
    said = ", ".join(f"rank {r} {1e3 * statistics.median(w[r] for w in waits):.2f} ms" for r in range(len(waits[0])))
    return f"<br>of the communication, waiting for the other ranks: {said}"


def comm_spec(timings: Timings) -> dict:
    """Tensor parallel: per layer, a decode step's compute and communication (rank 0's view)."""
    layers = timings.per_layer("decode")
    compute = [sum(r[f"{p.name}_ms"] for p in PARTS if p.name != "comm") for r in layers]
    x = [r["layer"] for r in layers]
    data = [{"type": "bar", "name": "compute", "x": x, "y": compute, "marker": {"color": "#636efa"}},
            {"type": "bar", "name": "communication (all-reduces)", "x": x, "y": [r["comm_ms"] for r in layers],
             "marker": {"color": "#ab63fa"}}]
    decode = timings.decode_steps
    head = 1e3 * statistics.median(s.head_comm_s for s in decode) if decode else 0.0
    layout = {"title": {"text": f"Compute vs communication per layer, per decode token, median of steps (head's "
                                f"collectives: {head:.2f} ms){_waits_said(decode)}"}, "barmode": "group", "height": 300,
              "margin": MARGIN,
              "xaxis": _axis("layer"), "yaxis": _axis("ms per token (median)", rangemode="tozero")}
    return {"data": data, "layout": layout}


def expert_load_spec(load: list[list[int]], ranks: int = 2, title: str = "Expert load") -> dict:
    """A mixture of experts: tokens routed to each expert of each layer ([layers][experts]: a
    run's Timings.expert_load(), prefill and decode), as a heat map; the title gives the
    routing's entropy (bits, of the even log2 E), the busiest expert's share and, were the
    experts split over `ranks` ranks by expert (each a contiguous run), the busiest rank's
    share (workbench.analysis.experts)."""
    import torch

    from workbench.analysis.experts import ExpertRouting

    if not load:
        return _no_run_yet()
    table = torch.tensor(load, dtype=torch.int64)
    n_experts = table.shape[1]
    routing = ExpertRouting(table, 1, 1, "this run")
    entropy, busiest = statistics.fmean(routing.entropy()), statistics.fmean(routing.busiest())
    rank = f"; busiest of {ranks} ranks {statistics.fmean(routing.busiest_rank(ranks)):.0%}" if ranks <= n_experts else ""
    data = [{"type": "heatmap", "z": load, "x": list(range(n_experts)), "y": list(range(len(load))),
             "colorscale": "Blues", "colorbar": {"title": {"text": "tokens"}}}]
    layout = {"title": {"text": f"{title}: {int(table.sum())} routings; entropy {entropy:.2f} of "
                                f"{math.log2(n_experts):.2f} bits, busiest expert {busiest:.1%}{rank} (means over layers)"},
              "height": 300, "margin": MARGIN, "xaxis": _axis("expert"), "yaxis": _axis("layer")}
    return {"data": data, "layout": layout}


def moe_bytes_spec(rows: list[dict], title: str = "A mixture's decode step as the batch grows") -> dict:
    """Predicted against measured: per batch B, the MB a decode step reads (the step records'
    median over rounds with its min-max, the cost model's with the measured routing and with
    uniform routing) and the distinct experts a layer's step read. rows: bench/moe_batch.py's
    ({"batch", "measured_bytes": [per round], "predicted_bytes", "uniform_bytes",
    "measured_experts": [per round], "predicted_experts", "uniform_experts"})."""
    b = [r["batch"] for r in rows]
    mb = [[x / 1e6 for x in r["measured_bytes"]] for r in rows]
    mid = [statistics.median(m) for m in mb]

    def line(name, key, axis, dash, scale=1e6):
        return {"type": "scatter", "name": name, "x": b, "y": [r[key] / scale for r in rows], "mode": "lines",
                "line": {"dash": dash}, "xaxis": "x" if axis == "" else "x2", "yaxis": "y" + axis}

    data = [{"type": "scatter", "name": "measured (step records)", "x": b, "y": mid, "mode": "markers",
             "marker": {"size": 9, "color": "#222"},
             "error_y": {"type": "data", "symmetric": False, "array": [max(m) - c for m, c in zip(mb, mid)],
                         "arrayminus": [c - min(m) for m, c in zip(mb, mid)]}},
            line("predicted, measured routing", "predicted_bytes", "", "solid"),
            line("predicted, uniform routing", "uniform_bytes", "", "dash"),
            {"type": "scatter", "name": "experts read, measured", "x": b, "xaxis": "x2", "yaxis": "y2",
             "y": [statistics.median(r["measured_experts"]) for r in rows], "mode": "markers",
             "marker": {"size": 9, "color": "#222"}, "showlegend": False},
            {**line("experts, measured routing", "predicted_experts", "2", "solid", 1), "showlegend": False},
            {**line("experts, uniform routing", "uniform_experts", "2", "dash", 1), "showlegend": False}]
    layout = {"title": {"text": title}, "height": 360, "margin": MARGIN, "legend": BELOW,
              "xaxis": _axis("batch (tokens a step)", type="log", domain=[0, 0.46]),
              "yaxis": _axis("MB a decode step reads", rangemode="tozero"),
              "xaxis2": _axis("batch (tokens a step)", type="log", domain=[0.54, 1]),
              "yaxis2": _axis("distinct experts a layer's step reads", anchor="x2", rangemode="tozero")}
    return {"data": data, "layout": layout}


def topk_spec(topk_log: list[dict]) -> dict:
    """Tensor parallel with check_topk: the distributed top-1's agreement with the true top-1
    (running share) and the top-k overlap of each position."""
    x = list(range(1, len(topk_log) + 1))
    agree, running = 0, []
    for i, c in enumerate(topk_log):
        agree += c["top1_agrees"]
        running.append(agree / (i + 1))
    data = [{"type": "scatter", "name": "top-1 agreement so far", "x": x, "y": running, "mode": "lines+markers"},
            {"type": "scatter", "name": "top-k overlap at the position", "x": x,
             "y": [c["topk_overlap"] for c in topk_log], "mode": "markers"}]
    layout = {"title": {"text": "Distributed top-k against all logits gathered"}, "height": 300, "margin": MARGIN,
              "xaxis": _axis("position (prefill's last token, then each decode step)"),
              "yaxis": _axis("fraction", range=[0, 1.05])}
    return {"data": data, "layout": layout}


def latency_figure(timings: Timings, previous=(), predicted=None) -> go.Figure:
    return go.Figure(latency_spec(timings, previous, predicted=predicted))


def bandwidth_figure(timings: Timings, peak_gbps: float, previous=()) -> go.Figure:
    return go.Figure(bandwidth_spec(timings, peak_gbps, previous))


def throughput_figure(timings: Timings, batch: int, previous=()) -> go.Figure:
    return go.Figure(throughput_spec(timings, batch, previous))


def knee_spec(rows: list[dict], title: str = "Latency against throughput") -> dict:
    """serve-bench rows (one per offered load) as a latency-throughput curve: output tokens/s
    served on x; time to first token p50 and p99 (left axis) and time per output token p50
    (right axis) on y, each point named by its load. Where latency turns up while throughput
    stops growing is the knee; loads the server fell behind on (`overloaded`) are crosses."""
    from workbench.analysis.serve_bench import load_label

    rows = sorted(rows, key=lambda r: r["output_tokens_per_s"])
    x = [r["output_tokens_per_s"] for r in rows]
    loads = [load_label(r) for r in rows]
    symbols = ["x" if r["overloaded"] else "circle" for r in rows]

    def ms(r: dict, key: str, p: str):
        v = r[key][p]
        return None if v is None else 1e3 * v

    def trace(name: str, key: str, p: str, dash: str, axis: str = "y") -> dict:
        return {"type": "scatter", "mode": "lines+markers", "name": name, "x": x, "y": [ms(r, key, p) for r in rows],
                "text": loads, "hovertemplate": "%{text}: %{y:.0f} ms at %{x:.1f} tokens/s", "yaxis": axis,
                "line": {"dash": dash}, "marker": {"symbol": symbols, "size": 9}}

    return {"data": [trace("TTFT p50", "ttft_s", "p50", "solid"), trace("TTFT p99", "ttft_s", "p99", "dot"),
                     trace("TPOT p50 (right)", "tpot_s", "p50", "dash", "y2")],
            "layout": {"title": {"text": title}, "height": 400, "margin": {"b": 110},
                       "xaxis": _axis("output tokens/s served", rangemode="tozero"),
                       "yaxis": _axis("time to first token, ms", rangemode="tozero"),
                       "yaxis2": {"title": {"text": "time per output token, ms"}, "overlaying": "y", "side": "right",
                                  "rangemode": "tozero"},
                       "legend": BELOW}}


def figure_data(figure) -> dict:
    """A figure (plotly JSON, or a go.Figure) as a MIME bundle: plotly's own type, drawn by
    JupyterLab's plotly renderer, and its title as text where nothing draws it (a terminal)."""
    spec = json.loads(figure.to_json()) if isinstance(figure, go.Figure) else figure
    title = spec.get("layout", {}).get("title")
    title = title.get("text") if isinstance(title, dict) else title  # plotly takes either form
    return {PLOTLY_MIME: spec, "text/plain": f"<{title or 'figure'}>"}


def figure_output(figure) -> dict:
    """The figure as one notebook output (nbformat's display_data): what an ipywidgets
    Output's `outputs` tuple holds, replaced whole at each redraw."""
    return {"output_type": "display_data", "metadata": {}, "data": figure_data(figure)}


def show_figure(figure) -> None:
    """Display a figure where the code runs: the one way the magics show one. The kernel's
    display publisher takes the MIME bundle (data and metadata apart); handing it a whole
    output dict instead gives an output nbformat's schema refuses, which JupyterLab neither
    draws nor saves."""
    from IPython.display import display

    display(figure_data(figure), raw=True)


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
            from workbench.kernels.peaks import measured_peaks

            peak_gbps = measured_peaks().triad_gbps
        self.peak_gbps = peak_gbps
        self.max_fps = max_fps
        self.live = live
        self.keep_previous = keep_previous
        self.previous: list[tuple[str, Timings]] = []  # earlier finished runs, newest first
        self._finished: tuple[str, Timings] | None = None  # the last finished run (drawn, not faint)
        self.finished_runs = 0
        self.timings = Timings()
        self.batch = 1
        self.updates = 0
        self._last = float("-inf")  # the first step always draws (perf_counter may start near 0)
        self.outputs = self.distributed_outputs = self.experts_output = None
        if widget:
            import ipywidgets

            self.outputs = [ipywidgets.Output(layout=ipywidgets.Layout(width="100%")) for _ in range(3)]
            # Tensor parallel only: compute vs communication, and the top-k checks.
            self.distributed_outputs = [ipywidgets.Output(layout=ipywidgets.Layout(width="100%", display="none"))
                                        for _ in range(2)]
            # A mixture of experts only: each layer's expert load.
            self.experts_output = ipywidgets.Output(layout=ipywidgets.Layout(width="100%", display="none"))
        self.topk_log: list[dict] = []
        self.predicted: dict[str, list[dict]] | None = None  # the cost model's per-layer rows, drawn dashed
        self.n_layers: int | None = None  # the model's, for the axes of figures with no run yet
        self._draw()

    @property
    def figures(self) -> list[go.Figure]:
        """[latency, bandwidth, throughput] for the latest timings."""
        return [self.latency, self.bandwidth, self.throughput]

    @property
    def latency(self) -> go.Figure:
        return go.Figure(latency_spec(self.timings, self.previous, predicted=self.predicted, n_layers=self.n_layers))

    @property
    def bandwidth(self) -> go.Figure:
        return bandwidth_figure(self.timings, self.peak_gbps, self.previous)

    @property
    def throughput(self) -> go.Figure:
        return throughput_figure(self.timings, self.batch, self.previous)

    def box(self):
        """The figures in one ipywidgets VBox (widget mode)."""
        import ipywidgets

        self._box = ipywidgets.VBox(self.outputs + self.distributed_outputs, layout=ipywidgets.Layout(width="100%"))
        self._box_experts()
        return self._box

    def _box_experts(self) -> None:
        """The expert-load figure joins the box once a run has some (a mixture of experts only:
        a dense model's panel keeps the children it always had)."""
        box = getattr(self, "_box", None)
        if box is not None and self.experts_output.layout.display is None and self.experts_output not in box.children:
            box.children += (self.experts_output,)

    def set_layers(self, n_layers: int) -> None:
        """The model's layer count: a figure with no run yet spans them."""
        if n_layers != self.n_layers:
            self.n_layers = n_layers
            self._draw()

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

    def finish(self, timings: Timings, label: str, batch: int | None = None, topk_log=None) -> None:
        """Draw the run's final state; the run finished before it becomes a faint trace.
        topk_log: a tensor-parallel run's top-k checks (GenerationResult.topk_log)."""
        if self._finished is not None:
            self.previous = ([self._finished] + self.previous)[:self.keep_previous]
        self.finished_runs += 1
        self._finished = (f"run {self.finished_runs}: {label}", timings)  # numbered: the same settings twice differ
        self.topk_log = list(topk_log or [])
        self.update(timings, batch)

    def _draw(self) -> None:
        self.updates += 1
        if self.outputs is None:
            return
        specs = (latency_spec(self.timings, self.previous, predicted=self.predicted, n_layers=self.n_layers),
                 bandwidth_spec(self.timings, self.peak_gbps, self.previous),
                 throughput_spec(self.timings, self.batch, self.previous))
        for out, spec in zip(self.outputs, specs):
            out.outputs = (figure_output(spec),)  # one message per figure, replacing what was there
        distributed = any(s.comm_bytes for s in self.timings.steps)
        moe = any(s.expert_tokens for s in self.timings.steps)
        comm_out, topk_out = self.distributed_outputs
        experts_out = self.experts_output
        comm_out.layout.display = None if distributed else "none"
        topk_out.layout.display = None if self.topk_log else "none"
        experts_out.layout.display = None if moe else "none"
        if distributed:
            comm_out.outputs = (figure_output(comm_spec(self.timings)),)
        if self.topk_log:
            topk_out.outputs = (figure_output(topk_spec(self.topk_log)),)
        if moe:
            experts_out.outputs = (figure_output(expert_load_spec(self.timings.expert_load())),)
            self._box_experts()


def ablation_figure(rows) -> go.Figure:
    """One bar per configuration: decode tokens/s, the median with min-max error bars over the
    repeats (left), and top-1 agreement with the naive / fp32-cache reference (right), for the
    rows of workbench.analysis.ablation.run_ablation (AblationRow objects or their dicts)."""
    from workbench.model.kv_formats import kv_label

    rows = [r if isinstance(r, dict) else r.__dict__ for r in rows]
    labels = [f"{r['attention']}/{kv_label(r['kv_cache'], r.get('kv_kernel'))} len {r['prompt_len']} b{r['batch']}"
              for r in rows]
    repeats = max(r.get("repeats", 1) for r in rows)
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"decode tokens/s, median (min-max) of {repeats}",
                                                        "top-1 agreement with naive + fp32 cache"))
    tps = [r["decode_tokens_per_s"] for r in rows]
    spread = {"type": "data", "symmetric": False,
              "array": [max(r.get("decode_tokens_per_s_max") or t, t) - t for r, t in zip(rows, tps)],
              "arrayminus": [t - min(r.get("decode_tokens_per_s_min") or t, t) for r, t in zip(rows, tps)]}
    fig.add_bar(x=labels, y=tps, error_y=spread, row=1, col=1, name="tokens/s")
    fig.add_bar(x=labels, y=[r["top1_agreement"] for r in rows], row=1, col=2, name="agreement")
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="fraction of positions", range=[0, 1.05], row=1, col=2)
    fig.update_layout(height=380, showlegend=False, margin=dict(l=60, r=20, t=40, b=120))
    return fig
