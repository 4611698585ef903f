"""The RMSNorm kernel of prefill (kernels.rms_norm: each row / sqrt(mean(row^2) + eps) * weight)
against a float64 reference, on every ISA build: odd widths (vector tails), one row and many
(rows in parallel), tiny and huge magnitudes, and clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# Also on the "emulated" build (conftest.py): the AVX-512 path, VNNI included, on any AVX2 host.
ALSO_EMULATED = True


@given(T=st.integers(1, 70), n=st.integers(1, 600), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 1000))
def test_rms_norm_matches_reference(kernels, T, n, scale, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n, generator=gen) * scale
    w = torch.randn(n, generator=gen)
    out = kernels.rms_norm(x, w, eps)
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(dim=-1, keepdim=True) + eps) * w.double()
    assert out.shape == (T, n) and out.dtype == torch.float32
    # fp32 sum of n squares (relative error about n * 2^-24 at worst), one rsqrt and two products
    bound = (n + 8) * 2.0**-24
    torch.testing.assert_close(out.double(), ref, atol=1e-30, rtol=bound)


def test_rms_norm_is_the_models_norm(kernels):
    """The model's layers and the fused decode step normalize the same way: torch's op and
    ours agree to fp32 rounding on a model-sized row."""
    x, w = torch.randn(5, 576), torch.randn(576)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (576,), w, 1e-5))


def test_rms_norm_rejects_bad_input(kernels):
    x, w = torch.zeros(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="weight has 4 values for rows of 8"):
        kernels.rms_norm(x, torch.ones(4), 1e-5)
    with pytest.raises(TypeError, match="x must be float32"):
        kernels.rms_norm(x.double(), w, 1e-5)
    with pytest.raises(TypeError, match="weight must be float32"):
        kernels.rms_norm(x, w.half(), 1e-5)
    with pytest.raises(ValueError, match=r"x must be 2-D|\[T, n\]"):
        kernels.rms_norm(torch.zeros(8), w, 1e-5)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        kernels.rms_norm(x, w, 0.0)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        kernels.rms_norm(x, w, "1e-5")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        kernels.rms_norm([[1.0]], w, 1e-5)
    assert kernels.rms_norm(torch.zeros(0, 8), w, 1e-5).shape == (0, 8)
