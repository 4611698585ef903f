"""How much a KV-cache format changes the model's predictions, on real text.

For each context length N the text is cut to its first N tokens: the first N - steps are
the prompt (prefilled), the last `steps` are teacher-forced one by one, so every prediction
measured is made by decode attention over a cache holding the whole preceding context in
the format under test (prefill attention reads fresh K and V, so its predictions cannot
show the format). Each format is compared with the fp32 cache at the same positions:

    top1_agreement_vs_fp32   share of positions where the most likely next token is the same
    kl_nats                  mean KL(p_fp32 || p_format) of the next-token distributions, nats
    kl_nats_max              the largest at any position
    perplexity               exp(mean negative log-likelihood of the text's actual next tokens)
    bytes_per_element        storage per cached value, scales included
    cache                    the format and, where it has several, its kernel: "int8 (tile)"
    attention_rel_error      the decode kernel's own error: its attention outputs against
                             float64 over the very values the cache stores (AttentionErrorProbe),
                             so the dot kernel's query rounding and the tile kernel's
                             probability rounding show apart from the cache's storage rounding

A format may name the kernel that reads it ("int8:dot"); rows give kv_cache and kv_kernel.
The default text is every license Debian ships (workbench.analysis.text.license_corpus).
Formats marked kernel=False run on the labelled torch reference path
(workbench.model.kv_quant): the same numbers a kernel would give, not its speed.
"""

from __future__ import annotations

from typing import Callable

import torch

from workbench.analysis.axes import decade_axis
from workbench.analysis.forcing import forced_logits, new_cache_for
from workbench.analysis.text import license_corpus
from workbench.model.kv_formats import KV_FORMATS, kernel_configs, kv_format, kv_label
from workbench.model.kv_quant import reference_attention
from workbench.model.switches import Switches

REFERENCE = "fp32"
# Every format, and each kernel of a format that has several (their rounding differs).
ALL_CACHES = tuple(f"{fmt}:{kernel}" if kernel else fmt for fmt, kernel in kernel_configs(KV_FORMATS, "all"))


def _contexts(context) -> list[int]:
    values = [context] if isinstance(context, int) else list(context)
    if not values or not all(isinstance(c, int) and c > 0 for c in values):
        raise ValueError(f"context must be a positive integer or a list of them, got {context!r}")
    return values


def kv_quality(model, formats=ALL_CACHES, context=1024, steps: int = 64, text: str | None = None,
               attention: str = "slim", progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per (context, format), see the module docstring. context: an int or a list
    (for example [512, 1024, 2048])."""
    caches = kernel_configs(formats)  # "int8:dot" names a kernel; a plain format gets its default
    contexts = _contexts(context)
    for c in contexts:
        if not 2 <= steps < c:
            raise ValueError(f"steps must be at least 2 and less than context ({c}), got {steps}")
    source = text if text is not None else license_corpus()[0]
    ids = model.tokenizer.encode(source)
    if len(ids) < max(contexts):
        raise ValueError(f"the text has {len(ids)} tokens; context={max(contexts)} needs at least that many")
    say = progress or (lambda msg: None)
    head_dim, kv_heads = model.config.head_dim, model.config.n_kv_heads
    rows = []
    for c in contexts:
        prompt, follow = [ids[:c - steps]], torch.tensor([ids[c - steps:c]])
        # forced_logits' position s predicts follow[s]; position 0 is the prefill's, the rest decode's.
        targets = torch.tensor(ids[c - steps + 1:c])

        def logprobs(fmt: str, kernel: str | None = None) -> tuple[torch.Tensor, float]:
            # The reference step path (the same kernels, called one by one), so the probe sees
            # every attention call.
            switches = Switches(attention, fmt, kernel, step="reference")
            cache = new_cache_for(model.llama, prompt, follow, switches)
            probe = AttentionErrorProbe(cache)
            lp = forced_logits(model.llama, prompt, follow, switches, cache=cache)[0, 1:].log_softmax(-1)
            return lp, probe.mean_relative_error

        ref, ref_err = logprobs(REFERENCE)  # [steps - 1, vocab]: the decode steps' predictions
        for fmt, kernel in caches:
            kernel = kv_format(fmt).kernel(kernel, head_dim)
            lp, attn_err = (ref, ref_err) if fmt == REFERENCE else logprobs(fmt, kernel)
            kl = (ref.exp() * (ref - lp)).sum(-1)
            nll = -lp.gather(-1, targets[:, None])
            f = KV_FORMATS[fmt]
            rows.append({"cache": kv_label(fmt, kernel), "kv_cache": fmt, "kv_kernel": kernel, "granularity": f.granularity, "bits": f.bits,
                         "bytes_per_element": f.bytes_per_element(head_dim, kv_heads), "kernel": f.has_kernel,
                         "context": c, "positions": lp.shape[0],
                         "top1_agreement_vs_fp32": (lp.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                         "kl_nats": kl.mean().item(), "kl_nats_max": kl.max().item(),
                         "perplexity": nll.mean().exp().item(), "attention_rel_error": attn_err})
            say(f"context {c}: {kv_label(fmt, kernel)} KL {rows[-1]['kl_nats']:.2e}, top-1 {rows[-1]['top1_agreement_vs_fp32']:.3f}")
    return rows


class AttentionErrorProbe:
    """Measures a decode kernel's own arithmetic error on a real run: every decode attention
    over `cache` is also computed in float64 over exactly the values the cache stores, and
    the relative L2 error of the kernel's output ||o - o64|| / ||o64|| (per sequence, head
    and layer) is averaged. Storage rounding is not in it (both read the same values), only
    what the kernel adds: the dot kernel's query quantization, the tile kernel's probability rounding, fp32
    accumulation order. Wraps cache.attend on this one cache object."""

    def __init__(self, cache):
        self.cache, self.errors = cache, []
        attend = cache.attend

        def checked(layer, q, lengths, **options):
            out = attend(layer, q, lengths, **options)
            self.errors.append(self._relative_error(layer, q, lengths, out))
            return out

        cache.attend = checked

    def _relative_error(self, layer, q, lengths, out) -> float:
        errs = []
        for b in range(q.shape[0]):
            k, v = (t.double() for t in self.cache.dequantized(layer, b, int(lengths[b])))
            ref = reference_attention(q[b].double(), k, v)
            errs.append(((out[b].double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).mean().item())
        return sum(errs) / len(errs)

    @property
    def mean_relative_error(self) -> float:
        return sum(self.errors) / len(self.errors) if self.errors else float("nan")


def weight_quality(reference, candidate, context: int = 1024, text: str | None = None) -> dict:
    """A weight dtype's effect on predictions, reported like the KV formats': both models
    score the same `context` tokens of real text in one forward pass each; mean KL(p_ref ||
    p_candidate), top-1 agreement and both perplexities over every position."""
    source = text if text is not None else license_corpus()[0]
    ids = reference.tokenizer.encode(source)[:context]
    if len(ids) < 2:
        raise ValueError("the text needs at least 2 tokens")
    ref = reference.logits(ids).log_softmax(-1)
    got = candidate.logits(ids).log_softmax(-1)
    targets = torch.tensor(ids[1:])
    kl = (ref.exp() * (ref - got)).sum(-1)

    def ppl(lp):
        return (-lp[:-1].gather(-1, targets[:, None])).mean().exp().item()

    return {"reference": reference.weight_dtype, "candidate": candidate.weight_dtype, "context": len(ids),
            "kl_nats": kl.mean().item(), "kl_nats_max": kl.max().item(),
            "top1_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
            "perplexity_reference": ppl(ref), "perplexity": ppl(got)}


def best_per_byte(rows: list[dict], context: int | None = None) -> list[dict]:
    """The formats no other beats on both bytes per element and KL (the Pareto front), at
    `context` (default: the longest measured), smallest first."""
    context = context or max(r["context"] for r in rows)
    at = [r for r in rows if r["context"] == context]
    front = [r for r in at if not any(o["bytes_per_element"] <= r["bytes_per_element"] and o["kl_nats"] < r["kl_nats"]
                                      and o is not r for o in at)]
    return sorted(front, key=lambda r: r["bytes_per_element"])


def quality_figure(rows: list[dict]) -> dict:
    """Plotly spec: KL against bytes per element, one marker per format, a trace per context."""
    data = []
    for c in sorted({r["context"] for r in rows}):
        at = [r for r in rows if r["context"] == c and r["kl_nats"] > 0]
        data.append({"type": "scatter", "mode": "markers+text", "name": f"context {c}",
                     "x": [r["bytes_per_element"] for r in at], "y": [r["kl_nats"] for r in at],
                     "text": [r.get("cache", r["kv_cache"]) for r in at], "textposition": "top center",
                     "hovertemplate": "%{text}: %{x:.3f} B/element, KL %{y:.2e} nats<extra></extra>"})
    kl = [r["kl_nats"] for r in rows if r["kl_nats"] > 0]  # an fp32 cache's 0 has no place on a log axis
    return {"data": data, "layout": {"title": {"text": "KV-cache quality vs bytes (KL to an fp32 cache; lower is better)"},
                                     "height": 460, "xaxis": {"title": {"text": "bytes per cached element (scales included)"}},
                                     "yaxis": decade_axis("mean KL, nats", kl) if kl else
                                     {"title": {"text": "mean KL, nats (none above 0)"}}}}


def default_text_name() -> str:
    """Which text kv_quality reads when none is given (for tables and reports)."""
    files = license_corpus()[1]
    return f"{len(files)} license texts under /usr/share/common-licenses" if len(files) > 1 else files[0]
