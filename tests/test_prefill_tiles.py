"""Prefill attention on the bf16 engines (kernels/prefill_tiles.cpp): SlimAttention and
FlashAttention with Q K^T and P V as bf16 products on AMX tiles or vdpbf16ps, on every ISA
build, against a float64 reference over shapes that cover every edge of the tiling: query
blocks and key blocks not whole 32-row / 32-key tiles, head dims not whole 32-value steps,
GQA ratios, batch > 1, more keys than queries, causal and not.

The reference computes what the kernels define: scores from the bf16 inputs in float64, the
exact softmax numerators exp(s - max) rounded to bf16 (the P operand of P V), their unrounded
sum as the denominator. What is left between kernel and reference is fp32 accumulation, the
exp polynomial (below 3e-6 relative) and the output's own rounding to bf16 (2^-8 relative),
plus the numerators that land on the other side of a bf16 rounding boundary: a tiny fp32
difference in a score, or flash rounding exp(s - m) against a running max m and rescaling it
afterwards, moves such a numerator by one bf16 ulp (at most 2^-7 of it). A row's error is
therefore bounded by 2^-7 sum_i p_i |v_i| / l (every numerator moved) + 2^-8 |out|, which
`tiles_bound` computes element by element; a fixed tolerance is wrong for rows that see few
keys with large values (hypothesis found one at 5.2e-3, inside its bound). Against the plain
float64 softmax (no rounding of P) the error is one bf16 rounding of each probability larger,
which `test_fma_engine_keeps_bf16_inputs_on_the_fp32_kernels` bounds.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import attention_reference

# Also on the "emulated" build (conftest.py): attention on AMX tiles and vdpbf16ps, their
# instructions in C++, checked on every host, not only where the CPU has them.
ALSO_EMULATED = True

BF16_ENGINES = ("amx_bf16", "avx512_bf16")


def runnable(kernels) -> list[str]:
    return [name for name in BF16_ENGINES if kernels.gemm_engines()[name][0]]


def tiles_reference(q, k, v, causal: bool, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention with each row's numerators exp(s - max) rounded to bf16 before P V,
    and the bound on each output element's distance from it (module docstring)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    n, nk = q.shape[2], k.shape[2]
    if causal:
        visible = torch.arange(nk)[None, :] <= torch.arange(n)[:, None] + (nk - n)
        s = s.masked_fill(~visible, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    total = e.sum(-1, keepdim=True)
    p = e.float().bfloat16().double()
    ref = (p @ v) / total
    bound = 2.0**-7 * ((p @ v.abs()) / total) + 2.0**-8 * ref.abs() + 1e-4
    return ref, bound


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (out.double() - ref).abs()
    worst = (err / bound).argmax()
    index = tuple(int(i) for i in torch.unravel_index(worst, err.shape))
    assert bool((err <= bound).all()), (
        f"{what}: {int((err > bound).sum())} of {err.numel()} elements outside the bound; worst at "
        f"{index}: |out - ref| = {err[index]:.3g} > {bound[index]:.3g}")


@st.composite
def case(draw):
    ratio = draw(st.sampled_from([1, 3, 4]))
    hkv = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    n = draw(st.one_of(st.integers(1, 70), st.sampled_from([95, 96, 97, 255, 256, 257, 400])))
    if n > 200:
        batch, hkv = 1, 1
    return dict(
        B=batch, H=hkv * ratio, Hkv=hkv, N=n, Nk=n + draw(st.sampled_from([0, 0, 1, 31, 40])),
        D=draw(st.sampled_from([8, 64, 72, 80, 128])), causal=draw(st.booleans()),
        block_m=draw(st.one_of(st.none(), st.integers(1, 300))),
        block_n=draw(st.one_of(st.none(), st.integers(1, 300))),
        seed=draw(st.integers(0, 1000)),
    )


def make_qkv(c):
    gen = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["B"], c["H"], c["N"], c["D"], generator=gen).bfloat16()
    k = torch.randn(c["B"], c["Hkv"], c["Nk"], c["D"], generator=gen).bfloat16()
    v = torch.randn(c["B"], c["Hkv"], c["Nk"], c["D"], generator=gen).bfloat16()
    return q, k, v


def run(kernels, algorithm: str, q, k, v, c):
    if algorithm == "slim":
        return kernels.slim_attention(q, k, v, causal=c["causal"], block_m=c["block_m"])
    return kernels.flash_attention(q, k, v, causal=c["causal"], block_m=c["block_m"], block_n=c["block_n"])


@pytest.mark.parametrize("algorithm", ["slim", "flash"])
@given(c=case())
def test_every_bf16_engine_matches_reference(kernels, algorithm, c):
    engines = runnable(kernels)
    if not engines:
        pytest.skip("no bf16 engine may run here: " + kernels.gemm_engines()["avx512_bf16"][1])
    q, k, v = make_qkv(c)
    ref, bound = tiles_reference(q, k, v, c["causal"])
    try:
        for engine in engines:
            kernels.set_gemm_engine(engine)
            out = run(kernels, algorithm, q, k, v, c)
            assert out.dtype == torch.bfloat16 and out.shape == q.shape
            assert_within(out, ref, bound, engine)
    finally:
        kernels.set_gemm_engine("auto")


@pytest.mark.parametrize("engine", BF16_ENGINES)
def test_causal_rows_ignore_future_keys_on_tiles(kernels, engine):
    """Changing keys and values a row may not see changes nothing in that row, including the
    rows that share a 32-key block with them (the mask inside the diagonal block)."""
    if engine not in runnable(kernels):
        pytest.skip(f"{engine} may not run here: {kernels.gemm_engines()[engine][1]}")
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 77, 64).bfloat16() for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 40:] = torch.randn_like(k2[:, :, 40:].float()).bfloat16() * 10
    v2[:, :, 40:] = 100.0
    kernels.set_gemm_engine(engine)
    try:
        for fn in (kernels.slim_attention, kernels.flash_attention):
            a, b = fn(q, k, v, causal=True), fn(q, k2, v2, causal=True)
            assert torch.equal(a[:, :, :40], b[:, :, :40])
            assert not torch.equal(a[:, :, 40:], b[:, :, 40:])
    finally:
        kernels.set_gemm_engine("auto")


def test_fma_engine_keeps_bf16_inputs_on_the_fp32_kernels(kernels):
    """Under "fma" bf16 inputs are widened to fp32 (no rounding of P): the plain reference
    holds to the fp32 kernels' bf16 tolerance, and the tiles' result differs from it."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 4, 100, 64).bfloat16() for _ in range(3))
    plain = attention_reference(q, k, v, causal=True)
    kernels.set_gemm_engine("fma")
    try:
        widened = kernels.slim_attention(q, k, v, causal=True)
        torch.testing.assert_close(widened.double(), plain, atol=4e-3, rtol=4e-3)
        for engine in runnable(kernels):
            kernels.set_gemm_engine(engine)
            tiles = kernels.slim_attention(q, k, v, causal=True)
            assert not torch.equal(tiles, widened)
            # One bf16 rounding of each probability more than the widened path: |dO| <= 2^-8 sum p |v| / l.
            bound = 2.0**-8 * v.double().abs().amax().item() + 8e-3
            assert (tiles.double() - plain).abs().max().item() < bound
    finally:
        kernels.set_gemm_engine("auto")


def test_long_prompt_and_model_shapes(kernels):
    """The last 64 queries of a 4096-token causal prompt at Llama-2-7B's head dim (rows that
    see thousands of keys: many 256-key chunks of P V, flash's key tiles), on every bf16 engine."""
    engines = runnable(kernels)
    if not engines:
        pytest.skip("no bf16 engine may run here")
    torch.manual_seed(3)
    q = torch.randn(1, 1, 64, 128).bfloat16()
    k, v = (torch.randn(1, 1, 4096, 128).bfloat16() for _ in range(2))
    ref, bound = tiles_reference(q, k, v, causal=True)
    try:
        for engine in engines:
            kernels.set_gemm_engine(engine)
            for out in (kernels.slim_attention(q, k, v, causal=True), kernels.flash_attention(q, k, v, causal=True)):
                assert_within(out, ref, bound, engine)
    finally:
        kernels.set_gemm_engine("auto")


def test_default_tile_block_is_whole_pairs_and_leaves_work_for_every_thread(kernels):
    from workbench.kernels import constants

    limit = constants()["tile_max_block_m"]
    threads = torch.get_num_threads()
    for n, tasks in ((1, 1), (31, 9), (1024, 9), (1024, 32), (4096, 32), (5000, 1), (100, 1)):
        block = kernels.default_block_m(n, n, 64, tasks, tiles=True)
        assert block % 32 == 0 and 32 <= block <= limit, (n, tasks, block)
        if block > 32:  # halved no further than four tasks per thread
            assert tasks * -(-n // block) >= 4 * threads, (n, tasks, block)
