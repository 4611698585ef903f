"""The report as files: JSON, and one HTML page that needs nothing but a browser (plotly's
JavaScript inlined once; no CDN, no network). Every string from a user or a model (title,
prompts, generated text, descriptions) is HTML-escaped; figure data is embedded as JSON
with "</" escaped, so nothing in it can close the script element."""

from __future__ import annotations

import html
import json
from pathlib import Path

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
            if r.get("decode_gbps"):
                points.append((f"entry {i} {r.get('attention')}/{r.get('kv_cache')} len {r.get('prompt_len')} "
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


def _kv(d: dict) -> str:
    return _table([{"field": k, "value": json.dumps(v) if isinstance(v, (dict, list)) else v} for k, v in d.items()])


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left;vertical-align:top}pre{white-space:pre-wrap}"""


def html_page(report: dict) -> str:
    from plotly.offline import get_plotlyjs

    from workbench.ui.plots import per_layer_spec  # here: plotly loads only when a page is made

    figures, sections = [], []
    summary = []
    for i, e in enumerate(report["entries"]):
        if e["kind"] == "generation":
            w = e["workload"]
            summary.append({"entry": i, "kind": "generation", "model": (e["model"] or {}).get("description"),
                            "switches": f"{w['attention']} / {w['kv_cache']}", "batch": w["batch"],
                            "prefill ms": e["prefill_ms"], "decode ms per step (median)": e["decode_step_ms"]["median"],
                            "decode tokens/s": e["decode_tokens_per_s"], "GB/s": e["decode_gbps"],
                            "GFLOP/s": e["decode_gflops"]})
            figures.append((f"fig-latency-{i}", per_layer_spec(e["per_layer_ms"], title=f"Entry {i}: per-layer latency")))
            stats = {k: v for k, v in e["decode_step_ms"].items() if k != "samples"}
            sections.append(f"<h3>Entry {i}: generation</h3>"
                            f"<p>prompt: <pre>{html.escape(str(w.get('prompt')))}</pre>"
                            f"text: <pre>{html.escape(str(e.get('text')))}</pre></p>"
                            f"{_kv({**w, 'decode step ms': stats, 'samples (ms)': e['decode_step_ms']['samples']})}"
                            f"<div id='fig-latency-{i}'></div>")
        else:
            summary.append({"entry": i, "kind": e["kind"], "model": (e["model"] or {}).get("description"),
                            "rows": len(e["rows"])})
            sections.append(f"<h3>Entry {i}: {html.escape(e['kind'])}</h3>{_table(e['rows'])}")
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
