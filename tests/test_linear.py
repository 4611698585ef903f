"""The linear-layer kernel (y = x W^T, fp32 or bf16 weights) against a float64 reference,
on every ISA build, on both of its paths: the matrix-vector kernel (few rows, decode)
and the packed GEMM (more rows: batched decode, prefill), whose shapes here cover a
partial block of W rows (N not a multiple of the 48-row task), several K slices of unequal
length, both orders the matrix-vector kernel may read a task's rows in (one after another or
four side by side, chosen per host), one- and two-vector token tiles, and several 256-token
blocks (M > 256). fp32 rows of W are read where they are, except at K = 1024, whose rows are a whole number of L1 ways
apart: there the GEMM copies each slice first (both paths are drawn). Where a block's slice of
x^T fits in L1d (up to 40 rows at any K here) the micro-tiles prefetch the next slice of W a
line at a time, elsewhere (255 rows and more at K >= 64) it is prefetched all at once.

Tolerance: the weights are exactly representable in both dtypes (bf16 weights are
compared against their own fp32 value), so only fp32 accumulation over K terms differs:
1e-4 relative to sqrt(K) * max|x| * max|w|, well above K * 2^-24 of that scale. Where the
GEMM runs bf16 weights on the AMX tiles (kernels.gemm_engine(), tests/test_gemm_engines.py)
it rounds x to bf16 first, and the reference does the same.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import int8_activations_reference, int8_weights_reference

# Also on the "emulated" build (conftest.py), where the tests that loop over the engines run
# the AMX and AVX512-BF16 ones too (a long prefill's packed x, allocated for the call).
ALSO_EMULATED = True


@contextmanager
def row_order(kernels, weights: str, serial: bool):
    """The matrix-vector kernel reading a task's rows one after another (serial) or four side
    by side, whatever this host's probe chose (workbench/kernels/prefetch.py)."""
    before = kernels.ext.get_matvec_prefetch(weights)
    kernels.ext.set_matvec_prefetch(weights, *before[:3], 1 << 30 if serial else 0)
    try:
        yield
    finally:
        kernels.ext.set_matvec_prefetch(weights, *before)


@given(
    M=st.one_of(st.integers(1, 40), st.sampled_from([255, 256, 257, 530])),
    N=st.integers(1, 130),
    K=st.sampled_from([1, 7, 64, 129, 576, 1000, 1024]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    matvec_max_rows=st.sampled_from([0, 1, 10, 64]),
    serial=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_linear_matches_reference(kernels, M, N, K, dtype, matvec_max_rows, serial, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen).to(dtype)
    with row_order(kernels, "float32" if dtype == torch.float32 else "bfloat16", serial):
        y = kernels.linear(x, w, matvec_max_rows=matvec_max_rows)
    on_tiles = dtype == torch.bfloat16 and M > matvec_max_rows and kernels.gemm_engine() != "fma"
    ref = (x.bfloat16() if on_tiles else x).double() @ w.double().t()
    assert y.dtype == torch.float32 and y.shape == (M, N)
    scale = K**0.5 * x.abs().max().item() * w.float().abs().max().item()
    torch.testing.assert_close(y.double(), ref, atol=1e-4 * scale, rtol=0)


@given(
    M=st.one_of(st.integers(1, 40), st.sampled_from([255, 257])),
    N=st.integers(1, 130),
    K=st.sampled_from([1, 7, 64, 129, 576, 1000]),
    matvec_max_rows=st.sampled_from([0, 1, 10, 64]),
    group=st.sampled_from([None, 32]),
    serial=st.booleans(),
    bits=st.sampled_from([8, 16]),
    seed=st.integers(0, 1000),
)
def test_int8_weights_match_reference(kernels, M, N, K, matvec_max_rows, group, serial, bits, seed):
    """Weight-only int8 (one scale per output row, or per 32 weights of a row) on both paths
    against float64 over the dequantized weights (as a bf16 engine sees them where the GEMM
    runs on one): only fp32 accumulation differs, as for fp32 and bf16 (K = 129, 1000 leave a partial last group; the GEMM's K slices do not start
    on group boundaries). The matrix-vector kernel's integer products (K a multiple of 32)
    with int8 activations are held to float64 over the rounded x (reference.py)."""
    from workbench.kernels import quantize_weight_int8

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen) * 3  # rows of different ranges
    q, s = quantize_weight_int8(w, group)
    before = kernels.block_activation_bits()
    kernels.set_block_activation_bits(bits)
    try:
        with row_order(kernels, "int8", serial):
            y = kernels.linear(x, q, scale=s, matvec_max_rows=matvec_max_rows)
            out = torch.empty(M, N)
            assert kernels.linear(x, q, scale=s, out=out, matvec_max_rows=matvec_max_rows) is not None
    finally:
        kernels.set_block_activation_bits(before)
    # The GEMM on a bf16 engine rounds x to bf16, and a grouped weight times its scale to bf16
    # (a per-row int8 value is exact in bf16; its scale applies to the output).
    on_engine = M > matvec_max_rows and kernels.gemm_engine_for("int8") != "fma"
    if group is None:
        deq = q.double() * s.double()[:, None]
    else:
        deq = int8_weights_reference(q, s)
        deq = (deq.bfloat16() if on_engine else deq).double()
    integer_products = M <= matvec_max_rows and K % 32 == 0 and bits == 8
    xs = int8_activations_reference(x) if integer_products else (x.bfloat16() if on_engine else x).double()
    ref = xs @ deq.t()
    scale = K**0.5 * x.abs().max().item() * deq.abs().max().item()
    torch.testing.assert_close(y.double(), ref, atol=1e-4 * scale, rtol=0)
    torch.testing.assert_close(out.double(), ref, atol=1e-4 * scale, rtol=0)  # into a caller's buffer


def test_int8_weight_quantization_within_half_a_step():
    from workbench.kernels import quantize_weight_int8

    w = torch.randn(50, 300) * torch.rand(50, 1) * 10
    w[3] = 0  # an all-zero row: scale 0, exact
    q, s = quantize_weight_int8(w)
    assert q.dtype == torch.int8 and s.shape == (50,) and s[3] == 0 and (q[3] == 0).all()
    err = (q.float() * s[:, None] - w).abs()
    assert torch.all(err <= s[:, None] / 2 * 1.0001 + 1e-7)
    assert torch.allclose(s, w.abs().amax(1) / 127)
    q, g = quantize_weight_int8(w, 32)  # per 32 weights of a row: 300 = 9 full groups and 12
    assert g.shape == (50, 10)
    step = g.repeat_interleave(32, dim=1)[:, :300]
    assert torch.all((q.float() * step - w).abs() <= step / 2 * 1.0001 + 1e-7)
    with pytest.raises(ValueError, match="group must be None"):
        quantize_weight_int8(w, 64)


def test_int8_weights_bad_input(kernels):
    from workbench.kernels import quantize_weight_int8

    q, s = quantize_weight_int8(torch.randn(4, 8))
    with pytest.raises(ValueError, match="int8 weights need scale"):
        kernels.linear(torch.randn(2, 8), q)
    with pytest.raises(ValueError, match="scale must have N = 4 entries"):
        kernels.linear(torch.randn(2, 8), q, scale=torch.ones(3))
    with pytest.raises(ValueError, match="grouped scale must be"):
        kernels.linear(torch.randn(2, 8), q, scale=torch.ones(4, 2))
    with pytest.raises(ValueError, match="scale is only for int8 weights"):
        kernels.linear(torch.randn(2, 8), torch.randn(4, 8), scale=s)


def test_linear_keeps_leading_dims(kernels):
    x = torch.randn(2, 3, 64)
    w = torch.randn(10, 64).bfloat16()
    assert kernels.linear(x, w).shape == (2, 3, 10)


def test_linear_bad_input(kernels):
    with pytest.raises(ValueError, match="w is \\[out_features, in_features\\]"):
        kernels.linear(torch.randn(2, 8), torch.randn(3, 9))
    with pytest.raises(TypeError, match="w must be float32, bfloat16 or int8"):
        kernels.linear(torch.randn(2, 8), torch.randn(3, 8).half())
    with pytest.raises(TypeError, match="x must be float32"):
        kernels.linear(torch.randn(2, 8).double(), torch.randn(3, 8))


@pytest.mark.parametrize("N", [50, 96])  # a partial 48-row task; whole tasks (fp32 rows read in place)
def test_gemm_over_several_panels_of_k(kernels, N):
    """K long enough that a block of x^T over all of it (300 tokens: two blocks of at least 144)
    exceeds this host's budget (constants()["gemm_panel_bytes"], from its caches) more than
    twice: the FMA GEMM then runs K in panels, the first writing y and the later ones adding to
    it, the last a partial one. fp32, bf16 and int8 weights (per row and per 32) on the FMA
    engine, against float64."""
    from workbench.kernels import constants, quantize_weight_int8

    gen = torch.Generator().manual_seed(7)
    M, K = 300, 2 * constants()["gemm_panel_bytes"] // (144 * 4) + 100
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen)
    q_row, s_row = quantize_weight_int8(w)
    q_g, s_g = quantize_weight_int8(w, 32)
    cases = {  # name: (weights, scale, the weights the kernel multiplies by)
        "fp32": (w, None, w.double()),
        "bf16": (w.bfloat16(), None, w.bfloat16().double()),
        "int8": (q_row, s_row, int8_weights_reference(q_row, s_row).double()),
        "int8-g32": (q_g, s_g, int8_weights_reference(q_g, s_g).double()),
    }
    try:
        kernels.set_gemm_engine("fma")
        for name, (weights, s, dense) in cases.items():
            y = kernels.linear(x, weights, **({"scale": s} if s is not None else {}))
            ref = x.double() @ dense.t()
            scale = K**0.5 * x.abs().max().item() * dense.abs().max().item()
            torch.testing.assert_close(y.double(), ref, atol=1e-4 * scale, rtol=0, msg=lambda m: f"{name}: {m}")
    finally:
        kernels.set_gemm_engine("auto")


def test_linear_long_prefill(kernels):
    """Enough rows that the GEMM's transposed x (here 2,112 padded tokens x 2,048 floats) is
    allocated for the call rather than kept in the thread's scratch."""
    x = torch.randn(2100, 2048)
    w = torch.randn(50, 2048).bfloat16()
    scale = 2048**0.5 * x.abs().max().item() * w.float().abs().max().item()
    try:
        for engine in [name for name, (ok, _) in kernels.gemm_engines().items() if ok]:
            kernels.set_gemm_engine(engine)  # the FMA GEMM's x^T, the AMX GEMM's packed x
            y = kernels.linear(x, w)
            ref = (x if engine == "fma" else x.bfloat16()).double() @ w.double().t()
            torch.testing.assert_close(y.double(), ref, atol=1e-4 * scale, rtol=0, msg=lambda m: f"{engine}: {m}")
    finally:
        kernels.set_gemm_engine("auto")


@pytest.mark.parametrize("name", sorted(__import__("workbench.model.weights", fromlist=["x"]).WEIGHT_FORMATS))
def test_each_formats_bits_per_weight_is_what_its_rows_take(name):
    """WeightFormat.bits_per_weight (the study's and the formats table's figure) against the
    bytes a Linear built in the format holds: long rows, so a per-row scale is below the bound."""
    from workbench.model.llama import Linear
    from workbench.model.weights import WEIGHT_FORMATS

    fmt = WEIGHT_FORMATS[name]
    lin = Linear(torch.randn(8, 4096, generator=torch.Generator().manual_seed(0)), fmt)
    assert lin.formats == [fmt]
    assert 8 * lin.nbytes / lin.params == pytest.approx(fmt.bits_per_weight, rel=2e-3)
