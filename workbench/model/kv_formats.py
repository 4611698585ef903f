"""KV-cache formats: one record per format, and the cache that stores K and V in one.

Everything that knows about cache formats reads it from `KV_FORMATS`: the model's cache,
the memory estimate before loading, the bytes a decode step must read, the choices of the
CLI, the magics and the panel, the ablation grids. Adding a format is one entry here plus
its kernels:

    name          what users type (`%kvcache int8`, `kv_cache="int8"`)
    storage       the torch dtype of the stored values
    scaled        one fp32 scale per head per token beside the values (the paper's int8
                  granularity: scale = max|x| / 127 of each head's d values)
    append        writes new tokens into the cache (quantizing them if scaled)
    dequantize    stored values (+ scales) -> fp32, for the reference attention paths
    decode        the decode-attention kernel over this format

A layer's cache holds K and V as [B, Hkv, max_len, D] of `storage`, plus [B, Hkv, max_len]
fp32 scales each when `scaled`; Hkv is the model's local KV-head count, so a tensor-parallel
rank allocates only its own heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from workbench import kernels

SCALE_BYTES = 4  # one fp32 scale


def _append(cache: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor, positions: torch.Tensor) -> None:
    kernels.kv_cache_append(cache, x, positions, scales=scales)


def _dequantize(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return values.float() if scales is None else kernels.dequantize_kv_int8(values, scales)


def _decode(q, k, v, k_scale, v_scale, lengths) -> torch.Tensor:
    return kernels.decode_attention(q, k, v, lengths, k_scale=k_scale, v_scale=v_scale)


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype
    scaled: bool
    description: str
    append: Callable = _append
    dequantize: Callable = _dequantize
    decode: Callable = _decode

    @property
    def bits(self) -> int:
        return 8 * self.storage.itemsize

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes of one head's K (or V) vector of one token, its scale included."""
        return head_dim * self.storage.itemsize + (SCALE_BYTES if self.scaled else 0)

    def bytes_per_element(self, head_dim: int) -> float:
        """Storage per cached value, scales included (int8 at d = 64: 1.0625)."""
        return self.bytes_per_vector(head_dim) / head_dim

    def cache_bytes(self, n_layers: int, kv_heads: int, head_dim: int, batch: int, tokens: int) -> int:
        """K and V of every layer for batch x tokens."""
        return 2 * n_layers * kv_heads * batch * tokens * self.bytes_per_vector(head_dim)


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("int8", torch.int8, scaled=True,
             description="int8, one fp32 scale per head per token (the paper's format)"),
    KVFormat("fp16", torch.float16, scaled=False, description="IEEE half precision"),
    KVFormat("bf16", torch.bfloat16, scaled=False, description="bfloat16"),
    KVFormat("fp32", torch.float32, scaled=False, description="single precision (the reference)"),
)}


def kv_format(name: str) -> KVFormat:
    """The format called `name`; a ValueError listing the formats otherwise."""
    try:
        return KV_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"kv_cache must be one of {', '.join(KV_FORMATS)}, got {name!r}") from None


class KVCache:
    """Preallocated K/V for every layer in one format; `lengths` [B] counts each sequence's
    tokens (the next position to write)."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, fmt: str):
        self.format = kv_format(fmt)
        self.max_len = max_len
        self.kv_heads, self.head_dim = kv_heads, head_dim
        shape = (batch, kv_heads, max_len, head_dim)  # per layer
        self.k = [torch.zeros(shape, dtype=self.format.storage) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=self.format.storage) for _ in range(n_layers)]
        none = [None] * n_layers
        self.k_scale = [torch.zeros(shape[:3]) for _ in range(n_layers)] if self.format.scaled else none
        self.v_scale = [torch.zeros(shape[:3]) for _ in range(n_layers)] if self.format.scaled else none
        self.lengths = torch.zeros(batch, dtype=torch.int64)

    @property
    def dtype_name(self) -> str:
        return self.format.name

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               rows: slice = slice(None)) -> None:
        """k, v [b, Hkv, T, D] written at positions[i] .. positions[i] + T of the sequences
        `rows` (all by default; prefill writes one prompt at a time)."""
        append = self.format.append
        k_scale, v_scale = self.k_scale[layer], self.v_scale[layer]
        append(self.k[layer][rows], None if k_scale is None else k_scale[rows], k, positions)
        append(self.v[layer][rows], None if v_scale is None else v_scale[rows], v, positions)

    def attend(self, layer: int, q: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Decode attention of q [B, H, D] over this layer's cache with this format's kernel."""
        return self.format.decode(q, self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer], lengths)

    def dequantized(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K, V [Hkv, length, D] of sequence b (for the reference attention paths)."""
        def one(values, scales):
            return self.format.dequantize(values[b, :, :length], None if scales is None else scales[b, :, :length])

        return one(self.k[layer], self.k_scale[layer]), one(self.v[layer], self.v_scale[layer])

    def bytes_read(self, lengths: torch.Tensor) -> int:
        """KV bytes (scales included) one layer's decode attention reads at these lengths."""
        return 2 * int(lengths.sum()) * self.kv_heads * self.format.bytes_per_vector(self.head_dim)

    @property
    def nbytes(self) -> int:
        layers, batch = len(self.k), self.lengths.numel()
        return self.format.cache_bytes(layers, self.kv_heads, self.head_dim, batch, self.max_len)
