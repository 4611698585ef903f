"""KV-cache quantization at every granularity the quality study compares, and the cache
that stores them (the reference path: torch code, for quality; the kernel formats, int8
and int8dot, are the fast ones).

A layer's K (or V) is [B, Hkv, L, D]. A granularity says which values share one
symmetric scale (scale = max|x| / qmax, q = round(x / scale), |x - q scale| <= scale / 2):

    tensor       all of a sequence's K (or V): [B] scales        set from the prompt, then fixed
    head         each KV head of a sequence: [B, Hkv]             set from the prompt, then fixed
    token        each token, all heads: [B, L]
    head_token   each head of each token: [B, Hkv, L]             the paper's granularity
    block32      each 32 values of a head's vector: [B, Hkv, L, D/32], fp16 scales (llama.cpp q8_0)
    channel32    each channel over 32 consecutive tokens: [B, Hkv, L/32, D] (KIVI's K); the
                 tokens of a group not yet complete stay fp32 (KIVI's residual) until it is
"Set from the prompt, then fixed": a scale that spans tokens cannot be known before the
tokens are; it is taken from the prompt's values (the first append), and later tokens are
clamped to it, as a static per-tensor or per-head cache must.

bits 8: q in [-127, 127], one int8 each. bits 4: q in [-7, 7], two per byte (low nibble
first), offset by 8 so each nibble is unsigned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workbench.hw import memory

GROUP = 32  # block32 values per scale; channel32 tokens per scale


@dataclass(frozen=True)
class Granularity:
    name: str
    description: str
    static: bool = False  # the scale spans tokens: set from the prompt, then fixed


GRANULARITIES: dict[str, Granularity] = {g.name: g for g in (
    Granularity("tensor", "one scale per sequence (all heads, tokens, channels)", static=True),
    Granularity("head", "one scale per KV head of a sequence (all its tokens)", static=True),
    Granularity("token", "one scale per token (all heads)"),
    Granularity("head_token", "one scale per head per token (the paper)"),
    Granularity("block32", "one fp16 scale per 32 values of a head's vector (llama.cpp q8_0)"),
    Granularity("channel32", "one scale per channel per 32 tokens, the open group kept fp32 (KIVI's K)"),
)}


@dataclass(frozen=True)
class QuantSpec:
    """How a reference-path format stores K and V."""

    k: str  # granularity names
    v: str
    bits: int = 8

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def scale_bytes_per_vector(self, granularity: str, head_dim: int, kv_heads: int) -> float:
        """Scale storage per head vector of one token (long-run average; the prompt-set
        scales of tensor / head granularity are one per sequence or head: ~0)."""
        return {"tensor": 0.0, "head": 0.0, "token": 4.0 / kv_heads, "head_token": 4.0,
                "block32": 2.0 * math.ceil(head_dim / GROUP), "channel32": 4.0 * head_dim / GROUP}[granularity]

    def bytes_per_vector(self, head_dim: int, kv_heads: int = 1) -> float:
        """Mean of K's and V's bytes per head vector per token, scales included."""
        values = head_dim * self.bits / 8
        return values + (self.scale_bytes_per_vector(self.k, head_dim, kv_heads)
                         + self.scale_bytes_per_vector(self.v, head_dim, kv_heads)) / 2


def _amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """max|x| over what one scale covers, for x [Hkv, T, D] of one sequence, shaped to
    broadcast against x (block32: [Hkv, T, D/32, 1] against x viewed in blocks)."""
    a = x.abs()
    if granularity == "tensor":
        return a.amax().reshape(1, 1, 1)
    if granularity == "head":
        return a.amax(dim=(1, 2), keepdim=True)
    if granularity == "token":
        return a.amax(dim=(0, 2), keepdim=True)
    if granularity == "head_token":
        return a.amax(dim=2, keepdim=True)
    if granularity == "channel32":
        return a.amax(dim=1, keepdim=True)  # x is one 32-token group here
    raise ValueError(f"no amax for granularity {granularity!r}")


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[Hkv, T, D] -> [Hkv, T, D/32, 32], zero-padded to whole blocks."""
    D = x.shape[-1]
    pad = (-D) % GROUP
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, GROUP)


def quantize(x: torch.Tensor, granularity: str, qmax: int, scale: torch.Tensor | None = None):
    """x [Hkv, T, D] fp32 -> (q int8 [Hkv, T, D], scale); `scale` given: use it (clamping)."""
    if granularity == "block32":
        xb = _blocks(x)
        if scale is None:
            scale = (xb.abs().amax(-1, keepdim=True) / qmax).half().float()  # stored as fp16
        q = torch.where(scale > 0, xb / torch.where(scale > 0, scale, 1), 0).round().clamp(-qmax, qmax)
        return q.reshape(*x.shape[:-1], -1)[..., :x.shape[-1]].to(torch.int8), scale
    if scale is None:
        scale = _amax(x, granularity) / qmax
    q = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1), 0).round().clamp(-qmax, qmax)
    return q.to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    if granularity == "block32":
        qb = _blocks(q.float())
        return (qb * scale).reshape(*q.shape[:-1], -1)[..., :q.shape[-1]]
    return q.float() * scale


def pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-7, 7], last dim D -> uint8 [.., ceil(D / 2)], low nibble first."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack4(p: torch.Tensor, D: int) -> torch.Tensor:
    lo = (p & 0x0F).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).reshape(*p.shape[:-1], -1)[..., :D]


class _Side:
    """K or V of one layer: stored values (int8, or packed 4-bit) and their scales."""

    def __init__(self, granularity: str, spec: QuantSpec, batch: int, kv_heads: int, max_len: int, D: int):
        self.g, self.spec, self.D = granularity, spec, D
        width = D if spec.bits == 8 else (D + 1) // 2
        self.values = memory.zeros((batch, kv_heads, max_len, width), torch.int8 if spec.bits == 8 else torch.uint8)
        shapes = {"tensor": (batch, 1, 1, 1), "head": (batch, kv_heads, 1, 1), "token": (batch, 1, max_len, 1),
                  "head_token": (batch, kv_heads, max_len, 1),
                  "block32": (batch, kv_heads, max_len, math.ceil(D / GROUP), 1),
                  "channel32": (batch, kv_heads, math.ceil(max_len / GROUP), D)}
        self.scales = torch.zeros(shapes[granularity])
        self.residual = torch.zeros(batch, kv_heads, GROUP, D) if granularity == "channel32" else None

    def _store(self, b: int, start: int, q: torch.Tensor) -> None:
        n = q.shape[1]
        self.values[b, :, start:start + n] = q if self.spec.bits == 8 else pack4(q)

    def _load(self, b: int, length: int) -> torch.Tensor:
        v = self.values[b, :, :length]
        return v if self.spec.bits == 8 else unpack4(v, self.D)

    def write(self, b: int, x: torch.Tensor, start: int) -> None:
        """x [Hkv, T, D] fp32 at positions start .. start + T of sequence b."""
        qmax, T = self.spec.qmax, x.shape[1]
        g = self.g
        if g == "channel32":  # fill the open group; quantize each group as it completes
            pos, t = start, 0
            while t < T:
                n = min(T - t, GROUP - pos % GROUP)
                self.residual[b, :, pos % GROUP:pos % GROUP + n] = x[:, t:t + n]
                pos, t = pos + n, t + n
                if pos % GROUP == 0:
                    q, s = quantize(self.residual[b], "channel32", qmax)
                    self.scales[b, :, pos // GROUP - 1] = s[:, 0]
                    self._store(b, pos - GROUP, q)
            return
        if g in ("tensor", "head"):
            if start == 0:
                _, s = quantize(x, g, qmax)
                self.scales[b] = s
            q, _ = quantize(x, g, qmax, self.scales[b])
        elif g == "token":
            q, s = quantize(x, g, qmax)
            self.scales[b, 0, start:start + T] = s[0]
        elif g == "head_token":
            q, s = quantize(x, g, qmax)
            self.scales[b, :, start:start + T] = s
        else:  # block32
            q, s = quantize(x, g, qmax)
            self.scales[b, :, start:start + T] = s
        self._store(b, start, q)

    def read(self, b: int, length: int) -> torch.Tensor:
        """fp32 [Hkv, length, D] of sequence b, as stored."""
        q = self._load(b, length)
        g = self.g
        if g == "channel32":
            full = length // GROUP * GROUP
            out = torch.empty(q.shape[0], length, self.D)
            if full:
                groups = q[:, :full].reshape(q.shape[0], -1, GROUP, self.D).float()
                out[:, :full] = (groups * self.scales[b, :, :full // GROUP].unsqueeze(2)).reshape(q.shape[0], full,
                                                                                                    self.D)
            out[:, full:] = self.residual[b, :, :length - full]
            return out
        scale = self.scales[b]
        if g in ("token", "head_token", "block32"):  # a scale per token: the first `length`
            scale = scale[:, :length]
        return dequantize(q, scale, g)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [H, D], k / v [Hkv, n, D] fp32 -> [H, D]: softmax(scale q k^T) v with GQA (scale
    default 1 / sqrt(D))."""
    H, D = q.shape
    group = H // k.shape[0]
    kk, vv = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scale = scale if scale is not None else 1 / math.sqrt(D)
    p = torch.softmax(torch.einsum("hd,hnd->hn", q, kk) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", p, vv)
