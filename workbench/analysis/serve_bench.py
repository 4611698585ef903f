"""A load generator for any OpenAI-compatible completions endpoint (`workbench serve-bench`,
`wb.serve_bench`): ours, llama.cpp's server, vLLM, driven the same way.

    rows = serve_bench("http://127.0.0.1:8000", rates=[1, 2, 4], num_requests=32, prompt_tokens=64,
                       max_tokens=32, shared_prefix_tokens=1000, shared_fraction=0.5, slo_ttft_s=1.0, slo_tpot_s=0.1)

Arrivals: at a rate (requests/s) with gamma-distributed gaps (burstiness 1 is a Poisson
process, below 1 burstier), or all at once under a fixed concurrency (rate None). Prompts are
synthetic (words of the bundled sample text, about one token each) of prompt_tokens words, a
shared_fraction of them starting with the same shared_prefix_tokens words; with range_ratio r
each prompt's length and each request's max_tokens are drawn uniformly from [n (1 - r),
n (1 + r)] (vLLM's benchmark calls it --random-range-ratio), so the requests are not all
alike. Or the prompts come from a file (prompts_file: one prompt a line, or JSON lines with
"prompt" and optionally "max_tokens"), taken in order and repeated as needed. Every request
streams (server-sent events) and asks for its max_tokens with ignore_eos, so each should
produce exactly that many; tokens are counted from the usage the server reports at the end of
the stream (stream_options.include_usage), else as text chunks.

Per run (one rate): TTFT (request sent -> first text), TPOT ((end - first) / (tokens - 1)),
ITL (gaps between streamed chunks; a chunk may carry more than one token) and end-to-end latency at p50 / p90 / p99; output tokens/s
and requests/s over the run; goodput (requests/s meeting both SLOs); refusals by status;
`overloaded` when the requests served per second fell below 90% of the offered rate or any was
refused: the load exceeded what the server sustains; and the prefix hit rate (prompt tokens
reused / prompt tokens looked up) with the bytes not recomputed, from the server's /metrics
counters before and after the run where it has them (ours; vLLM's prefix_cache_hits /
queries, without bytes), else None. The counters are the server's: another client loading it
at the same time is counted too.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from workbench.runtime.aio import run_coroutine

# Where a server counts its prompt-prefix reuse on /metrics: (prompt tokens looked up, tokens
# reused, bytes not recomputed or None), by the first counter's name.
PREFIX_COUNTERS = (
    ("workbench_prompt_tokens_total", "workbench_prefix_reused_tokens_total", "workbench_prefix_reused_bytes_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", None),
)


@dataclass
class Outcome:
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunks: list[float] = field(default_factory=list)  # arrival times of text chunks
    tokens: int = 0
    error: str = ""
    hung_up: bool = False  # the client closed the stream after the first text, on purpose

    @property
    def served(self) -> bool:
        return self.status == 200 and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.served and self.tokens > 1 else None


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    v = sorted(values)

    def pct(p: float) -> float:  # nearest rank
        return v[min(len(v) - 1, max(0, int(round(p / 100 * len(v) + 0.5)) - 1))]

    return {"p50": pct(50), "p90": pct(90), "p99": pct(99), "mean": statistics.fmean(v), "n": len(v)}


def drawn_lengths(n: int, length: int, range_ratio: float, rng: random.Random) -> list[int]:
    """n lengths drawn uniformly from [length (1 - r), length (1 + r)] (at least 1); all
    `length` when r is 0, without touching rng."""
    if not range_ratio:
        return [length] * n
    lo, hi = max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def synthetic_prompts(n: int, prompt_tokens: int, shared_prefix_tokens: int = 0, shared_fraction: float = 0.0,
                      seed: int = 0, prefix_seed: int = 0, range_ratio: float = 0.0) -> list[str]:
    """n prompts of about prompt_tokens words (drawn within range_ratio of it), plus the
    shared prefix where it applies; the prefix comes from prefix_seed alone, so runs with
    other seeds share it (and only it)."""
    from workbench.analysis.text import sample_text

    words = sample_text().split()
    rng = random.Random(seed)
    lengths = drawn_lengths(n, prompt_tokens, range_ratio, random.Random(f"prompt-lengths-{seed}"))

    def words_from(k: int, r: random.Random = rng) -> str:
        start = r.randrange(len(words))
        return " ".join(words[(start + i) % len(words)] for i in range(k))

    prefix = words_from(shared_prefix_tokens, random.Random(f"prefix-{prefix_seed}")) if shared_prefix_tokens else ""
    prompts = []
    for i in range(n):
        body = f"[{i}] " + words_from(lengths[i])  # distinct from the first word on
        prompts.append(f"{prefix} {body}" if prefix and rng.random() < shared_fraction else body)
    return prompts


def load_prompts(path) -> list[dict]:
    """A prompts file: JSON lines ({"prompt": text, "max_tokens": n optional}) where the name
    ends in .jsonl, else one prompt a line (blank lines skipped) -> [{"prompt", "max_tokens"
    (None: the run's)}]. A ValueError names the file, the line and what is accepted."""
    from pathlib import Path

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"prompts_file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"prompts_file {str(path)!r} cannot be read as UTF-8 text: {e}") from None
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            found.append({"prompt": line, "max_tokens": None})
            continue
        where = f"prompts_file {str(path)!r} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not JSON ({e.msg}); each line must be an object like "
                             '{"prompt": "...", "max_tokens": 32}') from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f'{where} needs "prompt": a non-empty string, got {line[:80]!r}')
        unknown = set(item) - {"prompt", "max_tokens"}
        if unknown:
            raise ValueError(f"{where} has unknown fields {sorted(unknown)}; accepted: prompt, max_tokens")
        n = item.get("max_tokens")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f'{where}: "max_tokens" must be a positive integer, got {n!r}')
        found.append({"prompt": item["prompt"], "max_tokens": n})
    if not found:
        raise ValueError(f"prompts_file {str(path)!r} holds no prompts")
    return found


def workload_label(row: dict) -> str:
    """What a row's requests were: their prompts and output lengths (the match key of
    `workbench compare`, beside the server and the load)."""
    spread = f" +-{row['range_ratio']:.0%}" if row.get("range_ratio") else ""
    if row.get("prompts_file"):
        return f"prompts {row['prompts_file']} max {row['max_tokens']}{spread}"
    return (f"prompt {row['prompt_tokens']} max {row['max_tokens']}{spread} "
            f"shared {row['shared_prefix_tokens']}x{row['shared_fraction']:g}")


async def _one(client, url: str, model: str, prompt: str, max_tokens: int, hang_up: bool = False) -> Outcome:
    """One streamed request; hang_up: close the connection after the first text (a client
    that goes away mid-stream)."""
    out = Outcome()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    usage_tokens = None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode("utf-8", "replace")[:200]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):  # the server's own count (a chunk may carry several tokens)
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if not chunk.get("choices"):
                    continue
                text = chunk["choices"][0].get("text") or chunk["choices"][0].get("delta", {}).get("content") or ""
                if text:
                    now = time.perf_counter()
                    out.chunks.append(now)
                    out.tokens += 1
                    if out.ttft_s is None:
                        out.ttft_s = now - t0
                    if hang_up:
                        out.hung_up = True
                        return out
        if usage_tokens is not None:
            out.tokens = usage_tokens
        out.e2e_s = time.perf_counter() - t0
    except Exception as e:  # a refused or dropped connection is an outcome, not a crash
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _run(url: str, prompts: list[str], max_tokens: list[int], rate: float | None, concurrency: int,
               burstiness: float, model: str, seed: int, timeout_s: float,
               hang_up_fraction: float = 0.0) -> tuple[list[Outcome], float]:
    import httpx

    rng = random.Random(seed)
    hang_ups = [rng.random() < hang_up_fraction for _ in prompts]
    limits = httpx.Limits(max_connections=max(concurrency, 1) if rate is None else 1000)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        if rate is None:
            gate = asyncio.Semaphore(concurrency)

            async def gated(p, n, hang_up):
                async with gate:
                    return await _one(client, url, model, p, n, hang_up)

            outcomes = await asyncio.gather(*(gated(p, n, h) for p, n, h in zip(prompts, max_tokens, hang_ups)))
        else:
            tasks = []
            for p, n, h in zip(prompts, max_tokens, hang_ups):
                tasks.append(asyncio.create_task(_one(client, url, model, p, n, h)))
                # gamma gaps with mean 1 / rate; shape = burstiness (1: exponential, Poisson)
                await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
            outcomes = await asyncio.gather(*tasks)
        return list(outcomes), time.perf_counter() - t0


def summarize_run(outcomes: list[Outcome], wall_s: float, *, rate: float | None = None,
                  slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
    """What one run's outcomes amount to: percentiles, rates over wall_s, goodput at the SLOs,
    statuses, and `overloaded` (a request refused or failed, or fewer served per second than
    90% of the offered rate; a client that hung up on purpose counts as served)."""
    ok = [o for o in outcomes if o.served]
    hung_up = sum(o.hung_up for o in outcomes)
    good = [o for o in ok if (slo_ttft_s is None or o.ttft_s <= slo_ttft_s) and
            (slo_tpot_s is None or o.tpot_s is None or o.tpot_s <= slo_tpot_s)]
    statuses: dict[str, int] = {}
    for o in outcomes:
        key = "hung up" if o.hung_up else str(o.status) if o.status else "error"
        statuses[key] = statuses.get(key, 0) + 1
    answered = len(ok) + hung_up
    return {
        "duration_s": wall_s, "completed": len(ok), "hung_up": hung_up, "statuses": statuses,
        "output_tokens": sum(o.tokens for o in ok), "output_tokens_per_s": sum(o.tokens for o in ok) / wall_s,
        "requests_per_s": len(ok) / wall_s, "goodput_requests_per_s": len(good) / wall_s,
        "ttft_s": _percentiles([o.ttft_s for o in ok if o.ttft_s is not None]),
        "tpot_s": _percentiles([o.tpot_s for o in ok if o.tpot_s is not None]),
        "itl_s": _percentiles([b - a for o in ok for a, b in zip(o.chunks, o.chunks[1:])]),
        "e2e_s": _percentiles([o.e2e_s for o in ok]),
        "overloaded": bool(answered < len(outcomes) or (rate is not None and answered / wall_s < 0.9 * rate)),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }


def serve_bench(url: str, *, rates: list[float | None] = (None,), concurrency: int = 8, num_requests: int = 32,
                prompt_tokens: int = 64, max_tokens: int = 32, shared_prefix_tokens: int = 0,
                shared_fraction: float = 0.0, burstiness: float = 1.0, slo_ttft_s: float | None = None,
                slo_tpot_s: float | None = None, model: str = "default", seed: int = 0,
                timeout_s: float = 600.0, label: str = "", hang_up_fraction: float = 0.0,
                range_ratio: float = 0.0, prompts_file: str | None = None) -> list[dict]:
    """One row per rate (None: all requests at once under `concurrency`). hang_up_fraction of
    the clients close their stream after the first text (counted apart, not as served).
    range_ratio: prompt and output lengths drawn within that fraction of prompt_tokens and
    max_tokens; prompts_file: the prompts from a file instead (load_prompts), in order."""
    for name, value in (("num_requests", num_requests), ("prompt_tokens", prompt_tokens), ("max_tokens", max_tokens),
                        ("concurrency", concurrency)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 <= shared_fraction <= 1:
        raise ValueError(f"shared_fraction must be in [0, 1], got {shared_fraction}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    from_file = None
    if prompts_file is not None:
        if shared_prefix_tokens:
            raise ValueError("prompts_file and shared_prefix_tokens do not go together: the file's prompts are "
                             "sent as they are (put a shared prefix in the file)")
        from_file = load_prompts(prompts_file)
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    base = url.rstrip("/")
    rows = []
    for i, rate in enumerate(rates):
        if rate is not None and rate <= 0:
            raise ValueError(f"rates must be > 0 (or None for a fixed concurrency), got {rate}")
        outputs = drawn_lengths(num_requests, max_tokens, range_ratio, random.Random(f"output-lengths-{seed + i}"))
        if from_file is None:
            prompts = synthetic_prompts(num_requests, prompt_tokens, shared_prefix_tokens, shared_fraction, seed + i,
                                        range_ratio=range_ratio)
        else:  # in the file's order, repeated as needed; a line's own max_tokens wins
            items = [from_file[j % len(from_file)] for j in range(num_requests)]
            prompts = [item["prompt"] for item in items]
            outputs = [item["max_tokens"] or n for item, n in zip(items, outputs)]
        before = _scrape(base)
        # run_coroutine, not asyncio.run: in a notebook the kernel's event loop is running already
        outcomes, wall = run_coroutine(_run(base, prompts, outputs, rate, concurrency, burstiness, model,
                                            seed + i, timeout_s, hang_up_fraction))
        reuse = prefix_reuse(before, _scrape(base))
        rows.append({
            "kind": "serve_bench", "label": label, "url": url, "rate": rate,
            "concurrency": None if rate is not None else concurrency, "burstiness": burstiness,
            "num_requests": num_requests, "prompt_tokens": None if from_file else prompt_tokens,
            "max_tokens": max_tokens, "range_ratio": range_ratio,
            "prompts_file": None if prompts_file is None else str(prompts_file),
            "output_tokens_asked": sum(outputs),
            "shared_prefix_tokens": shared_prefix_tokens, "shared_fraction": shared_fraction,
            "hang_up_fraction": hang_up_fraction, "slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s,
            **summarize_run(outcomes, wall, rate=rate, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s), **reuse,
        })
    return rows


def _scrape(url: str) -> dict[str, float]:
    """The server's /metrics counters, or {} where it serves none (llama.cpp's server)."""
    import httpx

    from workbench.serving.process import read_metrics

    try:
        return read_metrics(url)
    except httpx.HTTPError:
        return {}


def prefix_reuse(before: dict[str, float], after: dict[str, float]) -> dict:
    """The prefix hit rate over a run from two scrapes (PREFIX_COUNTERS): reused / looked-up
    prompt tokens, the tokens and (ours) the bytes; None where the server counts none."""
    for looked, hit, nbytes in PREFIX_COUNTERS:
        if looked in after and hit in after:
            d_looked, d_hit = after[looked] - before.get(looked, 0.0), after[hit] - before.get(hit, 0.0)
            return {"prefix_hit_rate": d_hit / d_looked if d_looked > 0 else None, "prefix_reused_tokens": int(d_hit),
                    "prefix_reused_bytes": int(after[nbytes] - before.get(nbytes, 0.0))
                    if nbytes and nbytes in after else None}
    return {"prefix_hit_rate": None, "prefix_reused_tokens": None, "prefix_reused_bytes": None}


def load_label(row: dict) -> str:
    """A row's offered load: "4 req/s" (Poisson or gamma arrivals) or "concurrency 8"."""
    return f"{row['rate']:g} req/s" if row.get("rate") is not None else f"concurrency {row['concurrency']}"


def knee(rows: list[dict]) -> dict | None:
    """The highest offered rate (req/s) the server kept up with (not `overloaded`) and the
    lowest it fell behind at, from a sweep over rates; None without rated rows."""
    rated = sorted((r for r in rows if r.get("rate") is not None), key=lambda r: r["rate"])
    if not rated:
        return None
    kept = [r for r in rated if not r["overloaded"]]
    behind = [r for r in rated if r["overloaded"]]
    return {"kept_up": kept[-1] if kept else None, "fell_behind": behind[0] if behind else None}


def format_rows(rows: list[dict]) -> str:
    from workbench.analysis.tables import format_table

    def ms(p: dict, key: str) -> str:
        return "-" if p[key] is None else f"{1e3 * p[key]:.0f}"

    table = [{"load": load_label(r),
              "done": f"{r['completed']}/{r['num_requests']}",
              "TTFT ms p50/p90/p99": f"{ms(r['ttft_s'], 'p50')}/{ms(r['ttft_s'], 'p90')}/{ms(r['ttft_s'], 'p99')}",
              "TPOT ms p50/p99": f"{ms(r['tpot_s'], 'p50')}/{ms(r['tpot_s'], 'p99')}",
              "ITL ms p50/p99": f"{ms(r['itl_s'], 'p50')}/{ms(r['itl_s'], 'p99')}",
              "out tok/s": f"{r['output_tokens_per_s']:.1f}", "req/s": f"{r['requests_per_s']:.2f}",
              "goodput req/s": f"{r['goodput_requests_per_s']:.2f}",
              "prefix hit": "-" if r.get("prefix_hit_rate") is None else f"{100 * r['prefix_hit_rate']:.0f}%",
              "overloaded": "yes" if r["overloaded"] else ""} for r in rows]
    return format_table(table, list(table[0]))
