"""Plain float64 PyTorch references that the kernels are tested against."""

from __future__ import annotations

import math

import torch


def attention_reference(q, k, v, *, causal: bool, scale: float | None = None, window: int = 0) -> torch.Tensor:
    """q [B, H, N, D], k / v [B, Hkv, Nk, D] -> float64 [B, H, N, D].
    Causal: query i sees keys 0 .. i + (Nk - N); with a window, only the last `window` of them."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, N, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(D))
    if causal:
        i = torch.arange(N)[:, None]
        j = torch.arange(Nk)[None, :]
        s = s.masked_fill(j > i + (Nk - N), float("-inf"))
        if window:
            s = s.masked_fill(j <= i + (Nk - N) - window, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def decode_reference(q, k_cache, v_cache, lengths, *, k_scale=None, v_scale=None,
                     scale: float | None = None, head_map=None) -> torch.Tensor:
    """q [B, H, D], caches [B, Hkv, Lmax, D] (any dtype; int8 with per-token scales)
    -> float64 [B, H, D], each sequence b attending to its first lengths[b] tokens; query
    head h reads KV head h // (H / Hkv), or (h + q_offset) // group with head_map =
    (group, q_offset)."""
    k = k_cache.double()
    v = v_cache.double()
    if k_scale is not None:
        k = k * k_scale.double().unsqueeze(-1)
        v = v * v_scale.double().unsqueeze(-1)
    B, H, D = q.shape
    if head_map is None:
        index = torch.arange(H) // (H // k.shape[1])
    else:
        index = (torch.arange(H) + head_map[1]) // head_map[0]
    out = torch.empty(B, H, D, dtype=torch.float64)
    sm = scale if scale is not None else 1.0 / math.sqrt(D)
    for b in range(B):
        n = int(lengths[b])
        kb = k[b, index, :n]  # [H, n, D]: each query head's KV head
        vb = v[b, index, :n]
        s = torch.einsum("hd,hnd->hn", q[b].double(), kb) * sm
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, dim=-1), vb)
    return out


def rope_reference(x, cos, sin, heads: int, head_dim: int) -> torch.Tensor:
    """Rotate-half RoPE in float64 on the first `heads` head vectors of each row of x [T, C]
    (as Hugging Face's apply_rotary_pos_emb: x * cos + rotate_half(x) * sin), on each head's
    first R = cos.shape[-1] values (partial rotary, as Phi's), the rest passed through."""
    out = x.double().clone()
    n, R = heads * head_dim, cos.shape[-1]
    h = out[:, :n].reshape(x.shape[0], heads, head_dim).clone()
    r = h[..., :R]
    half = R // 2
    rotated = torch.cat([-r[..., half:], r[..., :half]], dim=-1)
    h[..., :R] = r * cos.double()[:, None] + rotated * sin.double()[:, None]
    out[:, :n] = h.reshape(x.shape[0], n)
    return out


def int8_weights_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weights weight-only int8 stands for: q [N, K] times its scale, one per row
    (scale [N]) or one per 32 weights of a row (scale [N, ceil(K / 32)])."""
    if scale.dim() == 1:
        return q.float() * scale[:, None]
    return q.float() * scale.repeat_interleave(32, dim=1)[:, : q.shape[1]]


def int8_activations_reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) as decode's integer products see it with int8 activations
    (kernels.block_activation_bits() == 8): each 32 values rounded, half to even, to
    multiples of their largest |x| / 127, in fp32 as the kernel computes them (x times
    127 / amax, rounded: float64 would round a value on a half-step edge the other way)."""
    M, K = x.shape
    chunks = x.float().reshape(M, K // 32, 32)
    amax = chunks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    step = (amax / 127.0).double()
    return (torch.round(chunks * inv).double() * step).reshape(M, K)
