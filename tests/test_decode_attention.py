"""Decode attention against the float64 reference, for every cache dtype and ISA build.

The reference reads exactly the values stored in the cache (fp16/bf16 upcast, int8 times
its per-token scale), so what is tested is the kernel's arithmetic: fp32 accumulation
(1e-5 absolute + 1e-5 relative; measured worst ~3e-7). The bf16-q case rounds the output
to bf16 once (half an ulp: 2^-9 relative), so 4e-3.

Separately, an int8 cache must stay within the error its quantization implies of the
fp32-cache result (test_int8_cache_error_within_quantization_bound).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import decode_reference

CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


@st.composite
def decode_case(draw):
    # GQA ratios cover every register blocking of the score pass (rows per pass 8, 4, 2) and
    # groups wider than one pass of 8 heads (12); head dims include partial vectors (20, 72).
    ratio = draw(st.sampled_from([1, 3, 4, 6, 7, 8, 12]))
    return dict(
        B=draw(st.integers(1, 4)),
        Hkv=draw(st.integers(1, 3)),
        ratio=ratio,
        Lmax=draw(st.integers(1, 600)),
        D=draw(st.sampled_from([64, 128, 80, 72, 20])),
        cache_dtype=draw(st.sampled_from(CACHE_DTYPES)),
        q_dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])),
        num_splits=draw(st.one_of(st.none(), st.integers(1, 9))),
        ragged=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def build_cache(kernels, B, Hkv, Lmax, D, dtype, gen):
    """Random K/V in a cache of `dtype`, written through the append kernel."""
    k = torch.randn(B, Hkv, Lmax, D, generator=gen)
    v = torch.randn(B, Hkv, Lmax, D, generator=gen)
    k_cache = torch.zeros(B, Hkv, Lmax, D, dtype=dtype)
    v_cache = torch.zeros(B, Hkv, Lmax, D, dtype=dtype)
    scales = {}
    if dtype == torch.int8:
        scales = dict(k_scale=torch.zeros(B, Hkv, Lmax), v_scale=torch.zeros(B, Hkv, Lmax))
    start = torch.zeros(B, dtype=torch.int64)
    kernels.kv_cache_append(k_cache, k, start, scales=scales.get("k_scale"))
    kernels.kv_cache_append(v_cache, v, start, scales=scales.get("v_scale"))
    return k, v, k_cache, v_cache, scales


@given(c=decode_case())
def test_decode_matches_reference(kernels, c):
    gen = torch.Generator().manual_seed(c["seed"])
    B, Hkv, Lmax, D = c["B"], c["Hkv"], c["Lmax"], c["D"]
    H = Hkv * c["ratio"]
    _, _, k_cache, v_cache, scales = build_cache(kernels, B, Hkv, Lmax, D, c["cache_dtype"], gen)
    q = torch.randn(B, H, D, generator=gen).to(c["q_dtype"])
    if c["ragged"]:
        lengths = torch.randint(1, Lmax + 1, (B,), generator=gen, dtype=torch.int32)
    else:
        lengths = torch.full((B,), Lmax, dtype=torch.int64)
    out = kernels.decode_attention(q, k_cache, v_cache, lengths, num_splits=c["num_splits"], **scales)
    assert out.dtype == c["q_dtype"] and out.shape == (B, H, D)
    ref = decode_reference(q, k_cache, v_cache, lengths, **scales)
    tol = 1e-5 if c["q_dtype"] == torch.float32 else 4e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@given(
    lmax=st.integers(1, 300),
    splits=st.integers(1, 12),
    ratio=st.sampled_from([1, 4]),
    dtype=st.sampled_from(CACHE_DTYPES),
)
def test_split_kv_matches_unsplit(kernels, lmax, splits, ratio, dtype):
    """Split-KV (partial softmax statistics merged afterwards) equals one pass, including
    splits left empty because a sequence is shorter than the split count."""
    gen = torch.Generator().manual_seed(lmax)
    _, _, kc, vc, scales = build_cache(kernels, 3, 2, lmax, 64, dtype, gen)
    q = torch.randn(3, 2 * ratio, 64, generator=gen)
    lengths = torch.tensor([1, max(1, lmax // 2), lmax])
    one = kernels.decode_attention(q, kc, vc, lengths, num_splits=1, **scales)
    many = kernels.decode_attention(q, kc, vc, lengths, num_splits=splits, **scales)
    torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)


@given(
    L=st.integers(1, 600),
    D=st.sampled_from([64, 128, 80]),
    ratio=st.sampled_from([1, 4]),
    spread=st.sampled_from([0.01, 1.0, 30.0]),
)
def test_int8_cache_error_within_quantization_bound(kernels, L, D, ratio, spread):
    """|o_int8 - o_fp32| is bounded by what the per-token quantization error allows.

    Each K element moves by at most s_t / 2, so score t moves by at most
    delta_t = scale * ||q||_1 * s_t / 2; with delta = max_t delta_t every probability
    moves by a factor within exp(+-2 delta), so ||p' - p||_1 <= exp(2 delta) - 1.
    Each V element moves by at most s^v_t / 2. Hence
        |o' - o| <= (exp(2 delta) - 1) * max|v| + max_t s^v_t / 2   (+ fp32 rounding).
    """
    gen = torch.Generator().manual_seed(L * 7 + D)
    B, Hkv = 2, 2
    k = torch.randn(B, Hkv, L, D, generator=gen) * spread
    v = torch.randn(B, Hkv, L, D, generator=gen) * spread
    kc, ks = kernels.quantize_kv_int8(k)
    vc, vs = kernels.quantize_kv_int8(v)
    q = torch.randn(B, Hkv * ratio, D, generator=gen)
    lengths = torch.full((B,), L)
    out8 = kernels.decode_attention(q, kc, vc, lengths, k_scale=ks, v_scale=vs).double()
    out32 = kernels.decode_attention(q, k, v, lengths).double()

    sm = 1.0 / math.sqrt(D)
    q1 = q.abs().sum(-1).double()  # [B, H]
    ks_h = ks.double().repeat_interleave(ratio, dim=1)  # [B, H, L]
    delta = (sm * q1.unsqueeze(-1) * ks_h / 2).amax(-1)  # [B, H]
    bound = torch.expm1(2 * delta) * v.abs().amax().double() + vs.double().amax() / 2
    err = (out8 - out32).abs().amax(-1)  # [B, H]
    assert torch.all(err <= bound * 1.001 + 1e-5), (err / bound).max()


@given(c=decode_case())
def test_int8_query_within_the_query_quantization_bound(kernels, c):
    """The integer-dot path (int8_query) against the float64 reference over the same int8
    cache. Its one extra rounding is the query's: each q element moves by at most
    q_scale / 2 (q_scale = max|q_h| / 127), so score t moves by at most
    delta_t = scale * q_scale / 2 * ||k_t||_1 (k_t as stored, times its scale) and
        |o' - o| <= (exp(2 max_t delta_t) - 1) * max|v|   (+ fp32 rounding)."""
    gen = torch.Generator().manual_seed(c["seed"])
    B, Hkv, Lmax, D, ratio = c["B"], c["Hkv"], c["Lmax"], c["D"], c["ratio"]
    H = Hkv * ratio
    _, _, kc, vc, scales = build_cache(kernels, B, Hkv, Lmax, D, torch.int8, gen)
    q = torch.randn(B, H, D, generator=gen)
    lengths = torch.randint(1, Lmax + 1, (B,), generator=gen) if c["ragged"] else torch.full((B,), Lmax)
    out = kernels.decode_attention(q, kc, vc, lengths, num_splits=c["num_splits"], int8_query=True, **scales)
    ref = decode_reference(q, kc, vc, lengths, **scales)
    k = (kc.double() * scales["k_scale"].double().unsqueeze(-1)).repeat_interleave(ratio, dim=1)  # [B, H, L, D]
    v = vc.double() * scales["v_scale"].double().unsqueeze(-1)
    q_scale = q.double().abs().amax(-1) / 127  # [B, H]
    delta = (q_scale.unsqueeze(-1) / 2 * k.abs().sum(-1)).amax(-1) / math.sqrt(D)  # [B, H]
    bound = torch.expm1(2 * delta) * v.abs().amax()
    err = (out.double() - ref).abs().amax(-1)
    assert torch.all(err <= bound * 1.001 + 1e-5 + 1e-5 * ref.abs().amax(-1)), (err / bound).max()


def test_int8_query_is_exact_when_the_query_is_representable(kernels):
    """A query whose every head is already c * (integers in [-127, 127]) with a +-127 in it
    loses nothing to quantization: the integer path then equals the reference."""
    gen = torch.Generator().manual_seed(5)
    for D, ratio in ((64, 3), (20, 1), (130, 4)):
        _, _, kc, vc, scales = build_cache(kernels, 2, 2, 77, D, torch.int8, gen)
        q8 = torch.randint(-127, 128, (2, 2 * ratio, D), generator=gen)
        q8[..., 0] = 127
        q = q8.float() * 0.013
        lengths = torch.tensor([77, 31])
        out = kernels.decode_attention(q, kc, vc, lengths, int8_query=True, **scales)
        torch.testing.assert_close(out.double(), decode_reference(q, kc, vc, lengths, **scales), atol=1e-5,
                                   rtol=1e-5)


def test_int8_query_needs_an_int8_cache(kernels):
    import pytest

    kc = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="int8_query needs an int8 cache"):
        kernels.decode_attention(torch.zeros(1, 1, 16), kc, kc, torch.tensor([8]), int8_query=True)
    with pytest.raises(TypeError, match="int8_query must be True or False"):
        kernels.decode_attention(torch.zeros(1, 1, 16), kc, kc, torch.tensor([8]), int8_query="yes")


def test_decode_attends_only_within_length(kernels):
    """Tokens past a sequence's length, garbage or not, do not change its output."""
    q = torch.randn(2, 4, 64)
    k = torch.randn(2, 2, 50, 64)
    v = torch.randn(2, 2, 50, 64)
    lengths = torch.tensor([20, 50])
    out = kernels.decode_attention(q, k, v, lengths)
    k[0, :, 20:] = 1e4
    v[0, :, 20:] = float("nan")
    out2 = kernels.decode_attention(q, k, v, lengths)
    assert torch.equal(out, out2)


def test_default_splits_leave_no_thread_idle():
    from workbench.kernels import native

    threads = torch.get_num_threads()
    assert native.default_num_splits(1, 1, 4096) >= min(threads, 16)
    assert native.default_num_splits(64, 32, 4096) == 1
    assert native.default_num_splits(1, 1, 100) == 1  # too short to be worth splitting
