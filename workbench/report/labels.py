"""How the report writes what it measured: raw JSON keys become labels with units in one place
(FIELDS), numbers get the digits they mean, medians carry their min-max, long strings fold,
and rows become HTML tables. The JSON keeps every key and every digit; only the page rounds."""

from __future__ import annotations

import html
import math



# -- labels and numbers: the one place a raw key becomes words ------------------------------

# raw JSON key -> (label with its unit, how its numbers are written: see _number)
FIELDS: dict[str, tuple[str, str]] = {
    # switches and workload
    "attention": ("attention", "text"), "cache": ("KV cache", "text"), "kv_cache": ("KV format", "text"),
    "kv_kernel": ("KV kernel", "text"), "prompt_len": ("prompt tokens", "int"),
    "prompt_tokens": ("prompt tokens", "int"), "batch": ("batch", "int"), "new_tokens": ("new tokens", "int"),
    "threads": ("threads", "int"), "repeats": ("repeats", "int"), "step": ("step path", "text"),
    "sampling": ("sampling", "text"), "gemm_engine": ("GEMM engine", "text"),
    "tensor_parallel": ("tensor parallel", "text"), "prompt_sha256": ("prompt tokens' sha256", "text"),
    # timings, rates and their shares of the measured peaks
    "prefill_ms": ("prefill ms", "ms"), "time_to_first_token_ms": ("time to first token ms", "ms"),
    "decode_step_ms": ("decode step ms", "ms"), "decode_tokens_per_s": ("decode tokens/s", "sig"),
    "decode_gbps": ("decode GB/s", "sig"), "pct_peak_bandwidth": ("% of triad", "pct"),
    "decode_pct_of_triad": ("% of triad", "pct"), "decode_gflops": ("decode GFLOP/s", "sig"),
    "gbps": ("GB/s", "sig"), "gflops": ("GFLOP/s", "sig"),
    "pct_peak_fma": ("% of FMA peak", "pct"), "top1_agreement": ("top-1 agreement", "sig"),
    "decode_bytes_per_step": ("bytes read per decode step", "bytes"),
    "decode_flops_per_step": ("GFLOP per decode step", "giga"),
    "decode_comm_ms_per_step": ("communication ms per decode step", "ms"),
    "decode_wake_ms_per_step": ("thread wake-up ms per decode step", "ms"),
    # tensor parallel
    "ranks": ("ranks", "int"), "backend": ("backend", "text"), "token_broadcast": ("token broadcast", "text"),
    "lm_head": ("LM head", "text"), "zero_copy": ("zero copy", "text"),
    "kv_handoff": ("KV handoff", "text"),
    "decode_ms_per_token": ("decode ms per token", "ms"), "comm_ms_per_token": ("communication ms per token", "ms"),
    "pct_comm": ("% communication", "pct"),
    "comm_wait_ms_per_token": ("of it, waiting for the other ranks, ms per token", "ms"),
    "pct_comm_own": ("% communication, waits excluded", "pct"), "comm_ms_by_rank": ("communication ms per token, by rank", "ms"),
    "comm_wait_ms_by_rank": ("of it, waiting for the other ranks, by rank", "ms"), "comm_bytes_per_token": ("communication per token", "bytes"),
    "same_tokens_as_tp1": ("same tokens as 1 rank", "text"), "vs_tp1": ("time / 1 rank", "ratio"),
    "tp1_interleaved": ("1 rank in the same rounds", "text"),
    "decode_ms_by_round": ("decode ms per token, by round", "ms"),
    "allreduce_bytes_per_token": ("all-reduce payload per token", "bytes"),
    # tensor parallel: each switch's saving (tp_savings.switch_savings)
    "switch": ("switch", "text"), "setting": ("with", "text"), "against": ("against", "text"),
    "pairs": ("matched pairs", "int"), "rounds": ("paired rounds", "int"), "sent_bytes_saved_per_token": ("sent per token, saved", "bytes"),
    "copied_bytes_saved_per_token": ("copied per token, saved", "bytes"),
    "ms_saved": ("ms per token saved", "ms"), "pct_saved": ("% of the time without it", "pct"),
    # peers
    "engine": ("engine", "text"), "status": ("status", "text"), "matched": ("against", "text"),
    "ours_over_peer": ("ours / peer, decode", "ratio"), "ours_over_peer_prefill": ("ours / peer, prefill", "ratio"), "triad_gbps": ("triad GB/s", "sig"),
    "same_tokens_as_workbench_fp32": ("same tokens as workbench fp32", "int"), "description": ("details", "text"),
    # KV-cache quality
    "granularity": ("scale granularity", "text"), "bits": ("bits", "int"),
    "bytes_per_element": ("bytes per element", "sig"), "kernel": ("has a kernel", "text"),
    "context": ("context tokens", "int"), "positions": ("positions scored", "int"),
    "top1_agreement_vs_fp32": ("top-1 agreement with fp32", "sig"), "kl_nats": ("mean KL, nats", "sig"),
    "kl_nats_max": ("max KL, nats", "sig"), "perplexity": ("perplexity", "sig"),
    "attention_rel_error": ("attention relative error", "sig"),
    # weight formats
    "format": ("weight format", "text"), "formats": ("formats by tensor group", "text"),
    "bits_per_weight": ("bits per weight", "sig"), "bytes_per_token": ("weight bytes per token", "bytes"),
    "decode_tok_s": ("decode tokens/s", "sig"), "decode_pct_of_triad": ("decode, % of triad", "pct"),
    # the cost model, profiles
    "phase": ("phase", "text"), "part": ("part", "text"), "predicted_ms": ("predicted ms", "ms"),
    "measured_ms": ("measured ms", "ms"), "ratio": ("measured / predicted", "ratio"), "bound": ("bound", "text"),
    "why": ("why", "text"), "frame": ("frame", "text"), "self %": ("self %", "pct"), "total %": ("total %", "pct"),
    # the machine and its peaks
    "cpu_model": ("CPU", "text"), "logical_cpus": ("logical CPUs", "int"), "numa_nodes": ("NUMA nodes", "int"),
    "cpus_usable": ("CPUs usable", "int"), "threads_used": ("threads used", "int"), "ram_bytes": ("RAM", "bytes"),
    "available_bytes": ("available memory", "bytes"), "l2_bytes": ("L2 cache", "bytes"),
    "size_bytes": ("size", "bytes"), "shared_by_cpus": ("shared by CPUs", "int"),
    "triad_gbps_1t": ("triad GB/s, 1 thread", "sig"), "read_gbps": ("read GB/s", "sig"),
    "fma_gflops": ("FMA GFLOP/s", "sig"), "fma_gflops_1t": ("FMA GFLOP/s, 1 thread", "sig"),
    "amx_bf16_gflops": ("AMX bf16 GFLOP/s", "sig"), "avx512_bf16_gflops": ("AVX512-BF16 GFLOP/s", "sig"),
    "amx_int8_gops": ("AMX int8 GOP/s", "sig"), "kernels_isa": ("kernels' ISA path", "text"),
}
# where a median's min and max are not at key_min / key_max
SPREAD_KEYS = {"decode_ms_per_token": ("decode_ms_min", "decode_ms_max")}
FOLD_CHARS = 200  # longer strings are folded: <details> with this many characters as the summary


def label(key: str) -> str:
    return FIELDS[key][0] if key in FIELDS else str(key).replace("_", " ")


def _style(key: str, value) -> str:
    if key in FIELDS:
        return FIELDS[key][1]
    key = str(key)
    if key.endswith("_ms"):
        return "ms"
    if key.endswith("_bytes"):
        return "bytes"
    return "sig" if isinstance(value, float) else "text"


def _sig(v: float) -> str:
    """Three significant digits (trailing zeros kept: 68.0, 1.00), whole numbers from 1000 up."""
    if isinstance(v, int) or abs(v) >= 1000:
        return f"{v:,.0f}"
    return "0" if v == 0 else f"{v:#.3g}".rstrip(".")


def _number(v, style: str = "sig") -> str:
    """A value as a table or a sentence shows it; the JSON keeps every digit."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
        return " / ".join(_number(x, style) for x in v) or "-"  # one value per rank, say
    if not isinstance(v, (int, float)) or style == "text" or not math.isfinite(v):
        return str(v)
    if style == "int":
        return f"{v:,.0f}"
    if style == "ms":
        return _sig(v) if abs(v) < 0.01 else f"{v:,.2f}" if abs(v) < 10 else f"{v:,.1f}"
    if style == "pct":
        return f"{v:.1f}" if 0 < abs(v) < 10 else f"{v:.0f}"
    if style == "ratio":
        return f"{v:.2f}" if abs(v) < 10 else _sig(v)
    if style == "bytes":
        scale = next((s for s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                      if abs(v) >= s[1]), ("bytes", 1))
        return f"{_sig(v / scale[1])} {scale[0]}"
    if style == "giga":
        return _sig(v / 1e9)
    return _sig(v)


def _spread(row: dict, key: str) -> tuple[float, float, float] | None:
    """(median, min, max) of a row's measurement, from a {median, min, max} record or the
    key_min / key_max beside it; None where there is no value."""
    v = row.get(key)
    if isinstance(v, dict):
        return (v["median"], v["min"], v["max"]) if v.get("median") is not None else None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    lo_key, hi_key = SPREAD_KEYS.get(key, (f"{key}_min", f"{key}_max"))
    lo, hi = row.get(lo_key), row.get(hi_key)
    if lo is None or hi is None or not lo <= v <= hi:  # (a default 0.0 is not a measured minimum)
        return v, v, v
    return v, lo, hi


def _with_spread(m: float, lo: float, hi: float, style: str) -> str:
    if hi <= lo:
        return _number(m, style)
    return f"{_number(m, style)} ({_number(lo, style)}–{_number(hi, style)})"


def _folded(text, limit: int = FOLD_CHARS) -> str:
    """A string as escaped HTML; a long one folded, its first `limit` characters the summary."""
    if text is None:
        return "<i>not recorded</i>"
    text = str(text)
    if len(text) <= limit:
        return f"<pre>{html.escape(text)}</pre>" if "\n" in text else html.escape(text)
    head = " ".join(text[:limit].split())
    return (f"<details><summary>{html.escape(head)}… <span class='meta'>({len(text):,} characters: open for "
            f"all)</span></summary><pre>{html.escape(text)}</pre></details>")


# -- tables ----------------------------------------------------------------------------------


def _is_spread_key(key: str, row: dict) -> bool:
    """key_min / key_max of a median in the same row: shown in the median's cell."""
    base = next((b for b, pair in SPREAD_KEYS.items() if key in pair), None)
    if base is None and key.endswith(("_min", "_max")):
        base = key[:-4]
    if base is None or base not in row:
        return False
    return all(k in row for k in SPREAD_KEYS.get(base, (f"{base}_min", f"{base}_max")))


def _columns(rows: list[dict]) -> list[str]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [k for k in keys if not _is_spread_key(k, rows[0])]


def _cell(row: dict, key: str) -> str:
    v = row.get(key)
    style = _style(key, v)
    s = _spread(row, key) if style not in ("text", "int") else None
    text = _with_spread(*s, style) if s else _number(v, style) if not isinstance(v, (dict, list)) else _readable(v)
    numeric = s is not None or (isinstance(v, (int, float)) and not isinstance(v, bool))
    return f"<td class='num'>{html.escape(text)}</td>" if numeric else f"<td>{_folded(text)}</td>"


def _header(rows: list[dict], key: str) -> str:
    ranged = any((s := _spread(r, key)) and s[2] > s[1] for r in rows) and _style(key, rows[0].get(key)) != "int"
    return f"<th>{html.escape(label(key))}{'<br><small>median (min–max)</small>' if ranged else ''}</th>"


def _table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of raw values: headers from FIELDS, numbers rounded, a median with its min-max."""
    if not rows:
        return "<p><i>none</i></p>"
    columns = columns or _columns(rows)
    head = "".join(_header(rows, c) for c in columns)
    body = "".join("<tr>" + "".join(_cell(r, c) for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _grid_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A table whose settings that every row shares are said once above it."""
    columns = columns or _columns(rows)
    same = [c for c in columns if len(rows) > 1 and not isinstance(rows[0].get(c), float)
            and all(r.get(c) == rows[0].get(c) for r in rows)]
    said = "; ".join(f"{label(c)}: {_number(rows[0].get(c), _style(c, rows[0].get(c)))}" for c in same)
    return (f"<p class='meta'>Every row: {html.escape(said)}</p>" if said else "") + \
        _table(rows, [c for c in columns if c not in same])


def _readable(v) -> str:
    """A nested value as a reader meets it: records as "label: value" pairs, lists joined."""
    if isinstance(v, dict):
        return "; ".join(f"{label(k)}: {_number(x, _style(k, x)) if not isinstance(x, (dict, list)) else _readable(x)}"
                         for k, x in v.items()) or "-"
    if isinstance(v, (list, tuple)):
        if len(v) > 12 and all(isinstance(x, (int, float)) for x in v):
            return f"{len(v)} values, {_number(min(v))} to {_number(max(v))}"
        return ", ".join(_readable(x) for x in v) or "-"
    return _number(v)


def _kv(d: dict) -> str:
    """A record as a two-column table; a nested record as a table in its cell, a list of
    records as a table of them."""
    rows = "".join(f"<tr><th>{html.escape(label(k))}</th><td>{_kv_cell(k, v)}</td></tr>" for k, v in d.items())
    return f"<table class='kv'><tbody>{rows}</tbody></table>"


def _kv_cell(key: str, v) -> str:
    if isinstance(v, dict) and v:
        return _kv(v)
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        return _table(v)
    return _folded(_readable(v) if isinstance(v, (dict, list, tuple)) else _number(v, _style(key, v)))
