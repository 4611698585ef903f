"""Teacher forcing: prefill prompts, then feed a given continuation token by token, so that
every configuration sees exactly the same inputs and their next-token predictions can be
compared position by position (top-1 agreement, KL divergence, perplexity)."""

from __future__ import annotations

from typing import Iterator

import torch

from workbench.model.switches import Switches
from workbench.model.timing import StepRecord


def forced_steps(llama, prompts: list[list[int]], continuation: torch.Tensor, switches: Switches,
                 record: bool = False, cache=None) -> Iterator[tuple[int, torch.Tensor, StepRecord | None]]:
    """Yields (step, logits [B, vocab], record) for the prefill (step 0, the logits of each
    prompt's last token) and then for each token of continuation [B, steps] but the last:
    step s + 1 predicts continuation[:, s + 1]. Runs under inference_mode. cache: an empty
    cache to use (new_cache_for's), else a new one in switches.kv_cache / kv_kernel."""
    batch, steps = continuation.shape
    if batch != len(prompts):
        raise ValueError(f"continuation has {batch} rows for {len(prompts)} prompts")
    if cache is None:
        cache = new_cache_for(llama, prompts, continuation, switches)
    with torch.inference_mode():
        tokens = torch.tensor([t for p in prompts for t in p])
        logits, rec = llama.prefill(tokens, [len(p) for p in prompts], cache, switches, record)
        yield 0, logits, rec
        for s in range(steps - 1):
            logits, rec = llama.decode(continuation[:, s], cache, switches, record)
            yield s + 1, logits, rec


def new_cache_for(llama, prompts: list[list[int]], continuation: torch.Tensor, switches: Switches):
    """An empty cache long enough for the prompts and the continuation."""
    return llama.new_cache(len(prompts), max(map(len, prompts)) + continuation.shape[1], switches.kv_cache,
                           switches.kv_kernel)


def forced_logits(llama, prompts: list[list[int]], continuation: torch.Tensor, switches: Switches,
                  cache=None) -> torch.Tensor:
    """All of forced_steps' logits: [B, steps, vocab]; position s predicts continuation[:, s]."""
    steps = forced_steps(llama, prompts, continuation, switches, cache=cache)
    return torch.stack([logits for _, logits, _ in steps], dim=1)
