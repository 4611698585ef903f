"""Ablation grids: attention backend x KV dtype x prompt length x batch, one row each.

Every configuration decodes the same reference continuation (produced greedily by the
naive attention with an fp32 KV cache), teacher-forced, so that top-1 agreement compares
like with like at every position and the timings cover the same tokens:

    prefill_ms             the prompts' forward pass (all sequences of the batch)
    decode_tokens_per_s    tokens after the first, all sequences, per second
    decode_gbps            weight + KV bytes each decode step must read / its time
    pct_peak_bandwidth     decode_gbps against the machine's measured triad bandwidth
    decode_gflops          floating-point operations of each decode step / its time
    pct_peak_fma           decode_gflops against the machine's measured FMA peak: the larger
                           of the two percentages shows what bounds decoding (batch 1 is
                           bandwidth-bound; large batches on few cores become compute-bound)
    top1_agreement         how often the configuration's most likely next token is the
                           reference's token, over all positions and sequences
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from workbench.model import ATTENTION_BACKENDS, KV_DTYPES, KVCache, Switches

TEXT_SOURCES = ("/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/GPL-3")


def sample_text() -> str:
    """English text available offline (a license text), for prompts of any length."""
    for p in TEXT_SOURCES:
        if Path(p).is_file():
            return Path(p).read_text()
    return "The quick brown fox jumps over the lazy dog. " * 400


def sample_prompts(tokenizer, prompt_len: int, batch: int) -> list[list[int]]:
    """`batch` different prompts of exactly prompt_len tokens, cut from the sample text."""
    ids = tokenizer.encode(sample_text())
    while len(ids) < prompt_len + 37 * batch:
        ids = ids + ids
    return [ids[37 * b: 37 * b + prompt_len] for b in range(batch)]


@dataclass
class AblationRow:
    attention: str
    kv_cache: str
    prompt_len: int
    batch: int
    new_tokens: int
    prefill_ms: float
    decode_tokens_per_s: float
    decode_gbps: float
    pct_peak_bandwidth: float
    decode_gflops: float
    pct_peak_fma: float
    top1_agreement: float


def forced_decode(llama, prompts: list[list[int]], continuation: torch.Tensor, switches: Switches) -> dict:
    """Prefill the prompts, then decode `continuation` [B, steps] token by token (teacher
    forcing); returns timings and top-1 agreement with the continuation."""
    batch, steps = continuation.shape
    cache = KVCache(llama.cfg, batch, max(map(len, prompts)) + steps + 1, switches.kv_cache)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits, _ = llama.prefill(torch.tensor([t for p in prompts for t in p]), [len(p) for p in prompts],
                                  cache, switches)
        prefill_s = time.perf_counter() - t0
        hits = int((logits.argmax(-1) == continuation[:, 0]).sum())
        step_bytes, step_flops, t1 = 0, 0, time.perf_counter()
        for s in range(steps - 1):
            logits, rec = llama.decode(continuation[:, s], cache, switches, record=True)
            hits += int((logits.argmax(-1) == continuation[:, s + 1]).sum())
            step_bytes += rec.bytes_read
            step_flops += rec.total_flops
        decode_s = time.perf_counter() - t1
    return {"prefill_ms": 1e3 * prefill_s,
            "decode_tokens_per_s": batch * (steps - 1) / decode_s if steps > 1 else 0.0,
            "decode_gbps": step_bytes / decode_s / 1e9 if steps > 1 else 0.0,
            "decode_gflops": step_flops / decode_s / 1e9 if steps > 1 else 0.0,
            "top1_agreement": hits / (batch * steps)}


def run_ablation(model, attentions=ATTENTION_BACKENDS, kv_caches=tuple(KV_DTYPES), prompt_lens=(128,),
                 batches=(1,), new_tokens: int = 16,
                 progress: Callable[[int, int, AblationRow], None] | None = None) -> list[AblationRow]:
    """The grid, reference first for each (prompt length, batch); see the module docstring."""
    for name, values, accepted in (("attention", attentions, ATTENTION_BACKENDS), ("kv_cache", kv_caches, KV_DTYPES)):
        bad = [v for v in values if v not in accepted]
        if bad or not values:
            raise ValueError(f"{name} must be a non-empty list of {', '.join(accepted)}, got {list(values)}")
    for name, values in (("prompt_lens", prompt_lens), ("batches", batches)):
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name} must be positive integers, got {list(values)}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an integer >= 2, got {new_tokens!r}")
    from workbench.peaks import measured_peaks

    peaks = measured_peaks()
    rows: list[AblationRow] = []
    grid = list(itertools.product(prompt_lens, batches))
    total = len(grid) * len(attentions) * len(kv_caches)
    for prompt_len, batch in grid:
        prompts = sample_prompts(model.tokenizer, prompt_len, batch)
        ref = model.generate(prompts, max_new_tokens=new_tokens, attention="naive", kv_cache="fp32",
                             stop_at_eos=False, record=False).token_ids
        continuation = torch.tensor(ref)  # [batch, new_tokens]: list-of-lists prompts give one list each
        for attention, kv in itertools.product(attentions, kv_caches):
            r = forced_decode(model.llama, prompts, continuation, Switches(attention, kv))
            rows.append(AblationRow(attention, kv, prompt_len, batch, new_tokens, r["prefill_ms"],
                                    r["decode_tokens_per_s"],
                                    r["decode_gbps"], 100 * r["decode_gbps"] / peaks.triad_gbps,
                                    r["decode_gflops"], 100 * r["decode_gflops"] / peaks.fma_gflops,
                                    r["top1_agreement"]))
            if progress:
                progress(len(rows), total, rows[-1])
    return rows


def rows_as_dicts(rows: list[AblationRow]) -> list[dict]:
    return [asdict(r) for r in rows]


COLUMNS = ["attention", "kv_cache", "prompt_len", "batch", "prefill_ms", "decode_tokens_per_s", "decode_gbps",
           "pct_peak_bandwidth", "decode_gflops", "pct_peak_fma", "top1_agreement"]
_FORMATS = {"prefill_ms": "{:.1f}", "decode_tokens_per_s": "{:.1f}", "decode_gbps": "{:.2f}",
            "pct_peak_bandwidth": "{:.0f}", "decode_gflops": "{:.1f}", "pct_peak_fma": "{:.0f}",
            "top1_agreement": "{:.3f}"}


def format_table(rows: list[AblationRow], columns: list[str] = COLUMNS) -> str:
    """A plain-text table, one row per configuration."""
    cells = [[_FORMATS.get(c, "{}").format(getattr(r, c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
