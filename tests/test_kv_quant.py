"""The quality study's KV formats (workbench.model.kv_quant): each granularity's
quantization against float64 with the bound it implies, 4-bit packing, scales set from
the prompt, KIVI's open group, and the reference cache's attention against the float64
reference over exactly what it stores."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import decode_reference
from workbench.model.kv_formats import KV_FORMATS, ReferenceKVCache, new_kv_cache
from workbench.model.kv_quant import GRANULARITIES, _Side, QuantSpec, pack4, unpack4

REFERENCE_FORMATS = [n for n, f in KV_FORMATS.items() if not f.has_kernel]


@given(g=st.sampled_from([g for g in GRANULARITIES if g != "channel32"]), bits=st.sampled_from([8, 4]),
       Hkv=st.integers(1, 3), T=st.integers(1, 70), D=st.sampled_from([1, 7, 32, 64, 80]),
       spread=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 2**16))
def test_each_granularity_within_half_a_step(g, bits, Hkv, T, D, spread, seed):
    """Written at position 0 (so prompt-set scales see every value): |x - x'| <= scale / 2
    of the scale covering x (block32's fp16 scale rounded up by its own rounding)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(Hkv, T, D, generator=gen, dtype=torch.float64) * spread
    spec = QuantSpec(g, g, bits)
    side = _Side(g, spec, 1, Hkv, T, D)
    side.write(0, x.float(), 0)
    back = side.read(0, T).double()
    qmax = spec.qmax
    a = x.abs()
    if g == "tensor":
        step = a.amax() / qmax * torch.ones_like(x)
    elif g == "head":
        step = (a.amax(dim=(1, 2), keepdim=True) / qmax).expand_as(x)
    elif g == "token":
        step = (a.amax(dim=(0, 2), keepdim=True) / qmax).expand_as(x)
    elif g == "head_token":
        step = (a.amax(dim=2, keepdim=True) / qmax).expand_as(x)
    else:  # block32: one scale per 32 values, stored in fp16: rounded by 2^-11 of itself where it
        # is a normal fp16, by half fp16's smallest subnormal (2^-25) below 2^-14 (tiny values)
        pad = (-D) % 32
        blocks = torch.nn.functional.pad(a, (0, pad)).reshape(Hkv, T, -1, 32)
        exact = (blocks.amax(-1, keepdim=True) / qmax).expand_as(blocks).reshape(Hkv, T, -1)[..., :D]
        scale_err = torch.maximum(exact * 2.0 ** -11, torch.full_like(exact, 2.0 ** -25))
        step = exact + scale_err
        step = step + 2 * qmax * scale_err  # a rounded-down scale clamps: off by qmax times its error
    assert torch.all((back - x).abs() <= step / 2 * 1.0001 + 1e-6 * spread), g


def test_scales_set_from_the_prompt_clamp_later_tokens():
    side = _Side("tensor", QuantSpec("tensor", "tensor", 8), 1, 2, 8, 4)
    side.write(0, torch.full((2, 3, 4), 0.5), 0)  # the prompt: scale 0.5 / 127
    side.write(0, torch.full((2, 1, 4), 2.0), 3)  # a later, larger token is clamped
    back = side.read(0, 4)
    assert torch.allclose(back[:, :3], torch.full((2, 3, 4), 0.5))
    assert torch.allclose(back[:, 3], torch.full((2, 4), 0.5))


def test_kivi_keeps_the_open_group_exact_and_quantizes_it_once_complete():
    torch.manual_seed(0)
    side = _Side("channel32", QuantSpec("channel32", "head_token", 8), 1, 2, 100, 16)
    x = torch.randn(2, 40, 16)
    side.write(0, x[:, :35], 0)  # one full group and 3 open tokens
    back = side.read(0, 35)
    assert torch.equal(back[:, 32:], x[:, 32:35])  # the open group is kept in fp32
    step = x[:, :32].abs().amax(dim=1, keepdim=True) / 127  # per channel over the group
    assert torch.all((back[:, :32] - x[:, :32]).abs() <= step / 2 * 1.0001)
    for t in range(35, 40):
        side.write(0, x[:, t:t + 1], t)
    assert torch.equal(side.read(0, 40)[:, 32:], x[:, 32:40])
    assert side.read(0, 40)[:, :32].equal(back[:, :32])


@given(D=st.integers(1, 70), seed=st.integers(0, 999))
def test_four_bit_packing_round_trips(D, seed):
    q = torch.randint(-7, 8, (3, 5, D), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    packed = pack4(q)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == (D + 1) // 2  # two per byte
    assert torch.equal(unpack4(packed, D), q)


@pytest.mark.parametrize("fmt", REFERENCE_FORMATS)
def test_reference_cache_attends_over_what_it_stores(fmt):
    """Append a prompt and decode tokens through the cache, then its attention equals the
    float64 reference over its own dequantized K and V; its bytes are the format's."""
    torch.manual_seed(1)
    B, Hkv, H, D, L = 2, 2, 6, 40, 70
    cache = new_kv_cache(1, B, Hkv, L, D, fmt)
    assert isinstance(cache, ReferenceKVCache)
    for b, n in enumerate((37, 50)):  # prefill, one sequence at a time (as the model does)
        cache.append(0, torch.randn(1, Hkv, n, D), torch.randn(1, Hkv, n, D), torch.zeros(1, dtype=torch.int64),
                     rows=slice(b, b + 1))
    positions = torch.tensor([37, 50])
    for _ in range(5):  # decode appends
        cache.append(0, torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D), positions)
        positions = positions + 1
    q = torch.randn(B, H, D)
    out = cache.attend(0, q, positions)
    ref = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        k, v = cache.dequantized(0, b, int(positions[b]))
        ref[b] = decode_reference(q[b:b + 1], k[None], v[None], positions[b:b + 1])[0]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    per_vector = KV_FORMATS[fmt].bytes_per_vector(D, Hkv)
    assert cache.bytes_read(positions) == int(2 * int(positions.sum()) * Hkv * per_vector)
    bits = KV_FORMATS[fmt].bits
    assert cache.k[0].numel() * cache.k[0].element_size() == B * Hkv * L * math.ceil(D * bits / 8)


def test_the_papers_format_on_the_reference_path_matches_the_kernel():
    """int8-ref (torch) stores what the int8 kernel format stores, to within a rounding tie."""
    torch.manual_seed(2)
    k, v = torch.randn(1, 3, 50, 64), torch.randn(1, 3, 50, 64)
    a, b = new_kv_cache(1, 1, 3, 50, 64, "int8"), new_kv_cache(1, 1, 3, 50, 64, "int8-ref")
    for c in (a, b):
        c.append(0, k, v, torch.zeros(1, dtype=torch.int64))
    ka, va = a.dequantized(0, 0, 50)
    kb, vb = b.dequantized(0, 0, 50)
    step = k[0].abs().amax(-1, keepdim=True) / 127
    assert torch.all((ka - kb).abs() <= step * 1.0001)
    assert (ka == kb).float().mean() > 0.999
