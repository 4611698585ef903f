"""INT8 quantization and KV-cache appends.

The quantizer's contract is exact, so the tests are too: q in [-127, 127], the scale is
max|x| / 127, every element is within scale / 2 of its reconstruction (plus the fp32
rounding of x / scale before it is rounded to an integer: at most 127 * 2^-23 * scale),
and the largest element maps to +-127. fp16 / bf16 appends must equal torch's own round-to-nearest-even conversion.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from workbench.kernels import dequantize_kv_int8

# Also on the "emulated" build (conftest.py): the AVX-512 path, VNNI included, on any AVX2 host.
ALSO_EMULATED = True


@given(
    rows=st.integers(1, 40),
    D=st.sampled_from([1, 7, 64, 80, 128, 129]),
    magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 1000),
)
def test_quantize_int8_error_bound(kernels, rows, D, magnitude, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=gen) * magnitude
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    x[0] = 0  # an all-zero vector must come back exactly
    q, scales = kernels.quantize_kv_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scales.shape == (rows,)
    xf = x.float()
    amax = xf.abs().amax(-1)
    torch.testing.assert_close(scales, amax / 127, rtol=1e-6, atol=0)
    assert q.abs().max() <= 127
    err = (xf.double() - q.double() * scales.double().unsqueeze(-1)).abs()
    bound = scales.double().unsqueeze(-1) * (0.5 + 127 * 2**-23)
    assert torch.all(err <= bound)
    torch.testing.assert_close(dequantize_kv_int8(q, scales), (q.double() * scales.double().unsqueeze(-1)).float())
    assert torch.all(q[0] == 0) and scales[0] == 0
    nonzero = amax > 0
    assert torch.all(q[nonzero].abs().amax(-1) == 127)


def test_quantize_keeps_leading_shape(kernels):
    x = torch.randn(2, 3, 5, 64)
    q, s = kernels.quantize_kv_int8(x)
    assert q.shape == (2, 3, 5, 64) and s.shape == (2, 3, 5)


@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8]),
    T=st.integers(1, 5),
    D=st.sampled_from([64, 80]),
    seed=st.integers(0, 1000),
)
def test_append_writes_only_its_slots(kernels, dtype, T, D, seed):
    gen = torch.Generator().manual_seed(seed)
    B, Hkv, Lmax = 3, 2, 12
    sentinel = 7 if dtype == torch.int8 else 3.5
    cache = torch.full((B, Hkv, Lmax, D), sentinel, dtype=dtype)
    scales = torch.full((B, Hkv, Lmax), -1.0) if dtype == torch.int8 else None
    values = torch.randn(B, Hkv, T, D, generator=gen)
    positions = torch.randint(0, Lmax - T + 1, (B,), generator=gen)
    kernels.kv_cache_append(cache, values, positions, scales=scales)

    written = torch.zeros(B, Hkv, Lmax, dtype=torch.bool)
    for b in range(B):
        p = int(positions[b])
        written[b, :, p:p + T] = True
        got = cache[b, :, p:p + T]
        if dtype == torch.int8:
            q, s = kernels.quantize_kv_int8(values[b])
            assert torch.equal(got, q) and torch.equal(scales[b, :, p:p + T], s)
        else:
            assert torch.equal(got, values[b].to(dtype))
    assert torch.all(cache[~written] == sentinel)
    if scales is not None:
        assert torch.all(scales[~written] == -1.0)


def test_append_then_decode_sees_appended_tokens(kernels):
    """Token-by-token appends (as generation does) give the same cache as one bulk append."""
    B, Hkv, Lmax, D = 2, 2, 16, 64
    values = torch.randn(B, Hkv, 10, D)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        bulk = torch.zeros(B, Hkv, Lmax, D, dtype=dtype)
        step = torch.zeros(B, Hkv, Lmax, D, dtype=dtype)
        s_bulk = torch.zeros(B, Hkv, Lmax) if dtype == torch.int8 else None
        s_step = torch.zeros(B, Hkv, Lmax) if dtype == torch.int8 else None
        kernels.kv_cache_append(bulk, values, torch.zeros(B, dtype=torch.long), scales=s_bulk)
        for t in range(10):
            kernels.kv_cache_append(step, values[:, :, t:t + 1], torch.full((B,), t), scales=s_step)
        assert torch.equal(bulk, step)
        if s_bulk is not None:
            assert torch.equal(s_bulk, s_step)
