"""The report as files: JSON, and one HTML page that needs nothing but a browser (plotly's
JavaScript inlined once; no CDN, no network). Every string from a user or a model (title,
prompts, generated text, descriptions) is HTML-escaped; figure data is embedded as JSON
with "</" escaped, so nothing in it can close the script element."""

from __future__ import annotations

import html
import json
from pathlib import Path

from workbench.model.kv_formats import kv_label
from workbench.report.collect import build


def _json_for_script(obj) -> str:
    return json.dumps(obj).replace("</", "<\\/")


def _roofline_spec(report: dict) -> dict | None:
    """Every measurement as a point (FLOPs per byte, GFLOP/s) under the measured roofline."""
    peaks = report["machine"]["peaks"]
    points = []
    for i, e in enumerate(report["entries"]):
        if e["kind"] == "generation" and e.get("decode_bytes_per_step"):
            points.append((f"entry {i} decode", e["decode_flops_per_step"] / e["decode_bytes_per_step"],
                           e["decode_gflops"]))
        for r in e.get("rows", []):
            if r.get("decode_gbps") and r.get("decode_gflops"):  # ablation rows (peers rows have no FLOPs)
                points.append((f"entry {i} {r.get('attention')}/{kv_label(r.get('kv_cache'), r.get('kv_kernel'))} len {r.get('prompt_len')} "
                               f"b{r.get('batch')}", r["decode_gflops"] / r["decode_gbps"], r["decode_gflops"]))
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
             "text": [p[0] for p in points], "mode": "markers", "marker": {"size": 9}}]
    return {"data": data, "layout": {"title": {"text": "Roofline: every decode measurement against the measured peaks"},
                                     "height": 420, "xaxis": {"type": "log", "title": {"text": "FLOPs per byte read"}},
                                     "yaxis": {"type": "log", "title": {"text": "GFLOP/s"}}}}


def _table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "<p><i>none</i></p>"
    columns = columns or list(rows[0])

    def cell(v):
        if isinstance(v, float):
            v = f"{v:.4g}"
        return html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _readable(v) -> str:
    """A value as a reader meets it: nested records as "name: value" pairs, lists joined,
    floats to four significant digits (the JSON keeps every digit)."""
    if isinstance(v, dict):
        return "; ".join(f"{str(k).replace('_', ' ')}: {_readable(x)}" for k, x in v.items()) or "-"
    if isinstance(v, (list, tuple)):
        if len(v) > 12 and all(isinstance(x, (int, float)) for x in v):
            return f"{len(v)} values, {_readable(min(v))} to {_readable(max(v))}"
        return ", ".join(_readable(x) for x in v) or "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _kv(d: dict) -> str:
    return _table([{"field": str(k).replace("_", " "), "value": _readable(v)} for k, v in d.items()])


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left;vertical-align:top}pre{white-space:pre-wrap}"""


def _bars_with_spread(title: str, labels: list[str], rows: list[dict], unit: str) -> dict:
    """One bar per row at its median with a min-max error bar."""
    med = [r["median"] for r in rows]
    return {"data": [{"type": "bar", "x": labels, "y": med, "name": unit,
                      "error_y": {"type": "data", "symmetric": False, "array": [r["max"] - r["median"] for r in rows],
                                  "arrayminus": [r["median"] - r["min"] for r in rows]}}],
            "layout": {"title": {"text": title}, "height": 380, "yaxis": {"title": {"text": unit}, "rangemode": "tozero"},
                       "margin": {"b": 140}}}


def _comm_compute_spec(title: str, labels: list[str], total_ms: list[float], comm_ms: list[float]) -> dict:
    return {"data": [{"type": "bar", "name": "compute", "x": labels, "y": [t - c for t, c in zip(total_ms, comm_ms)]},
                     {"type": "bar", "name": "communication", "x": labels, "y": comm_ms}],
            "layout": {"title": {"text": title}, "barmode": "stack", "height": 380, "margin": {"b": 160},
                       "yaxis": {"title": {"text": "ms per decode token"}, "rangemode": "tozero"}}}


PREDICTED_COLUMNS = ["phase", "part", "predicted_ms", "measured_ms", "ratio", "bound", "why"]


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


def _generation_section(i: int, e: dict, figures: list, peak_gbps: float) -> str:
    from workbench.ui.plots import per_layer_spec, topk_spec  # here: plotly loads only when a page is made

    w = e["workload"]
    predicted = e.get("predicted") or {}
    figures.append((f"fig-latency-{i}", per_layer_spec(e["per_layer_ms"], title=f"Entry {i}: per-layer latency "
                                                       "(dashed: the roofline prediction)",
                                                       predicted=predicted.get("per_layer_ms"))))
    stats = {k: v for k, v in e["decode_step_ms"].items() if k != "samples"}
    parts = ""
    if predicted.get("parts"):
        flagged = [r for r in predicted["parts"] if r["why"]]
        parts = (f"<h4>Cost model: predicted vs measured per part</h4><p>{html.escape(predicted['hardware']['notes'])}"
                 f"; decode predicted at KV length {predicted['decode_kv_len']:g}. Bandwidth utilisation "
                 f"{100 * predicted['utilisation']['bandwidth_utilisation']:.0f}%, MFU "
                 f"{100 * predicted['utilisation']['mfu']:.1f}%. {len(flagged)} part(s) differ by more than 1.5x; "
                 f"the last column says why.</p>{_table(predicted['parts'], PREDICTED_COLUMNS)}")
    elif predicted.get("error"):
        parts = f"<p>no prediction: {html.escape(predicted['error'])}</p>"
    extra = ""
    if e.get("decode_bytes_per_step") and e["decode_step_ms"]["samples"]:
        figures.append((f"fig-bandwidth-{i}", _bandwidth_spec(i, e, peak_gbps)))
        extra += f"<div id='fig-bandwidth-{i}'></div>"
    if e.get("topk_checks"):
        figures.append((f"fig-topk-{i}", topk_spec(e["topk_checks"])))
        extra += f"<div id='fig-topk-{i}'></div>"
    if e.get("decode_comm_ms_per_step"):
        total = e["decode_step_ms"]["median"]
        figures.append((f"fig-comm-{i}", _comm_compute_spec(f"Entry {i}: communication vs compute", ["decode step"],
                                                            [total], [e["decode_comm_ms_per_step"]])))
        extra += f"<div id='fig-comm-{i}'></div>"
    return (f"<h3>Entry {i}: generation</h3>"
            f"<p>prompt: <pre>{html.escape(str(w.get('prompt')))}</pre>"
            f"text: <pre>{html.escape(str(e.get('text')))}</pre></p>"
            f"{_kv({**w, 'decode step ms': stats, 'samples (ms)': e['decode_step_ms']['samples']})}"
            f"<div id='fig-latency-{i}'></div>{parts}{extra}")


def _rows_section(i: int, e: dict, figures: list) -> str:
    kind, rows = e["kind"], e["rows"]
    body = ""
    if kind == "peers":
        ok = [r for r in rows if r.get("status") == "ok"]
        flat = [{"engine": r["engine"], "prompt": r["prompt_len"], "new tokens": r["new_tokens"],
                 "prefill ms (median)": r["prefill_ms"]["median"],
                 "prefill min-max": f"{r['prefill_ms']['min']:.1f}-{r['prefill_ms']['max']:.1f}",
                 "decode tok/s (median)": r["decode_tokens_per_s"]["median"],
                 "decode min-max": f"{r['decode_tokens_per_s']['min']:.1f}-{r['decode_tokens_per_s']['max']:.1f}",
                 "ours/peer decode": (f"{r['ours_over_peer']['median']:.2f} ({r['ours_over_peer']['min']:.2f}-"
                                      f"{r['ours_over_peer']['max']:.2f}) vs {r['matched']}")
                 if r.get("ours_over_peer") else "-",
                 "same tokens as workbench fp32": r.get("same_tokens_as_workbench_fp32"),
                 "engine details": r.get("description")} for r in ok]
        absent = [{"engine": r["engine"], "why not run": r["status"]} for r in rows if r.get("status") != "ok"]
        if ok:
            figures.append((f"fig-peers-{i}", _bars_with_spread(
                f"Entry {i}: decode tokens/s, median and min-max over rounds",
                [f"{r['engine']} (prompt {r['prompt_len']})" for r in ok], [r["decode_tokens_per_s"] for r in ok],
                "tokens/s")))
            body = f"<div id='fig-peers-{i}'></div>"
        body += _table(flat) + ("<h4>Not run</h4>" + _table(absent) if absent else "")
    elif kind == "tp_ablation":
        labels = [f"{r['ranks']} {r['backend']} {r['token_broadcast']} {r['lm_head']} zc {r['zero_copy']}" for r in rows]
        figures.append((f"fig-tp-{i}", _comm_compute_spec(f"Entry {i}: communication vs compute per decode token",
                                                          labels, [r["decode_ms_per_token"] for r in rows],
                                                          [r["comm_ms_per_token"] for r in rows])))
        body = f"<div id='fig-tp-{i}'></div>" + _table(rows)
    else:
        body = _table(rows)
    return f"<h3>Entry {i}: {html.escape(kind)}</h3>{body}"


def _summary_row(i: int, e: dict) -> dict:
    model = (e.get("model") or {}).get("description")
    if e["kind"] == "generation":
        w = e["workload"]
        return {"entry": i, "kind": "generation", "model": model, "switches": f"{w['attention']} / {kv_label(w['kv_cache'], w.get('kv_kernel'))}",
                "batch": w["batch"], "prefill ms": e["prefill_ms"],
                "decode ms per step (median)": e["decode_step_ms"]["median"],
                "decode tokens/s (over the wall time)": e["decode_tokens_per_s"], "GB/s": e["decode_gbps"],
                "GFLOP/s": e["decode_gflops"]}
    if e["kind"] == "ablation" and e.get("rows") and "decode_tokens_per_s" in e["rows"][0]:
        best = max(e["rows"], key=lambda r: r["decode_tokens_per_s"])
        return {"entry": i, "kind": "ablation", "model": model, "rows": len(e["rows"]),
                "switches": f"fastest: {best['attention']} / {kv_label(best['kv_cache'], best.get('kv_kernel'))}",
                "batch": best.get("batch"), "prefill ms": best.get("prefill_ms"),
                "decode tokens/s (over the wall time)": best["decode_tokens_per_s"]}
    if e["kind"] == "profile":
        return {"entry": i, "kind": "profile", "model": model, "statement": e.get("statement")}
    return {"entry": i, "kind": e["kind"], "model": model, "rows": len(e["rows"])}


def _profile_section(i: int, e: dict) -> str:
    return (f"<h3>Entry {i}: profile</h3><p>py-spy {html.escape(str(e.get('py_spy')))} at {e.get('rate')} Hz"
            f"{' with native frames' if e.get('native') else ''}, {e.get('samples')} samples of "
            f"<code>{html.escape(str(e.get('statement')))}</code>; speedscope JSON: "
            f"<code>{html.escape(e['speedscope'])}</code> (open it in speedscope.app)</p>"
            f"{_table(e['top_frames'])}")


def html_page(report: dict) -> str:
    from plotly.offline import get_plotlyjs

    figures, sections, summary = [], [], []
    for i, e in enumerate(report["entries"]):
        summary.append(_summary_row(i, e))
        if e["kind"] == "generation":
            sections.append(_generation_section(i, e, figures, report["machine"]["peaks"]["triad_gbps"]))
        elif e["kind"] == "profile":
            sections.append(_profile_section(i, e))
        else:
            sections.append(_rows_section(i, e, figures))
    roof = _roofline_spec(report)
    if roof:
        figures.insert(0, ("fig-roofline", roof))
    plots = "".join(f"Plotly.newPlot({json.dumps(fid)}, {_json_for_script(spec['data'])}, "
                    f"{_json_for_script(spec['layout'])});" for fid, spec in figures)
    commands = "".join(f"<pre>{html.escape(c)}</pre>" for c in report["reproduce"]) or "<p><i>none recorded</i></p>"
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(report['title'])}</title><style>{CSS}</style>
<script>{get_plotlyjs()}</script></head>
<body>
<h1>{html.escape(report['title'])}</h1>
<p>created {html.escape(report['created'])}; schema version {report['schema_version']};
{len(report['entries'])} measurement(s); peak resident memory {report['peak_rss_bytes'] / 2**20:.0f} MiB</p>
<h2>Summary</h2>{_table(summary)}
{"<div id='fig-roofline'></div>" if roof else ""}
<h2>Measurements</h2>{''.join(sections)}
<h2>Machine</h2>{_kv(report['machine'])}
<h2>Software</h2>{_kv(report['software'])}
<h2>Reproduce</h2>{commands}
<script>{plots}</script>
</body></html>
"""


def write(path="results/report.html", title: str = "Workbench report", entries: list[dict] | None = None) -> dict:
    """Write the report (default: this session's measurements) as HTML at `path` and JSON beside
    it; returns {"html": Path, "json": Path, "entries": n}."""
    path = Path(path)
    if path.suffix != ".html":
        raise ValueError(f"the report path must end in .html (the JSON is written beside it), got {str(path)!r}")
    report = build(entries, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2, default=str))
    path.write_text(html_page(report))
    return {"html": path, "json": json_path, "entries": len(report["entries"])}
