"""SlimAttention and FlashAttention against the float64 reference, on every ISA build.

Tolerances (inputs ~ N(0, 1), outputs are convex combinations of V rows, |o| <~ 4):
- fp32: 2e-5 absolute + 2e-5 relative. Each score is a D-term fp32 dot product (relative
  error ~ D * 2^-24 ~ 1e-5 of |q||k|/sqrt(D)), the exp polynomial is good to ~1e-7
  relative, and the P.V sums add ~N * 2^-24 relative; measured worst cases are ~1e-6.
- bf16 under the "fma" engine: the kernels compute in fp32 and round the output once to bf16
  (8 significant bits: rounding to nearest is within 2^-8 relative), so 4e-3 relative + 4e-3
  absolute.
- bf16 on a bf16 engine (the default where the CPU has AMX or AVX512-BF16 and the build targets
  AVX-512): Q K^T and P V on tiles, each probability rounded to bf16 once more (within 2^-8
  of itself), which moves an output by at most 2^-8 max|v| beyond that; test_prefill_tiles.py holds those kernels to a
  reference that rounds the same way.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import attention_reference

# Also on the "emulated" build (conftest.py): the AVX-512 path, VNNI included, on any AVX2 host.
ALSO_EMULATED = True

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=4e-3, rtol=4e-3)}


def tolerance(kernels, dtype, v) -> dict:
    if dtype == torch.bfloat16 and kernels.gemm_engine() != "fma":
        return dict(atol=4e-3 + 2.0**-8 * v.double().abs().max().item(), rtol=4e-3)
    return TOL[dtype]


@st.composite
def prefill_case(draw):
    ratio = draw(st.sampled_from([1, 3, 4, 8]))
    hkv = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 4))
    # 72: a head dim that is not whole micro-kernel panels (NR = 16 or 32) on any build
    d = draw(st.sampled_from([64, 128, 80, 72]))
    # Keep the float64 reference affordable: long prompts get fewer heads and sequences.
    n = draw(st.integers(1, 600))
    if n > 200:
        batch, hkv = 1, 1
        ratio = min(ratio, 4)
    extra_keys = draw(st.sampled_from([0, 0, 1, 17]))
    return dict(
        B=batch, H=hkv * ratio, Hkv=hkv, N=n, Nk=n + extra_keys, D=d,
        causal=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        block_m=draw(st.one_of(st.none(), st.integers(1, 300))),
        block_n=draw(st.one_of(st.none(), st.integers(1, 600))),
    )


def make_qkv(c):
    q = torch.randn(c["B"], c["H"], c["N"], c["D"]).to(c["dtype"])
    k = torch.randn(c["B"], c["Hkv"], c["Nk"], c["D"]).to(c["dtype"])
    v = torch.randn(c["B"], c["Hkv"], c["Nk"], c["D"]).to(c["dtype"])
    return q, k, v


@given(c=prefill_case())
def test_slim_attention_matches_reference(kernels, c):
    q, k, v = make_qkv(c)
    out = kernels.slim_attention(q, k, v, causal=c["causal"], block_m=c["block_m"])
    assert out.dtype == c["dtype"] and out.shape == q.shape
    ref = attention_reference(q, k, v, causal=c["causal"])
    torch.testing.assert_close(out.double(), ref, **tolerance(kernels, c["dtype"], v))


@given(c=prefill_case())
def test_flash_attention_matches_reference(kernels, c):
    q, k, v = make_qkv(c)
    out = kernels.flash_attention(q, k, v, causal=c["causal"], block_m=c["block_m"], block_n=c["block_n"])
    assert out.dtype == c["dtype"] and out.shape == q.shape
    ref = attention_reference(q, k, v, causal=c["causal"])
    torch.testing.assert_close(out.double(), ref, **tolerance(kernels, c["dtype"], v))


@pytest.mark.parametrize("algorithm", ["slim_attention", "flash_attention"])
def test_causal_output_ignores_future_keys(kernels, algorithm):
    """Changing keys and values a query cannot see leaves its output bit-identical."""
    f = getattr(kernels, algorithm)
    q, k, v = torch.randn(1, 4, 97, 64), torch.randn(1, 2, 97, 64), torch.randn(1, 2, 97, 64)
    out = f(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:] += 5.0
    v2[:, :, 50:] -= 3.0
    out2 = f(q, k2, v2, causal=True)
    assert torch.equal(out[:, :, :50], out2[:, :, :50])
    assert not torch.equal(out[:, :, 50:], out2[:, :, 50:])


def test_explicit_scale(kernels):
    q, k, v = torch.randn(2, 3, 40, 64), torch.randn(2, 3, 40, 64), torch.randn(2, 3, 40, 64)
    ref = attention_reference(q, k, v, causal=True, scale=0.05)
    for f in (kernels.slim_attention, kernels.flash_attention):
        torch.testing.assert_close(f(q, k, v, causal=True, scale=0.05).double(), ref, **TOL[torch.float32])


def test_thread_count_does_not_change_results(kernels):
    q, k, v = torch.randn(1, 8, 300, 128), torch.randn(1, 8, 300, 128), torch.randn(1, 8, 300, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.slim_attention(q, k, v)
        torch.set_num_threads(2)
        two = kernels.slim_attention(q, k, v)
    finally:
        torch.set_num_threads(before)
    # Each output row is computed by one task, whatever thread runs it: bit-identical.
    assert torch.equal(one, two)


def test_empty_inputs(kernels):
    q = torch.randn(1, 2, 0, 64)
    k = torch.randn(1, 2, 0, 64)
    assert kernels.slim_attention(q, k, k).shape == (1, 2, 0, 64)
    assert kernels.flash_attention(q, k, k).shape == (1, 2, 0, 64)


def test_default_block_m_is_whole_row_tiles_or_all_rows(kernels):
    mr = kernels.ext.gemm_mr()
    for n in (5, 256, 1024, 4096, 32768):
        bm = kernels.default_block_m(n, n, 128, 32)
        assert 1 <= bm <= n and (bm % mr == 0 or bm == n)


@given(c=prefill_case(), window=st.integers(1, 300), slim=st.booleans())
def test_a_sliding_window_matches_reference(kernels, c, window, slim):
    """Causal attention through a sliding window (Mistral's, Gemma 3's local layers): each query
    sees only its last `window` keys; windows shorter and longer than the prompt, blocks that
    start inside a window, with and without extra keys before the queries (an extend)."""
    c["causal"] = True
    q, k, v = make_qkv(c)
    if slim:
        out = kernels.slim_attention(q, k, v, causal=True, block_m=c["block_m"], window=window)
    else:
        out = kernels.flash_attention(q, k, v, causal=True, block_m=c["block_m"], block_n=c["block_n"], window=window)
    ref = attention_reference(q, k, v, causal=True, window=window)
    torch.testing.assert_close(out.double(), ref, **tolerance(kernels, c["dtype"], v))
