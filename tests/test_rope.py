"""RoPE (rotate-half, in place on the fused QKV rows) against a float64 reference, on every
ISA build: odd half-dims (masked tails), several heads, strided rows, untouched columns,
partial rotary (each head's first R dims rotated, the rest untouched)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import rope_reference

# Also on the "emulated" build (conftest.py): the AVX-512 path, VNNI included, on any AVX2 host.
ALSO_EMULATED = True


@given(
    T=st.integers(1, 40),
    head_dim=st.sampled_from([2, 6, 34, 64, 80, 128]),
    heads=st.integers(0, 5),
    extra_heads=st.integers(0, 3),
    pad=st.integers(0, 9),
    seed=st.integers(0, 1000),
    rotary_share=st.sampled_from([1.0, 0.5, 0.25, 0.0]),
)
def test_rope_matches_reference(kernels, T, head_dim, heads, extra_heads, pad, seed, rotary_share):
    gen = torch.Generator().manual_seed(seed)
    C = (heads + extra_heads) * head_dim + 1
    base = torch.randn(T, C + pad, generator=gen)
    x = base[:, :C]  # rows C + pad apart: a strided view, like q/k inside the fused QKV output
    R = max(2, 2 * int(head_dim * rotary_share / 2))  # rotated dims of each head, even
    angles = torch.rand(T, R // 2, generator=gen, dtype=torch.float64) * 100
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().float(), angles.sin().float()
    expected = rope_reference(x, cos, sin, heads, head_dim)
    before_pad = base[:, C:].clone()
    out = kernels.rope_(x, cos, sin, heads=heads, head_dim=head_dim)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x.double(), expected, atol=1e-6 * math.sqrt(head_dim), rtol=1e-6)
    assert torch.equal(x[:, heads * head_dim:].double(), expected[:, heads * head_dim:])  # untouched
    assert torch.equal(base[:, C:], before_pad)


def test_rope_bad_input(kernels):
    x, cs = torch.randn(3, 16), torch.randn(3, 8)
    with pytest.raises(ValueError, match="head_dim must be a positive even number, got 7"):
        kernels.rope_(torch.randn(3, 14), torch.randn(3, 7), torch.randn(3, 7), heads=2, head_dim=7)
    with pytest.raises(ValueError, match=r"heads must be in 0..2 .*got 3"):
        kernels.rope_(x, cs, cs, heads=3, head_dim=8)
    with pytest.raises(ValueError, match=r"cos and sin must be \[T, R\] with T = 3 .* got \[2, 8\]"):
        kernels.rope_(x, torch.randn(2, 8), torch.randn(2, 8), heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"R an even number of rotary dims up to head_dim \(8\), got \[3, 10\]"):
        kernels.rope_(x, torch.randn(3, 10), torch.randn(3, 10), heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"got \[3, 3\]"):
        kernels.rope_(x, torch.randn(3, 3), torch.randn(3, 3), heads=2, head_dim=8)
    with pytest.raises(TypeError, match="x must be float32"):
        kernels.rope_(x.double(), cs, cs, heads=2, head_dim=8)
    with pytest.raises(ValueError, match="x rows must be contiguous"):
        kernels.rope_(torch.randn(16, 3).t(), cs, cs, heads=2, head_dim=8)
    with pytest.raises(ValueError, match="heads must be an integer >= 0, got -1"):
        kernels.rope_(x, cs, cs, heads=-1, head_dim=8)
