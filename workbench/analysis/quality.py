"""How much a KV-cache format changes the model's predictions, on real text.

The text is cut to `context` tokens: the first context - steps are the prompt (prefilled),
the last `steps` are teacher-forced one by one, so every prediction measured is made by
decode attention over a cache that holds the whole preceding context in the format under
test (prefill attention reads fresh K and V, so its predictions cannot show the format).
Each format is compared with the fp32 cache at the same positions:

    top1_agreement_vs_fp32   share of positions where the most likely next token is the same
    kl_nats                  mean KL(p_fp32 || p_format) of the next-token distributions, nats
    kl_nats_max              the largest at any position
    perplexity               exp(mean negative log-likelihood of the text's actual next tokens)
"""

from __future__ import annotations

import torch

from workbench.analysis.forcing import forced_logits
from workbench.analysis.text import TEXT_SOURCES, sample_text
from workbench.model.kv_formats import KV_FORMATS, kv_format
from workbench.model.switches import Switches

REFERENCE = "fp32"


def kv_quality(model, formats=tuple(KV_FORMATS), context: int = 1024, steps: int = 64, text: str | None = None,
               attention: str = "slim") -> list[dict]:
    """One row per format (see the module docstring); `text` defaults to a license text."""
    for f in formats:
        kv_format(f)
    if not 2 <= steps < context:
        raise ValueError(f"steps must be at least 2 and less than context ({context}), got {steps}")
    ids = model.tokenizer.encode(text if text is not None else sample_text())
    if len(ids) < context:
        raise ValueError(f"the text has {len(ids)} tokens; context={context} needs at least that many")
    prompt, follow = [ids[:context - steps]], torch.tensor([ids[context - steps:context]])
    # forced_logits' position s predicts follow[s]; position 0 is the prefill's, the rest decode's.
    targets = torch.tensor(ids[context - steps + 1:context])

    def logprobs(fmt: str) -> torch.Tensor:
        return forced_logits(model.llama, prompt, follow, Switches(attention, fmt))[0, 1:].log_softmax(-1)

    ref = logprobs(REFERENCE)  # [steps - 1, vocab]: the decode steps' predictions
    rows = []
    for fmt in formats:
        lp = ref if fmt == REFERENCE else logprobs(fmt)
        kl = (ref.exp() * (ref - lp)).sum(-1)
        nll = -lp.gather(-1, targets[:, None])
        rows.append({"kv_cache": fmt, "bits": KV_FORMATS[fmt].bits,
                     "bytes_per_element": KV_FORMATS[fmt].bytes_per_element(model.config.head_dim),
                     "context": context, "positions": lp.shape[0],
                     "top1_agreement_vs_fp32": (lp.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                     "kl_nats": kl.mean().item(), "kl_nats_max": kl.max().item(),
                     "perplexity": nll.mean().exp().item()})
    return rows


def default_text_name() -> str:
    """Which file kv_quality reads when no text is given (for tables and reports)."""
    from pathlib import Path

    return next((p for p in TEXT_SOURCES if Path(p).is_file()), "a built-in sentence")
