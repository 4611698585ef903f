"""Choosing the next token from logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How a sequence picks its tokens, checked once: greedy at temperature 0 (the default),
    else sampled from the softmax at `temperature`, cut to the top_k most likely and the top_p
    nucleus, from a generator seeded by `seed` (the serving scheduler gives each request a
    generator of its own, seeded by its id without one, so its draws do not depend on its batch)."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 100:
            raise ValueError(f"temperature must be a number in 0..100, got {t!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative integer (0 or None: no cut), got {self.top_k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
           generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: greedy at temperature 0, else top-k / top-p sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
