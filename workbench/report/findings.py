"""What was found, in words that respect the run-to-run spread: for an ablation, each switch's
fastest setting (only if it beats every other setting beyond the min-max of every matched
pair of rows) and its ratios; for a generation, its rates against the measured peaks and the
cost model; a line or two for every other kind of entry."""

from __future__ import annotations

import html
import math
import statistics
from typing import Callable, NamedTuple

from workbench.analysis.tp_savings import switch_savings
from workbench.model.kv_formats import kv_label
from workbench.report.labels import _number, _spread, _with_spread


# -- ablation grids: the switches a grid varies ----------------------------------------------


class Dimension(NamedTuple):
    name: str                        # as a heading says it
    slug: str                        # in figure ids
    setting: Callable[[dict], object]  # a row's setting of it
    say: str                         # a setting in words ("{}-token prompt")


class Metric(NamedTuple):
    key: str
    higher_is_better: bool


DIMENSIONS = (Dimension("attention", "attention", lambda r: r["attention"], "{}"),
              Dimension("KV cache", "kv-cache", lambda r: kv_label(r["kv_cache"], r.get("kv_kernel")), "{}"),
              Dimension("prompt length", "prompt-length", lambda r: r["prompt_len"], "{}-token prompt"),
              Dimension("batch", "batch", lambda r: r["batch"], "batch {}"),
              Dimension("new tokens", "new-tokens", lambda r: r["new_tokens"], "{} new tokens"))
DECODE, PREFILL = Metric("decode_tokens_per_s", True), Metric("prefill_ms", False)
GRID_KEYS = ("attention", "kv_cache", "prompt_len", "batch", "new_tokens", DECODE.key, PREFILL.key)


def _is_grid(rows: list[dict]) -> bool:
    """Ablation rows (workbench.analysis.ablation), not rows someone recorded by hand."""
    return bool(rows) and all(r.get(k) is not None for r in rows for k in GRID_KEYS) and \
        all(r[m.key] > 0 for r in rows for m in (DECODE, PREFILL))  # ratios of them are taken


def _setting(dim: Dimension, row: dict) -> str:
    return dim.say.format(dim.setting(row))


def _varied(rows: list[dict]) -> list[Dimension]:
    return [d for d in DIMENSIONS if len({_setting(d, r) for r in rows}) > 1]


def _config(row: dict, dims, sep: str = ", ") -> str:
    return sep.join(_setting(d, row) for d in dims) or "every row"


def _matched(rows: list[dict], dim: Dimension, sep: str = ", ") -> dict[str, dict[str, dict]]:
    """The rows as matched groups: the same setting of every other varied switch (named with
    `sep` between them) -> {this switch's setting: row}."""
    others = [d for d in _varied(rows) if d is not dim]
    groups: dict[str, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(_config(r, others, sep), {})[_setting(dim, r)] = r
    return groups


def _speedup(fast: dict, slow: dict, m: Metric) -> tuple[float, float, float]:
    """How many times as fast `fast` is: median over median, then the range the repeats
    allow (the slowest run of one against the fastest of the other, both ways)."""
    (f, f_lo, f_hi), (s, s_lo, s_hi) = _spread(fast, m.key), _spread(slow, m.key)
    return (f / s, f_lo / s_hi, f_hi / s_lo) if m.higher_is_better else (s / f, s_lo / f_hi, s_hi / f_lo)


def _overlap(a: dict, b: dict, m: Metric) -> bool:
    (_, a_lo, a_hi), (_, b_lo, b_hi) = _spread(a, m.key), _spread(b, m.key)
    return a_lo <= b_hi and b_lo <= a_hi


def _fastest(groups: dict[str, dict[str, dict]], m: Metric) -> str:
    """The setting ahead on average: its log-distance from each matched group's geometric mean."""
    score: dict[str, list[float]] = {}
    for g in groups.values():
        if len(g) > 1:
            mean = statistics.fmean(math.log(r[m.key]) for r in g.values())
            for s, r in g.items():
                score.setdefault(s, []).append((math.log(r[m.key]) - mean) * (1 if m.higher_is_better else -1))
    if not score:  # no group holds two settings: nothing to rank by
        return next(s for g in groups.values() for s in g)
    return max(score, key=lambda s: statistics.fmean(score[s]))


class Comparison(NamedTuple):
    ratio: float   # how many times as fast, median over median (geometric mean over matched pairs)
    lo: float      # the range the repeats allow
    hi: float
    verdict: str   # in words that respect the run-to-run spread
    ahead: bool    # faster beyond the spread in every pair


NO_SPREAD = "one run each: no spread to judge the difference by"


def _compare_pairs(pairs: list[tuple[dict, dict]], m: Metric) -> Comparison:
    """The first row of each pair against the second, over all pairs."""
    ratios = [_speedup(a, b, m) for a, b in pairs]
    mid = math.exp(statistics.fmean(math.log(r[0]) for r in ratios))
    lo, hi = min(r[1] for r in ratios), max(r[2] for r in ratios)
    single = any(min(a.get("repeats", 1), b.get("repeats", 1)) < 2 for a, b in pairs)
    apart = [not _overlap(a, b, m) for a, b in pairs]
    faster = sum(x and r[0] > 1 for x, r in zip(apart, ratios))
    slower = sum(x and r[0] < 1 for x, r in zip(apart, ratios))
    n = len(pairs)
    within = n - faster - slower
    if single:
        verdict = NO_SPREAD
    elif faster == n:
        verdict = "faster beyond the run-to-run spread" + (f" in all {n} matched pairs" if n > 1 else "")
    elif within == n:
        verdict = ("within the run-to-run spread (the min–max ranges overlap)" if n == 1 else
                   f"within the run-to-run spread in all {n} matched pairs")
    else:
        verdict = ", ".join(p for p in (f"faster beyond the spread in {faster} of {n} matched pairs" if faster else "",
                                        f"within it in {within}" if within else "",
                                        f"slower beyond it in {slower}" if slower else "") if p)
    return Comparison(mid, lo, hi, verdict, faster == n and not single)


def _as_fast_as(c: Comparison, other: str) -> str:
    return (f"{_ratio(c.ratio)} as fast as {html.escape(other)} ({_number(c.lo, 'ratio')}–{_number(c.hi, 'ratio')}): "
            f"{c.verdict}")


def _ratio(x: float) -> str:
    return f"{_number(x, 'ratio')}x"


def _dimension_finding(rows: list[dict], dim: Dimension, m: Metric) -> str:
    """Which setting of `dim` is fastest by `m`, and by how much against each other setting."""
    groups = _matched(rows, dim)
    best = _fastest(groups, m)
    said = {}
    for other in dict.fromkeys(s for g in groups.values() for s in g if s != best):
        pairs = [(g[best], g[other]) for g in groups.values() if best in g and other in g]
        if pairs:
            said[other] = _compare_pairs(pairs, m)
    # "fastest", not "highest": for prefill time the best median is the lowest
    lead = f"<b>{html.escape(best)}</b> has the fastest median{'s' if len(groups) > 1 else ''}"
    if all(c.ahead for c in said.values()):
        lead = f"<b>{html.escape(best)}</b> is fastest"
    elif all(c.verdict != NO_SPREAD for c in said.values()):
        lead += ", but is not faster than every other setting beyond the run-to-run spread"
    items = "".join(f"<li>{_as_fast_as(c, other)}</li>" for other, c in said.items())
    return f"<td>{lead}:<ul>{items}</ul></td>"


def _ablation_table(rows: list[dict], dims: list[Dimension]) -> str:
    """A row per varied switch; per measure, the fastest setting and its ratios."""
    body = "".join(f"<tr><th>{html.escape(d.name[0].upper() + d.name[1:])}</th>"
                   f"{_dimension_finding(rows, d, DECODE)}{_dimension_finding(rows, d, PREFILL)}</tr>" for d in dims)
    return (f"<table class='findings'><thead><tr><th>switch</th><th>decode tokens/s</th><th>prefill time</th></tr>"
            f"</thead><tbody>{body}</tbody></table>")


def _repeats_said(rows: list[dict]) -> str:
    n = sorted({r.get("repeats", 1) for r in rows})
    return f"over {n[0]} repeats" if len(n) == 1 else f"over {n[0]} to {n[-1]} repeats"


def _roofline_finding(rows: list[dict], peaks: dict) -> str:
    """How close decode came to the measured roofs: GB/s against the triad, GFLOP/s against FMA."""
    rated = [r for r in rows if r.get("decode_gbps")]
    if not rated:
        return ""
    best = max(rated, key=lambda r: r["decode_gbps"])
    bw = [100 * r["decode_gbps"] / peaks["triad_gbps"] for r in rated]
    fma = [100 * r.get("decode_gflops", 0) / peaks["fma_gflops"] for r in rated]
    bound = (" Every configuration is nearer the bandwidth roof than the compute roof (at most "
             f"{_number(max(fma), 'pct')}% of the FMA peak, {_number(peaks['fma_gflops'])} GFLOP/s): decode is "
             "bound by memory bandwidth here." if all(b > f for b, f in zip(bw, fma)) else "")
    which, median = "", ""
    if len(rated) > 1:
        which = f" ({html.escape(_config(best, _varied(rows)))})"
        median = f"; the median configuration reached {_number(statistics.median(bw), 'pct')}%"
    return (f"<li><b>Roofline</b>: decode read memory at up to {_number(best['decode_gbps'])} GB/s{which}, "
            f"<b>{_number(max(bw), 'pct')}% of the measured triad</b> ({_number(peaks['triad_gbps'])} GB/s)"
            f"{median}.{bound}</li>")


def _ablation_findings(i: int, e: dict, peaks: dict) -> str:
    rows = e["rows"]
    if not _is_grid(rows):
        return _rows_findings(i, e, peaks)
    dims = _varied(rows)
    grid = f"{' × '.join(d.name for d in dims)}: {len(rows)} configurations" if dims else "one configuration"
    head = f"{grid}; timings median (min–max) {_repeats_said(rows)}"
    items = [_roofline_finding(rows, peaks)]
    if not dims:
        r = rows[0]
        items.insert(0, f"<li>decode {_with_spread(*_spread(r, DECODE.key), 'sig')} tokens/s, prefill "
                        f"{_with_spread(*_spread(r, PREFILL.key), 'ms')} ms</li>")
    return _entry_finding(i, e, head, items, _ablation_table(rows, dims) if dims else "")


def _entry_finding(i: int, e: dict, head: str, items=(), table: str = "") -> str:
    """One entry's findings: a heading that links to its measurements, a line on what was
    run, a table where there is one, then sentences."""
    model = (e.get("model") or {}).get("name")
    what = f"{e['kind'].replace('_', ' ')}{f' of {model}' if model else ''}"
    items = "".join(x for x in items if x)
    return (f"<div class='finding'><h3><a href='#entry-{i}'>Entry {i}</a>: {html.escape(what)}</h3>"
            f"<p class='meta'>{head}</p>{table}{f'<ul>{items}</ul>' if items else ''}</div>")


def _generation_findings(i: int, e: dict, peaks: dict) -> str:
    w, s = e["workload"], e["decode_step_ms"]
    head = html.escape(f"{w['attention']} attention, {kv_label(w['kv_cache'], w.get('kv_kernel'))} KV cache, batch "
                       f"{w['batch']}, {max(w['prompt_tokens'])}-token prompt, {w['new_tokens']} new tokens")
    items = [f"<li>prefill {_number(e['prefill_ms'], 'ms')} ms; decode {_number(e['decode_tokens_per_s'])} "
             f"tokens/s over the wall time</li>"]
    if s["samples"]:
        items.append(f"<li>a decode step: {_with_spread(s['median'], s['min'], s['max'], 'ms')} ms, median "
                     f"(min–max) over {len(s['samples'])} steps</li>")
    if e.get("decode_gbps"):
        items.append(f"<li><b>Roofline</b>: {_number(e['decode_gbps'])} GB/s, <b>"
                     f"{_number(100 * e['decode_gbps'] / peaks['triad_gbps'], 'pct')}% of the measured triad</b> "
                     f"({_number(peaks['triad_gbps'])} GB/s); {_number(e['decode_gflops'])} GFLOP/s, "
                     f"{_number(100 * e['decode_gflops'] / peaks['fma_gflops'], 'pct')}% of the FMA peak</li>")
    parts = (e.get("predicted") or {}).get("parts", [])
    step = next((p for p in parts if (p["phase"], p["part"]) == ("decode", "step")), None)
    if step:
        items.append(f"<li>the cost model predicts a decode step in {_number(step['predicted_ms'], 'ms')} ms; the "
                     f"measured step took {_ratio(step['ratio'])} that</li>")
    return _entry_finding(i, e, head, items)


def _tp_name(r: dict, sep: str = ", ") -> str:
    if r["ranks"] == 1:
        return "1 rank (one process)"
    return sep.join((f"{r['ranks']} ranks over {r['backend']}", f"token broadcast {_number(r['token_broadcast'])}",
                     f"LM head {r['lm_head']}", f"zero copy {_number(r['zero_copy'])}")
                    + ((f"KV handoff {_number(r['kv_handoff'])}",) if r.get("kv_handoff", "n/a") != "n/a" else ()))


SWITCH_SAID = {("token_broadcast", "ids"): "token ids broadcast instead of embeddings",
               ("lm_head", "topk"): "the LM head's local top-k exchanged instead of all logits gathered",
               ("lm_head", "hidden-split"): "the hidden-split LM head instead of all logits gathered",
               ("zero_copy", "on"): "zero copy (the kernels write into the collective's buffer) instead of a copy",
               ("kv_handoff", "on"): "the shared KV head computed by one rank and handed over instead of by both"}


def _saving_said(s: dict) -> str:
    """One switch's saving (tp_savings.switch_savings) in a sentence, its ms with the spread and
    whether every round agrees on its sign."""
    what = SWITCH_SAID.get((s["switch"], s["setting"]), f"{s['switch']} {s['setting']} instead of {s['against']}")
    where = f"{s['ranks']} ranks over {s['backend']}, {s['pairs']} matched pair{'s' if s['pairs'] > 1 else ''}"
    if s["switch"] == "zero_copy":
        bytes_ = f"{_number(s['copied_bytes_saved_per_token'], 'bytes')} per token not copied, the same sent"
    else:
        bytes_ = f"{_number(s['sent_bytes_saved_per_token'], 'bytes')} less sent per token"
    ms = s["ms_saved_per_token"]
    if ms is None:
        timed = "no rounds recorded to pair"
    else:
        n = s["rounds"]
        every = f"in all {n} paired rounds" if n > 1 else "in its one paired round (no spread to judge by)"
        verdict = (f"faster {every}" if ms["min"] > 0 else f"slower {every}" if ms["max"] < 0 else
                   f"within the run-to-run spread (its {n} paired rounds disagree on the sign)")
        timed = (f"{_with_spread(ms['median'], ms['min'], ms['max'], 'ms')} ms per token saved "
                 f"({_number(s['pct_saved'], 'pct')}% of the time without it): {verdict}")
    return f"{html.escape(what)} ({html.escape(where)}): {bytes_}; {timed}"


def _tp_findings(i: int, e: dict, peaks: dict) -> str:
    rows = e["rows"]
    m = Metric("decode_ms_per_token", False)
    best = min(rows, key=lambda r: r[m.key])
    items = [f"<li>fastest: <b>{html.escape(_tp_name(best))}</b>, {_with_spread(*_spread(best, m.key), 'ms')} ms per "
             f"token, median (min–max) {_repeats_said([best])}; communication {_number(best['pct_comm'], 'pct')}% "
             f"of it" + ("" if best.get("pct_comm_own") is None else
                         f", {_number(best['pct_comm_own'], 'pct')}% without the waits for the other ranks")
             + "</li>"]
    one = next((r for r in rows if r["ranks"] == 1), None)
    q = best.get("vs_tp1")
    if q:  # measured against the single process round by round
        how = ("in the same rounds" if best.get("tp1_interleaved") else
               "in runs apart (no room for both at once): worst and best pairing")
        items.append(f"<li>its time is {_ratio(q['median'])} the single process's ({_number(q['min'], 'ratio')}–"
                     f"{_number(q['max'], 'ratio')}, {how})</li>")
    elif one is not None and one is not best:
        items.append(f"<li>{_as_fast_as(_compare_pairs([(best, one)], m), _tp_name(one))}</li>")
    items += [f"<li>{_saving_said(s)}</li>" for s in switch_savings(rows)]
    return _entry_finding(i, e, f"{len(rows)} settings of ranks, backend and the three switches", items)


def _peers_findings(i: int, e: dict, peaks: dict) -> str:
    items = []
    for r in e["rows"]:
        if r.get("status") != "ok":
            continue
        for key, what, spread_of in (("ours_over_peer_prefill", "prefills (time to first token)", "prefill_ms"),
                                     ("ours_over_peer", "decodes", "decode_tokens_per_s")):
            q = r.get(key)
            if not q:
                continue
            verdict = ("faster beyond the round-to-round spread" if q["min"] > 1 else
                       "slower beyond the round-to-round spread" if q["max"] < 1 else
                       "within the round-to-round spread (the min–max ranges overlap)")
            rounds = len(r[spread_of].get("samples", [])) or "the"
            items.append(f"<li>{html.escape(str(r['matched']))} {what} {_ratio(q['median'])} as fast as "
                         f"<b>{html.escape(r['engine'])}</b> ({_number(q['min'], 'ratio')}–{_number(q['max'], 'ratio')}) "
                         f"at a {r['prompt_len']}-token prompt, median (min–max) over {rounds} rounds: {verdict}</li>")
    absent = [r["engine"] for r in e["rows"] if r.get("status") != "ok"]
    if absent:
        items.append(f"<li>not run: {html.escape(', '.join(absent))} (why: in the table below)</li>")
    return _entry_finding(i, e, "engines in their own processes, interleaved rounds, the same prompt tokens", items)


def _serve_findings(i: int, e: dict, peaks: dict) -> str:
    """A serve-bench run: where the server stopped keeping up, and the best it served."""
    from workbench.analysis.serve_bench import knee, load_label

    rows = e["rows"]
    items = []
    k = knee(rows)
    if k is not None:
        kept, behind = k["kept_up"], k["fell_behind"]
        if kept is not None:
            items.append(f"<li>kept up with {kept['rate']:g} req/s: time to first token p50 "
                         f"{_number(1e3 * kept['ttft_s']['p50'], 'ms')} ms, p99 {_number(1e3 * kept['ttft_s']['p99'], 'ms')} ms, "
                         f"{_number(kept['output_tokens_per_s'], 'sig')} output tokens/s</li>")
        if behind is not None:
            items.append(f"<li>fell behind at {behind['rate']:g} req/s (served {behind['requests_per_s']:.2f} req/s, "
                         f"statuses {html.escape(str(behind['statuses']))}): the knee lies between</li>")
    best = max(rows, key=lambda r: r["output_tokens_per_s"])
    items.append(f"<li>most output: {_number(best['output_tokens_per_s'], 'sig')} tokens/s at {html.escape(load_label(best))}</li>")
    head = (f"{len(rows)} load(s) against {html.escape(str(rows[0].get('url')))}, {rows[0]['num_requests']} requests each; "
            "latencies are percentiles over the requests of one run")
    return _entry_finding(i, e, head, items)


def _quality_findings(i: int, e: dict, peaks: dict) -> str:
    from workbench.analysis.quality import best_per_byte

    rows = e["rows"]
    if not rows or "kl_nats" not in rows[0]:
        return _entry_finding(i, e, f"{len(rows)} rows")
    front = best_per_byte(rows)
    said = "; ".join(f"{r.get('cache', r['kv_cache'])} ({_number(r['bytes_per_element'])} bytes per element, KL "
                     f"{_number(r['kl_nats'])} nats)" for r in front)
    return _entry_finding(i, e, f"{len(rows)} rows: each KV format's KL and top-1 agreement against an fp32 cache",
                          [f"<li>at {max(r['context'] for r in rows)} tokens of context, no format beats these on both "
                           f"bytes and KL: {html.escape(said)}</li>"])


def _weight_findings(i: int, e: dict, peaks: dict) -> str:
    from workbench.analysis.weight_study import pareto_front

    rows = e["rows"]
    if not rows or "kl_nats" not in rows[0]:
        return _entry_finding(i, e, f"{len(rows)} rows")
    front = "; ".join(f"{r['format']} ({_number(r['bytes_per_token'] / 1e6)} MB per token, KL {_number(r['kl_nats'])} "
                      f"nats)" for r in pareto_front(rows))
    fastest = max(rows, key=lambda r: r["decode_tok_s"]["median"])
    return _entry_finding(i, e, f"{len(rows)} weight formats: each one's KL and top-1 agreement against fp32 weights, "
                                f"the bytes a decode step reads and its speed",
                          [f"<li>no format reads fewer bytes with a lower KL than these: {html.escape(front)}</li>",
                           f"<li>fastest decode: {html.escape(fastest['format'])}, "
                           f"{_number(fastest['decode_tok_s']['median'])} tokens/s, "
                           f"{_number(fastest['decode_pct_of_triad'], 'pct')}% of the measured triad</li>"])


def _profile_findings(i: int, e: dict, peaks: dict) -> str:
    top = e.get("top_frames") or []
    item = (f"<li>hottest frame by self time: <code>{html.escape(str(top[0]['frame']))}</code> "
            f"({_number(top[0]['self %'], 'pct')}% of {e.get('samples')} samples)</li>" if top else "")
    return _entry_finding(i, e, f"py-spy over <code>{html.escape(str(e.get('statement')))}</code>", [item])


def _rows_findings(i: int, e: dict, peaks: dict) -> str:
    """Rows the page has no words for (a benchmark's JSON): where they came from."""
    source = f" from {e['source']}" if e.get("source") else ""
    return _entry_finding(i, e, html.escape(f"{len(e.get('rows', []))} row(s){source}: the table below"))


FINDINGS = {"ablation": _ablation_findings, "generation": _generation_findings, "tp_ablation": _tp_findings,
            "peers": _peers_findings, "kv_quality": _quality_findings, "weight_quality": _weight_findings,
            "profile": _profile_findings,
            "serve_bench": _serve_findings}


def _findings(report: dict) -> str:
    peaks = report["machine"]["peaks"]
    parts = [FINDINGS.get(e["kind"], _rows_findings)(i, e, peaks) for i, e in enumerate(report["entries"])]
    return (f"<h2>What was found</h2><p class='note'>A switch is compared with its other settings at equal settings of "
            f"every other switch (matched pairs). A ratio is median over median (the geometric mean over matched "
            f"pairs); in brackets, the range the repeats allow: one side's slowest run against the other's fastest, "
            f"both ways. Where two settings' min–max ranges overlap, their difference is within the run-to-run "
            f"spread and neither is called faster. Peaks: triad {_number(peaks['triad_gbps'])} GB/s, FMA "
            f"{_number(peaks['fma_gflops'])} GFLOP/s, measured on this machine.</p>{''.join(parts)}")
