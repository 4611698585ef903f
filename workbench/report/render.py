"""The report as files: JSON, and one HTML page that needs nothing but a browser (plotly's
JavaScript inlined once; no CDN, no network). Every string from a user or a model (title,
prompts, generated text, descriptions) is HTML-escaped; figure data is embedded as JSON
with "</" escaped, so nothing in it can close the script element.

The page reads top down as a reader asks: what was found (per measurement, in words that
respect the run-to-run spread), the figures that show it (a roofline, one figure per switch
an ablation varies), then the tables, the machine, the software and the commands. Raw JSON
keys become labels in one place (labels.FIELDS), the words of the findings are
findings.py's; the JSON keeps every key and every digit."""

from __future__ import annotations

import html
import json
from pathlib import Path

from workbench.analysis.axes import decade_axis
from workbench.analysis.tp_savings import savings_table, switch_savings
from workbench.model.kv_formats import kv_label
from workbench.hw.load import load_said
from workbench.report.collect import build, report_load
# The report package's own helpers: labels and numbers, and the findings in words.
from workbench.report.findings import (DECODE, DIMENSIONS, PREFILL, Dimension, _config, _findings, _is_grid, _matched,
                                       _repeats_said, _setting, _tp_name, _varied)
from workbench.report.labels import _folded, _grid_table, _kv, _number, _spread, _table, _with_spread


# -- figures ---------------------------------------------------------------------------------

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]


def _json_for_script(obj) -> str:
    return json.dumps(obj).replace("</", "<\\/")


def _roofline_spec(report: dict) -> dict | None:
    """Every measurement as a point (FLOPs per byte, GFLOP/s) under the measured roofline."""
    peaks = report["machine"]["peaks"]
    points = []
    for i, e in enumerate(report["entries"]):
        if e["kind"] == "generation" and e.get("decode_bytes_per_step"):
            points.append((f"entry {i}: the generation", e["decode_flops_per_step"] / e["decode_bytes_per_step"],
                           e["decode_gflops"]))
        rows = e.get("rows", []) if e["kind"] == "ablation" and _is_grid(e["rows"]) else []
        for r in (r for r in rows if r.get("decode_gbps") and r.get("decode_gflops")):
            points.append((f"entry {i}: {_config(r, _varied(rows) or DIMENSIONS[:2])}",
                           r["decode_gflops"] / r["decode_gbps"], r["decode_gflops"]))
    if not points:
        return None
    lo = min(p[1] for p in points) / 4
    hi = max(max(p[1] for p in points) * 4, 2 * peaks["fma_gflops"] / peaks["triad_gbps"])
    xs = [lo * (hi / lo) ** (k / 40) for k in range(41)]
    roof = [min(peaks["fma_gflops"], x * peaks["triad_gbps"]) for x in xs]
    data = [{"type": "scatter", "name": f"roofline: triad {peaks['triad_gbps']:.1f} GB/s, FMA "
                                        f"{peaks['fma_gflops']:.0f} GFLOP/s", "x": xs, "y": roof, "mode": "lines",
             "line": {"color": "gray", "dash": "dash"}},
            {"type": "scatter", "name": "measurements", "x": [p[1] for p in points], "y": [p[2] for p in points],
             "text": [p[0] for p in points], "mode": "markers", "marker": {"size": 9},
             "hovertemplate": "%{text}<br>%{x:.3g} FLOPs per byte, %{y:.3g} GFLOP/s<extra></extra>"}]
    return {"data": data, "layout": {"title": {"text": "Roofline: every decode measurement against the measured peaks"},
                                     "height": 420, "xaxis": decade_axis("FLOPs per byte read", xs),
                                     "yaxis": decade_axis("GFLOP/s", [*roof, *(p[2] for p in points)])}}


def _spread_bars(name: str, x: list[str], rows: list[dict], key: str, axis: str, color: str, legend: bool) -> dict:
    """Bars at the medians with min-max error bars."""
    s = [_spread(r, key) for r in rows]
    return {"type": "bar", "name": name, "legendgroup": name, "showlegend": legend, "x": x, "y": [m for m, _, _ in s],
            "marker": {"color": color}, "xaxis": f"x{axis}", "yaxis": f"y{axis}",
            "error_y": {"type": "data", "symmetric": False, "array": [hi - m for m, _, hi in s],
                        "arrayminus": [m - lo for m, lo, _ in s], "color": "#444"},
            "hovertemplate": f"{name}, %{{x}}: %{{y:.3g}}<extra></extra>"}


def _dimension_spec(i: int, rows: list[dict], dim: Dimension) -> dict:
    """One switch's settings side by side (a bar each, median with min-max) in every matched
    group: decode tokens/s above, prefill ms below."""
    groups = _matched(rows, dim, sep="<br>")  # a group's label on lines of its own
    settings = list(dict.fromkeys(_setting(dim, r) for r in rows))
    data = []
    for k, s in enumerate(settings):
        x = [g for g, by in groups.items() if s in by]
        for axis, key in (("", DECODE.key), ("2", PREFILL.key)):
            data.append(_spread_bars(s, x, [groups[g][s] for g in x], key, axis, PALETTE[k % len(PALETTE)], axis == ""))
    order = {"categoryorder": "array", "categoryarray": list(groups)}
    return {"data": data, "layout": {
        "title": {"text": f"Entry {i}: {dim.name}, each setting at the same other switches (median, min–max "
                          f"{_repeats_said(rows)})"},
        "barmode": "group", "height": 600, "margin": {"b": 110}, "legend": {"title": {"text": dim.name}},
        "xaxis": {**order, "anchor": "y", "showticklabels": False},
        "xaxis2": {**order, "anchor": "y2", "automargin": True},
        "yaxis": {"domain": [0.54, 1], "title": {"text": "decode tokens/s"}, "rangemode": "tozero"},
        "yaxis2": {"domain": [0, 0.44], "title": {"text": "prefill ms"}, "rangemode": "tozero"}}}


def _bars_with_spread(title: str, labels: list[str], rows: list[dict], unit: str) -> dict:
    """One bar per row at its median with a min-max error bar (rows: {median, min, max})."""
    return {"data": [_spread_bars(unit, labels, [{"v": r} for r in rows], "v", "", PALETTE[0], False)],
            "layout": {"title": {"text": title}, "height": 380, "margin": {"b": 140},
                       "yaxis": {"title": {"text": unit}, "rangemode": "tozero"}}}


def _comm_compute_spec(title: str, labels: list[str], total_ms: list[float], comm_ms: list[float]) -> dict:
    return {"data": [{"type": "bar", "name": "compute", "x": labels, "y": [t - c for t, c in zip(total_ms, comm_ms)]},
                     {"type": "bar", "name": "communication", "x": labels, "y": comm_ms}],
            "layout": {"title": {"text": title}, "barmode": "stack", "height": 380, "margin": {"b": 160},
                       "yaxis": {"title": {"text": "ms per decode token"}, "rangemode": "tozero"}}}


def _bandwidth_spec(i: int, e: dict, peak_gbps: float) -> dict:
    """GB/s of each decode step (the step's bytes over its time) against the measured triad."""
    samples = e["decode_step_ms"]["samples"]
    gbps = [e["decode_bytes_per_step"] / (ms / 1e3) / 1e9 for ms in samples]
    top = 1.15 * max([peak_gbps, *gbps])
    return {"data": [{"type": "scatter", "mode": "lines+markers", "name": "decode steps",
                      "x": list(range(1, len(gbps) + 1)), "y": gbps}],
            "layout": {"title": {"text": f"Entry {i}: bandwidth per decode step (bytes read / step time)"},
                       "height": 300, "xaxis": {"title": {"text": "decode step"}},
                       "yaxis": {"title": {"text": "GB/s"}, "range": [0, top]},
                       "shapes": [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": peak_gbps, "y1": peak_gbps,
                                   "line": {"dash": "dash", "color": "gray"}}],
                       "annotations": [{"xref": "paper", "x": 0, "xanchor": "left", "y": peak_gbps, "yanchor": "bottom",
                                        "showarrow": False, "text": f"measured triad {peak_gbps:.1f} GB/s"}]}}


def _figure(figures: list, fid: str, spec: dict) -> str:
    figures.append((fid, spec))
    return f"<div id='{fid}' class='figure'></div>"


# -- sections, one per entry -----------------------------------------------------------------

PREDICTED_COLUMNS = ["phase", "part", "predicted_ms", "measured_ms", "ratio", "bound", "why"]
WORKLOAD = ["prompt_tokens", "batch", "new_tokens", "threads", "attention", "kv_cache", "kv_kernel", "step",
            "sampling", "gemm_engine", "tensor_parallel", "prompt_sha256"]
TIMINGS = ["prefill_ms", "time_to_first_token_ms", "decode_step_ms", "decode_tokens_per_s", "decode_gbps",
           "decode_gflops", "decode_bytes_per_step", "decode_flops_per_step", "decode_comm_ms_per_step",
           "decode_wake_ms_per_step"]


def _cost_model(predicted: dict) -> str:
    if predicted.get("parts"):
        flagged = [r for r in predicted["parts"] if r["why"]]
        return (f"<h4>Cost model: predicted vs measured per part</h4><p>{html.escape(predicted['hardware']['notes'])}"
                f"; decode predicted at KV length {predicted['decode_kv_len']:g}. Bandwidth utilisation "
                f"{100 * predicted['utilisation']['bandwidth_utilisation']:.0f}%, MFU "
                f"{100 * predicted['utilisation']['mfu']:.1f}%. {len(flagged)} part(s) differ by more than 1.5x; "
                f"the last column says why.</p>{_table(predicted['parts'], PREDICTED_COLUMNS)}")
    if predicted.get("error"):
        return f"<p>no prediction: {html.escape(predicted['error'])}</p>"
    return ""


def _timings_table(e: dict) -> str:
    s = e["decode_step_ms"]
    steps = {"decode_step_ms": f"{_with_spread(s['median'], s['min'], s['max'], 'ms')}, median (min–max) over "
                               f"{len(s['samples'])} steps; p90 {_number(s['p90'], 'ms')}" if s["samples"] else None}
    return _kv({k: steps.get(k, e.get(k)) for k in TIMINGS if k in e})


def _generation_section(i: int, e: dict, figures: list, peak_gbps: float) -> str:
    from workbench.ui.plots import expert_load_spec, per_layer_spec, topk_spec  # plotly loads only when a page is made

    w = e["workload"]
    predicted = e.get("predicted") or {}
    body = _figure(figures, f"fig-latency-{i}", per_layer_spec(
        e["per_layer_ms"], title=f"Entry {i}: per-layer latency (dashed: the roofline prediction)",
        predicted=predicted.get("per_layer_ms"))) + _cost_model(predicted)
    if e.get("decode_bytes_per_step") and e["decode_step_ms"]["samples"]:
        body += _figure(figures, f"fig-bandwidth-{i}", _bandwidth_spec(i, e, peak_gbps))
    if e.get("topk_checks"):
        body += _figure(figures, f"fig-topk-{i}", topk_spec(e["topk_checks"]))
    if e.get("expert_load"):
        body += _figure(figures, f"fig-experts-{i}", expert_load_spec(e["expert_load"], title=f"Entry {i}: expert load"))
    if e.get("decode_comm_ms_per_step"):
        body += _figure(figures, f"fig-comm-{i}", _comm_compute_spec(
            f"Entry {i}: communication vs compute", ["decode step"], [e["decode_step_ms"]["median"]],
            [e["decode_comm_ms_per_step"]]))
    return (f"<h3 id='entry-{i}'>Entry {i}: generation</h3>"
            f"<div><b>Prompt</b>: {_folded(w.get('prompt'))}</div><div><b>Generated</b>: {_folded(e.get('text'))}</div>"
            f"<div class='side'><div><h4>Workload</h4>{_kv({k: w.get(k) for k in WORKLOAD if k in w})}</div>"
            f"<div><h4>Timings</h4>{_timings_table(e)}</div></div>{body}")


def _ablation_body(i: int, rows: list[dict], figures: list) -> str:
    if not _is_grid(rows):
        return _grid_table(rows)
    figs = "".join(_figure(figures, f"fig-ablation-{i}-{d.slug}", _dimension_spec(i, rows, d)) for d in _varied(rows))
    view = [{"attention": r["attention"], "cache": kv_label(r["kv_cache"], r.get("kv_kernel")),
             **{k: v for k, v in r.items() if k not in ("attention", "kv_cache", "kv_kernel")}} for r in rows]
    return figs + _grid_table(view)


PEER_COLUMNS = ["engine", "prompt_len", "new_tokens", "prefill_ms", "decode_tokens_per_s", "decode_gbps",
                "decode_pct_of_triad", "ours_over_peer_prefill", "ours_over_peer", "matched", "same_tokens_as_workbench_fp32", "description"]


def _peers_body(i: int, rows: list[dict], figures: list) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    absent = [{"engine": r["engine"], "status": r["status"]} for r in rows if r.get("status") != "ok"]
    body = ""
    if ok:
        body = _figure(figures, f"fig-peers-{i}", _bars_with_spread(
            f"Entry {i}: decode tokens/s, median and min-max over rounds",
            [f"{r['engine']} (prompt {r['prompt_len']})" for r in ok], [r["decode_tokens_per_s"] for r in ok],
            "tokens/s"))
    columns = [c for c in PEER_COLUMNS if any(c in r for r in ok)]
    return body + (_grid_table(ok, columns) if ok else "") + ("<h4>Not run</h4>" + _table(absent) if absent else "")


def _tp_body(i: int, rows: list[dict], figures: list) -> str:
    fig = _figure(figures, f"fig-tp-{i}", _comm_compute_spec(
        f"Entry {i}: communication vs compute per decode token", [_tp_name(r, "<br>") for r in rows],
        [r["decode_ms_per_token"] for r in rows], [r["comm_ms_per_token"] for r in rows]))
    savings = savings_table(switch_savings(rows))
    return fig + _grid_table(rows) + (
        "<p>Each switch's saving per decode token: its optimization against the setting without it, in rows "
        "matched on the other switches; ms as the paired rows' difference round by round, median (min–max) "
        "over every pair and round.</p>" + _grid_table(savings) if savings else "")


SERVE_COLUMNS = ["load", "requests", "completed", "num_requests", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p99",
                 "output_tokens_per_s", "requests_per_s", "goodput_requests_per_s", "prefix_hit_rate", "overloaded"]


def _serve_body(i: int, rows: list[dict], figures: list) -> str:
    from workbench.analysis.serve_bench import load_label, workload_label
    from workbench.ui.plots import knee_spec

    def ms(p: dict, key: str):
        return None if p[key] is None else 1e3 * p[key]

    flat = [{**r, "load": load_label(r), "requests": workload_label(r), "ttft_ms_p50": ms(r["ttft_s"], "p50"), "ttft_ms_p99": ms(r["ttft_s"], "p99"),
             "tpot_ms_p50": ms(r["tpot_s"], "p50"), "itl_ms_p99": ms(r["itl_s"], "p99")} for r in rows]
    return (_figure(figures, f"fig-serve-{i}", knee_spec(rows, f"Entry {i}: latency against throughput"))
            + _grid_table(flat, SERVE_COLUMNS))


WEIGHT_COLUMNS = ["format", "formats", "bits_per_weight", "bytes_per_token", "kl_nats", "kl_nats_max", "top1_agreement",
                  "perplexity", "decode_tok_s", "decode_pct_of_triad", "prefill_ms"]


def _weight_body(i: int, rows: list[dict], figures: list) -> str:
    from workbench.analysis.weight_study import study_figure

    spec = study_figure(rows)
    spec["layout"]["title"]["text"] = f"Entry {i}: " + spec["layout"]["title"]["text"]
    return _figure(figures, f"fig-weights-{i}", spec) + _grid_table(rows, WEIGHT_COLUMNS)


def _rows_section(i: int, e: dict, figures: list) -> str:
    body = {"peers": _peers_body, "tp_ablation": _tp_body, "ablation": _ablation_body, "serve_bench": _serve_body,
            "weight_quality": _weight_body}.get(
        e["kind"], lambda i, rows, figures: _grid_table(rows))(i, e["rows"], figures)
    return f"<h3 id='entry-{i}'>Entry {i}: {html.escape(e['kind'].replace('_', ' '))}</h3>{body}"


def _profile_section(i: int, e: dict) -> str:
    return (f"<h3 id='entry-{i}'>Entry {i}: profile</h3><p>py-spy {html.escape(str(e.get('py_spy')))} at "
            f"{e.get('rate')} Hz{' with native frames' if e.get('native') else ''}, {e.get('samples')} samples of "
            f"<code>{html.escape(str(e.get('statement')))}</code>; speedscope JSON: "
            f"<code>{html.escape(e['speedscope'])}</code> (open it in speedscope.app)</p>"
            f"{_table(e['top_frames'])}")


def _section(i: int, e: dict, figures: list, report: dict) -> str:
    if e["kind"] == "generation":
        return _generation_section(i, e, figures, report["machine"]["peaks"]["triad_gbps"])
    if e["kind"] == "profile":
        return _profile_section(i, e)
    return _rows_section(i, e, figures)


CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222;
line-height:1.45}
h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:1.6em}h3{margin:1.2em 0 .3em}h3 a{color:inherit}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 8px;font-size:13px;text-align:left;
vertical-align:top}th{background:#f4f4f4;font-weight:600}th small{font-weight:400;color:#666}td.num{text-align:right;
font-variant-numeric:tabular-nums;white-space:nowrap}tbody tr:nth-child(even) td{background:#fafafa}
table.kv th{white-space:nowrap}table.kv td{overflow-wrap:anywhere}table.kv table.kv{margin:0}table.kv table.kv th{background:#fafafa}
pre{white-space:pre-wrap;margin:.2em 0;font-size:13px}.meta{color:#555;font-size:14px}
.note{color:#555;font-size:13px;background:#f7f7f7;padding:.5em .8em;border-left:3px solid #ccc}
.finding{margin-bottom:.8em}.finding ul{margin:.2em 0;padding-left:1.4em}.finding li{margin:.25em 0}
table.findings td{font-size:14px;width:45%}table.findings th{font-size:14px}table.findings ul{margin:.2em 0}
details summary{cursor:pointer;color:#333}details summary .meta{font-size:12px}details pre{background:#f7f7f7;
padding:.5em}.side{display:flex;gap:2em;flex-wrap:wrap}.side>div{flex:1;min-width:420px}.figure{margin:.6em 0}
tbody tr.regression td{background:#fdd}tbody tr.improvement td{background:#dfd}.verdict{font-size:17px}"""


def html_page(report: dict) -> str:
    from plotly.offline import get_plotlyjs

    figures: list = []
    roof = _roofline_spec(report)
    roof_div = _figure(figures, "fig-roofline", roof) if roof else ""
    sections = "".join(_section(i, e, figures, report) for i, e in enumerate(report["entries"]))
    plots = "".join(f"Plotly.newPlot({json.dumps(fid)}, {_json_for_script(spec['data'])}, "
                    f"{_json_for_script(spec['layout'])});" for fid, spec in figures)
    commands = "".join(f"<pre>{html.escape(c)}</pre>" for c in report["reproduce"]) or "<p><i>none recorded</i></p>"
    cpu = report["machine"].get("cpu_model", "an unnamed CPU")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(report['title'])}</title><style>{CSS}</style>
<script>{get_plotlyjs()}</script></head>
<body>
<h1>{html.escape(report['title'])}</h1>
<p class='meta'>{len(report['entries'])} measurement(s) on {html.escape(str(cpu))} with
{report['machine'].get('threads_used', '?')} thread(s); created {html.escape(report['created'])}; peak resident memory
{report['peak_rss_bytes'] / 2**20:.0f} MiB; schema version {report['schema_version']}</p>
<p class='meta'>Measured in {html.escape(str(report['software'].get('frontend', 'an unrecorded frontend')))};
the busiest the machine was at a measurement: {html.escape(load_said(report_load(report)))}</p>
{_findings(report)}
{roof_div}
<h2>Measurements</h2>{sections}
<h2>Machine</h2>{_kv(report['machine'])}
<h2>Software</h2>{_kv(report['software'])}
<h2>Reproduce</h2>{commands}
<script>{plots}</script>
</body></html>
"""


def write(path=None, title: str = "Workbench report", entries: list[dict] | None = None) -> dict:
    """Write the report (default: this session's measurements) as HTML at `path` (default
    report.html in workbench.cache.results_dir()) and JSON beside it; returns {"html": Path,
    "json": Path, "entries": n}, the paths absolute."""
    from workbench.cache import results_dir

    path = (results_dir() / "report.html" if path is None else Path(path).expanduser()).resolve()
    if path.suffix != ".html":
        raise ValueError(f"the report path must end in .html (the JSON is written beside it), got {str(path)!r}")
    report = build(entries, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2, default=str))
    path.write_text(html_page(report))
    return {"html": path, "json": json_path, "entries": len(report["entries"])}
