"""The workbench's main job: every attention backend x every KV-cache dtype on one model.

For a short and a long prompt (real English text), the fp32-cache / naive-attention run
generates the reference continuation greedily. Every configuration then decodes that same
continuation (teacher forcing, so later positions are comparable even after a first
disagreement), and we record:

    prefill_ms              time of the prompt's forward pass
    decode_tokens_per_s     after the first token
    decode_gbps             weight + KV bytes read per decode step / step time
    top1_agreement          how often the configuration's most likely next token equals the
                            reference's, position by position
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from workbench.model import ATTENTION_BACKENDS, KV_DTYPES, KVCache, Switches

TEXT_SOURCES = ("/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/GPL-3")


def sample_text() -> str:
    for p in TEXT_SOURCES:
        if Path(p).is_file():
            return Path(p).read_text()
    return ("The quick brown fox jumps over the lazy dog. " * 200)  # any English will do


def forced_decode(llama, prompt: list[int], continuation: list[int], switches: Switches) -> dict:
    """Prefill `prompt`, then decode `continuation` token by token; time and score it."""
    cache = KVCache(llama.cfg, 1, len(prompt) + len(continuation) + 1, switches.kv_cache)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits, _ = llama.prefill(torch.tensor(prompt), [len(prompt)], cache, switches)
        prefill_s = time.perf_counter() - t0
        predictions = [int(logits.argmax(-1))]
        step_bytes, t1 = 0, time.perf_counter()
        for tok in continuation[:-1]:
            logits, rec = llama.decode(torch.tensor([tok]), cache, switches, record=True)
            predictions.append(int(logits.argmax(-1)))
            step_bytes += sum(rec.weight_bytes) + sum(rec.kv_bytes)
        decode_s = time.perf_counter() - t1
    steps = len(continuation) - 1
    agree = sum(p == t for p, t in zip(predictions, continuation)) / len(continuation)
    return {"prefill_ms": 1e3 * prefill_s,
            "decode_tokens_per_s": steps / decode_s if steps else 0.0,
            "decode_gbps": step_bytes / decode_s / 1e9 if steps else 0.0,
            "top1_agreement": agree}


def run_demo(model, short_tokens: int = 16, long_tokens: int = 512, new_tokens: int = 32,
             attentions=ATTENTION_BACKENDS, kv_caches=tuple(KV_DTYPES), progress=None) -> list[dict]:
    ids = model.tokenizer.encode(sample_text())
    prompts = {"short": ids[:short_tokens], "long": ids[:long_tokens]}
    rows = []
    configs = [(a, k) for a in attentions for k in kv_caches]
    total, done = len(prompts) * len(configs), 0
    for label, prompt in prompts.items():
        ref = model.generate(prompt, max_new_tokens=new_tokens, attention="naive", kv_cache="fp32",
                             stop_at_eos=False, record=False).token_ids
        for attention, kv in configs:
            r = forced_decode(model.llama, prompt, ref, Switches(attention, kv))
            rows.append({"prompt": label, "prompt_tokens": len(prompt), "attention": attention, "kv_cache": kv, **r})
            done += 1
            if progress:
                progress(done, total, rows[-1])
    return rows


def format_table(rows: list[dict]) -> str:
    cols = ["prompt", "prompt_tokens", "attention", "kv_cache", "prefill_ms", "decode_tokens_per_s", "decode_gbps",
            "top1_agreement"]
    fmt = {"prefill_ms": "{:.1f}", "decode_tokens_per_s": "{:.1f}", "decode_gbps": "{:.2f}",
           "top1_agreement": "{:.3f}"}
    cells = [[fmt.get(c, "{}").format(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
