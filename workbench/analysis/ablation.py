"""Ablation grids: attention backend x KV format (and the kernels that read it) x prompt
length x batch, one row each.

Every configuration decodes the same reference continuation (produced greedily by the
naive attention with an fp32 KV cache), teacher-forced, so that top-1 agreement compares
like with like at every position and the timings cover the same tokens:

    prefill_ms             the prompts' forward pass (all sequences of the batch)
    decode_tokens_per_s    tokens after the first, all sequences, per second
    decode_gbps            all bytes the decode steps must read (weights, LM head, KV cache
                           with its scales) / their total time
    pct_peak_bandwidth     decode_gbps against the machine's measured triad bandwidth
    decode_gflops          floating-point operations of the decode steps / their total time
    pct_peak_fma           decode_gflops against the machine's measured FMA peak: the larger
                           of the two percentages shows what bounds decoding (batch 1 is
                           bandwidth-bound; large batches on few cores become compute-bound)
    top1_agreement         how often the configuration's most likely next token is the
                           reference's token, over all positions and sequences

With repeats > 1 (the default, 3) every configuration of a (prompt length, batch) is run
that many times, the configurations in a new random order each round, after one warm-up
round that is not kept; the timings are medians, with min and max beside them
(prefill_ms_min / _max, decode_tokens_per_s_min / _max), so a row's spread is on the row.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from workbench.analysis.forcing import forced_steps
from workbench.analysis.tables import format_table as _format_table
from workbench.analysis.text import sample_prompts
from workbench.hw.rounds import interleaved_rounds
from workbench.model.attention import ATTENTION_BACKENDS
from workbench.model.kv_formats import KERNEL_FORMATS, KV_FORMATS, kernel_configs, kv_format, kv_label
from workbench.model.switches import Switches
from workbench.model.timing import Timings


@dataclass
class AblationRow:
    attention: str
    kv_cache: str
    kv_kernel: str | None  # the kernel that read the cache (None: a reference-path format)
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
    repeats: int = 1
    prefill_ms_min: float = 0.0
    prefill_ms_max: float = 0.0
    decode_tokens_per_s_min: float = 0.0
    decode_tokens_per_s_max: float = 0.0


def forced_decode(llama, prompts: list[list[int]], continuation: torch.Tensor, switches: Switches) -> dict:
    """Prefill the prompts, then decode `continuation` [B, steps] (teacher forcing); returns
    timings (rates aggregated as in workbench.model.timing) and top-1 agreement."""
    batch, steps = continuation.shape
    timings, hits = Timings(), 0
    t0 = time.perf_counter()
    for step, logits, rec in forced_steps(llama, prompts, continuation, switches, record=True):
        if step == 0:
            prefill_s, t_decode = time.perf_counter() - t0, time.perf_counter()
        else:
            timings.steps.append(rec)
            timings.decode_tokens += batch
        hits += int((logits.argmax(-1) == continuation[:, step]).sum())
    timings.decode_s = time.perf_counter() - t_decode
    return {"prefill_ms": 1e3 * prefill_s, "decode_tokens_per_s": timings.decode_tokens_per_s,
            "decode_gbps": timings.gbps("decode"), "decode_gflops": timings.gflops("decode"),
            "top1_agreement": hits / (batch * steps)}


def run_ablation(model, attentions=tuple(ATTENTION_BACKENDS), kv_caches=KERNEL_FORMATS, prompt_lens=(128,),
                 batches=(1,), new_tokens: int = 16,
                 progress: Callable[[int, int, AblationRow], None] | None = None, repeats: int = 3,
                 seed: int = 0, kv_kernels: str | list[str] | None = None) -> list[AblationRow]:
    """The grid, reference first for each (prompt length, batch); see the module docstring.
    kv_caches: formats, each optionally naming its kernel ("int8:widen"); kv_kernels: the
    other formats read by their default kernel (None), by every kernel they have ("all"), or
    by those listed that they have (kv_formats.kernel_configs)."""
    for name, values, accepted in (("attention", attentions, ATTENTION_BACKENDS), ("kv_cache", kv_caches, KV_FORMATS)):
        bad = [v for v in values if str(v).partition(":")[0] not in accepted]
        if bad or not values:
            raise ValueError(f"{name} must be a non-empty list of {', '.join(accepted)} (a format may name its "
                             f"kernel: int8:widen), got {list(values)}")
    for name, values in (("prompt_lens", prompt_lens), ("batches", batches)):
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name} must be positive integers, got {list(values)}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an integer >= 2, got {new_tokens!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    head_dim = model.config.head_dim
    caches = [(kv, kv_format(kv).kernel(k, head_dim)) for kv, k in kernel_configs(kv_caches, kv_kernels)]
    from workbench.kernels.peaks import measured_peaks

    peaks = measured_peaks()
    rows: list[AblationRow] = []
    order = random.Random(seed)
    grid = list(itertools.product(prompt_lens, batches))
    total = len(grid) * len(attentions) * len(caches)
    for prompt_len, batch in grid:
        prompts = sample_prompts(model.tokenizer, prompt_len, batch)
        ref = model.generate(prompts, max_new_tokens=new_tokens, attention="naive", kv_cache="fp32",
                             stop_at_eos=False, record=False).token_ids
        continuation = torch.tensor(ref)  # [batch, new_tokens]: list-of-lists prompts give one list each
        configs = [(a, kv, k) for a in attentions for kv, k in caches]
        samples = {c: [] for c in configs}
        # a warm-up round first when there are repeats
        for round_, c in interleaved_rounds(configs, repeats, warmup=int(repeats > 1), seed=order.randrange(2**31)):
            r = forced_decode(model.llama, prompts, continuation, Switches(*c))  # (attention, kv_cache, kv_kernel)
            if round_ >= 0:
                samples[c].append(r)
        for attention, kv, kernel in configs:
            runs = samples[(attention, kv, kernel)]

            def med(key, runs=runs):
                return statistics.median(r[key] for r in runs)

            prefill, rate = [r["prefill_ms"] for r in runs], [r["decode_tokens_per_s"] for r in runs]
            gbps, gflops = med("decode_gbps"), med("decode_gflops")
            rows.append(AblationRow(attention, kv, kernel, prompt_len, batch, new_tokens, med("prefill_ms"),
                                    med("decode_tokens_per_s"), gbps, 100 * gbps / peaks.triad_gbps,
                                    gflops, 100 * gflops / peaks.fma_gflops, runs[0]["top1_agreement"],
                                    len(runs), min(prefill), max(prefill), min(rate), max(rate)))
            if progress:
                progress(len(rows), total, rows[-1])
    return rows


def spread_warnings(rows: list[AblationRow], metric: str = "decode_tokens_per_s") -> list[str]:
    """One line per run of configurations (same prompt length and batch) that the table cannot
    rank: sorted by `metric`, neighbours whose min-max ranges overlap are within the run-to-run
    spread of each other, and a chain of such neighbours is named once, slowest to fastest
    (a noisy machine gives one line per prompt length, not one per pair). Empty when every
    row has one sample (nothing to compare with)."""
    def name(r):
        return f"{r.attention} / {kv_label(r.kv_cache, r.kv_kernel)} ({getattr(r, metric):.1f})"

    lines = []
    groups: dict[tuple, list[AblationRow]] = {}
    for r in rows:
        groups.setdefault((r.prompt_len, r.batch), []).append(r)
    for (prompt_len, batch), group in groups.items():
        ranged = sorted((r for r in group if r.repeats > 1), key=lambda r: getattr(r, metric))
        chains: list[list[AblationRow]] = []
        for lo, hi in zip(ranged, ranged[1:]):
            if getattr(hi, f"{metric}_min") <= getattr(lo, f"{metric}_max"):
                if chains and chains[-1][-1] is lo:
                    chains[-1].append(hi)
                else:
                    chains.append([lo, hi])
        for chain in chains:
            who = " and ".join(map(name, chain)) if len(chain) == 2 else ", ".join(map(name, chain))
            lines.append(f"prompt {prompt_len}, batch {batch}: {who} overlap in their min-max ranges, each with the "
                         f"next: the differences are within the run-to-run spread (more --repeats, a quieter machine)")
    return lines


def rows_as_dicts(rows: list[AblationRow]) -> list[dict]:
    return [asdict(r) for r in rows]


COLUMNS = ["attention", "kv_cache", "kv_kernel", "prompt_len", "batch", "repeats", "prefill_ms", "prefill_ms_min", "prefill_ms_max",
           "decode_tokens_per_s", "decode_tokens_per_s_min", "decode_tokens_per_s_max", "decode_gbps",
           "pct_peak_bandwidth", "decode_gflops", "pct_peak_fma", "top1_agreement"]
# Meaningful digits per column, for tables people read (FORMATS for text, DIGITS for DataFrames).
DIGITS = {"prefill_ms": 1, "prefill_ms_min": 1, "prefill_ms_max": 1, "decode_tokens_per_s": 1,
          "decode_tokens_per_s_min": 1, "decode_tokens_per_s_max": 1, "decode_gbps": 2, "pct_peak_bandwidth": 0, "decode_gflops": 1,
          "pct_peak_fma": 0, "top1_agreement": 3}
FORMATS = {"prefill_ms": "{:.1f}", "prefill_ms_min": "{:.1f}", "prefill_ms_max": "{:.1f}",
           "decode_tokens_per_s": "{:.1f}", "decode_tokens_per_s_min": "{:.1f}", "decode_tokens_per_s_max": "{:.1f}", "decode_gbps": "{:.2f}",
           "pct_peak_bandwidth": "{:.0f}", "decode_gflops": "{:.1f}", "pct_peak_fma": "{:.0f}",
           "top1_agreement": "{:.3f}"}


def format_table(rows: list[AblationRow], columns: list[str] = COLUMNS) -> str:
    """A plain-text table, one row per configuration."""
    return _format_table(rows_as_dicts(rows), columns, FORMATS)
