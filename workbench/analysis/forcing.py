"""Teacher forcing: prefill prompts, then feed a given continuation token by token, so that
every configuration sees exactly the same inputs and their next-token predictions can be
compared position by position (top-1 agreement, KL divergence, perplexity)."""

from __future__ import annotations

from typing import Iterator

import torch

from workbench.model.switches import Switches
from workbench.runtime.timing import StepRecord


def forced_steps(llama, prompts: list[list[int]], continuation: torch.Tensor, switches: Switches,
                 record: bool = False) -> Iterator[tuple[int, torch.Tensor, StepRecord | None]]:
    """Yields (step, logits [B, vocab], record) for the prefill (step 0, the logits of each
    prompt's last token) and then for each token of continuation [B, steps] but the last:
    step s + 1 predicts continuation[:, s + 1]. Runs under inference_mode."""
    batch, steps = continuation.shape
    if batch != len(prompts):
        raise ValueError(f"continuation has {batch} rows for {len(prompts)} prompts")
    cache = llama.new_cache(batch, max(map(len, prompts)) + steps, switches.kv_cache)
    with torch.inference_mode():
        tokens = torch.tensor([t for p in prompts for t in p])
        logits, rec = llama.prefill(tokens, [len(p) for p in prompts], cache, switches, record)
        yield 0, logits, rec
        for s in range(steps - 1):
            logits, rec = llama.decode(continuation[:, s], cache, switches, record)
            yield s + 1, logits, rec


def forced_logits(llama, prompts: list[list[int]], continuation: torch.Tensor, switches: Switches) -> torch.Tensor:
    """All of forced_steps' logits: [B, steps, vocab]; position s predicts continuation[:, s]."""
    return torch.stack([logits for _, logits, _ in forced_steps(llama, prompts, continuation, switches)], dim=1)
