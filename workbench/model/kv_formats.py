"""KV-cache formats and the kernels that read them: one record per format, and the cache
that stores K and V in one.

A format is storage: what is kept per token (dtype, scales, bytes). A kernel is how a decode
step reads it. Everything that knows about cache formats reads it from `KV_FORMATS`: the
model's cache, the memory estimate before loading, the bytes a decode step must read, the
choices of the CLI, the magics and the panel, the ablation grids. Adding a format is one
entry here plus its kernels:

    name          what users type (`%kvcache int8`, `kv_cache="int8"`)
    storage       the torch dtype of the stored values
    scaled        one fp32 scale per head per token beside the values (the paper's int8
                  granularity: scale = max|x| / 127 of each head's d values)
    kernels       the decode kernels that can read it (KV_KERNELS), the default first: the
                  fastest whose quality on unseen text matches the paper's kernel
                  (docs/measurements.md); `%kvcache int8 --kernel widen` picks another
    append        writes new tokens into the cache (quantizing them if scaled)
    dequantize    stored values (+ scales) -> fp32, for the reference attention paths
    decode        the decode-attention call over this format

A layer's cache holds K and V as [B, Hkv, max_len, D] of `storage`, plus [B, Hkv, max_len]
fp32 scales each when `scaled`; Hkv is the model's local KV-head count, so a tensor-parallel
rank allocates only its own heads. The "tile" kernel reads the same values and scales in a
tiled layout: the cache rounds the allocated max_len up to a multiple of
kernels.TILED_ALIGN and keeps each plane's tokens in tiles; `dequantized` returns token rows
either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from workbench import kernels
from workbench.hw import memory
from workbench.model.kv_quant import QuantSpec, _Side, reference_attention

SCALE_BYTES = 4  # one fp32 scale


def _append(cache: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor, positions: torch.Tensor,
            layout: str = "rows") -> None:
    kernels.kv_cache_append(cache, x, positions, scales=scales, layout=layout)


def _dequantize(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return values.float() if scales is None else kernels.dequantize_kv_int8(values, scales)


def _decode(q, k, v, k_scale, v_scale, lengths, **options) -> torch.Tensor:
    return kernels.decode_attention(q, k, v, lengths, k_scale=k_scale, v_scale=v_scale, **options)


# How a decode kernel reads a cache (kernels.decode_attention's int8_kernel): the names are
# kernels.h's Int8Kernel, exported as kernels.constants()["int8_kernels"] (a test checks they agree).
KV_KERNELS = {
    "widen": "stored values widened to fp32 in registers, fp32 scores and P.V (the paper's kernel for int8)",
    "dot": "int8 only: the query quantized to int8, scores by integer dot products (VNNI / pmaddubsw), P.V in fp32",
    "tile": "int8 only, the values and scales in a tiled layout: integer scores and integer P.V "
            "(probabilities at 7 bits per 32 tokens)",
}


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype
    scaled: bool
    description: str
    append: Callable = _append
    dequantize: Callable = _dequantize
    decode: Callable = _decode
    # Reference-path formats (the quality study's granularities and bit widths): how K and V
    # are quantized (workbench.model.kv_quant); None for the formats with C++ kernels.
    quant: QuantSpec | None = None
    kernels: tuple[str, ...] = ("widen",)  # KV_KERNELS that read it, the default first; () on the reference path

    def kernel(self, requested: str | None = None, head_dim: int | None = None, rings=()) -> str | None:
        """The kernel that reads this format: `requested`, checked, or the default (the first
        of `kernels` the cache allows: "tile" needs a head dim that is a multiple of 4 and
        sliding-window rings of whole tiles, kernels.TILED_ALIGN tokens). None for a reference
        format (decoded in torch)."""
        if not self.kernels:
            if requested is not None:
                raise ValueError(f"kv_kernel: kv_cache {self.name!r} runs on the torch reference path and has no "
                                 f"kernel to choose, got {requested!r}")
            return None
        if requested is None:
            align = kernels.constants()["tiled_align"]
            usable = [k for k in self.kernels if k != "tile" or ((head_dim is None or head_dim % 4 == 0)
                                                                 and not any(r % align for r in rings))]
            return usable[0]
        if requested not in self.kernels:
            raise ValueError(f"kv_kernel must be one of {', '.join(self.kernels)} for kv_cache {self.name!r}, "
                             f"got {requested!r}")
        return requested

    @property
    def bits(self) -> int:
        return self.quant.bits if self.quant else 8 * self.storage.itemsize

    @property
    def has_kernel(self) -> bool:
        """Decoded by a C++ kernel (else by the labelled torch reference path: quality, not speed)."""
        return self.quant is None

    @property
    def granularity(self) -> str:
        if self.quant:
            return self.quant.k if self.quant.k == self.quant.v else f"K {self.quant.k}, V {self.quant.v}"
        return "head_token" if self.scaled else "-"

    def bytes_per_vector(self, head_dim: int, kv_heads: int = 1) -> float:
        """Bytes of one head's K (or V) vector of one token, its scale included (the mean of
        K and V where they differ)."""
        if self.quant:
            return self.quant.bytes_per_vector(head_dim, kv_heads)
        return head_dim * self.storage.itemsize + (SCALE_BYTES if self.scaled else 0)

    def bytes_per_element(self, head_dim: int, kv_heads: int = 1) -> float:
        """Storage per cached value, scales included (int8 at d = 64: 1.0625)."""
        return self.bytes_per_vector(head_dim, kv_heads) / head_dim

    def cache_bytes(self, n_layers: int, kv_heads: int, head_dim: int, batch: int, tokens: int) -> int:
        """K and V of every layer for batch x tokens."""
        return int(2 * n_layers * kv_heads * batch * tokens * self.bytes_per_vector(head_dim, kv_heads))


def _reference(name: str, k: str, v: str | None = None, bits: int = 8, description: str = "") -> KVFormat:
    return KVFormat(name, torch.int8 if bits == 8 else torch.uint8, scaled=True, quant=QuantSpec(k, v or k, bits),
                    description=f"{description} [reference path: torch, for quality]", kernels=())


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("int8", torch.int8, scaled=True, kernels=("tile", "dot", "widen"),
             description="int8, one fp32 scale per head per token (the paper's format)"),
    KVFormat("fp16", torch.float16, scaled=False, description="IEEE half precision"),
    KVFormat("bf16", torch.bfloat16, scaled=False, description="bfloat16"),
    KVFormat("fp32", torch.float32, scaled=False, description="single precision (the reference)"),
    # The quality study's other granularities (workbench.model.kv_quant), int8 and 4-bit:
    _reference("int8-tensor", "tensor", description="int8, one scale per sequence, set from the prompt"),
    _reference("int8-head", "head", description="int8, one scale per KV head, set from the prompt"),
    _reference("int8-token", "token", description="int8, one scale per token (all heads)"),
    _reference("int8-ref", "head_token", description="int8, per head per token (the paper's, in torch)"),
    _reference("int8-kivi", "channel32", "head_token",
               description="int8, K per channel over 32 tokens (open group fp32), V per head and token (KIVI)"),
    _reference("int8-block32", "block32", description="int8, one fp16 scale per 32 values (llama.cpp q8_0)"),
    _reference("int4-head_token", "head_token", bits=4, description="4-bit, per head per token"),
    _reference("int4-block32", "block32", bits=4, description="4-bit, one fp16 scale per 32 values (q4_0-like)"),
    _reference("int4-kivi", "channel32", "head_token", bits=4, description="4-bit KIVI"),
)}
KERNEL_FORMATS = tuple(name for name, f in KV_FORMATS.items() if f.has_kernel)


def kv_label(fmt: str, kernel: str | None = None) -> str:
    """A cache as tables and reports name it: the format, and for a format with several
    kernels the one that reads it ("int8 (tile)"; None: the default); "fp16" otherwise."""
    record = KV_FORMATS.get(fmt)
    if record is None or len(record.kernels) < 2:
        return str(fmt)
    return f"{fmt} ({kernel or record.kernels[0]})"


def parse_kv(spec: str) -> tuple[str, str | None]:
    """A cache named in a list ("int8", "int8:widen"): (format, kernel or None for its
    default), checked (a ValueError naming what is accepted)."""
    name, _, kernel = str(spec).partition(":")
    kv_format(name).kernel(kernel or None)
    return name, kernel or None


def kernel_configs(formats=KERNEL_FORMATS, kernels: str | list[str] | None = None) -> list[tuple[str, str | None]]:
    """(format, kernel) pairs for a grid. An entry "int8:dot" names its kernel; a plain format
    is read by its default kernel (kernels None), by every kernel it has ("all"), or by those
    of `kernels` it has (a format with none of them keeps its default). A kernel that reads
    none of the formats is a ValueError."""
    specs = [parse_kv(f) for f in formats]
    if kernels is not None and kernels != "all":
        kernels = list(kernels)
        for k in kernels:
            if k not in KV_KERNELS:
                raise ValueError(f"kv_kernel must be one of {', '.join(KV_KERNELS)} (or all), got {k!r}")
            if not any(k in kv_format(f).kernels for f, _ in specs):
                raise ValueError(f"kv_kernel {k!r} reads none of the formats {', '.join(map(str, formats))}")
    pairs = []
    for name, kernel in specs:
        fmt = kv_format(name)
        if kernel is not None or kernels is None or not fmt.kernels:
            pairs.append((name, kernel))
        else:
            have = fmt.kernels if kernels == "all" else [k for k in kernels if k in fmt.kernels]
            pairs += [(name, k) for k in have] if have else [(name, None)]
    return list(dict.fromkeys(pairs))


def new_kv_cache(n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, fmt: str,
                 kernel: str | None = None, windows=None):
    """The cache for format `fmt` read by `kernel` (None: the format's default): KVCache for
    the kernel formats, ReferenceKVCache for the rest. windows: each layer's sliding window
    (0 or None: none); a kernel format keeps a windowed layer's K and V in a ring of that many
    slots."""
    if kv_format(fmt).has_kernel:
        return KVCache(n_layers, batch, kv_heads, max_len, head_dim, fmt, kernel, windows)
    kv_format(fmt).kernel(kernel)  # a reference format takes no kernel: say so
    return ReferenceKVCache(n_layers, batch, kv_heads, max_len, head_dim, fmt, windows)


def kv_format(name: str) -> KVFormat:
    """The format called `name`; a ValueError listing the formats otherwise."""
    try:
        return KV_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"kv_cache must be one of {', '.join(KV_FORMATS)}, got {name!r}") from None


def per_query_head(k: torch.Tensor, v: torch.Tensor, n_heads: int, head_map: tuple[int, int] | None,
                   dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v with their KV heads (along `dim`) as one per query head, for code that takes equal
    groups only, where head_map = (group, q_offset) makes them uneven: query head h reads KV
    head (h + q_offset) // group. As they are for head_map None."""
    if head_map is None:
        return k, v
    group, q_offset = head_map
    index = torch.div(torch.arange(n_heads) + q_offset, group, rounding_mode="floor")
    return k.index_select(dim, index), v.index_select(dim, index)


class KVCache:
    """Preallocated K/V for every layer in one format, laid out for the kernel that reads it
    (`kernel`: KV_KERNELS); `lengths` [B] counts each sequence's tokens (the next position
    to write).

    A layer with a sliding window shorter than max_len (Gemma 3's local layers, Mistral's)
    keeps a ring of `window` slots: token p at slot p % window, so its K and V cost the window,
    not the context (Gemma 3's five local layers of six: about a sixth of a Llama-style cache
    at long context). Decode attention reads every filled slot: the last `window` tokens, in
    slot order, which the softmax does not care about (RoPE was applied before caching)."""

    # Which KV head each query head reads where the groups are uneven (a tensor-parallel rank
    # whose shard splits a group of query heads, workbench.distributed.shard): (group,
    # q_offset) as kernels.decode_attention takes them; None: equal groups. Set by the model.
    head_map: tuple[int, int] | None = None

    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, fmt: str,
                 kernel: str | None = None, windows=None):
        self.format = kv_format(fmt)
        self.max_len = max_len
        self.kv_heads, self.head_dim = kv_heads, head_dim
        # each layer's ring (its window, where shorter than the cache), 0 for a full-length layer
        self.rings = [w if w and w < max_len else 0 for w in (windows or [0] * n_layers)]
        self.kernel = self.format.kernel(kernel, head_dim, self.rings)
        if self.tiled and head_dim % 4:
            raise ValueError(f"kv_kernel 'tile' (the tiled layout) needs a head_dim that is a multiple of 4, "
                             f"got {head_dim}; use kv_kernel 'dot' or 'widen'")
        align = kernels.constants()["tiled_align"]
        if self.tiled and any(r % align for r in self.rings):
            raise ValueError(f"kv_kernel 'tile' keeps a windowed layer's ring in whole blocks of {align} tokens; a "
                             f"window of {next(r for r in self.rings if r % align)} is not: use kv_kernel 'dot' or 'widen'")
        zeros = memory.zeros  # on huge pages where the OS allows: decode streams these from DRAM

        def plane(ring: int) -> tuple[int, ...]:  # [B, Hkv, slots, D]
            return (batch, kv_heads, ring or (kernels.tiled_length(max_len) if self.tiled else max_len), head_dim)

        self.k = [zeros(plane(r), self.format.storage) for r in self.rings]
        self.v = [zeros(plane(r), self.format.storage) for r in self.rings]
        none = [None] * n_layers
        self.k_scale = [zeros(plane(r)[:3]) for r in self.rings] if self.format.scaled else none
        self.v_scale = [zeros(plane(r)[:3]) for r in self.rings] if self.format.scaled else none
        self.lengths = torch.zeros(batch, dtype=torch.int64)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               rows: slice = slice(None)) -> None:
        """k, v [b, Hkv, T, D] written at positions[i] .. positions[i] + T of the sequences
        `rows` (all by default; prefill writes one prompt at a time). A ring layer keeps the
        last `window` of them, each at its slot (runs of several tokens: one sequence a call)."""
        ring = self.rings[layer]
        if ring and k.shape[2] > 1:
            if positions.numel() != 1:
                raise ValueError("appending several tokens to a windowed layer's ring takes one sequence at a time")
            start, T = int(positions.reshape(-1)[0]), k.shape[2]
            first = max(0, T - ring)  # older tokens would be overwritten within this call
            for t0 in range(first, T):  # contiguous runs of slots: the ring's end splits at most one
                if t0 > first and (start + t0) % ring != 0:
                    continue
                t1 = min(T, t0 + ring - (start + t0) % ring)
                self._write(layer, k[:, :, t0:t1], v[:, :, t0:t1], torch.tensor([(start + t0) % ring]), rows)
            return
        self._write(layer, k, v, positions % ring if ring else positions, rows)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, rows: slice) -> None:
        append = self.format.append
        k_scale, v_scale = self.k_scale[layer], self.v_scale[layer]
        k_layout, v_layout = self.layouts
        append(self.k[layer][rows], None if k_scale is None else k_scale[rows], k, slots, k_layout)
        append(self.v[layer][rows], None if v_scale is None else v_scale[rows], v, slots, v_layout)

    def rows(self, n: int) -> KVCache:
        """A cache over this one's first n sequences, sharing their storage (views, no copy),
        with lengths of its own: a continuous-batching scheduler decodes the sequences in its
        first n slots through it (workbench.serving)."""
        if not 1 <= n <= self.lengths.numel():
            raise ValueError(f"n must be in 1..{self.lengths.numel()}, got {n}")
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.k, view.v = [t[:n] for t in self.k], [t[:n] for t in self.v]
        view.k_scale = [None if t is None else t[:n] for t in self.k_scale]
        view.v_scale = [None if t is None else t[:n] for t in self.v_scale]
        view.lengths = self.lengths[:n].clone()
        return view

    @property
    def tiled(self) -> bool:
        """K and V in the tiled int8 layout (kernels/decode_tiled.cpp), not token rows."""
        return self.kernel == "tile"

    @property
    def layouts(self) -> tuple[str, str]:
        """How K and V planes are stored (kernels.kv_cache_append's layout)."""
        return ("k_tiles", "v_groups") if self.tiled else ("rows", "rows")

    @property
    def per_layer(self) -> list[tuple]:
        """(k, v, k_scale, v_scale) of each layer (the fused step's caches)."""
        return list(zip(self.k, self.v, self.k_scale, self.v_scale))

    def attend(self, layer: int, q: torch.Tensor, lengths: torch.Tensor, **options) -> torch.Tensor:
        """Decode attention of q [B, H, D] over this layer's cache with its kernel (options:
        the kernel's, such as num_splits and scale); a ring layer's every filled slot."""
        if self.head_map is not None:
            options = {**options, "group": self.head_map[0], "q_offset": self.head_map[1]}
        ring = self.rings[layer]
        return self.format.decode(q, self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer],
                                  lengths.clamp(max=ring) if ring else lengths, int8_kernel=self.kernel, **options)

    def dequantized(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K, V [Hkv, n, D] of sequence b's tokens before `length` that the layer still
        holds: all of them, or a ring layer's last `window`, in position order."""
        ring = self.rings[layer]
        held = min(length, ring) if ring else length

        def one(values, scales, layout):
            plane = values[b]
            if layout != "rows":  # whole blocks of the tiled layout, back in token rows
                plane = kernels.untile_kv(plane[:, :kernels.tiled_length(held)], layout)
            out = self.format.dequantize(plane[:, :held], None if scales is None else scales[b, :, :held])
            if ring and length > ring:  # the oldest held token, length - ring, is at slot length % ring
                out = torch.roll(out, -(length % ring), dims=1)
            return out

        k_layout, v_layout = self.layouts
        return (one(self.k[layer], self.k_scale[layer], k_layout), one(self.v[layer], self.v_scale[layer], v_layout))

    def visible(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K, V of what the query at position length - 1 attends to (the reference paths)."""
        return self.dequantized(layer, b, length)

    def bytes_read(self, lengths: torch.Tensor, layer: int = 0) -> int:
        """KV bytes (scales included) layer `layer`'s decode attention reads at these lengths."""
        ring = self.rings[layer] if layer < len(self.rings) else 0
        tokens = int((lengths.clamp(max=ring) if ring else lengths).sum())
        return int(2 * tokens * self.kv_heads * self.format.bytes_per_vector(self.head_dim, self.kv_heads))

    @property
    def nbytes(self) -> int:
        batch = self.lengths.numel()
        return sum(self.format.cache_bytes(1, self.kv_heads, self.head_dim, batch, ring or self.max_len)
                   for ring in self.rings)


class ReferenceKVCache(KVCache):
    """A reference-path format (workbench.model.kv_quant): K and V stored quantized at the
    format's granularity and bit width, dequantized and attended in torch. For measuring
    quality; its timings are not a kernel's speed."""

    kernel = None  # decoded in torch
    tiled = False

    def __init__(self, n_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, fmt: str,
                 windows=None):
        self.format = kv_format(fmt)
        # every token kept (no rings here: a study of the formats' quality), a windowed layer
        # attending to its last `window`
        self.windows = [w if w and w < max_len else 0 for w in (windows or [0] * n_layers)]
        self.rings = [0] * n_layers
        spec = self.format.quant
        self.max_len, self.kv_heads, self.head_dim = max_len, kv_heads, head_dim
        self.k_side = [_Side(spec.k, spec, batch, kv_heads, max_len, head_dim) for _ in range(n_layers)]
        self.v_side = [_Side(spec.v, spec, batch, kv_heads, max_len, head_dim) for _ in range(n_layers)]
        self.k = [s.values for s in self.k_side]
        self.v = [s.values for s in self.v_side]
        self.k_scale = [s.scales for s in self.k_side]
        self.v_scale = [s.scales for s in self.v_side]
        self.lengths = torch.zeros(batch, dtype=torch.int64)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               rows: slice = slice(None)) -> None:
        batch = range(self.lengths.numel())[rows]
        for i, b in enumerate(batch):
            start = int(positions[i] if positions.numel() > 1 else positions[0])
            self.k_side[layer].write(b, k[i].float(), start)
            self.v_side[layer].write(b, v[i].float(), start)

    def attend(self, layer: int, q: torch.Tensor, lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=torch.float32)
        for b in range(q.shape[0]):
            k, v = per_query_head(*self.visible(layer, b, int(lengths[b])), q.shape[1], self.head_map)
            out[b] = reference_attention(q[b].float(), k, v, scale)
        return out

    def dequantized(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_side[layer].read(b, length), self.v_side[layer].read(b, length)

    def visible(self, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.dequantized(layer, b, length)
        window = self.windows[layer]
        return (k[:, -window:], v[:, -window:]) if window else (k, v)

    @property
    def nbytes(self) -> int:
        layers, batch = len(self.k_side), self.lengths.numel()
        return self.format.cache_bytes(layers, self.kv_heads, self.head_dim, batch, self.max_len)
