"""Static copies of the panel's figures: plain SVG in HTML, drawn with no JavaScript.

The panel's live figures are widgets, which a saved notebook shows only while its kernel
runs; a notebook opened elsewhere (shared, untrusted, nbviewer, GitHub) shows the HTML
fallback of the panel's output instead. This module draws that fallback: per-layer decode
and prefill latency as stacked bars by timing part, and bandwidth and tokens/s per decode
step as lines, every number taken from the run's Timings (the same statistics as the live
figures: medians over steps per layer)."""

from __future__ import annotations

import html
import math

from workbench.model.timing import PARTS, Timings

WIDTH, HEIGHT = 420, 230
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 28, 34


def _ticks(top: float) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) from 0 to at least `top`."""
    if top <= 0:
        return [0.0, 1.0]
    power = 10 ** math.floor(math.log10(top / 4))
    step = next(power * f for f in (1, 2, 5, 10) if top / (power * f) <= 5)
    return [round(i * step, 12) for i in range(math.ceil(top / step) + 1)]


def _frame(title: str, ylabel: str, xlabel: str, ymax: float) -> tuple[list[str], float]:
    """The SVG's title, axes and y ticks; returns the elements and the y scale's top."""
    ticks = _ticks(ymax)
    top = max(ticks[-1], ymax) or 1.0
    h = HEIGHT - TOP - BOTTOM
    parts = [f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<line x1="{LEFT}" y1="{TOP + h}" x2="{WIDTH - RIGHT}" y2="{TOP + h}" stroke="#444"/>',
             f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + h}" stroke="#444"/>',
             f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 4}" text-anchor="middle" font-size="11">'
             f'{html.escape(xlabel)}</text>',
             f'<text x="12" y="{TOP + h / 2}" text-anchor="middle" font-size="11" '
             f'transform="rotate(-90 12 {TOP + h / 2})">{html.escape(ylabel)}</text>']
    for t in ticks:
        y = TOP + h * (1 - t / top)
        parts.append(f'<line x1="{LEFT - 3}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{LEFT - 5}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{t:g}</text>')
    return parts, top


def _svg(elements: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif">' + "".join(elements) + "</svg>")


def stacked_bars(title: str, ylabel: str, rows: list[dict]) -> str:
    """Per-layer rows of Timings.per_layer: one bar per layer, stacked by timing part."""
    totals = [sum(r[f"{p.name}_ms"] for p in PARTS) for r in rows]
    parts, top = _frame(title, ylabel, "layer", max(totals, default=0.0))
    h, w = HEIGHT - TOP - BOTTOM, WIDTH - LEFT - RIGHT
    slot = w / max(len(rows), 1)
    for i, r in enumerate(rows):
        y = TOP + h
        for p in PARTS:
            bar = h * r[f"{p.name}_ms"] / top
            if bar > 0:
                y -= bar
                parts.append(f'<rect x="{LEFT + i * slot + 0.1 * slot:.1f}" y="{y:.1f}" width="{0.8 * slot:.1f}" '
                             f'height="{bar:.1f}" fill="{p.color}"><title>layer {r["layer"]} {p.name}: '
                             f'{r[f"{p.name}_ms"]:.3f} ms</title></rect>')
    return _svg(parts)


def lines(title: str, ylabel: str, series: list[tuple[str, str, list[float]]], flat: tuple[str, float] | None = None) -> str:
    """Values per decode step (x = 1, 2, ...); `flat`, a (label, value) line across the plot."""
    ymax = max([v for _, _, ys in series for v in ys] + ([flat[1]] if flat else []), default=0.0)
    parts, top = _frame(title, ylabel, "decode step", ymax * 1.1)
    h, w = HEIGHT - TOP - BOTTOM, WIDTH - LEFT - RIGHT
    n = max((len(ys) for _, _, ys in series), default=1)
    for name, color, ys in series:
        pts = " ".join(f"{LEFT + w * (i / max(n - 1, 1)):.1f},{TOP + h * (1 - v / top):.1f}" for i, v in enumerate(ys))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"><title>'
                     f'{html.escape(name)}</title></polyline>')
    if flat:
        y = TOP + h * (1 - flat[1] / top)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="gray" '
                     f'stroke-dasharray="5,4"/><text x="{LEFT + 4}" y="{y - 4:.1f}" font-size="10">'
                     f'{html.escape(flat[0])}</text>')
    return _svg(parts)


def figures_html(timings: Timings, label: str, batch: int, peak_gbps: float) -> str:
    """The run's four static figures and a legend, as one HTML fragment."""
    decode = timings.decode_steps
    legend = " ".join(f'<span style="color:{p.color}">&#9632;</span> {html.escape(p.label)}' for p in PARTS
                      if p.name != "comm" or any(s.comm_s for s in timings.steps))
    figs = [stacked_bars("Decode: ms per token, per layer (median of steps)", "ms", timings.per_layer("decode")),
            stacked_bars("Prefill: ms per prompt, per layer", "ms", timings.per_layer("prefill")),
            lines("Achieved bandwidth per decode step", "GB/s", [("this run", "#636efa", [s.gbps() for s in decode])],
                  flat=(f"measured triad {peak_gbps:.1f} GB/s", peak_gbps)),
            lines(f"Decode tokens/s per step (batch {batch})", "tokens/s",
                  [("all sequences", "#ef553b", [s.tokens / s.total_s for s in decode])])]
    return (f'<div class="workbench-static-figures"><p><b>{html.escape(label)}</b>: a static copy of the panel\'s '
            f"figures at the end of its last run (the live figures need the notebook's kernel).</p>"
            f'<div style="display:flex;flex-wrap:wrap;gap:8px">{"".join(figs)}</div>'
            f"<p><small>{legend}</small></p></div>")
