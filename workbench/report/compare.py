"""Two reports side by side: every measurement both have, the ratio, and a verdict that
respects noise.

    rows = compare(load("a.json"), load("b.json"))
    print(format_compare(rows))                     # or: workbench compare a.json b.json -o diff.html

A measurement is matched by what was run (kind, model, switches, batch, prompt length,
threads, ranks, engine), not by its position. Each side has a median and the min-max of its
samples (a generation's per-step decode times, a tensor-parallel row's repeats, a peer's
rounds; a serve-bench load is one run, so its ratios come without a verdict). The verdict, for B against A:
    within noise   the two min-max ranges overlap
    regression     B is worse (slower, or fewer tokens/s) and the ranges do not overlap
    improvement    B is better and the ranges do not overlap
    no spread      one side has a single sample: only the ratio can be given

Before any verdict, a warning where the two runs were made in different conditions
(load_warnings): the machine busier in one (other processes on half a CPU more, or load
averages a quarter of the CPUs apart), or another frontend (a Jupyter kernel against an
IPython terminal). A verdict between such runs measures the conditions as much as the code.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from workbench.model.kv_formats import kv_label
from workbench.report.collect import report_load


def load(path) -> dict:
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable report JSON ({e})") from None
    if not isinstance(report, dict) or "schema_version" not in report or "entries" not in report:
        raise ValueError(f"{path}: not a workbench report (no schema_version / entries)")
    return report


def _metric(name: str, unit: str, better: str, median, lo=None, hi=None, n: int = 1) -> dict:
    return {"metric": name, "unit": unit, "better": better, "median": median,
            "min": median if lo is None else lo, "max": median if hi is None else hi, "n": n}


def measurements(report: dict) -> dict[str, dict]:
    """key -> metric dict, for every measurement in a report."""
    out: dict[str, dict] = {}

    def add(key: str, metric: dict) -> None:
        if metric["median"] is None:
            return
        k, i = f"{key} | {metric['metric']}", 2
        while k in out:  # the same configuration measured again in one report
            k, i = f"{key} #{i} | {metric['metric']}", i + 1
        out[k] = metric

    for e in report.get("entries", []):
        model = (e.get("model") or {}).get("name", "?")
        kind = e.get("kind")
        if kind == "generation":
            w = e["workload"]
            ranks = (e.get("model") or {}).get("ranks", 1)
            key = (f"generation {model} {w['attention']}/{kv_label(w['kv_cache'], w.get('kv_kernel'))} batch {w['batch']} prompt "
                   f"{max(w['prompt_tokens'])} threads {w['threads']} ranks {ranks}")
            s = e["decode_step_ms"]
            add(key, _metric("decode ms per step", "ms", "lower", s["median"], s["min"], s["max"], len(s["samples"])))
            add(key, _metric("prefill ms", "ms", "lower", e.get("prefill_ms")))
        elif kind == "ablation":
            for r in e["rows"]:
                key = f"ablation {model} {r['attention']}/{kv_label(r['kv_cache'], r.get('kv_kernel'))} batch {r['batch']} prompt {r['prompt_len']}"
                n = r.get("repeats", 1)  # the row's median with the min-max of its repeats
                add(key, _metric("decode tokens/s", "tokens/s", "higher", r["decode_tokens_per_s"],
                                 r.get("decode_tokens_per_s_min"), r.get("decode_tokens_per_s_max"), n))
                add(key, _metric("prefill ms", "ms", "lower", r["prefill_ms"], r.get("prefill_ms_min"),
                                 r.get("prefill_ms_max"), n))
        elif kind == "tp_ablation":
            for r in e["rows"]:
                key = (f"tensor parallel {model} ranks {r['ranks']} {r['backend']} {r['token_broadcast']} "
                       f"{r['lm_head']} zero copy {r['zero_copy']}"
                       + (f" KV handoff {r['kv_handoff']}" if r.get("kv_handoff", "n/a") not in ("n/a", "-") else ""))
                add(key, _metric("decode ms per token", "ms", "lower", r["decode_ms_per_token"], r.get("decode_ms_min"),
                                 r.get("decode_ms_max"), r.get("repeats", 1)))
        elif kind == "peers":
            for r in e["rows"]:
                if r.get("status") != "ok":
                    continue
                key = f"peer {r['engine']} prompt {r['prompt_len']} threads {r['threads']}"
                for name, unit, better, field in (("decode tokens/s", "tokens/s", "higher", "decode_tokens_per_s"),
                                                  ("prefill ms", "ms", "lower", "prefill_ms")):
                    d = r[field]
                    add(key, _metric(name, unit, better, d["median"], d["min"], d["max"], len(d.get("samples", []))))
        elif kind == "serve_bench":
            from workbench.analysis.serve_bench import load_label, workload_label

            for r in e["rows"]:  # one run per load: no repeats, so a ratio without a verdict
                key = f"serve {r.get('label') or r.get('url')} {load_label(r)} {workload_label(r)}"
                for name, unit, better, value in (
                        ("TTFT p50 ms", "ms", "lower", r["ttft_s"]["p50"]), ("TTFT p99 ms", "ms", "lower", r["ttft_s"]["p99"]),
                        ("TPOT p50 ms", "ms", "lower", r["tpot_s"]["p50"]),
                        ("output tokens/s", "tokens/s", "higher", r["output_tokens_per_s"]),
                        ("goodput req/s", "req/s", "higher", r["goodput_requests_per_s"])):
                    add(key, _metric(name, unit, better, None if value is None else
                                     (1e3 * value if unit == "ms" else value)))
    return out


def _verdict(a: dict, b: dict) -> str:
    if a["n"] < 2 or b["n"] < 2:
        return "no spread"
    if a["min"] <= b["max"] and b["min"] <= a["max"]:
        return "within noise"
    worse = b["median"] > a["median"] if a["better"] == "lower" else b["median"] < a["median"]
    return "regression" if worse else "improvement"


def compare(a: dict, b: dict) -> list[dict]:
    """One row per measurement both reports have (then those only one has)."""
    ma, mb = measurements(a), measurements(b)
    rows = []
    for key in [k for k in ma if k in mb]:
        x, y = ma[key], mb[key]
        rows.append({"measurement": key, "unit": x["unit"], "a": x["median"], "a_min": x["min"], "a_max": x["max"],
                     "b": y["median"], "b_min": y["min"], "b_max": y["max"],
                     "ratio_b_over_a": y["median"] / x["median"] if x["median"] else None,
                     "verdict": _verdict(x, y)})
    for key, side in [(k, "a") for k in ma if k not in mb] + [(k, "b") for k in mb if k not in ma]:
        m = (ma if side == "a" else mb)[key]
        rows.append({"measurement": key, "unit": m["unit"], side: m["median"], f"{side}_min": m["min"],
                     f"{side}_max": m["max"], "verdict": f"only in {side.upper()}"})
    return rows


# Two runs' loads differ when other processes kept this many more CPUs busy in one, or their
# load averages (1 minute) are this share of the CPUs apart (at least one runnable thread).
BUSY_CPUS_APART = 0.5
LOADAVG_SHARE_APART = 0.25


def load_warnings(a: dict, b: dict) -> list[str]:
    """Why A and B may not be comparable: different machine loads, another frontend, or a load
    not recorded on one side."""
    from workbench.hw.load import load_said

    warnings = []
    la, lb = report_load(a), report_load(b)
    if la is None or lb is None:
        missing = " and ".join(side for side, x in (("A", la), ("B", lb)) if x is None)
        warnings.append(f"{missing} recorded no machine load: whether the machine was busy cannot be told")
    else:
        cpus = max(la["cpus"] or 1, lb["cpus"] or 1)
        if (abs(la["busy_elsewhere_cpus"] - lb["busy_elsewhere_cpus"]) >= BUSY_CPUS_APART or
                abs(la["loadavg"][0] - lb["loadavg"][0]) >= max(1.0, LOADAVG_SHARE_APART * cpus)):
            warnings.append(f"the machine's load differed: A {load_said(la)}; B {load_said(lb)}. The ratios "
                            f"below measure that too")
    fa, fb = ((r.get("software") or {}).get("frontend") for r in (a, b))
    if fa and fb and fa != fb:
        warnings.append(f"A ran in {fa}, B in {fb}")
    return warnings


def _side(report: dict) -> dict:
    from workbench.hw.load import load_said

    m, s = report.get("machine", {}), report.get("software", {})
    git = s.get("git") or {}
    return {"title": report.get("title"), "created": report.get("created"), "frontend": s.get("frontend"),
            "machine load": load_said(report_load(report)), "CPU": m.get("cpu_model"),
            "threads": m.get("threads_used"), "triad GB/s": (m.get("peaks") or {}).get("triad_gbps"),
            "FMA GFLOP/s": (m.get("peaks") or {}).get("fma_gflops"), "kernels ISA": s.get("kernels_isa"),
            "torch": (s.get("packages") or {}).get("torch"),
            "commit": f"{(git.get('commit') or '?')[:10]}{' (dirty)' if git.get('dirty') else ''}"}


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))


def format_compare(rows: list[dict], a: dict | None = None, b: dict | None = None) -> str:
    from workbench.analysis.tables import format_table

    lines = []
    if a is not None and b is not None:
        lines += [f"warning: {w}" for w in load_warnings(a, b)]
        sa, sb = _side(a), _side(b)
        lines.append(format_table([{"": k, "A": _fmt(sa[k]), "B": _fmt(sb[k])} for k in sa], ["", "A", "B"]))
        lines.append("")
    table = [{"measurement": r["measurement"],
              "A median (min-max)": f"{_fmt(r.get('a'))} ({_fmt(r.get('a_min'))}-{_fmt(r.get('a_max'))})"
              if "a" in r else "",
              "B median (min-max)": f"{_fmt(r.get('b'))} ({_fmt(r.get('b_min'))}-{_fmt(r.get('b_max'))})"
              if "b" in r else "",
              "B/A": _fmt(r.get("ratio_b_over_a")), "verdict": r["verdict"]} for r in rows]
    lines.append(format_table(table, ["measurement", "A median (min-max)", "B median (min-max)", "B/A", "verdict"]))
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("regression", "improvement", "within noise",
                                                                "no spread")}
    lines.append("\n" + ", ".join(f"{n} {v}" for v, n in counts.items()) +
                 ("" if not counts["regression"] else
                  "\nregressions: " + "; ".join(f"{r['measurement']} ({r['ratio_b_over_a']:.2f}x)"
                                                 for r in rows if r["verdict"] == "regression")))
    return "\n".join(lines)


VERDICT_ORDER = ("regression", "improvement", "within noise", "no spread", "only in A", "only in B")


def _side_cell(r: dict, side: str) -> str:
    from workbench.report.render import _with_spread

    if side not in r:
        return "-"
    style = "ms" if r["unit"] == "ms" else "sig"
    return _with_spread(r[side], r[f"{side}_min"], r[f"{side}_max"], style)


def _run(row: dict) -> str:
    return row["measurement"].rpartition(" | ")[0]


def _measure(row: dict) -> str:
    return row["measurement"].rpartition(" | ")[2]


def _verdict_html(rows: list[dict]) -> str:
    """The counts first, then every regression and improvement by name."""
    plural = {"regression": "regressions", "improvement": "improvements"}
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICT_ORDER}
    said = ", ".join(f"<b>{n} {plural.get(v, v) if n != 1 else v}</b>" if v in plural and n else
                     f"{n} {plural.get(v, v) if n != 1 else v}" for v, n in counts.items() if n or v in plural)
    notable = "".join(f"<li>{html.escape(r['verdict'])}: {html.escape(_measure(r))} of {html.escape(_run(r))}: B/A "
                      f"{r['ratio_b_over_a']:.2f}; A {html.escape(_side_cell(r, 'a'))}, B "
                      f"{html.escape(_side_cell(r, 'b'))} {html.escape(r['unit'])}</li>"
                      for r in rows if r["verdict"] in plural)
    return (f"<h2>Verdict</h2><p class='verdict'>{said}.</p>{f'<ul>{notable}</ul>' if notable else ''}"
            "<p class='note'>Each side: median (min–max) of its samples. B/A is B's median over A's. Within noise: "
            "the two min–max ranges overlap, so neither is called faster. No spread: a side with a single "
            "sample, only the ratio can be given.</p>")


def _rows_html(rows: list[dict]) -> str:
    """Every row, regressions first: what was run, the measure, both sides, B/A, the verdict."""
    from workbench.report.render import _number

    head = "".join(f"<th>{c}</th>" for c in ("what was run", "measure", "A<br><small>median (min–max)</small>",
                                             "B<br><small>median (min–max)</small>", "B/A", "verdict"))
    body = ""
    for r in sorted(rows, key=lambda r: VERDICT_ORDER.index(r["verdict"])):
        words = (_run(r), _measure(r))
        numbers = (_side_cell(r, "a"), _side_cell(r, "b"), _number(r.get("ratio_b_over_a"), "ratio"))
        body += (f"<tr class='{r['verdict'].replace(' ', '-')}'>" + "".join(f"<td>{html.escape(w)}</td>" for w in words)
                 + "".join(f"<td class='num'>{html.escape(x)}</td>" for x in numbers)
                 + f"<td>{html.escape(r['verdict'])}</td></tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_page(rows: list[dict], a: dict, b: dict) -> str:
    from workbench.report.render import CSS, _number

    sa, sb = _side(a), _side(b)
    sides = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_number(sa[k]))}</td>"
                    f"<td>{html.escape(_number(sb[k]))}</td></tr>" for k in sa)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>workbench compare</title><style>{CSS}</style>"
            f"</head><body><h1>{html.escape(str(a.get('title')))} (A) vs {html.escape(str(b.get('title')))} (B)</h1>"
            + "".join(f"<p class='warning'><b>warning:</b> {html.escape(w)}</p>" for w in load_warnings(a, b)) +
            f"{_verdict_html(rows)}<h2>The two runs</h2><table class='kv'><thead><tr><th></th><th>A</th><th>B</th>"
            f"</tr></thead><tbody>{sides}</tbody></table>"
            f"<h2>Every measurement</h2>{_rows_html(rows)}</body></html>")
