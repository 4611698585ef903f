"""Attention backends: one record per backend, read by the model, the switches, the CLI, the
magics, the panel and the ablation grids (`ATTENTION_BACKENDS`).

    prefill(q, k, v, scale, window)      causal attention of one prompt:
                                         q [1, H, N, D], k / v [1, Hkv, N, D] -> [1, H, N, D];
                                         softmax scale (None: 1 / sqrt(D)), sliding window (0: none)
    decode(q, cache, layer, lengths, scale)   one new token per sequence over the KV cache:
                                         q [B, H, D] -> [B, H, D], sequence b sees lengths[b] tokens
                                         (a windowed layer: the last `window` of them)

slim and flash are our kernels; both use our decode kernel (the cache format picks its
variant). sdpa is PyTorch's own CPU attention; naive is the plain-PyTorch reference that
the tests and the ablation's reference runs trust. The last two decode over a dequantized
fp32 copy of each sequence's cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from workbench import kernels
from workbench.model.kv_formats import per_query_head


def _window_mask(n: int, nk: int, window: int) -> torch.Tensor:
    """[n, nk] True where query i (the last n of nk positions) may see key j: causally, and
    within the last `window` keys when window > 0."""
    i = torch.arange(n)[:, None] + (nk - n)
    j = torch.arange(nk)[None, :]
    return (j <= i) & ((j > i - window) if window else True)


def _naive_prefill(q, k, v, scale: float | None = None, window: int = 0):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    s = s.masked_fill(~_window_mask(q.shape[2], k.shape[2], window), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _sdpa_prefill(q, k, v, scale: float | None = None, window: int = 0):
    gqa = k.shape[1] != q.shape[1]
    if window:  # a boolean mask (True: attend): PyTorch's kernels take no window of their own
        mask = _window_mask(q.shape[2], k.shape[2], window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def _kernel_decode(q, cache, layer: int, lengths, scale: float | None = None):
    return cache.attend(layer, q, lengths, scale=scale)


def _per_sequence_decode(attend_one: Callable) -> Callable:
    """A decode function that runs attend_one(q [H, 1, D], k, v [Hkv, n, D], scale) -> [H, 1, D]
    on what each sequence's new token sees of its dequantized cache (a windowed layer: its
    last `window` tokens)."""
    def decode(q, cache, layer: int, lengths, scale: float | None = None):
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            k, v = per_query_head(*cache.visible(layer, b, int(lengths[b])), q.shape[1], cache.head_map)
            out[b] = attend_one(q[b].unsqueeze(1), k, v, scale)[:, 0]
        return out

    return decode


def _sdpa_one(q, k, v, scale):
    return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale,
                                          enable_gqa=k.shape[0] != q.shape[0])[0]


def _naive_one(q, k, v, scale):
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    return torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    description: str
    prefill: Callable  # (q, k, v, scale=None, window=0) -> out
    decode: Callable   # (q, cache, layer, lengths, scale=None) -> out
    decode_kernel: bool = False  # decode is our C++ kernel (so the fused decode step can run it)


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (
    AttentionBackend("slim", "SlimAttention: queries split only, one exact softmax pass (our kernel)",
                     lambda q, k, v, scale=None, window=0: kernels.slim_attention(q, k, v, causal=True, scale=scale,
                                                                                window=window),
                     _kernel_decode, True),
    AttentionBackend("flash", "FlashAttention-2: 2-D tiles, online softmax with rescaling (our kernel)",
                     lambda q, k, v, scale=None, window=0: kernels.flash_attention(q, k, v, causal=True, scale=scale,
                                                                                 window=window),
                     _kernel_decode, True),
    AttentionBackend("sdpa", "torch.nn.functional.scaled_dot_product_attention (PyTorch's CPU kernels)",
                     _sdpa_prefill, _per_sequence_decode(_sdpa_one)),
    AttentionBackend("naive", "plain PyTorch matmul + softmax: the reference",
                     _naive_prefill, _per_sequence_decode(_naive_one)),
)}


def attention_backend(name: str) -> AttentionBackend:
    """The backend called `name`; a ValueError listing the backends otherwise."""
    try:
        return ATTENTION_BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}") from None
